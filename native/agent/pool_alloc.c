/* The application's stream-ordered allocation calls (cuMemAllocAsync, cuMemAllocFromPoolAsync, cuMemFreeAsync, their
 * per-thread forms), the synchronize points at which pools give memory back, and stream destroy, which orders a
 * stream's frees first. pool.c serves the blocks; what the agent does not serve (graph memory, the driver's own
 * pools) goes to the driver and is recorded with why. Lock order: gate -> g_pool_mu -> registry lock. */
#include <pthread.h>
#include "pool_impl.h"

/* Stream-ordered memory the driver keeps: recorded with why. */
static void note_driver_alloc(CUdeviceptr va, size_t size, struct apool *pl)
{
    note_native(&g_reg.pool_by_va, &g_reg.pool_bytes, &g_reg.pool_count, va, size);
    hmap_put(&g_native_reason, va, (void *)(uintptr_t)(pl && pl->ipc ? 1 : 2));
}

static bool capturing(CUstream h, bool pt)
{
    int status = CU_STREAM_CAPTURE_STATUS_NONE;
    return gpucr_drv.cuStreamIsCapturing && gpucr_drv.cuStreamIsCapturing(pool_stream_handle(h, pt), &status) == CUDA_SUCCESS &&
           status != CU_STREAM_CAPTURE_STATUS_NONE;
}

typedef CUresult (*real_alloc_fn)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);

/* Both allocation entry points. pool NULL: the current pool of the current device (cuMemAllocAsync). */
static CUresult alloc_async(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream h, bool pt,
                            CUresult (*real_plain)(CUdeviceptr *, size_t, CUstream), real_alloc_fn real_pool)
{
    if (!dptr || !size || capturing(h, pt)) {
        /* bad arguments are the driver's to answer; during capture the graph owns the memory (its
         * aliasing and addresses), so it stays the driver's: graph memory, reported as such */
        CUresult rc = pool ? real_pool(dptr, size, pool, h) : real_plain(dptr, size, h);
        if (rc == CUDA_SUCCESS && size) { pthread_mutex_lock(&g_pool_mu); g_pool_stats.captured_allocs++; pthread_mutex_unlock(&g_pool_mu); }
        return rc;
    }
    CUcontext ctx = NULL;
    CUdevice dev = 0;
    if (!pool && (gpucr_drv.cuCtxGetDevice(&dev) != CUDA_SUCCESS || !gpucr_drv.cuDeviceGetMemPool ||
                  gpucr_drv.cuDeviceGetMemPool(&pool, dev) != CUDA_SUCCESS))
        return real_plain(dptr, size, h);
    gpucr_drv.cuCtxGetCurrent(&ctx);
    pthread_mutex_lock(&g_pool_mu);
    g_pool_stats.alloc_calls++;
    if (!g_pool_gran) {
        CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED, .location = {CU_MEM_LOCATION_TYPE_DEVICE, 0}};
        if (gpucr_drv.cuMemGetAllocationGranularity(&g_pool_gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS) g_pool_gran = 0;
    }
    struct apool *pl = pool_shadow(pool);
    CUresult rc = CUDA_ERROR_NOT_SUPPORTED;
    if (pl && !pl->native && g_pool_gran && ctx) rc = pool_serve(pl, dptr, size, h, pt, ctx);
    pthread_mutex_unlock(&g_pool_mu);
    if (rc != CUDA_ERROR_NOT_SUPPORTED) return rc;
    rc = real_pool ? real_pool(dptr, size, pool, h) : real_plain(dptr, size, h);
    if (rc == CUDA_SUCCESS) {
        pthread_mutex_lock(&g_pool_mu);
        note_driver_alloc(*dptr, size, pl);
        pthread_mutex_unlock(&g_pool_mu);
    }
    return rc;
}

static CUresult free_async(CUdeviceptr va, CUstream h, bool pt, CUresult (*real)(CUdeviceptr, CUstream))
{
    /* during capture a free becomes a free node, which CUDA takes only for a graph allocation: the
     * agent's blocks never are one (allocations during capture are the driver's), so such a free goes
     * to the driver, which answers it as CUDA does (CUDA_ERROR_INVALID_VALUE, the capture going on);
     * the block stays the application's */
    bool captured = capturing(h, pt);
    pthread_mutex_lock(&g_pool_mu);
    struct slot *s = va && !captured ? hmap_get(&g_pool_live, va) : NULL;
    CUresult rc = CUDA_SUCCESS;
    if (s) {
        struct sstate *st = pool_stream_state(h, pt);
        if (!st) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            st->epoch++;
            if (st->eager) pool_stream_record(st);
            pool_slot_free(s, st);
        }
    }
    pthread_mutex_unlock(&g_pool_mu);
    if (s) return rc;
    /* forgotten before the driver frees it: once freed, another thread may get the address */
    void *rec = take_native(&g_reg.pool_by_va, &g_reg.pool_bytes, &g_reg.pool_count, va);
    rc = real(va, h);
    if (rc != CUDA_SUCCESS && rec) keep_native(&g_reg.pool_by_va, &g_reg.pool_bytes, &g_reg.pool_count, va, rec);
    if (rc == CUDA_SUCCESS) {
        pthread_mutex_lock(&g_pool_mu);
        hmap_del(&g_native_reason, va);
        pthread_mutex_unlock(&g_pool_mu);
    }
    return rc;
}

/* Pools above their release threshold give back what they may (the host just saw work complete).
 * Its callers, the synchronize wrappers, hold the gate. */
static void after_sync(uint64_t key, bool whole_ctx)
{
    CUcontext cur = NULL;
    if (whole_ctx) gpucr_drv.cuCtxGetCurrent(&cur);
    pthread_mutex_lock(&g_pool_mu);
    if (key || whole_ctx) pool_streams_done(key, cur);
    for (struct apool *pl = g_pools; pl; pl = pl->next)
        if (!pl->native && pl->reserved > pl->threshold) pool_shrink(pl, pl->threshold, false);
    pool_forget_destroyed();
    pthread_mutex_unlock(&g_pool_mu);
}

static bool any_served(void)
{
    /* a destroyed pool's blocks still go back at a synchronize */
    return __atomic_load_n(&g_pool_stats.pools_served, __ATOMIC_RELAXED) != 0 || __atomic_load_n(&g_pools_dying, __ATOMIC_RELAXED) != 0;
}

/* ---- entry points ---- */

#define ALLOC_PLAIN(sym, pt, poolsym)                                                                   \
    GPUCR_EXPORT CUresult sym(CUdeviceptr *dptr, size_t size, CUstream st)                              \
    {                                                                                                   \
        gpucr_init();                                                                                   \
        if (!REAL(sym)) return CUDA_ERROR_NOT_SUPPORTED;                                                \
        gpucr_gate_enter();                                                                             \
        CUresult rc = alloc_async(dptr, size, NULL, st, pt, REAL(sym), REAL(poolsym));                  \
        gpucr_gate_leave();                                                                             \
        return rc;                                                                                      \
    }
ALLOC_PLAIN(cuMemAllocAsync, false, cuMemAllocFromPoolAsync)
ALLOC_PLAIN(cuMemAllocAsync_ptsz, true, cuMemAllocFromPoolAsync_ptsz)

#define ALLOC_POOL(sym, pt, plainsym)                                                                   \
    GPUCR_EXPORT CUresult sym(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream st)           \
    {                                                                                                   \
        gpucr_init();                                                                                   \
        if (!REAL(sym)) return CUDA_ERROR_NOT_SUPPORTED;                                                \
        gpucr_gate_enter();                                                                             \
        CUresult rc = pool ? alloc_async(dptr, size, pool, st, pt, REAL(plainsym), REAL(sym))           \
                           : REAL(sym)(dptr, size, pool, st);                                           \
        gpucr_gate_leave();                                                                             \
        return rc;                                                                                      \
    }
ALLOC_POOL(cuMemAllocFromPoolAsync, false, cuMemAllocAsync)
ALLOC_POOL(cuMemAllocFromPoolAsync_ptsz, true, cuMemAllocAsync_ptsz)

#define FREE_ASYNC(sym, pt)                                                                             \
    GPUCR_EXPORT CUresult sym(CUdeviceptr dptr, CUstream st)                                            \
    {                                                                                                   \
        gpucr_init();                                                                                   \
        if (!REAL(sym)) return CUDA_ERROR_NOT_SUPPORTED;                                                \
        gpucr_gate_enter();                                                                             \
        CUresult rc = free_async(dptr, st, pt, REAL(sym));                                              \
        gpucr_gate_leave();                                                                             \
        return rc;                                                                                      \
    }
FREE_ASYNC(cuMemFreeAsync, false)
FREE_ASYNC(cuMemFreeAsync_ptsz, true)

/* Synchronize points. They wait at the closed gate like a launch: the driver's lock does not hold
 * them, and one that overlaps its checkpoint kills the process (entrypoints.def). One already waiting
 * when the gate closes is drained with the other calls in flight: it returns once the work submitted
 * before the gate closed is done, which the checkpoint's own synchronize waits for anyway. The host
 * then sees work complete and (as CUDA does) pools above their release threshold give memory back. */
static CUresult synchronized(CUresult rc, uint64_t key, bool whole_ctx)
{
    if (rc == CUDA_SUCCESS && any_served()) after_sync(key, whole_ctx);
    gpucr_gate_leave();
    return rc;
}

#define STREAM_SYNC(sym, pt)                                                                            \
    GPUCR_EXPORT CUresult sym(CUstream st)                                                              \
    {                                                                                                   \
        gpucr_init();                                                                                   \
        if (!REAL(sym)) return CUDA_ERROR_NOT_SUPPORTED;                                                \
        gpucr_gate_enter_waiting();                                                                     \
        return synchronized(REAL(sym)(st), pool_stream_key(st, pt), false);                                  \
    }
STREAM_SYNC(cuStreamSynchronize, false)
STREAM_SYNC(cuStreamSynchronize_ptsz, true)

/* CUDA 13's form names the context; NULL is the current one */
GPUCR_EXPORT CUresult cuCtxSynchronize_v2(CUcontext ctx)
{
    gpucr_init();
    if (!REAL(cuCtxSynchronize_v2)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter_waiting();
    CUresult rc = REAL(cuCtxSynchronize_v2)(ctx);
    if (rc == CUDA_SUCCESS && any_served()) {
        CUcontext cur = NULL;
        gpucr_drv.cuCtxGetCurrent(&cur);
        if (ctx && ctx != cur) gpucr_drv.cuCtxSetCurrent(ctx);
        after_sync(0, true);
        if (ctx && ctx != cur) gpucr_drv.cuCtxSetCurrent(cur);
    }
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuCtxSynchronize(void)
{
    gpucr_init();
    if (!REAL(cuCtxSynchronize)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter_waiting();
    return synchronized(REAL(cuCtxSynchronize)(), 0, true);
}

GPUCR_EXPORT CUresult cuEventSynchronize(CUevent ev)
{
    gpucr_init();
    if (!REAL(cuEventSynchronize)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter_waiting();
    return synchronized(REAL(cuEventSynchronize)(ev), 0, false);   /* which frees completed: the events say */
}

/* A stream that goes: record its event last thing, so blocks freed on it stay ordered; a new stream
 * that gets the same handle starts afresh. */
#define STREAM_DESTROY(sym)                                                                             \
    GPUCR_EXPORT CUresult sym(CUstream st)                                                              \
    {                                                                                                   \
        gpucr_init();                                                                                   \
        if (!REAL(sym)) return CUDA_ERROR_NOT_SUPPORTED;                                                \
        gpucr_gate_enter_waiting();                                                                     \
        pthread_mutex_lock(&g_pool_mu);                                                                      \
        struct sstate *s = st ? hmap_get(&g_pool_streams, pool_stream_key(st, false)) : NULL;                     \
        if (s) {                                                                                        \
            if (s->ev_epoch < s->epoch && !pool_stream_record(s)) {                                          \
                gpucr_drv.cuStreamSynchronize(st);   /* no event: wait, so its frees are complete */    \
                s->done = s->epoch;                                                                     \
            }                                                                                           \
            s->dead = true;                                                                             \
            hmap_del(&g_pool_streams, s->key);                                                               \
        }                                                                                               \
        pthread_mutex_unlock(&g_pool_mu);                                                                    \
        CUresult rc = REAL(sym)(st);                                                                    \
        gpucr_gate_leave();                                                                             \
        return rc;                                                                                      \
    }
STREAM_DESTROY(cuStreamDestroy)
STREAM_DESTROY(cuStreamDestroy_v2)
