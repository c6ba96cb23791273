/* Shared declarations of the in-process agent (libgpucr.so).
 *
 * Threads: the application's (through the wrappers), the control channel's (one per connection),
 * and the agent's own helper while a checkpoint runs (a deadline job); at rest, only the channel's. The agent
 * copies, pins and makes nothing in host memory: gpucr's data plane runs in another process, makes the staging
 * and hands the agent its fds to hold.
 *
 * Lock order (never take an earlier lock while holding a later one):
 *   g_op (verbs.c, one checkpoint or restore at a time)
 *     -> reg_lock (registry.c, the registry)
 *   g_pool_mu (pool_impl.h, the stream-ordered pools) -> reg_lock; it is taken inside the gate (or by the
 *     checkpoint itself, before the driver holds the process), so no thread waits on a locked driver
 *     while holding it
 *   reg_lock is never held while taking S.mu (staging.c, the held segments), nor the other way round
 * and each of these is held only on its own: g_dp_mu (dataplane.c, what status reports of the data
 * plane), the gate's mutex (gate.c), g_clients_mu (channel.c), a deadline job's mutex (deadline.c).
 * Rules that keep it so:
 *   - No driver call is made under reg_lock: the driver may hold a call for as long as it holds the
 *     process locked, and status (which takes reg_lock) must answer then. Copy what is needed out of
 *     the registry under the lock, call the driver without it, record the result under it again.
 *   - The data plane (dataplane.c) runs only while the gate is closed and under g_op; see registry.h.
 *   - One-time initialisation goes through pthread_once (gpucr_init, the settings); state that
 *     other threads read without a lock is atomic.
 *
 * Errors, one convention: an entry point or a driver step returns its CUresult; every other function
 * that can fail returns 0, or -1 with one line for the user in (err, errlen) when it has a caller to
 * tell, and a bool only when it answers a question. A driver error that nobody is told of is logged
 * with gpucr_cu_warn, which names the call and the error (cuGetErrorName). */
#ifndef GPUCR_AGENT_H
#define GPUCR_AGENT_H
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include "cutypes.h"

#define GPUCR_EXPORT __attribute__((visibility("default")))

/* ---- entry table (entry.c resolves the real functions; table.c holds the wrappers) ---- */
enum gpucr_entry_kind { GATED, WAITS, QUERY, CUSTOM };
enum gpucr_entry_id {
#define E(kind, sym, base, ver, pt, params, args) ENTRY_##sym,
#include "entrypoints.def"
#undef E
    ENTRY_COUNT
};
struct gpucr_entry {
    const char *symbol, *base;
    int version, per_thread, kind;
    void *real;      /* the driver's, as its own resolver returns it */
};
extern struct gpucr_entry gpucr_entries[ENTRY_COUNT];

/* Typed access to the real driver function of an entry: REAL(cuMemAlloc_v2)(&p, n). */
#define E(kind, sym, base, ver, pt, params, args) typedef CUresult (*pfn_##sym) params;
#include "entrypoints.def"
#undef E
#define REAL(sym) ((pfn_##sym)gpucr_entries[ENTRY_##sym].real)

void gpucr_init(void);                       /* idempotent: load libcuda, resolve the table */
void gpucr_on_first_use(void (*fn)(void));   /* run by every gpucr_init (the channel's start in a fork child) */
bool gpucr_cuda_loaded(void);
void *gpucr_real_dlsym(void *handle, const char *name);
/* The wrappers (table.c, above every file that defines one): an entry by name or by its real function, and its
 * wrapper; the wrapper whose real function is exactly p, else p (a pointer the table does not know, or a wrapper). */
const struct gpucr_entry *gpucr_entry_by_symbol(const char *symbol);
const struct gpucr_entry *gpucr_entry_by_real(void *real);
bool gpucr_is_wrapper(void *p);
void *gpucr_wrapper_of(const struct gpucr_entry *e);
void *gpucr_substitute(void *p);
/* What the application is handed for the driver function `real` named `name`: its wrapper, a thunk that waits at
 * the closed gate (thunk.c), or `real` itself. */
void *gpucr_hand_out(const char *name, void *real);
void *gpucr_thunk_for(const char *name, void *real);
bool gpucr_is_driver_handle(void *handle);
void gpucr_thunks_reset_after_fork(void);

/* Driver functions the agent calls itself but does not wrap (resolved in entry.c). None copies or pins: the
 * data plane runs in another process (tests/test_agent_calls.py holds this list, and REAL()'s, to that). */
struct gpucr_driver {
    CUresult (*cuGetProcAddress_v2)(const char *, void **, int, cuuint64_t, int *);
    CUresult (*cuCtxGetCurrent)(CUcontext *);
    CUresult (*cuCtxSetCurrent)(CUcontext);
    CUresult (*cuCtxGetDevice)(CUdevice *);
    CUresult (*cuCtxSynchronize)(void);
    CUresult (*cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*cuMemAddressFree)(CUdeviceptr, size_t);
    CUresult (*cuMemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, int);
    CUresult (*cuMemGetInfo_v2)(size_t *, size_t *);   /* room.c: free memory, for room on demand */
    CUresult (*cuStreamSynchronize)(CUstream);
    CUresult (*cuEventCreate)(CUevent *, unsigned);
    CUresult (*cuEventRecord)(CUevent, CUstream);
    CUresult (*cuGetErrorString)(CUresult, const char **);
    CUresult (*cuGetErrorName)(CUresult, const char **);
    CUresult (*cuDeviceGetAttribute)(int *, int, CUdevice);
    CUresult (*cuDeviceGetUuid)(unsigned char uuid[16], CUdevice);   /* _v2 (the resolver's at 12000) */
    CUresult (*cuPointerGetAttribute)(void *, int, CUdeviceptr);
    CUresult (*cuDevicePrimaryCtxGetState)(CUdevice, unsigned *, int *);
    CUresult (*cuDeviceGetCount)(int *);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*cuDevicePrimaryCtxRelease_v2)(CUdevice);
    /* stream-ordered allocation (pool.c) */
    CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned);
    CUresult (*cuEventQuery)(CUevent);
    CUresult (*cuStreamIsCapturing)(CUstream, int *);
    CUresult (*cuDeviceGetMemPool)(CUmemoryPool *, CUdevice);
    CUresult (*cuDeviceGetDefaultMemPool)(CUmemoryPool *, CUdevice);
    CUresult (*cuDeviceGraphMemTrim)(CUdevice);
    CUresult (*cuDeviceGetGraphMemAttribute)(CUdevice, int, void *);
    int (*simcudaIsSimulated)(void);     /* present only in simcuda, the test double */
};
extern struct gpucr_driver gpucr_drv;
/* "CUDA_ERROR_NAME (what it means)", for messages (in a buffer of the calling thread's). */
const char *gpucr_cu_errstr(CUresult rc);
/* Log a driver error nobody else is told of: "<what> failed: CUDA_ERROR_NAME (what it means)". */
void gpucr_cu_warn(CUresult rc, const char *what_fmt, ...) __attribute__((format(printf, 2, 3)));
/* Make ctx current for the agent's own work; a failure is logged (the next call then fails with its
 * own error, which is reported). */
void gpucr_use_ctx(CUcontext ctx);
const char *gpucr_libcuda_path(void);

/* ---- gate (gate.c) ---- */
/* A call that submits work or changes memory: its time is recorded (the last submission, for idle parking);
 * at the closed gate it raises the demand flag (once per park) before it waits. */
void gpucr_gate_enter(void);
/* A call that waits at the closed gate like any other but is not demand (synchronizes, records, context
 * switches, the agent's own threads). */
void gpucr_gate_enter_waiting(void);
/* An allocation's way in (alloc.c): as gpucr_gate_enter, but at a parked app's closed gate it waits at most the swap
 * service's wait limit (GPUCR_SWAP_WAIT_LIMIT_MS; 0: for ever), then false, outside the gate: the allocation fails
 * with out-of-memory. */
bool gpucr_gate_enter_alloc(void);
long long gpucr_gate_wait_limit_ms(void);
/* The swap service's view (status): the last submission and the demand raised while parked. */
struct jb;
void gpucr_gate_json(struct jb *j);
/* `watch` (the gpucr server's swap service keeps one on each of its apps): waits, on the channel's thread, until a
 * demanding call raises the flag at the closed gate, an allocation asks for room (room.c), the gate opens (someone
 * else's restore, a failed park), or the server hangs up (client_fd readable); answers which. It carries the verdict on the last room
 * request (room=1 made, room=2 none). */
void gpucr_gate_watch(struct jb *j, const char *req, int client_fd);   /* watch.c */
long long gpucr_gate_demand_ns(void);
void gpucr_gate_demand_declined(long long demand_ns);
long long gpucr_gate_demands_answered(void);   /* a watch answers: the demands counted so far, noted as seen */
long gpucr_gate_opens(void);
int gpucr_gate_demand_fd(void);
void gpucr_gate_wake_watch(void);
/* Leave the gate entirely while waiting on something else (room), and come back in (as demand): the depth. Coming
 * back waits at most limit_ms (0: for ever) at a closed gate: false past it (counted in all the same, for the
 * caller's leave, which must then call no driver). */
int gpucr_gate_step_out(void);
bool gpucr_gate_step_in(int depth, long long limit_ms);

/* ---- room on demand (room.c) ---- */
/* After an allocation failed for lack of memory: true when the gpucr server made room (retry once). */
bool gpucr_room_ask(size_t bytes);
bool gpucr_room_ask_context(CUdevice dev);   /* a context the driver could not make for memory: room, then retry */
/* An allocation of this thread succeeded: its allocator's retry, if any, is over. */
void gpucr_room_allocated(void);
bool gpucr_room_pending(void);
void gpucr_room_json(struct jb *j);
void gpucr_room_verdict(bool granted);
void gpucr_room_watching(int delta);
void gpucr_room_reset_after_fork(void);
void gpucr_gate_leave(void);
/* Close the gate and wait for calls in flight; false (gate reopened) if they do not drain in time. */
bool gpucr_gate_close(int64_t deadline_ns, long *in_flight_left);
void gpucr_gate_open(void);
/* A query's way through: false when it is to call the driver (the gate then held, leave it after), true
 * when it is answered "complete" without the driver: the gate is closed and the checkpoint settled. It
 * waits while the gate is closed and not yet settled. */
bool gpucr_gate_query(void);
/* The closed gate's calls drained and the device synchronised: queries are answered from here to open. */
void gpucr_gate_settle(void);
bool gpucr_gate_is_closed(void);
/* The checkpoint held now was committed at level data: the process keeps its context, the driver holds nothing. */
bool gpucr_parked_at_data_level(void);
void gpucr_gate_reset_after_fork(void);

/* ---- time and logging (util.c) ---- */
int64_t gpucr_now_ns(void);
/* Wait on cv (mu held) for at most 10 ms and never past deadline_ns (gpucr_now_ns clock); the
 * caller re-checks its condition and the deadline around it. */
void gpucr_cond_wait_step(pthread_cond_t *cv, pthread_mutex_t *mu, int64_t deadline_ns);
/* Start fn(arg) in a detached thread that takes none of the application's signals; false if it
 * could not be started. */
bool gpucr_spawn_detached(void *(*fn)(void *), void *arg, const char *name);
/* Whether the calling thread is one the agent started (gpucr_spawn_detached): never the application's activity. */
bool gpucr_agent_thread(void);
/* An integer setting from the environment; dflt when unset or empty. */
long gpucr_env_long(const char *name, long dflt);
void gpucr_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void gpucr_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* ---- the private runtime dir (rundir.c) and the control channel (channel.c) ---- */
const char *gpucr_runtime_dir(void);
/* Make (or find) the private runtime dir by the rule; NULL, said, when there is none. The channel says
 * when it is up (listening there) and when not (a fork child). */
const char *gpucr_make_runtime_dir(void);
void gpucr_runtime_dir_up(bool up);

/* ---- contexts (context.c) ---- */
int gpucr_contexts_held(void);

/* ---- channel (channel.c) ---- */
void gpucr_channel_start(void);
/* Every wrapped call, first thing (gpucr_init): the child of a fork starts its channel at its first
 * CUDA call, not at the fork (a child that never uses CUDA costs nothing). One atomic load. */
void gpucr_channel_first_use(void);

/* ---- fork (channel.c) ----
 * pthread_atfork: before the fork the registry lock is taken (never held across a driver call, so
 * this is short); in the child every module forgets the parent's state with plain stores and
 * close(), as POSIX allows there (no socket, thread, malloc or driver call), and its locks are made
 * new. The parent's staging fds and ledger entry are closed in the child (never unlocked there). */

#endif
