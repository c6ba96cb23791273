#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "registry.h"
#include "rules.h"

struct registry g_reg;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

void reg_lock(void) { pthread_mutex_lock(&g_mu); }
void reg_unlock(void) { pthread_mutex_unlock(&g_mu); }

void reg_lost(const char *fmt, ...)
{
    char why[sizeof g_reg.lost_why];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    gpucr_warn("%s: this process cannot be checkpointed any more (a checkpoint would miss it)", why);
    if (!g_reg.lost++) snprintf(g_reg.lost_why, sizeof g_reg.lost_why, "%s", why);
}

int reg_put(struct hmap *m, uint64_t key, void *val, const char *what)
{
    if (hmap_put(m, key, val) == 0) return 0;
    reg_lost("out of host memory recording %s at 0x%llx", what, (unsigned long long)key);
    return -1;
}

/* Room for one more element in a grown array of *cap elements of `size` bytes. */
static bool grow(void **arr, int *cap, int n, size_t size)
{
    if (n < *cap) return true;
    int want = *cap ? *cap * 2 : 8;
    void *a = realloc(*arr, (size_t)want * size);
    if (!a) return false;
    *arr = a;
    *cap = want;
    return true;
}

static int ctx_index(CUcontext ctx)
{
    for (int i = 0; i < g_reg.nctx; i++)
        if (g_reg.ctxs[i].ctx == ctx) return i;
    return -1;
}

/* The device of the current context, and its UUID; asked while the process runs (once the driver
 * holds the process, its calls would wait), never under the registry lock. */
static void query_device(struct ctx_rec *r)
{
    CUdevice dev;
    CUresult rc;
    r->dev = -1;
    memset(r->uuid, 0, sizeof r->uuid);
    if ((rc = gpucr_drv.cuCtxGetDevice(&dev)) != CUDA_SUCCESS) {
        gpucr_cu_warn(rc, "cuCtxGetDevice (the device of context %p)", (void *)r->ctx);
        return;
    }
    r->dev = dev;
    if (gpucr_drv.cuDeviceGetUuid && (rc = gpucr_drv.cuDeviceGetUuid(r->uuid, dev)) != CUDA_SUCCESS)
        gpucr_cu_warn(rc, "cuDeviceGetUuid (device %d)", dev);
}

int reg_ctx_device(CUcontext ctx)
{
    int i = ctx_index(ctx);
    return i < 0 ? -1 : g_reg.ctxs[i].dev;
}

void reg_uuid_text(const unsigned char u[16], char out[48])
{
    snprintf(out, 48, GPUCR_UUID_TEXT,
             u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}

void reg_ctx_uuid(CUcontext ctx, char out[48])
{
    int i = ctx_index(ctx);
    if (i < 0) out[0] = 0;
    else reg_uuid_text(g_reg.ctxs[i].uuid, out);
}

void reg_learn_ctx(CUcontext ctx)
{
    if (!ctx) return;
    reg_lock();
    bool known = ctx_index(ctx) >= 0;
    reg_unlock();
    if (known) return;
    struct ctx_rec r = {.ctx = ctx};
    query_device(&r);
    reg_lock();
    if (ctx_index(ctx) < 0) {
        if (!grow((void **)&g_reg.ctxs, &g_reg.ctx_cap, g_reg.nctx, sizeof *g_reg.ctxs)) {
            reg_lost("out of host memory recording context %p", (void *)ctx);
        } else {
            g_reg.ctxs[g_reg.nctx++] = r;
            /* memory whose context ended waits for a new one on its device */
            for (struct phys *p = g_reg.all; p; p = p->next_all)
                if (!p->ctx && p->prop.location.id == r.dev) p->ctx = ctx;
        }
    }
    reg_unlock();
}

CUcontext *reg_contexts(int *n)
{
    reg_lock();
    CUcontext *out = g_reg.nctx ? malloc(sizeof *out * (size_t)g_reg.nctx) : NULL;
    *n = out ? g_reg.nctx : 0;
    for (int i = 0; i < *n; i++) out[i] = g_reg.ctxs[i].ctx;
    reg_unlock();
    return out;
}

void reg_forget_ctx(CUcontext ctx)
{
    int i = ctx_index(ctx);
    if (i < 0) return;
    int dev = g_reg.ctxs[i].dev;
    g_reg.nctx--;
    memmove(&g_reg.ctxs[i], &g_reg.ctxs[i + 1], sizeof g_reg.ctxs[0] * (size_t)(g_reg.nctx - i));
    CUcontext heir = NULL;
    for (int k = 0; k < g_reg.nctx && !heir; k++)
        if (g_reg.ctxs[k].dev == dev) heir = g_reg.ctxs[k].ctx;
    for (struct phys *p = g_reg.all; p; p = p->next_all)
        if (p->ctx == ctx) p->ctx = heir;
    for (int k = 0; k < g_reg.npeers; k++) {
        if (g_reg.peers[k].ctx == ctx) g_reg.peers[k--] = g_reg.peers[--g_reg.npeers];
        else if (!heir && dev >= 0 && dev < 32) g_reg.peers[k].devs &= ~(1u << dev);   /* no context left there to use it */
    }
}

static void forget_gone(struct hmap *map, size_t *bytes, long *count, bool (*gone)(CUdeviceptr))
{
    uint64_t key;
    void *val;
    for (size_t i = 0; (i = hmap_next(map, i, &key, &val)) < map->cap; i++) {
        if (!gone(key)) continue;
        hmap_del(map, key);
        *bytes -= reg_native_size(val);
        (*count)--;
    }
}

void reg_forget_natives(bool (*gone)(CUdeviceptr))
{
    forget_gone(&g_reg.native_by_va, &g_reg.native_bytes, &g_reg.native_count, gone);
    forget_gone(&g_reg.pool_by_va, &g_reg.pool_bytes, &g_reg.pool_count, gone);
    forget_gone(&g_reg.managed_by_va, &g_reg.managed_bytes, &g_reg.managed_count, gone);
}

void reg_refresh_devices(void)
{
    int n = 0;
    CUcontext *ctxs = reg_contexts(&n);
    for (int i = 0; i < n; i++) {
        if (gpucr_drv.cuCtxSetCurrent(ctxs[i]) != CUDA_SUCCESS) continue;   /* it ended meanwhile: nothing to ask */
        struct ctx_rec r = {.ctx = ctxs[i]};
        query_device(&r);
        reg_lock();
        int k = ctx_index(ctxs[i]);
        if (k >= 0) g_reg.ctxs[k] = r;
        reg_unlock();
    }
    free(ctxs);
}

struct phys *reg_phys_new(enum phys_kind kind, CUmemGenericAllocationHandle real, size_t size,
                          const CUmemAllocationProp *prop, CUcontext ctx)
{
    struct phys *p = calloc(1, sizeof *p);
    if (!p) { reg_lost("out of host memory recording an allocation of %zu bytes", size); return NULL; }
    p->kind = kind;
    p->own_fd = -1;
    p->size = size;
    if (prop) p->prop = *prop;
    p->ctx = ctx;
    p->app_refs = kind == PHYS_CONVERTED ? 0 : 1;
    reg_set_real(p, real);
    if (kind != PHYS_CONVERTED) {
        /* The application keeps the first driver handle as its name for this memory; a restore
         * changes the driver's handle, never the application's. */
        p->app_handle = real;
        if (hmap_get(&g_reg.by_app_handle, real)) p->app_handle = (1ULL << 63) | (uint64_t)(uintptr_t)p;
        reg_put(&g_reg.by_app_handle, p->app_handle, p, "a memory handle");
    }
    p->next_all = g_reg.all;
    if (g_reg.all) g_reg.all->prev_all = p;
    g_reg.all = p;
    return p;
}

void reg_set_real(struct phys *p, CUmemGenericAllocationHandle real)
{
    if (p->real && hmap_get(&g_reg.by_real_handle, p->real) == p) hmap_del(&g_reg.by_real_handle, p->real);
    p->real = real;
    if (real) reg_put(&g_reg.by_real_handle, real, p, "a driver handle");
}

void reg_phys_close_fds(struct phys *p)
{
    for (int i = 0; i < p->share_ndups; i++) close(p->share_dups[i]);
    p->share_ndups = 0;
    if (p->own_fd >= 0) close(p->own_fd);
    p->own_fd = -1;
}

void reg_phys_free(struct phys *p)
{
    if (p->own_fd_missing) g_reg.unexportable--;
    reg_phys_close_fds(p);   /* an open fd would keep the memory on the GPU */
    while (p->maps) reg_map_remove(p->maps);
    reg_set_real(p, 0);
    if (p->app_handle) hmap_del(&g_reg.by_app_handle, p->app_handle);
    if (p->kind == PHYS_CONVERTED && !p->piece_tail) hmap_del(&g_reg.conv_by_va, p->resv_va);
    if (p->prev_all) p->prev_all->next_all = p->next_all; else g_reg.all = p->next_all;
    if (p->next_all) p->next_all->prev_all = p->prev_all;
    free(p);
}

struct mapping *reg_map_add(struct phys *p, CUdeviceptr va, size_t size, size_t offset)
{
    struct mapping *m = calloc(1, sizeof *m);
    if (!m) { reg_lost("out of host memory recording a mapping at 0x%llx", (unsigned long long)va); return NULL; }
    m->va = va; m->size = size; m->offset = offset; m->phys = p;
    m->next = p->maps;
    p->maps = m;
    reg_put(&g_reg.map_by_va, va, m, "a mapping");
    return m;
}

void reg_map_merge_access(struct mapping *m, const CUmemAccessDesc *desc, size_t count)
{
    for (size_t i = 0; i < count; i++) {
        int k = 0;
        while (k < m->ndesc && (m->desc[k].location.type != desc[i].location.type || m->desc[k].location.id != desc[i].location.id))
            k++;
        if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_NONE) {
            if (k < m->ndesc) m->desc[k] = m->desc[--m->ndesc];
        } else if (k < m->ndesc) {
            m->desc[k] = desc[i];
        } else if (m->ndesc < MAX_ACCESS) {
            m->desc[m->ndesc++] = desc[i];
        } else {
            reg_lost("more than %d locations given access to the mapping at 0x%llx", MAX_ACCESS, (unsigned long long)m->va);
        }
    }
}

uint32_t reg_peer_devs(CUcontext owner)
{
    for (int i = 0; i < g_reg.npeers; i++)
        if (g_reg.peers[i].ctx == owner) return g_reg.peers[i].devs;
    return 0;
}

int reg_peer_set(CUcontext owner, int dev, bool on)
{
    if (dev < 0 || dev >= 32) {
        if (on) reg_lost("peer access for device %d: gpucr records peer access for devices 0 to 31", dev);
        return on ? -1 : 0;
    }
    int i = 0;
    while (i < g_reg.npeers && g_reg.peers[i].ctx != owner) i++;
    if (i == g_reg.npeers) {
        if (!on) return 0;
        if (!grow((void **)&g_reg.peers, &g_reg.peer_cap, g_reg.npeers, sizeof *g_reg.peers)) {
            reg_lost("out of host memory recording peer access of context %p", (void *)owner);
            return -1;
        }
        g_reg.peers[g_reg.npeers++] = (struct peer_grant){owner, 0};
    }
    if (on) g_reg.peers[i].devs |= 1u << dev;
    else g_reg.peers[i].devs &= ~(1u << dev);
    return 0;
}

void reg_map_remove(struct mapping *m)
{
    struct phys *p = m->phys;
    for (struct mapping **pp = &p->maps; *pp; pp = &(*pp)->next)
        if (*pp == m) { *pp = m->next; break; }
    if (hmap_get(&g_reg.map_by_va, m->va) == m) hmap_del(&g_reg.map_by_va, m->va);
    free(m);
}

struct phys *reg_phys_containing(CUdeviceptr ptr)
{
    for (struct phys *p = g_reg.all; p; p = p->next_all)
        for (struct mapping *m = p->maps; m; m = m->next)
            if (ptr >= m->va && ptr < m->va + m->size) return p;
    return NULL;
}

bool reg_phys_movable(const struct phys *p)
{
    /* imported memory is its exporter's to save: an importer only unlinks and relinks it */
    if (p->kind == PHYS_IMPORTED) return false;
    if (!p->ctx) return false;   /* its context ended and no other is on its device: the driver keeps it */
    /* The data plane reads the memory through one mapping that covers all of it. */
    for (const struct mapping *m = p->maps; m; m = m->next)
        if (m->offset == 0 && m->size == p->size && m->ndesc > 0) return true;
    return false;
}

/* The child of fork() shares no CUDA state with its parent: forget the parent's registry without
 * touching any driver object (they are not the child's). */
void reg_reset_after_fork(void)
{
    /* the forking thread holds the lock (channel.c's fork handlers): the records are whole */
    g_mu = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    /* the child's copies of the agent's fds of shared memory would keep the parent's GPU memory
     * alive (a DataLoader worker pinning VRAM while its parent is parked): close them (close is
     * async-signal-safe) */
    for (struct phys *p = g_reg.all; p; p = p->next_all) reg_phys_close_fds(p);
    g_reg.all = NULL;   /* the parent's records are leaked in the child on purpose: never freed twice */
    struct hmap *maps[] = {&g_reg.by_app_handle, &g_reg.by_real_handle, &g_reg.conv_by_va, &g_reg.map_by_va,
                           &g_reg.native_by_va, &g_reg.pool_by_va, &g_reg.managed_by_va};
    for (size_t i = 0; i < sizeof maps / sizeof maps[0]; i++) memset(maps[i], 0, sizeof *maps[i]);
    g_reg.native_bytes = g_reg.pool_bytes = g_reg.managed_bytes = 0;
    g_reg.native_count = g_reg.pool_count = g_reg.managed_count = g_reg.ipc_exports = 0;
    g_reg.multicast_objects = g_reg.fabric_shares = g_reg.unexportable = 0;
    /* the arrays are the parent's too (leaked, as the records are): start afresh */
    g_reg.ctxs = NULL; g_reg.nctx = g_reg.ctx_cap = 0;
    g_reg.peers = NULL; g_reg.npeers = g_reg.peer_cap = 0;
    g_reg.lost = 0; g_reg.lost_why[0] = 0;
}

/* ---- plain allocations the driver keeps (native), counted per kind ---- */
void note_native(struct hmap *map, size_t *bytes, long *count, CUdeviceptr ptr, size_t size)
{
    CUcontext ctx = NULL;
    CUdevice dev = -1;
    if (gpucr_drv.cuCtxGetDevice(&dev) != CUDA_SUCCESS) dev = -1;
    if (gpucr_drv.cuCtxGetCurrent(&ctx) == CUDA_SUCCESS) reg_learn_ctx(ctx);
    reg_lock();
    if (reg_put(map, ptr, reg_native_value(size, dev), "a plain allocation") == 0) {
        *bytes += size;
        (*count)++;
    }
    reg_unlock();
}

/* Forget a native allocation before the driver frees it (once freed, another thread's allocation may
 * get its address and be recorded under it); its record, NULL if `map` had none. */
void *take_native(struct hmap *map, size_t *bytes, long *count, CUdeviceptr ptr)
{
    reg_lock();
    void *v = hmap_del(map, ptr);
    if (v) { *bytes -= reg_native_size(v); (*count)--; }
    reg_unlock();
    return v;
}

/* The driver did not free it after all: it is the application's still. */
void keep_native(struct hmap *map, size_t *bytes, long *count, CUdeviceptr ptr, void *v)
{
    reg_lock();
    if (reg_put(map, ptr, v, "a plain allocation") == 0) { *bytes += reg_native_size(v); (*count)++; }
    reg_unlock();
}

/* ---- one allocation's state ---- */
static const char *const ALLOC_STATE_NAME[] = {"live", "handed", "parked", "given"};
/* LEGAL[from][to]: live -> handed (a handover), handed -> live (taken back: nothing left the GPU), handed -> parked
 * (the commit), parked -> live (adopted, relinked, or replaced by zeroed memory: an orphaned import); handed -> given
 * (given back before the commit: a two-way switch), given -> live (made again from staging: a roll-back), given ->
 * parked (the commit). */
static const bool LEGAL[4][4] = {
    [AL_LIVE] = {[AL_HANDED] = true},
    [AL_HANDED] = {[AL_LIVE] = true, [AL_PARKED] = true, [AL_GIVEN] = true},
    [AL_PARKED] = {[AL_LIVE] = true},
    [AL_GIVEN] = {[AL_LIVE] = true, [AL_PARKED] = true},
};

const char *reg_alloc_state_name(enum alloc_state s) { return ALLOC_STATE_NAME[s]; }

bool reg_alloc_move(struct phys *p, enum alloc_state to)
{
    if (!LEGAL[p->state][to]) {
        gpucr_warn("internal error: the allocation of %zu MiB at 0x%llx cannot go from %s to %s; left %s", p->size >> 20,
                   (unsigned long long)(p->maps ? p->maps->va : 0), ALLOC_STATE_NAME[p->state], ALLOC_STATE_NAME[to],
                   ALLOC_STATE_NAME[p->state]);
        return false;
    }
    p->state = to;
    return true;
}
