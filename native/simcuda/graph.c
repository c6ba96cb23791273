/*
 * Stream capture and graph memory nodes, as far as stream-ordered memory needs them: CUDA turns a
 * cuMemAllocAsync on a capturing stream into an allocation node (the graph owns the address) and a
 * cuMemFreeAsync into a free node, which "must be passed the address of a graph allocation": freeing
 * anything else during capture is CUDA_ERROR_INVALID_VALUE, and the capture goes on (measured on an
 * H200, driver 580, for a pool block and for a VMM mapping alike).
 *
 * Modelled: capture on a stream simcuda made (not a per-thread one), one stream per capture (no fork/join through events; other work enqueued on a
 * capturing stream still runs at once, as all simcuda work does), graphs holding memory nodes only
 * (never instantiated or launched: an allocation node's memory exists from its capture on, as if
 * launched), and the device's graph memory: used while a graph or the application holds it, then
 * reserved (cached for graphs) until cuDeviceGraphMemTrim gives it back. Memory a graph frees is
 * cached when that graph is destroyed; memory it does not free outlives it until cuMemFreeAsync or
 * cuMemFree outside a capture.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>

#include "simcuda.h"

struct sim_graph {
    struct sim_graph *next;
    CUstream capturing;       /* the stream capturing into it; NULL once the capture ended */
};

struct galloc {
    struct galloc *next;
    CUdeviceptr va;
    size_t size;
    struct sim_ctx *ctx;
    struct sim_graph *graph;  /* the graph that allocated it; NULL once that graph is gone */
    bool freed_in_graph;      /* a free node of its graph: the memory goes back when the graph does */
    bool in_use;              /* false: cached by the device for graphs, until trimmed */
};

static struct {
    pthread_mutex_t mu;
    struct sim_graph *graphs;
    struct galloc *allocs;
    uint64_t used[SIM_MAX_DEVICES], reserved[SIM_MAX_DEVICES], used_high[SIM_MAX_DEVICES], reserved_high[SIM_MAX_DEVICES];
} gm = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* gm.mu held */
static struct sim_graph *capture_of(CUstream s)
{
    if (!s) return NULL;
    for (struct sim_graph *g = gm.graphs; g; g = g->next)
        if (g->capturing == s) return g;
    return NULL;
}

static void unuse(struct galloc *a)
{
    a->in_use = false;
    gm.used[a->ctx->device] -= a->size;
}

/* gm.mu held: give one allocation's memory back to the device. */
static void release(struct galloc **link)
{
    struct galloc *a = *link;
    *link = a->next;
    if (a->in_use) gm.used[a->ctx->device] -= a->size;
    gm.reserved[a->ctx->device] -= a->size;
    sim_free(a->va);
    free(a);
}

/* gm.mu held: a graph goes. Its allocations freed in it are cached; the others are the application's
 * to free. */
static void graph_drop(struct sim_graph *g)
{
    for (struct galloc **l = &gm.allocs; *l;) {
        struct galloc *a = *l;
        if (a->graph != g) { l = &a->next; continue; }
        a->graph = NULL;
        if (a->freed_in_graph) unuse(a);
        l = &a->next;
    }
    for (struct sim_graph **l = &gm.graphs; *l; l = &(*l)->next)
        if (*l == g) { *l = g->next; break; }
    free(g);
}

int sim_graph_capture_status(CUstream s)
{
    pthread_mutex_lock(&gm.mu);
    struct sim_graph *g = capture_of(s);
    int st = g ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    pthread_mutex_unlock(&gm.mu);
    return st;
}

bool sim_graph_alloc(CUdeviceptr *va, size_t size, CUstream s, struct sim_ctx *ctx, CUresult *rc)
{
    pthread_mutex_lock(&gm.mu);
    struct sim_graph *g = capture_of(s);
    if (g) {
        struct galloc *a = calloc(1, sizeof *a);
        size_t need = sim_round_up(size, SIM_GRANULE);
        *rc = a ? sim_alloc(&a->va, need, SIM_ALLOC_POOL, ctx) : CUDA_ERROR_OUT_OF_MEMORY;
        if (*rc != CUDA_SUCCESS) {
            free(a);
        } else {
            int d = ctx->device;
            a->size = need; a->ctx = ctx; a->graph = g; a->in_use = true;
            SIM_PUSH(gm.allocs, a);
            gm.used[d] += need;
            gm.reserved[d] += need;
            if (gm.used[d] > gm.used_high[d]) gm.used_high[d] = gm.used[d];
            if (gm.reserved[d] > gm.reserved_high[d]) gm.reserved_high[d] = gm.reserved[d];
            *va = a->va;
        }
    }
    pthread_mutex_unlock(&gm.mu);
    return g != NULL;
}

bool sim_graph_free(CUdeviceptr va, CUstream s, bool on_stream, CUresult *rc)
{
    pthread_mutex_lock(&gm.mu);
    struct sim_graph *g = on_stream ? capture_of(s) : NULL;
    struct galloc *a = gm.allocs;
    while (a && !(a->va == va && a->in_use && !a->freed_in_graph)) a = a->next;
    bool handled = g || a;
    if (g) {
        /* a free node: only of an allocation this graph made (else INVALID_VALUE; the capture goes on) */
        *rc = a && a->graph == g ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
        if (*rc == CUDA_SUCCESS) a->freed_in_graph = true;
    } else if (a) {
        /* graph memory freed outside its graph: cached for graphs (a graph still holding it may not) */
        *rc = a->graph ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
        if (*rc == CUDA_SUCCESS) unuse(a);
    }
    pthread_mutex_unlock(&gm.mu);
    return handled;
}

void sim_graph_drop_ctx(struct sim_ctx *ctx)
{
    pthread_mutex_lock(&gm.mu);
    for (struct galloc **l = &gm.allocs; *l;) {
        struct galloc *a = *l;
        if (a->ctx != ctx) { l = &a->next; continue; }
        /* memory.c frees the context's memory: only forget it */
        *l = a->next;
        if (a->in_use) gm.used[ctx->device] -= a->size;
        gm.reserved[ctx->device] -= a->size;
        free(a);
    }
    pthread_mutex_unlock(&gm.mu);
}

/* ---- capture ---- */

static CUresult begin_capture(CUstream s, int mode)
{
    CUresult rc = sim_stream_check(s);
    if (rc != CUDA_SUCCESS) return rc;
    if (mode < 0 || mode > CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_ERROR_INVALID_VALUE;
    /* the legacy stream cannot capture (CUDA); simcuda captures on streams it made only */
    if (!s || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    pthread_mutex_lock(&gm.mu);
    struct sim_graph *g = capture_of(s) ? NULL : calloc(1, sizeof *g);
    rc = capture_of(s) ? CUDA_ERROR_ILLEGAL_STATE : g ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
    if (g) {
        g->capturing = s;
        SIM_PUSH(gm.graphs, g);
    }
    pthread_mutex_unlock(&gm.mu);
    return rc;
}
SIMAPI CUresult cuStreamBeginCapture_v2(CUstream hStream, int mode) { SIM_GATED(begin_capture(hStream, mode)); }
SIMAPI CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, int mode) { SIM_GATED(begin_capture(hStream, mode)); }

static CUresult end_capture(CUstream s, CUgraph *out)
{
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_stream_check(s);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&gm.mu);
    struct sim_graph *g = capture_of(s);
    *out = NULL;
    if (!g) {
        rc = CUDA_ERROR_ILLEGAL_STATE;
    } else {
        g->capturing = NULL;
        *out = g;
    }
    pthread_mutex_unlock(&gm.mu);
    return rc;
}
SIMAPI CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph) { SIM_GATED(end_capture(hStream, phGraph)); }
SIMAPI CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph) { SIM_GATED(end_capture(hStream, phGraph)); }

static CUresult graph_destroy(CUgraph g)
{
    pthread_mutex_lock(&gm.mu);
    struct sim_graph *q = gm.graphs;
    while (q && !(q == g && !q->capturing)) q = q->next;
    if (q) graph_drop(q);
    pthread_mutex_unlock(&gm.mu);
    return q ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
SIMAPI CUresult cuGraphDestroy(CUgraph hGraph) { SIM_GATED(graph_destroy(hGraph)); }

/* ---- the device's graph memory ---- */

static CUresult graph_mem_trim(CUdevice dev)
{
    CUresult rc = sim_device_check(dev);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&gm.mu);
    for (struct galloc **l = &gm.allocs; *l;)
        if (!(*l)->in_use && (*l)->ctx->device == dev) release(l);
        else l = &(*l)->next;
    pthread_mutex_unlock(&gm.mu);
    return CUDA_SUCCESS;
}
SIMAPI CUresult cuDeviceGraphMemTrim(CUdevice device) { SIM_GATED(graph_mem_trim(device)); }

static CUresult graph_mem_attr(CUdevice dev, int attr, void *value)
{
    CUresult rc = sim_device_check(dev);
    if (rc != CUDA_SUCCESS) return rc;
    if (!value || attr < CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT || attr > CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&gm.mu);
    uint64_t *v[] = {gm.used, gm.used_high, gm.reserved, gm.reserved_high};
    *(uint64_t *)value = v[attr][dev];
    pthread_mutex_unlock(&gm.mu);
    return CUDA_SUCCESS;
}
SIMAPI CUresult cuDeviceGetGraphMemAttribute(CUdevice device, int attr, void *value) { SIM_GATED(graph_mem_attr(device, attr, value)); }
