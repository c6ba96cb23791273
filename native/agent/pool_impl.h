/* What the pool files share among themselves (pool.c: the shadows, segments and blocks; pool_alloc.c: the
 * stream-ordered allocation calls; mempool.c: the cuMemPool* calls). The rest of the agent uses pool.h.
 * Everything here is under g_pool_mu unless said otherwise; lock order: gate -> g_pool_mu -> registry lock. */
#ifndef GPUCR_POOL_IMPL_H
#define GPUCR_POOL_IMPL_H
#include <pthread.h>
#include "pool.h"
#include "registry.h"

#define MIN_SHIFT 9                       /* 512 B: the smallest slot */
#define MAX_SMALL_SHIFT 20                /* 1 MiB: the largest slot; larger sizes get a segment */
#define NSMALL (MAX_SMALL_SHIFT - MIN_SHIFT + 1)
#define LARGE NSMALL                      /* the free list of whole segments */

struct sstate;

struct slot {
    struct slot *prev, *next;             /* in its pool's free list while free */
    struct seg *seg;
    CUdeviceptr va;
    size_t size;
    bool free;
    struct sstate *st;                    /* the stream it was freed on */
    uint64_t epoch;                       /* ... and that stream's free count then */
};

struct seg {
    struct seg *next;
    struct apool *pool;
    struct phys *phys;
    CUcontext ctx;
    CUdeviceptr va;
    size_t size;
    int cls;                              /* < NSMALL: a slab of that class; LARGE: one block */
    int nslots, nlive;
    struct slot slots[];
};

/* A stream the application freed pool memory on. */
struct sstate {
    uint64_t key;                         /* the stream (per-thread default streams: the thread) */
    CUstream handle;                      /* what to hand the driver for it */
    CUcontext ctx;                        /* where its event lives */
    bool eager;                           /* a per-thread stream: record at every free (no other thread can later) */
    bool dead;                            /* destroyed: its event was recorded last thing */
    uint64_t epoch, done, ev_epoch;       /* frees so far; frees known complete; frees before the event */
    CUevent ev;
};

/* The agent's shadow of one of the application's pools. */
struct apool {
    struct apool *next;
    CUmemoryPool handle;
    int dev;
    const char *native;                   /* NULL: the agent serves it; else why the driver keeps it */
    bool ipc;                             /* created with handle types (IPC-capable) */
    size_t max_size;                      /* 0: no limit */
    bool destroyed;                       /* cuMemPoolDestroy: forgotten once its last segment is gone */
    int internal_deps;                    /* CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES */
    int opportunistic;                    /* CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC */
    uint64_t threshold;
    uint64_t used, reserved, used_high, reserved_high;
    int nacc;
    CUmemAccessDesc acc[MAX_ACCESS];      /* peers granted by cuMemPoolSetAccess */
    struct slot free_head[NSMALL + 1];    /* sentinels of the free lists */
    struct seg *segs;
};

/* pool.c's state */
extern pthread_mutex_t g_pool_mu;
extern struct apool *g_pools;
extern struct hmap g_pool_live;           /* va -> slot handed out */
extern struct hmap g_pool_streams;        /* key -> sstate */
extern struct hmap g_native_reason;       /* va -> reason of stream-ordered memory the driver keeps (1 ipc, 2 other) */
extern struct pool_stats g_pool_stats;
extern long g_pools_dying;                /* served pools destroyed, not yet forgotten (their blocks in use; atomic) */
extern size_t g_pool_gran;                /* the VMM granule, once known */

/* Streams: the key of a stream (per-thread default streams: the thread) and the handle to give the driver;
 * its state, made on first sight (NULL: out of memory); its event recorded now, after every free so far;
 * everything freed on stream `key` (0: on every stream of ctx) known complete. */
uint64_t pool_stream_key(CUstream h, bool pt);
CUstream pool_stream_handle(CUstream h, bool pt);
struct sstate *pool_stream_state(CUstream h, bool pt);
bool pool_stream_record(struct sstate *st);
void pool_streams_done(uint64_t key, CUcontext ctx);

/* Shadows: a new one (counted in the stats); the one of pool h, made on first sight. */
struct apool *pool_shadow_new(CUmemoryPool h, int dev, const char *native);
struct apool *pool_shadow(CUmemoryPool h);
/* Release idle segments until the pool holds at most `keep` bytes (`all_done`: the device was synchronised). */
void pool_shrink(struct apool *pl, uint64_t keep, bool all_done);
/* Forget the shadows of destroyed pools with nothing left. */
void pool_forget_destroyed(void);

/* Blocks: serve `size` bytes of pl to stream h in context ctx; hand a block back, freed on st (NULL: complete). */
CUresult pool_serve(struct apool *pl, CUdeviceptr *dptr, size_t size, CUstream h, bool pt, CUcontext ctx);
void pool_slot_free(struct slot *s, struct sstate *st);
#endif
