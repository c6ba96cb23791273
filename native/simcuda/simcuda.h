/*
 * simcuda internals shared between the source files. simcuda is a TEST DOUBLE of the CUDA
 * driver: "device memory" is host memory at stable addresses, work runs synchronously on the
 * calling thread, and the driver checkpoint API is a real state machine served over a Unix
 * socket, so CI without a GPU can run checkpoint/restore end to end with real processes.
 *
 * Files, one job each:
 *   init.c        cuInit, configuration from the environment, process-wide start-up
 *   gate.c        the API gate every entry point passes (what the checkpoint lock closes)
 *   accounting.c  the runtime dir and per-process device-memory accounting across processes
 *   memory.c      VA arena, physical allocations (memfds), mappings, host registrations,
 *                 and saving/re-creating physical memory for checkpoint/restore
 *   api_device.c  devices and contexts
 *   api_memory.c  memory entry points (plain, VMM, IPC, host, pointer attributes)
 *   api_exec.c    copies, memsets, streams, events, modules, builtin kernels
 *   gpucr_kernels.c  gpucr's own kernels (its fatbin's zero scan and chunk digest) in C
 *   order.c       the stream-ordering model: what work is ordered after what (vector clocks)
 *   pool.c        stream-ordered memory pools (cuMemAllocAsync, cuMemPoolCreate, ...)
 *   ckpt.c        the checkpoint state machine, its control socket, and the controller side
 *   procaddr.c    cuGetProcAddress over a static table of our own entry points
 *   errors.c      cuGetErrorString / cuGetErrorName
 *
 * Lock order (never take an earlier lock while holding a later one):
 *   ctx lock (api_device.c) -> exec lock (api_exec.c) -> pool lock (pool.c) -> order lock (order.c)
 *   -> memory rwlock -> accounting lock -> the runtime dir's flock. The gate's mutex is only ever
 *   held on its own.
 */
#ifndef SIMCUDA_H
#define SIMCUDA_H

#include <stdbool.h>
#include <sys/types.h>

#define SIMCUDA_BUILDING
#include "simcuda_api.h"

#pragma GCC visibility push(hidden)

#define SIM_GRANULE (2ull << 20)     /* VMM granularity, as on the H200 */
#define SIM_MAX_DEVICES 16
#define SIM_DRIVER_VERSION 13000
#define SIM_PITCH_ALIGN 512

static inline size_t sim_round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

/* ---- init.c: configuration and process start-up ---- */

struct sim_config {
    int ndevices;        /* SIMCUDA_DEVICES, default 1 */
    size_t total_mem;    /* SIMCUDA_TOTAL_MEM bytes per device, default 16 GiB */
    size_t ctx_bytes;    /* SIMCUDA_CTX_BYTES per live context, default 64 MiB */
    CUresult fail_restore; /* SIMCUDA_FAIL_RESTORE=1 (CUDA_ERROR_UNKNOWN) or oom (OUT_OF_MEMORY): the next RESTORE
                            * fails so (one shot) */
    bool fail_lock;      /* SIMCUDA_FAIL_LOCK=1: the next LOCK times out (one shot), as if a call never drained */
    size_t checkpoint_delay_ms; /* SIMCUDA_CHECKPOINT_DELAY_MS: the next CHECKPOINT answers this late (one shot) */
    char fail_call[64];  /* SIMCUDA_FAIL_CALL=NAME[:N]: the N-th call (default the first) of entry point */
    unsigned fail_nth;   /* NAME fails with CUDA_ERROR_UNKNOWN (one shot); see sim_fault_injected */
    pid_t pid;           /* the process that ran cuInit (a forked child is not it) */
};
extern struct sim_config sim_cfg;

/* Reads the environment into a config; the controller side uses it without cuInit. */
void sim_config_load(struct sim_config *cfg);
/* True once cuInit succeeded in this process (and we are not a forked child of it). */
bool sim_is_ready(void);
/* Whether this call of `entry` is the one SIMCUDA_FAIL_CALL says fails (counted per process). Only
 * the entry points that call it can be made to fail: cuMemCreate, cuMemMap, cuMemUnmap, cuMemRelease,
 * cuMemSetAccess (those a checkpoint's data plane uses). */
bool sim_fault_injected(const char *entry);

/* ---- gate.c ---- */

CUresult sim_gate_enter(void);
void sim_gate_exit(void);
bool sim_gate_close(unsigned timeout_ms); /* false: timed out, gate reopened */
/* The process is checkpointed by a controller (not only locked). */
bool sim_ckpt_checkpointed(void);
void sim_gate_open(void);

/* Runs an entry point's body between enter() and exit(), returning its result. */
#define SIM_BETWEEN(enter, exit, expr)                                                        \
    do {                                                                                      \
        CUresult sim_between_rc_ = enter();                                                   \
        if (sim_between_rc_ != CUDA_SUCCESS)                                                  \
            return sim_between_rc_;                                                           \
        sim_between_rc_ = (expr);                                                             \
        exit();                                                                               \
        return sim_between_rc_;                                                               \
    } while (0)

/* Runs an entry point's body inside the gate: blocks while the process is locked. */
#define SIM_GATED(expr) SIM_BETWEEN(sim_gate_enter, sim_gate_exit, expr)

/* Every registry of simcuda (contexts, modules, pools, their blocks, graphs, physical memory) is a list linked
 * through `next`, newest first. */
#define SIM_PUSH(head, node)                                                                  \
    do {                                                                                      \
        (node)->next = (head);                                                                \
        (head) = (node);                                                                      \
    } while (0)
#define SIM_PUSH_LOCKED(mu, head, node)                                                       \
    do {                                                                                      \
        pthread_mutex_lock(mu);                                                               \
        SIM_PUSH(head, node);                                                                 \
        pthread_mutex_unlock(mu);                                                             \
    } while (0)

/* ---- accounting.c ---- */

/* Resolves, creates (0700) and checks the per-user runtime dir into buf. */
CUresult sim_rundir(char *buf, size_t len);
/* Builds "<rundir>/<pid><suffix>". */
CUresult sim_rundir_path(char *buf, size_t len, pid_t pid, const char *suffix);
CUresult sim_acct_init(void);
/* A new open of <rundir>/nvidiactl: what the driver hands out for each export (-1 on failure). */
int sim_acct_open_ctl(void);
/* Device arguments are this process's ordinals; usage is published per physical device
 * (the GPU an ordinal stands for, which a restore with GPU pairs can change). */
/* Charges bytes to this process on dev; CUDA_ERROR_OUT_OF_MEMORY if the device lacks room. */
CUresult sim_acct_charge(int dev, size_t bytes);
void sim_acct_uncharge(int dev, size_t bytes);
/* Host memory pinned in this process (cuMemHostRegister, cuMemHostAlloc) grew or shrank by delta: published
 * beside the device usage, for simcudaProcessHostPinned. */
void sim_acct_host_pinned(long long delta);
/* All-or-nothing charge of bytes[dev] on every device (restore). */
CUresult sim_acct_charge_all(const size_t bytes[SIM_MAX_DEVICES]);
void sim_acct_uncharge_all(const size_t bytes[SIM_MAX_DEVICES]);
/* Free bytes on dev as every live process sees it. */
size_t sim_acct_free(int dev);
/* The physical device behind ordinal dev; identity until a restore remaps the process. */
int sim_acct_physical(int dev);
/* The ordinal standing for physical device phys, or -1. */
int sim_acct_ordinal(int phys);
/* Reads / replaces the whole ordinal -> physical map (phys[] is a permutation of the devices);
 * replacing it moves what the process has charged along with its ordinals. */
void sim_acct_devices(int phys[SIM_MAX_DEVICES]);
void sim_acct_set_devices(const int phys[SIM_MAX_DEVICES]);

/* ---- api_device.c: contexts ---- */

struct sim_ctx {
    struct sim_ctx *next; /* every context ever made; see api_device.c for why none is freed */
    int device;
    unsigned flags;
    bool primary;
    bool live;
};

/* The calling thread's current context, or CUDA_ERROR_INVALID_CONTEXT. */
CUresult sim_ctx_current(struct sim_ctx **out);
bool sim_ctx_is_live(struct sim_ctx *ctx);
/* Adds the per-device context cost (ctx_bytes per live context) to per_dev; returns the mask
 * of devices with a live context. Caller holds the ctx lock. */
unsigned sim_ctx_costs_locked(size_t per_dev[SIM_MAX_DEVICES]);
void sim_ctx_lock(void);
void sim_ctx_unlock(void);
CUresult sim_device_check(CUdevice dev);
/* The UUID of a physical device (not an ordinal: see sim_acct_physical). */
void sim_device_uuid(int phys, CUuuid *uuid);

/* ---- memory.c ---- */

enum sim_alloc_kind { SIM_ALLOC_PLAIN, SIM_ALLOC_MANAGED, SIM_ALLOC_POOL };

/* What cuPointerGetAttribute / cuMemGetAddressRange know about an address. */
struct sim_ptrinfo {
    int memory_type; /* CU_MEMORYTYPE_DEVICE or CU_MEMORYTYPE_HOST */
    CUdeviceptr base;
    size_t size;
    struct sim_ctx *ctx;
    int device;
    bool vmm;                 /* an application VMM mapping, not a cuMemAlloc-family allocation */
    enum sim_alloc_kind kind; /* when !vmm */
};

CUresult sim_mem_init(void);

/* Copies, memsets and kernels hold the read lock while they touch memory, so that nothing is
 * unmapped under them; everything that changes the maps takes the write lock. */
void sim_mem_rdlock(void);
void sim_mem_unlock(void);

/* What touches memory: SMs (kernels, memsets) reach only what the device may access; a copy
 * engine also reaches any device's cuMemAlloc memory (unified addressing: copies between
 * devices need no peer access on CUDA). */
enum sim_engine { SIM_ENGINE_SM, SIM_ENGINE_COPY };

/* With the read lock held: may work issued in ctx touch [p, p+n) with at least `need` access
 * (CU_MEM_ACCESS_FLAGS_PROT_READ or _READWRITE)? VMM memory: what cuMemSetAccess granted to
 * ctx's device; cuMemAlloc-family memory: its context's device and contexts that enabled
 * peer access to that context (any context for a copy engine); pinned host memory: always. */
bool sim_mem_accessible(const struct sim_ctx *ctx, uintptr_t p, size_t n, int need, enum sim_engine engine);
bool sim_mem_in_arena(uintptr_t p);
/* Whether host memory [p, p+n) lies wholly inside one pinned range (registered or cuMemHostAlloc'd). */
bool sim_mem_host_pinned(uintptr_t p, size_t n);
bool sim_mem_host_pinned_locked(uintptr_t p, size_t n);   /* the same, with the read lock held */

/* Peer access of ctx to peer's cuMemAlloc-family memory (cuCtxEnablePeerAccess).
 * CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED / _NOT_ENABLED as on CUDA. */
CUresult sim_mem_peer_enable(const struct sim_ctx *ctx, const struct sim_ctx *peer);
CUresult sim_mem_peer_disable(const struct sim_ctx *ctx, const struct sim_ctx *peer);

CUresult sim_vmm_reserve(CUdeviceptr *va, size_t size, size_t align, CUdeviceptr hint);
CUresult sim_vmm_free(CUdeviceptr va, size_t size);
CUresult sim_vmm_create(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop);
CUresult sim_vmm_release(CUmemGenericAllocationHandle h);
CUresult sim_vmm_map(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                     struct sim_ctx *ctx);
CUresult sim_vmm_unmap(CUdeviceptr va, size_t size);
/* desc[] is validated (devices, flags): each entry sets its device's access to the range. */
CUresult sim_vmm_set_access(CUdeviceptr va, size_t size, const CUmemAccessDesc *desc, size_t count);
CUresult sim_vmm_get_access(CUdeviceptr va, int dev, int *flags);
CUresult sim_vmm_retain(CUmemGenericAllocationHandle *h, CUdeviceptr va);
CUresult sim_vmm_get_prop(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h);
CUresult sim_vmm_export_fd(int *fd, CUmemGenericAllocationHandle h);
CUresult sim_vmm_export_fabric(void *out, CUmemGenericAllocationHandle h);
CUresult sim_vmm_import_fd(CUmemGenericAllocationHandle *h, int fd);

CUresult sim_alloc(CUdeviceptr *va, size_t size, enum sim_alloc_kind kind, struct sim_ctx *ctx);
CUresult sim_free(CUdeviceptr va);
CUresult sim_ptrinfo(CUdeviceptr p, struct sim_ptrinfo *info);
/* Frees the cuMemAlloc-family allocations, pinned host memory and peer access (either way)
 * of a context going away. */
void sim_mem_drop_ctx(struct sim_ctx *ctx);

CUresult sim_host_alloc(void **pp, size_t size, unsigned flags, struct sim_ctx *ctx);
CUresult sim_host_free(void *p);
CUresult sim_host_register(void *p, size_t size, unsigned flags, struct sim_ctx *ctx);
CUresult sim_host_unregister(void *p);

/* ---- exportable memory's lifetime across processes (objects.c) ---- */
/* A new object of size bytes on physical GPU phys, held by this process: its data fd (-1: failed). */
int sim_obj_create(int phys, size_t size, uint64_t *id);
/* Object id's data on physical GPU phys, opened for one use (it holds nothing); -1: gone. */
int sim_obj_data(uint64_t id, int phys);
/* Object id's data, opened and held by this process (the caller holds an fd of it); -1: gone. */
int sim_obj_open(uint64_t id, int *phys);
/* This process lets go of object id: freed when nobody else holds it; else, if this process made it
 * (owner), it counts on its GPU by itself from now on. */
void sim_obj_drop(uint64_t id, int phys, bool owner);
/* A new exported fd of object id (an open of nvidiactl holding it); -1: failed. */
int sim_obj_export(uint64_t id);
/* The object an exported fd names; 0: not an export. */
uint64_t sim_obj_of_fd(int fd);
/* Adds the bytes of objects kept alive only by others' fds to sums[] (by physical GPU), freeing
 * every object nobody holds any more. */
void sim_obj_usage(const char *rundir, size_t sums[SIM_MAX_DEVICES]);

/* Checkpoint support, called by the control thread while the gate is closed. Accounting is
 * left to the caller. sim_mem_checkpoint copies every physical allocation into private host
 * memory and frees it (mappings become PROT_NONE reservations at the same addresses);
 * charged[dev] receives the bytes they had charged. sim_mem_checkpointed_bytes says what a
 * restore will charge again, and returns the mask of devices holding physical memory.
 * sim_mem_restore re-creates, refills and re-maps everything with the same protections;
 * when it fails nothing has changed (still checkpointed). */
CUresult sim_mem_checkpoint(size_t charged[SIM_MAX_DEVICES]);
unsigned sim_mem_checkpointed_bytes(size_t need[SIM_MAX_DEVICES]);
CUresult sim_mem_restore(void);

/* ---- api_exec.c ---- */

/* Forgets the streams, events and modules of a context that is going away. */
void sim_exec_drop_ctx(struct sim_ctx *ctx);
/* NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD or a live stream; else CUDA_ERROR_INVALID_HANDLE. */
CUresult sim_stream_check(CUstream s);

/* ---- order.c: what CUDA promises about the order of work across streams ---- */

#define SIM_ORDER_MAX 1024   /* streams alive at once whose order is told apart (ids of forgotten ones are reused);
                               * a long-lived server or test process holds hundreds (each thread's per-thread stream too) */
struct sim_clock { uint64_t c[SIM_ORDER_MAX]; };   /* per stream id: the last position ordered before */
struct sim_pos { int id; uint64_t seq; };           /* one piece of work: its stream's id and position */
#define SIM_MAP_WORK 4      /* asynchronous copies a mapping remembers (per stream), so it is not unmapped under them */

/* Work enqueued on s: returns its position. */
struct sim_pos sim_order_op(CUstream s);
/* cuEventRecord: an op on s whose clock the event keeps. */
void sim_order_record(struct sim_clock *ev, CUstream s);
/* cuStreamWaitEvent: later work on s is ordered after what ev recorded. */
void sim_order_wait(CUstream s, const struct sim_clock *ev);
/* later work on s is ordered after p (what the driver's own stream-ordered allocator inserts) */
void sim_order_wait_pos(CUstream s, struct sim_pos p);
/* The host saw s's work (or an event's, or everything) complete. */
void sim_order_sync_stream(CUstream s);
void sim_order_sync_clock(const struct sim_clock *ev);
void sim_order_sync_all(void);
bool sim_order_done(const struct sim_clock *ev);
bool sim_order_pos_done(struct sim_pos p);
/* An asynchronous copy at p touched [ptr, ptr + n): its mappings are not unmapped before p is seen done. */
void sim_vmm_note_work(uintptr_t ptr, size_t n, struct sim_pos p);
/* Whether work enqueued next on s is ordered after every asynchronous copy that touched the mappings of
 * [ptr, ptr + n) (a kernel that reads what copies wrote must be); the caller holds the memory lock. */
bool sim_vmm_work_ordered(CUstream s, uintptr_t ptr, size_t n);
/* How the next work on s is ordered after p (0: it is not): on the same stream, through events
 * waited on, or because the host saw p complete. */
enum { SIM_ORDER_SAME_STREAM = 1, SIM_ORDER_EVENTS = 2, SIM_ORDER_COMPLETE = 4 };
int sim_order_relation(CUstream s, struct sim_pos p);
void sim_order_forget(CUstream s);

/* ---- pool.c: stream-ordered memory pools ---- */

/* cuMemFree of memory a pool handed out: true (and *rc set) if it was a pool's. */
bool sim_pool_free_sync(CUdeviceptr p, CUresult *rc);
/* A synchronize completed: pools above their release threshold give back what they may. */
void sim_pool_after_sync(void);
/* Every pool of a context's device that is going away forgets what it held. */
void sim_pool_drop_ctx(struct sim_ctx *ctx);

/* ---- graph.c: stream capture and graph memory nodes ---- */

/* cuMemAllocAsync on s: true (and *rc, *va set) if s is capturing, so the allocation is a graph's. */
bool sim_graph_alloc(CUdeviceptr *va, size_t size, CUstream s, struct sim_ctx *ctx, CUresult *rc);
/* cuMemFreeAsync on s (on_stream false: cuMemFree): true (and *rc set) if s is capturing (then only a
 * graph allocation of that capture may be freed) or va is graph memory freed outside its graph. */
bool sim_graph_free(CUdeviceptr va, CUstream s, bool on_stream, CUresult *rc);
/* The capture status of s (CU_STREAM_CAPTURE_STATUS_*). */
int sim_graph_capture_status(CUstream s);
/* A context that is going away: forget its graph memory (memory.c frees it). */
void sim_graph_drop_ctx(struct sim_ctx *ctx);

/* ---- ckpt.c ---- */

/* Starts the control thread serving <rundir>/<pid>.ctl. */
CUresult sim_ctl_start(void);

/* Calls the driver's checkpoint lock does not hold (stream and event queries, every synchronize;
 * measured on an H200, driver 580): they run while the process is locked. One that overlaps a
 * checkpoint fails it with CUDA_ERROR_OPERATING_SYSTEM; one made while the process is checkpointed
 * kills it. Either way the process goes FAILED and dies with SIGSEGV, as on the driver. */
CUresult sim_unheld_enter(void);
void sim_unheld_exit(void);

/* Runs an entry point's body as a call the lock does not hold. */
#define SIM_UNHELD(expr) SIM_BETWEEN(sim_unheld_enter, sim_unheld_exit, expr)

/* ---- gpucr_kernels.c: gpucr's own kernels ---- */

/* Whether a module image is gpucr's kernels' fatbin (its header, and every kernel's name in it). */
bool sim_gpucr_image(const void *image);
/* The kernels, params as cuLaunchKernel's: (base, nbytes, out) over one range; (table, n, out, out2) over
 * a table of ranges in device memory. stream: the one they were launched on. */
CUresult sim_k_gpucr_digest(const struct sim_ctx *ctx, CUstream stream, void **params);
CUresult sim_k_gpucr_zero_scan(const struct sim_ctx *ctx, CUstream stream, void **params);
CUresult sim_k_gpucr_scan_table(const struct sim_ctx *ctx, CUstream stream, void **params);
CUresult sim_k_gpucr_check_table(const struct sim_ctx *ctx, CUstream stream, void **params);

#pragma GCC visibility pop

#endif /* SIMCUDA_H */
