/* The registry: every live device allocation the agent has seen, and what the checkpoint can do
 * with it. Guarded by reg_lock() (agent.h says where it sits in the lock order). No driver call is
 * made under it: a wrapper copies what it needs out under the lock, calls the driver without it, and
 * records the result under it again. Records are added and freed only by gated wrappers, so while the
 * gate is closed (a checkpoint or restore runs) the set of records and their mappings stay as they are;
 * the data plane walks them then without the lock, and makes each change to a record under it. */
#ifndef GPUCR_REGISTRY_H
#define GPUCR_REGISTRY_H
#include "agent.h"
#include "hmap.h"

#define MAX_ACCESS 34   /* one descriptor per device (peer access covers 32) and the host that may touch a mapping */
#define SHARE_MAX_DUPS 16   /* exports or imports of one allocation told apart for a checkpoint */

struct mapping {
    CUdeviceptr va;
    size_t size, offset;
    int ndesc;
    CUmemAccessDesc desc[MAX_ACCESS];
    struct phys *phys;
    struct mapping *next;       /* the phys's other mappings */
};

enum phys_kind { PHYS_CONVERTED, PHYS_APP_VMM, PHYS_IMPORTED };

/* One piece of physical device memory: a plain allocation the agent turned into VMM, or a handle
 * the application created or imported itself. */
/* One allocation's state in a checkpoint (registry.c's table says which change is legal):
 *   LIVE     its memory mapped at its addresses (as made, taken back, adopted or relinked)
 *   HANDED   released to gpucr's data plane; the agent's own fd keeps the memory on the GPU (an abort maps it again)
 *   PARKED   committed: the memory off the GPU, the data in staging or an image (an import: unlinked, its
 *            exporter's to save)
 *   GIVEN    handed, then given back before the commit (a two-way switch frees it as soon as its copy landed in
 *            staging): off the GPU, no fd of it left; an abort first needs it made again and filled from staging */
enum alloc_state { AL_LIVE, AL_HANDED, AL_PARKED, AL_GIVEN };

struct phys {
    enum phys_kind kind;
    uint64_t app_handle;        /* the value the application holds (0: it holds none) */
    CUmemGenericAllocationHandle real;  /* the driver's handle now (0 while checkpointed) */
    size_t size;
    CUmemAllocationProp prop;
    CUcontext ctx;
    int app_refs;               /* references the application holds on the handle */
    bool exported;              /* shared as a POSIX fd (cuMemExportToShareableHandle) */
    /* Shared memory (share.c): the key names it across processes (the exporter makes it; an
     * importer is given its exporter's by a controller, 0 until then); sid names it in this
     * process; the dups are the agent's own duplicates of the fds exported or imported. */
    uint64_t share_key;
    unsigned share_sid;
    long share_owner_pid;                   /* an importer's exporter, as the binding controller saw it */
    unsigned long long share_owner_start;   /* ... and its start time (with the pid, names one process) */
    int share_dups[SHARE_MAX_DUPS];
    int share_ndups;
    int share_open_at_release;  /* the application's fds of it still open when it was released */
    bool share_unknown;         /* shared in a way the agent cannot name (a handle type other than a POSIX fd) */
    /* The agent's own POSIX fd of the memory (share.c): -1 when it has none (not exportable, host
     * memory, released for a checkpoint, or no fd could be had: then own_fd_missing). */
    int own_fd;
    bool own_fd_missing;
    bool fd_type_added;         /* the agent added the POSIX-fd handle type the application did not ask for */
    struct mapping *maps;
    /* its memory now was made by another process, the gpucr server, at a restore (dp_adopt): nvidia-smi
     * counts it under that process while it holds a handle, then under none, never under this one */
    bool adopted;
    /* adopted by a restore not finished yet: dp_unadopt gives it back if that restore's fill is refused */
    bool adopt_pending;
    CUdeviceptr resv_va;        /* PHYS_CONVERTED: the VA reservation the agent owns */
    bool pool_seg;              /* PHYS_CONVERTED: a segment of a stream-ordered pool (pool.c), not a plain allocation */
    /* PHYS_CONVERTED made in pieces (alloc.c, GPUCR_PIECE_BYTES): the first piece holds the reservation and names the
     * allocation (conv_by_va); each piece is its own physical memory mapped after the one before, so the data plane
     * moves, and a two-way switch gives back, each on its own. */
    struct phys *next_piece;
    bool piece_tail;            /* a piece after the first: no reservation of its own, freed with the first */
    size_t resv_size, user_size;
    /* checkpoint bookkeeping */
    enum alloc_state state;     /* changed only by reg_alloc_move, which checks the change against its table */
    int staging_seg;            /* 1 + the staging segment its data waits in (0: none), at staging_off */
    size_t staging_off;
    struct phys *next_all, *prev_all;
};

/* Whether p's physical memory is given back for a checkpoint (handed over or parked): not mapped at its addresses. */
static inline bool reg_phys_released(const struct phys *p) { return p->state != AL_LIVE; }
/* p moves to `to` (registry locked); false, said as the agent's own mistake, when the table forbids it. */
bool reg_alloc_move(struct phys *p, enum alloc_state to);
const char *reg_alloc_state_name(enum alloc_state s);

struct registry {
    struct phys *all;
    struct hmap by_app_handle, by_real_handle, conv_by_va, map_by_va;
    struct hmap native_by_va, pool_by_va, managed_by_va;   /* values: reg_native_value(size, device) */
    size_t native_bytes, pool_bytes, managed_bytes;
    long native_count, pool_count, managed_count, ipc_exports;
    long multicast_objects;     /* cuMulticastCreate (NCCL's NVLS): no checkpoint covers them */
    long fabric_shares;         /* memory exported or imported as a fabric handle */
    long unexportable;          /* allocations the agent has no fd of for want of one (RLIMIT_NOFILE) */
    /* the contexts the application uses, each with its device ordinal and UUID (grown as needed) */
    struct ctx_rec { CUcontext ctx; int dev; unsigned char uuid[16]; } *ctxs;
    int nctx, ctx_cap;
    /* cuCtxEnablePeerAccess: the devices whose contexts may touch ctx's plain allocations, which
     * the agent turned into VMM and so must grant them itself (grown as needed) */
    struct peer_grant { CUcontext ctx; uint32_t devs; } *peers;
    int npeers, peer_cap;
    /* What the agent could not record (out of host memory, a limit): a checkpoint would miss it, so
     * it is refused, and status says why (the first such problem). */
    long lost;
    char lost_why[160];
};

extern struct registry g_reg;
void reg_lock(void);
void reg_unlock(void);
/* Remember a context the application uses, and its device; ctx must be the calling thread's current
 * one (every caller just asked the driver for it). Registry NOT locked: it asks the driver. */
void reg_learn_ctx(CUcontext ctx);
/* The contexts known now (malloc'd, *n of them; NULL when none or out of memory). */
CUcontext *reg_contexts(int *n);
/* Something could not be recorded: log it and remember it, so a checkpoint is refused (registry locked). */
void reg_lost(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* hmap_put that records a failure with reg_lost; 0 or -1 (registry locked). */
int reg_put(struct hmap *m, uint64_t key, void *val, const char *what);
/* Ask again which GPU each context is on: a restore may have moved the process to others (--map).
 * Registry NOT locked: it asks the driver. */
void reg_refresh_devices(void);
/* A context ends: forget it; memory recorded in it moves to another live context of its device, or
 * to none until the process makes one (the data plane leaves such memory to the driver). */
void reg_forget_ctx(CUcontext ctx);
/* The device ordinal of a context as last learnt (-1: not known). Registry locked. */
int reg_ctx_device(CUcontext ctx);
/* a UUID as NVML and nvidia-smi write it (rules.h: GPU-xxxxxxxx-...), and that of a context's device ("" unknown) */
void reg_uuid_text(const unsigned char u[16], char out[48]);
void reg_ctx_uuid(CUcontext ctx, char out[48]);
/* Forget the plain, pool and managed allocations `gone` says the driver no longer has. */
void reg_forget_natives(bool (*gone)(CUdeviceptr));
/* A plain allocation's record: its size, and the device it is on (for per-GPU accounting). */
static inline void *reg_native_value(size_t size, int dev) { return (void *)(uintptr_t)(size | (uint64_t)(dev + 1) << 56); }
static inline size_t reg_native_size(const void *v) { return (size_t)((uintptr_t)v & ((1ULL << 56) - 1)); }
static inline int reg_native_dev(const void *v) { return (int)((uintptr_t)v >> 56) - 1; }
/* A new record (registry locked; its context learnt first with reg_learn_ctx); NULL, recorded as
 * lost, when out of host memory. */
struct phys *reg_phys_new(enum phys_kind kind, CUmemGenericAllocationHandle real, size_t size,
                          const CUmemAllocationProp *prop, CUcontext ctx);
void reg_phys_free(struct phys *p);
void reg_set_real(struct phys *p, CUmemGenericAllocationHandle real);
struct mapping *reg_map_add(struct phys *p, CUdeviceptr va, size_t size, size_t offset);
/* Record access set on a mapping as the driver keeps it: per location, the newest call wins, and a
 * location set to no access is forgotten (a re-created mapping starts with none). */
void reg_map_merge_access(struct mapping *m, const CUmemAccessDesc *desc, size_t count);
uint32_t reg_peer_devs(CUcontext owner);
int reg_peer_set(CUcontext owner, int dev, bool on);   /* 0, or -1 out of memory (recorded as lost) */
void reg_map_remove(struct mapping *m);
struct phys *reg_phys_containing(CUdeviceptr ptr);
/* Give back the plain allocation at va the agent made VMM: unmap, release, free its addresses, forget
 * it (alloc.c; registry NOT locked, the gate entered, its context current). */
CUresult alloc_free_converted(CUdeviceptr va);
/* Memory the driver keeps (alloc.c; registry NOT locked): record it, forget it before the driver frees
 * it (its record, NULL if `map` had none), or record it again when the driver did not free it. */
void note_native(struct hmap *map, size_t *bytes, long *count, CUdeviceptr ptr, size_t size);
void *take_native(struct hmap *map, size_t *bytes, long *count, CUdeviceptr ptr);
void keep_native(struct hmap *map, size_t *bytes, long *count, CUdeviceptr ptr, void *v);
/* Close the fds the agent holds of p's memory (its own and the duplicates of shared ones): each keeps it on the GPU. */
void reg_phys_close_fds(struct phys *p);
/* Whether the data plane moves this allocation itself (else the driver's checkpoint does). */
bool reg_phys_movable(const struct phys *p);
void reg_reset_after_fork(void);

/* ---- memory shared with other processes (share.c); registry locked ---- */
/* Whether two fds of this process are one open file description (kcmp, else F_SETSIG). */
bool share_same_file(int a, int b);
uint64_t share_new_key(void);
/* Keep a duplicate of an fd exported or imported for p (and give p its sid). */
void share_keep_fd(struct phys *p, int fd);
/* How many of the application's open fds are p's memory (they keep it on the GPU). */
int share_open_fds(const struct phys *p);
/* p's memory is being released: count the application's fds of it, then close the agent's own. */
void share_release(struct phys *p);
/* Whether the agent keeps an fd of memory with these properties: device memory (host-located memory is not GPU
 * data) that can be exported as a POSIX fd. */
bool share_keeps_fd(const CUmemAllocationProp *prop);
/* Device memory made exportable as a POSIX fd where its device can (so the data plane can be handed it); true
 * when the agent added the type the application did not ask for. */
bool share_make_exportable(CUmemAllocationProp *prop);
/* The process uses CUDA, so the agent will keep an fd per allocation: soft RLIMIT_NOFILE to the hard one. */
void share_raise_nofile(void);
/* The agent's own fd of memory it manages: an export of `real` (registry NOT locked: asks the
 * driver), or -1 when none can be had (said once, naming RLIMIT_NOFILE). */
int share_export_own(CUmemGenericAllocationHandle real);
/* Whether n more fds of the agent's own fit before the part of the table it leaves to others. */
bool share_fds_left(int n);
/* Give p its own fd (fd from share_export_own, or a dup of an imported one; -1: counted as not
 * exportable). Registry locked. */
void share_adopt_own(struct phys *p, int fd, bool wanted);
/* A new fd of p's memory for the application (a dup of the agent's own), or -1 when it has none. */
int share_dup_own(const struct phys *p);
#endif
