/* Stream-ordered allocation (cuMemAllocAsync, cuMemAllocFromPoolAsync, cuMemFreeAsync) served by the
 * agent from VMM memory it owns, so the data plane moves it at link speed and restores it at the same
 * addresses, instead of the driver's checkpoint (~2 GB/s).
 *
 * The application keeps the driver's pool handles (default pools, cuMemPoolCreate): the agent keeps a
 * shadow of each pool it serves, keyed by that handle, with its own blocks. CUDA's semantics kept:
 *   - a block freed on a stream is reused by that stream at once; another stream gets it only when the
 *     free is ordered before it: the free is known complete (a synchronize or an event query saw it),
 *     or the agent records an event on the freeing stream and makes the new stream wait on it (CUDA's
 *     REUSE_ALLOW_INTERNAL_DEPENDENCIES; with that attribute off, only complete frees are reused);
 *   - at a synchronize (stream, event, context), a pool holding more than its release threshold gives
 *     back free memory whose frees completed; cuMemPoolTrimTo likewise down to its argument;
 *   - the used/reserved attributes and their high watermarks are the agent's (plus the driver's own);
 *   - cuMemPoolSetAccess grants peers access to every block, present and future;
 *   - cuMemPoolCreate's props: a device pool with no handle type is served; a pool with handle types
 *     (IPC) or another location stays the driver's, and says so in `gpucr status`.
 * Left to the driver and reported: allocations during stream capture (they become graph memory, whose
 * addresses the graph owns), IPC-capable pools, pools the agent did not see created (imported). A free
 * during capture of a block the agent served goes to the driver too: CUDA takes only graph allocations
 * there, so the application gets the driver's own answer (CUDA_ERROR_INVALID_VALUE on an H200).
 * A pool the application destroys leaves status at once; its blocks still in use go back once freed.
 * A pool exported or imported for IPC makes a checkpoint refuse up front (pool_refusal).
 *
 * Layout: sizes up to 1 MiB are power-of-two slots (from 512 B) in slabs of one VMM granule; larger
 * ones get a segment of their own, rounded to the granule. A segment is one piece of VMM memory in the
 * registry (PHYS_CONVERTED, pool_seg), so the data plane moves it like any converted allocation.
 *
 * This file keeps the shadows, their segments and blocks, and answers the rest of the agent (pool.h); the
 * application's calls are pool_alloc.c's (allocate, free, synchronize) and mempool.c's (cuMemPool*).
 * Lock order: gate -> g_pool_mu (pool_impl.h) -> registry lock. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "pool_impl.h"

#define SCAN_LIMIT 64                     /* free blocks looked at per allocation */

pthread_mutex_t g_pool_mu = PTHREAD_MUTEX_INITIALIZER;
struct apool *g_pools;
struct hmap g_pool_live;
struct hmap g_pool_streams;
struct hmap g_native_reason;
struct pool_stats g_pool_stats;
long g_pools_dying;
size_t g_pool_gran;

static size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

/* ---- streams ---- */

uint64_t pool_stream_key(CUstream h, bool pt)
{
    if (h == CU_STREAM_PER_THREAD || (!h && pt)) return (uint64_t)pthread_self() | 3;   /* tagged: no handle ends in 3 */
    if (!h || h == CU_STREAM_LEGACY) return 1;
    return (uint64_t)(uintptr_t)h;
}

CUstream pool_stream_handle(CUstream h, bool pt)
{
    return (!h && pt) ? CU_STREAM_PER_THREAD : h;
}

struct sstate *pool_stream_state(CUstream h, bool pt)
{
    uint64_t key = pool_stream_key(h, pt);
    struct sstate *st = hmap_get(&g_pool_streams, key);
    if (st) return st;
    st = calloc(1, sizeof *st);
    if (!st) return NULL;
    st->key = key;
    st->handle = pool_stream_handle(h, pt);
    st->eager = (key & 3) == 3;
    gpucr_drv.cuCtxGetCurrent(&st->ctx);
    if (hmap_put(&g_pool_streams, key, st)) { free(st); return NULL; }
    return st;
}

/* Record the stream's event now: it follows every free enqueued on it so far. */
bool pool_stream_record(struct sstate *st)
{
    if (!st->ev && gpucr_drv.cuEventCreate(&st->ev, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) { st->ev = NULL; return false; }
    if (gpucr_drv.cuEventRecord(st->ev, st->handle) != CUDA_SUCCESS) return false;
    st->ev_epoch = st->epoch;
    return true;
}

/* Has the free at `epoch` on st completed? Asks the event (cheap) when that could tell. */
static bool free_complete(struct sstate *st, uint64_t epoch)
{
    if (epoch <= st->done) return true;
    if (st->ev && st->ev_epoch >= epoch && gpucr_drv.cuEventQuery(st->ev) == CUDA_SUCCESS) st->done = st->ev_epoch;
    return epoch <= st->done;
}

/* May a block freed at (st, epoch) be handed to work on stream `to`? Either it already may, or the
 * agent makes `to` wait for the free (when the pool allows internal dependencies). */
static bool order_after_free(struct apool *pl, struct sstate *st, uint64_t epoch, uint64_t to_key, CUstream to,
                             CUcontext cur)
{
    if (st->key == to_key || (pl->opportunistic && free_complete(st, epoch))) return true;
    if (!pl->internal_deps || st->ctx != cur) return false;
    /* a per-thread stream is recorded only by its own thread (at each free): if that failed, no other
     * thread can record on it, and a stream that is gone cannot be recorded on at all */
    if (st->ev_epoch < epoch && (st->dead || st->eager || !pool_stream_record(st))) return false;
    if (gpucr_drv.cuStreamWaitEvent(to, st->ev, 0) != CUDA_SUCCESS) return false;
    g_pool_stats.cross_stream_waits++;
    return true;
}

/* The host saw work complete: everything freed on streams `key` (0: every stream of ctx) is reusable. */
void pool_streams_done(uint64_t key, CUcontext ctx)
{
    uint64_t k;
    void *v;
    for (size_t i = 0; (i = hmap_next(&g_pool_streams, i, &k, &v)) < g_pool_streams.cap; i++) {
        struct sstate *st = v;
        if (key ? st->key == key : st->ctx == ctx) st->done = st->epoch;
    }
}

/* ---- pools ---- */

struct apool *pool_shadow_new(CUmemoryPool h, int dev, const char *native)
{
    struct apool *pl = calloc(1, sizeof *pl);
    if (!pl) return NULL;
    pl->handle = h;
    pl->dev = dev;
    pl->native = native;
    pl->internal_deps = pl->opportunistic = 1;
    for (int c = 0; c <= NSMALL; c++) pl->free_head[c].next = pl->free_head[c].prev = &pl->free_head[c];
    pl->next = g_pools;
    g_pools = pl;
    if (native) g_pool_stats.pools_native++; else g_pool_stats.pools_served++;
    return pl;
}

/* The shadow of pool h: made on first sight for a device's default pool; any other pool not seen
 * created (an imported one) is the driver's. A destroyed pool's shadow is never found: the driver
 * may hand its handle to a new pool. g_pool_mu held. */
struct apool *pool_shadow(CUmemoryPool h)
{
    for (struct apool *pl = g_pools; pl; pl = pl->next)
        if (pl->handle == h && !pl->destroyed) return pl;
    int n = 0;
    if (gpucr_drv.cuDeviceGetCount) gpucr_drv.cuDeviceGetCount(&n);
    for (int d = 0; d < n; d++) {
        CUmemoryPool dflt = NULL;
        if (gpucr_drv.cuDeviceGetDefaultMemPool && gpucr_drv.cuDeviceGetDefaultMemPool(&dflt, d) == CUDA_SUCCESS && dflt == h)
            return pool_shadow_new(h, d, NULL);
    }
    return pool_shadow_new(h, -1, "a pool gpucr did not see created (imported from another process)");
}

static void list_push(struct slot *head, struct slot *s)
{
    s->next = head->next; s->prev = head;
    head->next->prev = s; head->next = s;
}

static void list_unlink(struct slot *s)
{
    s->prev->next = s->next; s->next->prev = s->prev;
    s->prev = s->next = NULL;
}

static int size_class(size_t size)
{
    if (size > (1u << MAX_SMALL_SHIFT)) return LARGE;
    int c = 0;
    while (((size_t)1 << (MIN_SHIFT + c)) < size) c++;
    return c;
}

static void note_high(struct apool *pl)
{
    if (pl->used > pl->used_high) pl->used_high = pl->used;
    if (pl->reserved > pl->reserved_high) pl->reserved_high = pl->reserved;
}

/* A new segment of pool memory: VMM reserve + create + map, access for the pool's device and its
 * peers, recorded in the registry so the data plane moves it. g_pool_mu held. */
static struct seg *seg_new(struct apool *pl, int cls, size_t size, CUcontext ctx)
{
    if (pl->max_size && pl->reserved + size > pl->max_size) return NULL;
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED, .location = {CU_MEM_LOCATION_TYPE_DEVICE, pl->dev}};
    share_make_exportable(&prop);   /* a gpucr server can be handed it, as every allocation the agent manages */
    int nslots = cls == LARGE ? 1 : (int)(size >> (MIN_SHIFT + cls));
    struct seg *sg = calloc(1, sizeof *sg + sizeof(struct slot) * (size_t)nslots);
    if (!sg) return NULL;
    CUdeviceptr va = 0;
    CUmemGenericAllocationHandle h = 0;
    CUmemAccessDesc acc[MAX_ACCESS] = {{{CU_MEM_LOCATION_TYPE_DEVICE, pl->dev}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE}};
    int nacc = 1;
    for (int i = 0; i < pl->nacc && nacc < MAX_ACCESS; i++)
        if (pl->acc[i].location.id != pl->dev) acc[nacc++] = pl->acc[i];   /* its own device is there already */
    if (gpucr_drv.cuMemAddressReserve(&va, size, g_pool_gran, 0, 0) != CUDA_SUCCESS) { free(sg); return NULL; }
    CUresult rc = REAL(cuMemCreate)(&h, size, &prop, 0);
    if (rc == CUDA_SUCCESS) {
        rc = REAL(cuMemMap)(va, size, 0, h, 0);
        if (rc == CUDA_SUCCESS && (rc = REAL(cuMemSetAccess)(va, size, acc, (size_t)nacc)) != CUDA_SUCCESS)
            REAL(cuMemUnmap)(va, size);
        if (rc != CUDA_SUCCESS) REAL(cuMemRelease)(h);
    }
    struct phys *p = NULL;
    if (rc == CUDA_SUCCESS) {
        reg_learn_ctx(ctx);   /* asks the driver: before the registry lock */
        bool keep = share_keeps_fd(&prop);
        int own = keep ? share_export_own(h) : -1;
        reg_lock();
        p = reg_phys_new(PHYS_CONVERTED, h, size, &prop, ctx);
        struct mapping *m = p ? reg_map_add(p, va, size, 0) : NULL;
        if (p) share_adopt_own(p, own, keep);
        else if (own >= 0) close(own);
        if (m) {
            reg_map_merge_access(m, acc, (size_t)nacc);
            p->resv_va = va; p->resv_size = size; p->user_size = size;
            p->pool_seg = true;
        } else if (p) {
            reg_phys_free(p);
            p = NULL;
        }
        reg_unlock();
        if (!p) { REAL(cuMemUnmap)(va, size); REAL(cuMemRelease)(h); }
    }
    if (!p) { gpucr_drv.cuMemAddressFree(va, size); free(sg); return NULL; }
    sg->pool = pl; sg->phys = p; sg->ctx = ctx; sg->va = va; sg->size = size; sg->cls = cls; sg->nslots = nslots;
    size_t each = cls == LARGE ? size : (size_t)1 << (MIN_SHIFT + cls);
    for (int i = 0; i < nslots; i++) {
        struct slot *s = &sg->slots[i];
        s->seg = sg; s->va = va + each * (size_t)i; s->size = each; s->free = true;
        if (i) list_push(&pl->free_head[cls], s);   /* slot 0 goes to the caller */
    }
    sg->next = pl->segs;
    pl->segs = sg;
    pl->reserved += size;
    return sg;
}

/* Give a segment with nothing in use back to the device (in its own context: the caller may be the
 * agent's channel thread, which has none). g_pool_mu held. On failure the segment stays as it was, unless
 * its context is ending (`ending`: context.c then frees what is left of it). */
static void seg_release(struct seg *sg, bool ending)
{
    struct apool *pl = sg->pool;
    CUcontext cur = NULL;
    gpucr_drv.cuCtxGetCurrent(&cur);
    if (cur != sg->ctx) gpucr_drv.cuCtxSetCurrent(sg->ctx);
    reg_lock();
    CUmemGenericAllocationHandle real = sg->phys->real;
    reg_unlock();
    /* no driver call under the registry lock (registry.h): unmap, forget the record, then give the
     * memory and the addresses back (forgotten first: once the addresses are free, another thread's
     * allocation may get them) */
    CUresult rc = REAL(cuMemUnmap)(sg->va, sg->size);
    if (rc == CUDA_SUCCESS || ending) {
        reg_lock();
        reg_phys_free(sg->phys);
        reg_unlock();
    }
    if (rc == CUDA_SUCCESS) {
        CUresult r2 = REAL(cuMemRelease)(real);
        if (r2 != CUDA_SUCCESS) gpucr_cu_warn(r2, "cuMemRelease of %zu bytes of pool memory", sg->size);
        if ((r2 = gpucr_drv.cuMemAddressFree(sg->va, sg->size)) != CUDA_SUCCESS)
            gpucr_cu_warn(r2, "cuMemAddressFree of %zu bytes of pool memory", sg->size);
    }
    if (cur != sg->ctx) gpucr_drv.cuCtxSetCurrent(cur);
    if (rc != CUDA_SUCCESS && !ending) {
        gpucr_warn("giving back %zu bytes of pool memory failed: %s (kept)", sg->size, gpucr_cu_errstr(rc));
        return;
    }
    for (int i = 0; i < sg->nslots; i++)
        if (sg->slots[i].prev) list_unlink(&sg->slots[i]);
    for (struct seg **l = &pl->segs; *l; l = &(*l)->next)
        if (*l == sg) { *l = sg->next; break; }
    pl->reserved -= sg->size;
    g_pool_stats.segments_released++;
    free(sg);
}

/* May the segment go: nothing in use and every free complete (or `all_done`: the device was synchronised). */
static bool seg_idle(struct seg *sg, bool all_done)
{
    if (sg->nlive) return false;
    for (int i = 0; i < sg->nslots && !all_done; i++)
        if (sg->slots[i].st && !free_complete(sg->slots[i].st, sg->slots[i].epoch)) return false;
    return true;
}

/* Release idle segments until the pool holds at most `keep` bytes. g_pool_mu held. */
void pool_shrink(struct apool *pl, uint64_t keep, bool all_done)
{
    for (struct seg *sg = pl->segs, *next; sg && pl->reserved > keep; sg = next) {
        next = sg->next;
        if (seg_idle(sg, all_done)) seg_release(sg, false);
    }
}

/* Forget the shadows of destroyed pools with nothing left (as CUDA releases such a pool once its last
 * allocation is freed and that free completed). g_pool_mu held. */
void pool_forget_destroyed(void)
{
    for (struct apool **l = &g_pools; *l;) {
        struct apool *pl = *l;
        if (pl->destroyed && !pl->segs) {
            if (!pl->native) __atomic_sub_fetch(&g_pools_dying, 1, __ATOMIC_RELAXED);
            *l = pl->next;
            free(pl);
        }
        else l = &pl->next;
    }
}

/* Take a free slot of class cls for stream `to`, ordered after its free. g_pool_mu held. */
static struct slot *take_free(struct apool *pl, int cls, size_t need, struct sstate *to_st, CUstream to, CUcontext cur)
{
    struct slot *head = &pl->free_head[cls];
    int seen = 0;
    /* first pass: blocks freed on this stream, or whose free completed; then any the stream may wait for */
    for (int pass = 0; pass < 2; pass++) {
        seen = 0;
        for (struct slot *s = head->next; s != head && seen < SCAN_LIMIT; s = s->next, seen++) {
            if (s->seg->ctx != cur) continue;
            if (cls == LARGE && (s->size < need || s->size > 2 * need)) continue;
            if (s->st) {
                bool ready = s->st == to_st || (pl->opportunistic && free_complete(s->st, s->epoch));
                if (!ready && (pass == 0 || !order_after_free(pl, s->st, s->epoch, to_st->key, to, cur))) continue;
            }
            list_unlink(s);
            return s;
        }
    }
    return NULL;
}

CUresult pool_serve(struct apool *pl, CUdeviceptr *dptr, size_t size, CUstream h, bool pt, CUcontext ctx)
{
    int cls = size_class(size);
    size_t need = cls == LARGE ? round_up(size, g_pool_gran) : (size_t)1 << (MIN_SHIFT + cls);
    struct sstate *st = pool_stream_state(h, pt);
    if (!st) return CUDA_ERROR_OUT_OF_MEMORY;
    struct slot *s = take_free(pl, cls, need, st, pool_stream_handle(h, pt), ctx);
    if (!s) {
        struct seg *sg = seg_new(pl, cls, cls == LARGE ? need : g_pool_gran, ctx);
        if (!sg && pl->reserved) {   /* out of memory: give back what the pool holds free, and try once more */
            pool_shrink(pl, 0, false);
            sg = seg_new(pl, cls, cls == LARGE ? need : g_pool_gran, ctx);
        }
        if (!sg) return CUDA_ERROR_OUT_OF_MEMORY;
        s = &sg->slots[0];
    }
    s->free = false;
    s->st = NULL;
    s->seg->nlive++;
    pl->used += s->size;
    note_high(pl);
    if (hmap_put(&g_pool_live, s->va, s)) {   /* cannot remember it: give it back at once */
        s->free = true; s->seg->nlive--; pl->used -= s->size;
        list_push(&pl->free_head[cls], s);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *dptr = s->va;
    return CUDA_SUCCESS;
}

/* Hand a slot back to its pool's free list, freed at (st, epoch). g_pool_mu held. */
void pool_slot_free(struct slot *s, struct sstate *st)
{
    struct seg *sg = s->seg;
    hmap_del(&g_pool_live, s->va);
    s->free = true;
    s->st = st;
    s->epoch = st ? st->epoch : 0;
    sg->nlive--;
    sg->pool->used -= s->size;
    list_push(&sg->pool->free_head[sg->cls], s);
}

bool pool_free_sync(CUdeviceptr va, CUresult *rc)
{
    pthread_mutex_lock(&g_pool_mu);
    struct slot *s = va ? hmap_get(&g_pool_live, va) : NULL;
    if (s) {
        /* cuMemFree waits for the work that may use the memory: then it is free for every stream */
        CUcontext cur = NULL;
        gpucr_drv.cuCtxGetCurrent(&cur);
        if (cur != s->seg->ctx) gpucr_drv.cuCtxSetCurrent(s->seg->ctx);
        *rc = gpucr_drv.cuCtxSynchronize();
        if (cur != s->seg->ctx) gpucr_drv.cuCtxSetCurrent(cur);
        if (*rc == CUDA_SUCCESS) pool_slot_free(s, NULL);
    }
    pthread_mutex_unlock(&g_pool_mu);
    return s != NULL;
}


/* ---- the rest of the agent ---- */

void pool_forget_ctx(CUcontext ctx)
{
    pthread_mutex_lock(&g_pool_mu);
    for (struct apool *pl = g_pools; pl; pl = pl->next)
        for (struct seg *sg = pl->segs, *next; sg; sg = next) {
            next = sg->next;
            if (sg->ctx != ctx) continue;
            for (int i = 0; i < sg->nslots; i++)
                if (!sg->slots[i].free) { hmap_del(&g_pool_live, sg->slots[i].va); pl->used -= sg->slots[i].size; }
            sg->nlive = 0;
            seg_release(sg, true);
        }
    pool_forget_destroyed();
    uint64_t k;
    void *v;
    for (size_t i = 0; (i = hmap_next(&g_pool_streams, i, &k, &v)) < g_pool_streams.cap; i++)
        if (((struct sstate *)v)->ctx == ctx) { ((struct sstate *)v)->dead = true; hmap_del(&g_pool_streams, k); }
    pthread_mutex_unlock(&g_pool_mu);
}

/* Graph memory the driver holds, on every device the process uses. With `trim` (gate closed, every
 * context synchronised): what no graph holds goes back first, and what the graph allocator still
 * reserves after that is what the driver's checkpoint moves. Without it (the process runs): only the
 * memory graphs use now, since what they merely cache is trimmed before a checkpoint (on the H200 a
 * graph that frees its scratch inside the graph kept it reserved between launches: 32 MiB). Asked in
 * one context of each device, made current here: the caller may be the agent's channel thread. */
static unsigned long long graph_memory(bool trim)
{
    reg_lock();
    CUcontext ctxs[16];
    int devs[16], n = 0;
    for (int i = 0; i < g_reg.nctx && n < 16; i++) {
        int k = 0;
        while (k < n && devs[k] != g_reg.ctxs[i].dev) k++;
        if (k == n && g_reg.ctxs[i].dev >= 0) { devs[n] = g_reg.ctxs[i].dev; ctxs[n++] = g_reg.ctxs[i].ctx; }
    }
    reg_unlock();
    unsigned long long total = 0;
    if (!n || !gpucr_drv.cuCtxGetCurrent) return 0;   /* no context yet (the driver may not even be resolved) */
    CUcontext cur = NULL;
    gpucr_drv.cuCtxGetCurrent(&cur);
    for (int i = 0; i < n; i++) {
        gpucr_drv.cuCtxSetCurrent(ctxs[i]);
        if (trim && gpucr_drv.cuDeviceGraphMemTrim) gpucr_drv.cuDeviceGraphMemTrim(devs[i]);
        cuuint64_t v = 0;
        if (gpucr_drv.cuDeviceGetGraphMemAttribute &&
            gpucr_drv.cuDeviceGetGraphMemAttribute(devs[i], trim ? CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT
                                                                  : CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &v) == CUDA_SUCCESS)
            total += v;
    }
    gpucr_drv.cuCtxSetCurrent(cur);
    return total;
}

void pool_trim_for_checkpoint(void)
{
    pthread_mutex_lock(&g_pool_mu);
    uint64_t k;
    void *v;
    for (size_t i = 0; (i = hmap_next(&g_pool_streams, i, &k, &v)) < g_pool_streams.cap; i++)
        ((struct sstate *)v)->done = ((struct sstate *)v)->epoch;   /* every context was synchronised */
    for (struct apool *pl = g_pools; pl; pl = pl->next) {
        if (!pl->native) pool_shrink(pl, 0, true);
        else if (!pl->destroyed && REAL(cuMemPoolTrimTo)) REAL(cuMemPoolTrimTo)(pl->handle, 0);   /* the driver's: less for it to move */
    }
    pool_forget_destroyed();
    pthread_mutex_unlock(&g_pool_mu);
    /* graph memory the driver holds for graphs not running now goes back before its checkpoint */
    unsigned long long g = graph_memory(true);
    pthread_mutex_lock(&g_pool_mu);
    g_pool_stats.graph_bytes = g;
    pthread_mutex_unlock(&g_pool_mu);
}

bool pool_refusal(char *why, size_t len)
{
    pthread_mutex_lock(&g_pool_mu);
    long ex = g_pool_stats.ipc_exports, im = g_pool_stats.ipc_imports;
    pthread_mutex_unlock(&g_pool_mu);
    if (!ex && !im) return false;
    snprintf(why, len, "the process shares stream-ordered memory pools with other processes (cuMemPoolExportToShareableHandle / "
             "cuMemPoolExportPointer: %ld, cuMemPoolImportFromShareableHandle / cuMemPoolImportPointer: %ld), which gpucr "
             "cannot relink; share memory through VMM POSIX-fd handles (cuMemExportToShareableHandle) instead", ex, im);
    return true;
}

void pool_get_stats(struct pool_stats *out, bool running)
{
    unsigned long long g = running ? graph_memory(false) : 0;
    pthread_mutex_lock(&g_pool_mu);
    if (running) g_pool_stats.graph_bytes = g;
    *out = g_pool_stats;
    out->served_used = out->served_reserved = 0;
    for (struct apool *pl = g_pools; pl; pl = pl->next)
        if (!pl->native) { out->served_used += pl->used; out->served_reserved += pl->reserved; }
    out->ipc_pool_bytes = out->other_native_bytes = 0;
    out->ipc_pool_allocs = out->other_native_allocs = 0;
    uint64_t k;
    void *v;
    reg_lock();
    for (size_t i = 0; (i = hmap_next(&g_native_reason, i, &k, &v)) < g_native_reason.cap; i++) {
        void *rec = hmap_get(&g_reg.pool_by_va, k);
        if (!rec) { hmap_del(&g_native_reason, k); continue; }   /* its context ended */
        if ((uintptr_t)v == 1) { out->ipc_pool_bytes += reg_native_size(rec); out->ipc_pool_allocs++; }
        else { out->other_native_bytes += reg_native_size(rec); out->other_native_allocs++; }
    }
    reg_unlock();
    pthread_mutex_unlock(&g_pool_mu);
}

/* The child of fork() has none of its parent's CUDA state: forget it all (leaked on purpose). */
void pool_reset_after_fork(void)
{
    pthread_mutex_init(&g_pool_mu, NULL);
    g_pools = NULL;
    memset(&g_pool_live, 0, sizeof g_pool_live);
    memset(&g_pool_streams, 0, sizeof g_pool_streams);
    memset(&g_native_reason, 0, sizeof g_native_reason);
    memset(&g_pool_stats, 0, sizeof g_pool_stats);
    g_pools_dying = 0;
}

__attribute__((constructor)) static void pool_init(void) { pthread_atfork(NULL, NULL, pool_reset_after_fork); }
