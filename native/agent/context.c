/* Contexts that end. cuCtxDestroy and cuDevicePrimaryCtxReset (so cudaDeviceReset) free everything
 * allocated in the context. The plain allocations the agent made VMM are not the driver's to free
 * with it, so the agent gives them back itself; then it forgets the context everywhere it kept it
 * (registry, copy streams, ring events; host memory pinned in it is unpinned while it still
 * lives), and afterwards forgets the plain allocations the driver freed. A context left in the
 * records would make every later checkpoint fail on it. */
#include <stdlib.h>
#include "registry.h"
#include "dataplane.h"
#include "pool.h"

#define CU_POINTER_ATTRIBUTE_CONTEXT 1

/* Before the driver destroys ctx (alive still, gate entered). */
static void before_end(CUcontext ctx)
{
    CUcontext cur = NULL;
    CUresult rc;
    gpucr_log("context %p ends: what was allocated in it is forgotten", (void *)ctx);
    gpucr_drv.cuCtxGetCurrent(&cur);
    gpucr_use_ctx(ctx);
    /* as the driver does: no work may still use what is freed */
    if ((rc = gpucr_drv.cuCtxSynchronize()) != CUDA_SUCCESS) gpucr_cu_warn(rc, "cuCtxSynchronize (context %p, ending)", (void *)ctx);
    pool_forget_ctx(ctx);   /* its pools' memory first: pool.c keeps its own records of it */
    /* the addresses of its converted allocations, taken under the lock; given back without it */
    reg_lock();
    size_t n = 0, k = 0;
    for (struct phys *p = g_reg.all; p; p = p->next_all) n += p->kind == PHYS_CONVERTED && p->ctx == ctx && !p->piece_tail;
    CUdeviceptr *vas = n ? malloc(sizeof *vas * n) : NULL;
    for (struct phys *p = g_reg.all; p && vas; p = p->next_all)
        if (p->kind == PHYS_CONVERTED && p->ctx == ctx && !p->piece_tail) vas[k++] = p->resv_va;   /* with its pieces */
    if (n && !vas) reg_lost("out of host memory giving back the allocations of context %p", (void *)ctx);
    reg_unlock();
    for (size_t i = 0; i < k; i++)
        if ((rc = alloc_free_converted(vas[i])) != CUDA_SUCCESS)
            gpucr_cu_warn(rc, "giving back the allocation at 0x%llx of ending context %p", (unsigned long long)vas[i], (void *)ctx);
    free(vas);
    reg_lock();
    reg_forget_ctx(ctx);
    reg_unlock();
    gpucr_use_ctx(cur == ctx ? NULL : cur);
}

static bool freed(CUdeviceptr ptr)
{
    CUcontext owner = NULL;
    return gpucr_drv.cuPointerGetAttribute(&owner, CU_POINTER_ATTRIBUTE_CONTEXT, ptr) != CUDA_SUCCESS;
}

/* After: the plain allocations the driver freed with the context are no longer the process's. */
static void after_end(void)
{
    reg_lock();
    reg_forget_natives(freed);
    reg_unlock();
}

GPUCR_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    gpucr_init();
    if (!REAL(cuCtxDestroy_v2)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    if (ctx) before_end(ctx);
    CUresult rc = REAL(cuCtxDestroy_v2)(ctx);
    if (rc == CUDA_SUCCESS) after_end();
    gpucr_gate_leave();
    return rc;
}

/* The primary context of dev, if it exists (retained and released again: its count is unchanged). */
static CUcontext primary_of(CUdevice dev)
{
    unsigned flags = 0;
    int active = 0;
    CUcontext ctx = NULL;
    if (gpucr_drv.cuDevicePrimaryCtxGetState(dev, &flags, &active) != CUDA_SUCCESS || !active) return NULL;
    if (gpucr_drv.cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS) return NULL;
    CUresult rc = gpucr_drv.cuDevicePrimaryCtxRelease_v2(dev);
    if (rc != CUDA_SUCCESS) gpucr_cu_warn(rc, "cuDevicePrimaryCtxRelease (device %d)", dev);
    return ctx;
}

static CUresult reset(CUresult (*real)(CUdevice), CUdevice dev)
{
    gpucr_init();
    if (!real) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    CUcontext ctx = primary_of(dev);
    if (ctx) before_end(ctx);
    CUresult rc = real(dev);
    if (rc == CUDA_SUCCESS) after_end();
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev) { return reset(REAL(cuDevicePrimaryCtxReset), dev); }
GPUCR_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) { return reset(REAL(cuDevicePrimaryCtxReset_v2), dev); }

/* Whether the process holds a CUDA context: a primary context active on some device (the runtime's,
 * so PyTorch's), or a context it allocated in. A launcher that only initialised the driver (torchrun
 * does) holds none, and is left out of a job's checkpoint. Call only while the driver does not hold
 * the process: its calls would wait until it lets go. */
int gpucr_contexts_held(void)
{
    if (!gpucr_cuda_loaded() || !gpucr_drv.cuDeviceGetCount || !gpucr_drv.cuDevicePrimaryCtxGetState) return 0;
    int n = 0, count = 0;
    if (gpucr_drv.cuDeviceGetCount(&count) != CUDA_SUCCESS) return 0;
    for (int d = 0; d < count; d++) {
        unsigned flags = 0;
        int active = 0;
        if (gpucr_drv.cuDevicePrimaryCtxGetState(d, &flags, &active) == CUDA_SUCCESS && active) n++;
    }
    reg_lock();
    if (g_reg.nctx > n) n = g_reg.nctx;
    reg_unlock();
    return n;
}

/* A context switch waits at the closed gate and is not demand (entrypoints.def). One to the context already current
 * on this thread changes nothing, so it neither waits nor reaches the driver (cuCtxGetCurrent is answered while the
 * driver holds the process): a parked app's thread that re-enters its own context before each launch then
 * reaches the launch, which brings the app back. */
GPUCR_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
    gpucr_init();
    if (!REAL(cuCtxSetCurrent)) return CUDA_ERROR_NOT_SUPPORTED;
    CUcontext cur = NULL;
    if (gpucr_gate_is_closed() && gpucr_drv.cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur == ctx) return CUDA_SUCCESS;
    gpucr_gate_enter_waiting();
    CUresult rc = REAL(cuCtxSetCurrent)(ctx);
    gpucr_gate_leave();
    return rc;
}

/* A context the driver cannot make for lack of GPU memory (an app starting on a GPU its swap service's apps fill)
 * asks the gpucr server for room, as an allocation does (room.c), and is tried once more if room was made. They wait
 * at the closed gate, as every context switch does (entrypoints.def). */
#define MADE_WITH_ROOM(real, dev, ...)                                                \
    do {                                                                              \
        gpucr_init();                                                                 \
        if (!(real)) return CUDA_ERROR_NOT_SUPPORTED;                                 \
        CUresult rc;                                                                  \
        for (int try_ = 0;; try_++) {                                                 \
            gpucr_gate_enter_waiting();                                               \
            rc = (real)(__VA_ARGS__);                                                 \
            gpucr_gate_leave();                                                       \
            if (rc != CUDA_ERROR_OUT_OF_MEMORY || try_ || !gpucr_room_ask_context(dev)) break; \
        }                                                                             \
        return rc;                                                                    \
    } while (0)

GPUCR_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev)
{
    MADE_WITH_ROOM(REAL(cuDevicePrimaryCtxRetain), dev, ctx, dev);
}

GPUCR_EXPORT CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned flags, CUdevice dev)
{
    MADE_WITH_ROOM(REAL(cuCtxCreate_v2), dev, ctx, flags, dev);
}

GPUCR_EXPORT CUresult cuCtxCreate_v3(CUcontext *ctx, void *affinity, int n, unsigned flags, CUdevice dev)
{
    MADE_WITH_ROOM(REAL(cuCtxCreate_v3), dev, ctx, affinity, n, flags, dev);
}

GPUCR_EXPORT CUresult cuCtxCreate_v4(CUcontext *ctx, void *params, unsigned flags, CUdevice dev)
{
    MADE_WITH_ROOM(REAL(cuCtxCreate_v4), dev, ctx, params, flags, dev);
}
