/* The application's cuMemPool* calls: the driver answers each first, then the agent's shadow of the pool follows
 * (pool.c): created, destroyed, its attributes, trimmed, its peers' access; pools shared with other processes
 * (IPC) are counted, so a checkpoint refuses up front. Lock order: gate -> g_pool_mu -> registry lock. */
#include <pthread.h>
#include <string.h>
#include "pool_impl.h"

GPUCR_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    gpucr_init();
    if (!REAL(cuMemPoolCreate)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();   /* never hold the pools' lock where the driver may hold the process */
    CUresult rc = REAL(cuMemPoolCreate)(pool, props);
    if (rc != CUDA_SUCCESS) { gpucr_gate_leave(); return rc; }
    const char *native = NULL;
    if (props->handleTypes)
        native = "an IPC-capable pool (cuMemPoolCreate with handle types): its memory must stay exportable by the driver";
    else if (props->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        native = "a pool of host memory";
    else if (props->usage)
        native = "a pool with special usage flags";
    pthread_mutex_lock(&g_pool_mu);
    struct apool *pl = pool_shadow_new(*pool, props->location.id, native);
    if (pl) { pl->ipc = props->handleTypes != 0; pl->max_size = props->maxSize; }
    pthread_mutex_unlock(&g_pool_mu);
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    gpucr_init();
    if (!REAL(cuMemPoolDestroy)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    CUresult rc = REAL(cuMemPoolDestroy)(pool);
    if (rc == CUDA_SUCCESS) {
        /* as on CUDA: the pool is gone for the application (and from status) at once; what is free
         * goes now, blocks still in use go back once freed and their frees seen complete (a threshold
         * of 0 gives them back at the next synchronize); the shadow is forgotten once empty */
        pthread_mutex_lock(&g_pool_mu);
        for (struct apool *pl = g_pools; pl; pl = pl->next) {
            if (pl->handle != pool || pl->destroyed) continue;
            pl->destroyed = true;
            pl->threshold = 0;
            if (pl->native) g_pool_stats.pools_native--;
            else { g_pool_stats.pools_served--; __atomic_add_fetch(&g_pools_dying, 1, __ATOMIC_RELAXED); pool_shrink(pl, 0, false); }
        }
        pool_forget_destroyed();
        pthread_mutex_unlock(&g_pool_mu);
    }
    gpucr_gate_leave();
    return rc;
}

static struct apool *served_pool(CUmemoryPool h)
{
    struct apool *pl = pool_shadow(h);
    return pl && !pl->native ? pl : NULL;
}

GPUCR_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value)
{
    gpucr_init();
    if (!REAL(cuMemPoolSetAttribute)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();   /* never hold the pools' lock where the driver may hold the process */
    CUresult rc = REAL(cuMemPoolSetAttribute)(pool, attr, value);   /* the driver checks the value */
    if (rc != CUDA_SUCCESS) { gpucr_gate_leave(); return rc; }
    pthread_mutex_lock(&g_pool_mu);
    struct apool *pl = served_pool(pool);
    if (pl && attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) pl->threshold = *(uint64_t *)value;
    else if (pl && attr == CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES) pl->internal_deps = *(int *)value != 0;
    else if (pl && attr == CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC) pl->opportunistic = *(int *)value != 0;
    else if (pl && attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) pl->reserved_high = pl->reserved;
    else if (pl && attr == CU_MEMPOOL_ATTR_USED_MEM_HIGH) pl->used_high = pl->used;
    pthread_mutex_unlock(&g_pool_mu);
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value)
{
    gpucr_init();
    if (!REAL(cuMemPoolGetAttribute)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();   /* never hold the pools' lock where the driver may hold the process */
    CUresult rc = REAL(cuMemPoolGetAttribute)(pool, attr, value);
    if (rc != CUDA_SUCCESS || attr < CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT || attr > CU_MEMPOOL_ATTR_USED_MEM_HIGH) { gpucr_gate_leave(); return rc; }
    /* the driver's figure (what it holds itself) plus the agent's */
    pthread_mutex_lock(&g_pool_mu);
    struct apool *pl = served_pool(pool);
    if (pl) {
        uint64_t mine = attr == CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT ? pl->reserved
                      : attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH  ? pl->reserved_high
                      : attr == CU_MEMPOOL_ATTR_USED_MEM_CURRENT   ? pl->used
                                                                   : pl->used_high;
        *(uint64_t *)value += mine;
    }
    pthread_mutex_unlock(&g_pool_mu);
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep)
{
    gpucr_init();
    if (!REAL(cuMemPoolTrimTo)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    CUresult rc = REAL(cuMemPoolTrimTo)(pool, keep);
    if (rc == CUDA_SUCCESS) {
        pthread_mutex_lock(&g_pool_mu);
        struct apool *pl = served_pool(pool);
        if (pl) pool_shrink(pl, keep, false);
        pthread_mutex_unlock(&g_pool_mu);
    }
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuMemPoolSetAccess(CUmemoryPool pool, const CUmemAccessDesc *map, size_t count)
{
    gpucr_init();
    if (!REAL(cuMemPoolSetAccess)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    CUresult rc = REAL(cuMemPoolSetAccess)(pool, map, count);   /* the driver validates the descriptors */
    pthread_mutex_lock(&g_pool_mu);
    struct apool *pl = rc == CUDA_SUCCESS ? served_pool(pool) : NULL;
    if (pl) {
        /* remembered for later segments, applied to every present one (and so kept by a restore) */
        struct mapping tmp = {.ndesc = pl->nacc};
        memcpy(tmp.desc, pl->acc, sizeof pl->acc);
        reg_map_merge_access(&tmp, map, count);
        pl->nacc = tmp.ndesc;
        memcpy(pl->acc, tmp.desc, sizeof pl->acc);
        for (struct seg *sg = pl->segs; sg && rc == CUDA_SUCCESS; sg = sg->next) {
            rc = REAL(cuMemSetAccess)(sg->va, sg->size, map, count);   /* no driver call under the registry lock */
            reg_lock();
            if (rc == CUDA_SUCCESS && sg->phys->maps) reg_map_merge_access(sg->phys->maps, map, count);
            reg_unlock();
        }
    }
    pthread_mutex_unlock(&g_pool_mu);
    gpucr_gate_leave();
    return rc;
}

/* Pools shared with other processes: the driver's IPC; counted, so a checkpoint refuses up front. */
static void count_ipc(bool import)
{
    pthread_mutex_lock(&g_pool_mu);
    if (import) g_pool_stats.ipc_imports++; else g_pool_stats.ipc_exports++;
    pthread_mutex_unlock(&g_pool_mu);
}

GPUCR_EXPORT CUresult cuMemPoolExportToShareableHandle(void *out, CUmemoryPool pool, int type, unsigned long long flags)
{
    gpucr_init();
    if (!REAL(cuMemPoolExportToShareableHandle)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();   /* never hold the pools' lock where the driver may hold the process */
    CUresult rc = REAL(cuMemPoolExportToShareableHandle)(out, pool, type, flags);
    if (rc == CUDA_SUCCESS) count_ipc(false);
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuMemPoolExportPointer(CUmemPoolPtrExportData *out, CUdeviceptr ptr)
{
    gpucr_init();
    if (!REAL(cuMemPoolExportPointer)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();   /* never hold the pools' lock where the driver may hold the process */
    CUresult rc = REAL(cuMemPoolExportPointer)(out, ptr);
    if (rc == CUDA_SUCCESS) count_ipc(false);
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuMemPoolImportFromShareableHandle(CUmemoryPool *pool, void *handle, int type, unsigned long long flags)
{
    gpucr_init();
    if (!REAL(cuMemPoolImportFromShareableHandle)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();   /* never hold the pools' lock where the driver may hold the process */
    CUresult rc = REAL(cuMemPoolImportFromShareableHandle)(pool, handle, type, flags);
    if (rc == CUDA_SUCCESS) {
        count_ipc(true);
        pthread_mutex_lock(&g_pool_mu);
        struct apool *pl = pool_shadow(*pool);   /* not seen created: the driver's */
        if (pl) pl->ipc = true;
        pthread_mutex_unlock(&g_pool_mu);
    }
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuMemPoolImportPointer(CUdeviceptr *ptr, CUmemoryPool pool, CUmemPoolPtrExportData *data)
{
    gpucr_init();
    if (!REAL(cuMemPoolImportPointer)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();   /* never hold the pools' lock where the driver may hold the process */
    CUresult rc = REAL(cuMemPoolImportPointer)(ptr, pool, data);
    if (rc == CUDA_SUCCESS) count_ipc(true);
    gpucr_gate_leave();
    return rc;
}
