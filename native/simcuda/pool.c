/*
 * Stream-ordered memory pools (cuMemAllocAsync and friends), modelled on what CUDA documents:
 * each device has a default pool and a current pool (cuDeviceSetMemPool); a pool keeps freed
 * blocks reserved for reuse; a block freed on a stream is reused at once by that stream, by
 * another one only when the free is ordered before it (an event it waited on:
 * REUSE_FOLLOW_EVENT_DEPENDENCIES; the host saw the free complete: REUSE_ALLOW_OPPORTUNISTIC) or
 * by making that stream wait for the free (REUSE_ALLOW_INTERNAL_DEPENDENCIES); at a synchronize a
 * pool holding more than its release threshold gives back free blocks whose frees completed;
 * cuMemPoolTrimTo does the same down to a size. Ordering comes from order.c. Each block is one
 * cuMemAlloc-style allocation (its own memfd), so the checkpoint moves pool memory like any other.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "simcuda.h"

struct pblock {
    struct pblock *next;
    CUdeviceptr va;
    size_t size;             /* rounded to the granule: what the pool reserves for it */
    struct sim_ctx *ctx;     /* the context its memory was allocated in */
    bool free;
    struct sim_pos freed_at; /* the free's position in its stream */
};

struct sim_pool {
    struct sim_pool *next;
    CUmemPoolProps props;
    int follow, opportunistic, internal;   /* the reuse attributes (all on by default, as on CUDA) */
    uint64_t threshold, used, reserved, used_high, reserved_high;
    int access[SIM_MAX_DEVICES];           /* CUmemAccess_flags per device; its own device: read/write */
    bool is_default, destroyed;
    struct pblock *blocks;
};

static struct {
    pthread_mutex_t mu;
    struct sim_pool *pools;                 /* explicit pools */
    struct sim_pool defaults[SIM_MAX_DEVICES];
    struct sim_pool *current[SIM_MAX_DEVICES];
    bool init;
} pl = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void pool_init(struct sim_pool *p, int dev, const CUmemPoolProps *props)
{
    memset(p, 0, sizeof *p);
    if (props) p->props = *props;
    p->props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    p->props.location = (CUmemLocation){CU_MEM_LOCATION_TYPE_DEVICE, dev};
    p->follow = p->opportunistic = p->internal = 1;
    p->access[dev] = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
}

/* pl.mu held */
static void defaults_init(void)
{
    if (pl.init) return;
    for (int d = 0; d < SIM_MAX_DEVICES; d++) {
        pool_init(&pl.defaults[d], d, NULL);
        pl.defaults[d].is_default = true;
        pl.current[d] = &pl.defaults[d];
    }
    pl.init = true;
}

/* pl.mu held: is p a pool this process has (a default one or a live explicit one)? */
static bool pool_known(const struct sim_pool *p)
{
    defaults_init();
    if (p >= pl.defaults && p < pl.defaults + sim_cfg.ndevices) return true;
    for (struct sim_pool *q = pl.pools; q; q = q->next)
        if (q == p && !q->destroyed) return true;
    return false;
}

static void note_high(struct sim_pool *p)
{
    if (p->used > p->used_high) p->used_high = p->used;
    if (p->reserved > p->reserved_high) p->reserved_high = p->reserved;
}

/* pl.mu held: give one free block's memory back. */
static void block_release(struct sim_pool *p, struct pblock **link)
{
    struct pblock *b = *link;
    *link = b->next;
    sim_free(b->va);
    p->reserved -= b->size;
    free(b);
}

/* pl.mu held: release free blocks whose frees completed until the pool holds at most keep bytes. */
static void pool_shrink(struct sim_pool *p, uint64_t keep)
{
    for (struct pblock **l = &p->blocks; *l && p->reserved > keep;)
        if ((*l)->free && sim_order_pos_done((*l)->freed_at)) block_release(p, l);
        else l = &(*l)->next;
}

static CUresult alloc_from(CUdeviceptr *dptr, size_t size, struct sim_pool *p, CUstream s)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if (!dptr || size == 0 || size > SIZE_MAX - SIM_GRANULE) return CUDA_ERROR_INVALID_VALUE;
    if ((rc = sim_stream_check(s)) != CUDA_SUCCESS) return rc;
    size_t need = sim_round_up(size, SIM_GRANULE);
    if (sim_graph_alloc(dptr, size, s, c, &rc)) return rc;   /* capturing: an allocation node */
    pthread_mutex_lock(&pl.mu);
    if (!pool_known(p)) { pthread_mutex_unlock(&pl.mu); return CUDA_ERROR_INVALID_VALUE; }
    /* the smallest free block that fits (at most twice the size) and whose free this stream may
     * follow; failing that, one it may be made to wait for */
    struct pblock *best = NULL, *wait = NULL;
    for (struct pblock *b = p->blocks; b; b = b->next) {
        if (!b->free || b->size < need || b->size > 2 * need || b->ctx != c) continue;
        int rel = sim_order_relation(s, b->freed_at);
        bool ok = (rel & SIM_ORDER_SAME_STREAM) || (p->follow && (rel & SIM_ORDER_EVENTS)) ||
                  (p->opportunistic && (rel & SIM_ORDER_COMPLETE));
        if (ok && (!best || b->size < best->size)) best = b;
        else if (!ok && p->internal && (!wait || b->size < wait->size)) wait = b;
    }
    if (!best && wait) {
        sim_order_wait_pos(s, wait->freed_at);   /* the driver makes the stream wait for the free */
        best = wait;
    }
    if (best) {
        best->free = false;
        p->used += best->size;
        *dptr = best->va;
    } else {
        struct pblock *b = calloc(1, sizeof *b);
        rc = b ? sim_alloc(&b->va, need, SIM_ALLOC_POOL, c) : CUDA_ERROR_OUT_OF_MEMORY;
        if (rc != CUDA_SUCCESS) {
            free(b);
        } else {
            b->size = need;
            b->ctx = c;
            SIM_PUSH(p->blocks, b);
            p->used += need;
            p->reserved += need;
            *dptr = b->va;
        }
    }
    note_high(p);
    pthread_mutex_unlock(&pl.mu);
    if (rc == CUDA_SUCCESS) sim_order_op(s);
    return rc;
}

static CUresult alloc_async(CUdeviceptr *dptr, size_t size, CUstream s)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&pl.mu);
    defaults_init();
    struct sim_pool *p = pl.current[c->device];
    pthread_mutex_unlock(&pl.mu);
    return alloc_from(dptr, size, p, s);
}
SIMAPI CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) { SIM_GATED(alloc_async(dptr, bytesize, hStream)); }
SIMAPI CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    SIM_GATED(alloc_async(dptr, bytesize, hStream));
}
SIMAPI CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    SIM_GATED(alloc_from(dptr, bytesize, pool, hStream));
}
SIMAPI CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    SIM_GATED(alloc_from(dptr, bytesize, pool, hStream));
}

/* pl.mu held: the live block at va and its pool. */
static struct pblock *find_block(CUdeviceptr va, struct sim_pool **owner, struct pblock ***link)
{
    defaults_init();
    for (int d = 0; d < SIM_MAX_DEVICES + 1; d++) {
        for (struct sim_pool *p = d < SIM_MAX_DEVICES ? &pl.defaults[d] : pl.pools; p;
             p = d < SIM_MAX_DEVICES ? NULL : p->next)
            for (struct pblock **l = &p->blocks; *l; l = &(*l)->next)
                if ((*l)->va == va && !(*l)->free) {
                    *owner = p;
                    if (link) *link = l;
                    return *l;
                }
    }
    return NULL;
}

static void pool_forget_if_done(struct sim_pool *p);

static CUresult free_async(CUdeviceptr va, CUstream s)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if ((rc = sim_stream_check(s)) != CUDA_SUCCESS) return rc;
    if (sim_graph_free(va, s, true, &rc)) return rc;   /* a free node, or graph memory freed outside it */
    pthread_mutex_lock(&pl.mu);
    struct sim_pool *p = NULL;
    struct pblock *b = find_block(va, &p, NULL);
    if (b) {
        b->free = true;
        b->freed_at = sim_order_op(s);
        p->used -= b->size;
        pool_forget_if_done(p);
    }
    pthread_mutex_unlock(&pl.mu);
    /* memory from cuMemAlloc may be freed here too; it goes at once, as work is synchronous */
    return b ? CUDA_SUCCESS : sim_free(va);
}
SIMAPI CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) { SIM_GATED(free_async(dptr, hStream)); }
SIMAPI CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) { SIM_GATED(free_async(dptr, hStream)); }

bool sim_pool_free_sync(CUdeviceptr va, CUresult *rc)
{
    if (sim_graph_free(va, NULL, false, rc)) return true;   /* graph memory: cached for graphs */
    pthread_mutex_lock(&pl.mu);
    struct sim_pool *p = NULL;
    struct pblock **link = NULL;
    struct pblock *b = find_block(va, &p, &link);
    if (b) {
        /* cuMemFree of pool memory: the memory is gone at once (the caller made its work complete) */
        p->used -= b->size;
        block_release(p, link);
        pool_forget_if_done(p);
        *rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&pl.mu);
    return b != NULL;
}

/* pl.mu held: a destroyed pool is forgotten once nothing it handed out is still in use. */
static void pool_forget_if_done(struct sim_pool *p)
{
    if (!p->destroyed) return;
    for (struct pblock **l = &p->blocks; *l;)
        if ((*l)->free) block_release(p, l);
        else return;   /* still one in use */
    for (struct sim_pool **l = &pl.pools; *l; l = &(*l)->next)
        if (*l == p) { *l = p->next; free(p); return; }
}

void sim_pool_after_sync(void)
{
    pthread_mutex_lock(&pl.mu);
    if (pl.init) {
        for (int d = 0; d < sim_cfg.ndevices; d++)
            if (pl.defaults[d].reserved > pl.defaults[d].threshold) pool_shrink(&pl.defaults[d], pl.defaults[d].threshold);
        for (struct sim_pool *p = pl.pools; p; p = p->next)
            if (p->reserved > p->threshold) pool_shrink(p, p->threshold);
    }
    pthread_mutex_unlock(&pl.mu);
}

void sim_pool_drop_ctx(struct sim_ctx *ctx)
{
    pthread_mutex_lock(&pl.mu);
    defaults_init();
    for (int d = 0; d < SIM_MAX_DEVICES + 1; d++)
        for (struct sim_pool *p = d < SIM_MAX_DEVICES ? &pl.defaults[d] : pl.pools; p;
             p = d < SIM_MAX_DEVICES ? NULL : p->next)
            for (struct pblock **l = &p->blocks; *l;) {
                struct pblock *b = *l;
                if (b->ctx != ctx) { l = &b->next; continue; }
                /* the context's memory goes with it (memory.c frees it): only forget the block */
                *l = b->next;
                p->reserved -= b->size;
                if (!b->free) p->used -= b->size;
                free(b);
            }
    pthread_mutex_unlock(&pl.mu);
}

/* ---- pools as objects ---- */

static CUresult pool_create(CUmemoryPool *out, const CUmemPoolProps *props)
{
    if (!out || !props) return CUDA_ERROR_INVALID_VALUE;
    if (props->allocType != CU_MEM_ALLOCATION_TYPE_PINNED || props->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_device_check(props->location.id);
    if (rc != CUDA_SUCCESS) return rc;
    if (props->handleTypes & ~CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
    struct sim_pool *p = malloc(sizeof *p);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    pool_init(p, props->location.id, props);
    SIM_PUSH_LOCKED(&pl.mu, pl.pools, p);
    *out = p;
    return CUDA_SUCCESS;
}
SIMAPI CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props) { SIM_GATED(pool_create(pool, props)); }

static CUresult pool_destroy(CUmemoryPool p)
{
    pthread_mutex_lock(&pl.mu);
    CUresult rc = CUDA_SUCCESS;
    if (!pool_known(p) || p->is_default) {
        rc = CUDA_ERROR_INVALID_VALUE;   /* a default pool cannot be destroyed */
    } else {
        for (int d = 0; d < SIM_MAX_DEVICES; d++)
            if (pl.current[d] == p) pl.current[d] = &pl.defaults[d];
        /* as on CUDA: returns at once; what is still in use is released when it is freed */
        p->destroyed = true;
        pool_forget_if_done(p);
    }
    pthread_mutex_unlock(&pl.mu);
    return rc;
}
SIMAPI CUresult cuMemPoolDestroy(CUmemoryPool pool) { SIM_GATED(pool_destroy(pool)); }

static CUresult pool_attr(CUmemoryPool p, int attr, void *value, bool set)
{
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&pl.mu);
    CUresult rc = pool_known(p) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    int *flag = NULL;
    uint64_t *u64 = NULL;
    if (rc == CUDA_SUCCESS) {
        switch (attr) {
        case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES: flag = &p->follow; break;
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC: flag = &p->opportunistic; break;
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: flag = &p->internal; break;
        case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: u64 = &p->threshold; break;
        case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: u64 = &p->reserved; break;
        case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: u64 = &p->reserved_high; break;
        case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: u64 = &p->used; break;
        case CU_MEMPOOL_ATTR_USED_MEM_HIGH: u64 = &p->used_high; break;
        default: rc = CUDA_ERROR_INVALID_VALUE;
        }
    }
    if (rc == CUDA_SUCCESS && !set) {
        if (flag) *(int *)value = *flag;
        else *(uint64_t *)value = *u64;
    } else if (rc == CUDA_SUCCESS) {
        if (flag) {
            *flag = *(int *)value != 0;
        } else if (attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) {
            *u64 = *(uint64_t *)value;
        } else if ((attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH || attr == CU_MEMPOOL_ATTR_USED_MEM_HIGH) &&
                   *(uint64_t *)value == 0) {
            /* resetting a high watermark sets it to the current value */
            *u64 = attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH ? p->reserved : p->used;
        } else {
            rc = CUDA_ERROR_INVALID_VALUE;   /* current values are read-only, a watermark only resets to 0 */
        }
    }
    pthread_mutex_unlock(&pl.mu);
    return rc;
}
SIMAPI CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value) { SIM_GATED(pool_attr(pool, attr, value, true)); }
SIMAPI CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value) { SIM_GATED(pool_attr(pool, attr, value, false)); }

static CUresult pool_trim(CUmemoryPool p, size_t keep)
{
    pthread_mutex_lock(&pl.mu);
    CUresult rc = pool_known(p) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS) pool_shrink(p, keep);
    pthread_mutex_unlock(&pl.mu);
    return rc;
}
SIMAPI CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) { SIM_GATED(pool_trim(pool, minBytesToKeep)); }

static CUresult pool_set_access(CUmemoryPool p, const CUmemAccessDesc *map, size_t count)
{
    if (!map && count) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&pl.mu);
    CUresult rc = pool_known(p) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < count && rc == CUDA_SUCCESS; i++) {
        const CUmemAccessDesc *d = &map[i];
        if (d->location.type != CU_MEM_LOCATION_TYPE_DEVICE || sim_device_check(d->location.id) != CUDA_SUCCESS ||
            (d->flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && d->flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
             d->flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE))
            rc = CUDA_ERROR_INVALID_VALUE;
        else if (d->location.id == p->props.location.id && d->flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            rc = CUDA_ERROR_INVALID_VALUE;   /* the pool's own device always has read/write */
    }
    for (size_t i = 0; i < count && rc == CUDA_SUCCESS; i++) p->access[map[i].location.id] = map[i].flags;
    pthread_mutex_unlock(&pl.mu);
    return rc;
}
SIMAPI CUresult cuMemPoolSetAccess(CUmemoryPool pool, const CUmemAccessDesc *map, size_t count)
{
    SIM_GATED(pool_set_access(pool, map, count));
}

static CUresult pool_get_access(int *flags, CUmemoryPool p, CUmemLocation *loc)
{
    if (!flags || !loc || loc->type != CU_MEM_LOCATION_TYPE_DEVICE || sim_device_check(loc->id) != CUDA_SUCCESS)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&pl.mu);
    CUresult rc = pool_known(p) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS) *flags = p->access[loc->id];
    pthread_mutex_unlock(&pl.mu);
    return rc;
}
SIMAPI CUresult cuMemPoolGetAccess(int *flags, CUmemoryPool memPool, CUmemLocation *location)
{
    SIM_GATED(pool_get_access(flags, memPool, location));
}

/* ---- pools shared with other processes: exported as a file descriptor, pointers as 64 bytes ---- */

static CUresult pool_export(void *out, CUmemoryPool p, int type, unsigned long long flags)
{
    if (!out || flags) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&pl.mu);
    CUresult rc = pool_known(p) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS && (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || !(p->props.handleTypes & type)))
        rc = CUDA_ERROR_INVALID_VALUE;   /* only a pool created with that handle type exports it */
    pthread_mutex_unlock(&pl.mu);
    if (rc != CUDA_SUCCESS) return rc;
    int fd = sim_acct_open_ctl();
    if (fd < 0) return CUDA_ERROR_OPERATING_SYSTEM;
    *(int *)out = fd;
    return CUDA_SUCCESS;
}
SIMAPI CUresult cuMemPoolExportToShareableHandle(void *handle_out, CUmemoryPool pool, CUmemAllocationHandleType handleType,
                                                 unsigned long long flags)
{
    SIM_GATED(pool_export(handle_out, pool, handleType, flags));
}

static CUresult pool_export_pointer(CUmemPoolPtrExportData *out, CUdeviceptr va)
{
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&pl.mu);
    struct sim_pool *p = NULL;
    struct pblock *b = find_block(va, &p, NULL);
    CUresult rc = b && p->props.handleTypes ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS) {
        memset(out, 0, sizeof *out);
        memcpy(out->reserved, &va, sizeof va);
        pid_t pid = getpid();
        memcpy(out->reserved + sizeof va, &pid, sizeof pid);
    }
    pthread_mutex_unlock(&pl.mu);
    return rc;
}
SIMAPI CUresult cuMemPoolExportPointer(CUmemPoolPtrExportData *shareData_out, CUdeviceptr ptr)
{
    SIM_GATED(pool_export_pointer(shareData_out, ptr));
}

/* ---- the device's default and current pools ---- */

static CUresult device_pool(CUmemoryPool *out, CUdevice dev, bool dflt)
{
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_device_check(dev);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&pl.mu);
    defaults_init();
    *out = dflt ? &pl.defaults[dev] : pl.current[dev];
    pthread_mutex_unlock(&pl.mu);
    return CUDA_SUCCESS;
}
SIMAPI CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev) { SIM_GATED(device_pool(pool_out, dev, true)); }
SIMAPI CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) { SIM_GATED(device_pool(pool, dev, false)); }

static CUresult device_set_pool(CUdevice dev, CUmemoryPool p)
{
    CUresult rc = sim_device_check(dev);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&pl.mu);
    rc = pool_known(p) && p->props.location.id == dev ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS) pl.current[dev] = p;
    pthread_mutex_unlock(&pl.mu);
    return rc;
}
SIMAPI CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool) { SIM_GATED(device_set_pool(dev, pool)); }
