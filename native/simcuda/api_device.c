/*
 * Devices and contexts. A device is an ordinal below SIMCUDA_DEVICES with fixed, plausible
 * properties (an H200-like compute capability 9.0 part). An ordinal stands for a physical
 * device, itself until a restore with GPU pairs moves the process (accounting.c): what
 * identifies the hardware (UUID, PCI bus id) is the physical device's. A context costs SIMCUDA_CTX_BYTES of
 * device memory while it lives, as the real driver's per-context reservation does, so a
 * process's usage never drops to 0 unless it is checkpointed or has no context.
 *
 * Context structs are never freed: another thread's context stack may still name one after
 * it was destroyed, and keeping the struct turns every later use into a clean
 * CUDA_ERROR_INVALID_CONTEXT instead of a use-after-free. Each is a few dozen bytes.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "simcuda.h"

#define SIM_CTX_STACK_MAX 64

static struct {
    pthread_mutex_t mu;
    struct sim_ctx *created; /* cuCtxCreate'd, live or destroyed */
    struct sim_ctx primary[SIM_MAX_DEVICES];
    unsigned primary_refs[SIM_MAX_DEVICES];
} ctxs = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* The calling thread's context stack; the top is the current context (NULL allowed). */
static __thread struct {
    struct sim_ctx *stack[SIM_CTX_STACK_MAX];
    unsigned depth;
} tls;

void sim_ctx_lock(void) { pthread_mutex_lock(&ctxs.mu); }
void sim_ctx_unlock(void) { pthread_mutex_unlock(&ctxs.mu); }

CUresult sim_device_check(CUdevice dev)
{
    return dev >= 0 && dev < sim_cfg.ndevices ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

static bool ctx_known(struct sim_ctx *c)
{
    if (c >= &ctxs.primary[0] && c < &ctxs.primary[SIM_MAX_DEVICES])
        return true;
    bool found = false;
    sim_ctx_lock();
    for (struct sim_ctx *x = ctxs.created; x && !found; x = x->next)
        found = x == c;
    sim_ctx_unlock();
    return found;
}

/* `live` is written under the ctx lock and read without it on every call's fast path. */
bool sim_ctx_is_live(struct sim_ctx *c)
{
    return c && ctx_known(c) && __atomic_load_n(&c->live, __ATOMIC_ACQUIRE);
}

CUresult sim_ctx_current(struct sim_ctx **out)
{
    struct sim_ctx *c = tls.depth ? tls.stack[tls.depth - 1] : NULL;
    if (!c || !__atomic_load_n(&c->live, __ATOMIC_ACQUIRE))
        return CUDA_ERROR_INVALID_CONTEXT;
    *out = c;
    return CUDA_SUCCESS;
}

unsigned sim_ctx_costs_locked(size_t per_dev[SIM_MAX_DEVICES])
{
    unsigned mask = 0;
    for (int d = 0; d < SIM_MAX_DEVICES; d++)
        if (ctxs.primary[d].live) {
            per_dev[d] += sim_cfg.ctx_bytes;
            mask |= 1u << d;
        }
    for (struct sim_ctx *c = ctxs.created; c; c = c->next)
        if (c->live) {
            per_dev[c->device] += sim_cfg.ctx_bytes;
            mask |= 1u << c->device;
        }
    return mask;
}

/* Brings a context to life: charges its cost. Caller holds the ctx lock. */
static CUresult ctx_activate(struct sim_ctx *c)
{
    CUresult rc = sim_acct_charge(c->device, sim_cfg.ctx_bytes);
    if (rc == CUDA_SUCCESS)
        __atomic_store_n(&c->live, true, __ATOMIC_RELEASE);
    return rc;
}

/* Frees what a context owns. Caller holds the ctx lock. */
static void ctx_drop_resources(struct sim_ctx *c)
{
    sim_exec_drop_ctx(c);
    sim_pool_drop_ctx(c);
    sim_graph_drop_ctx(c);
    sim_mem_drop_ctx(c);
}

static void ctx_deactivate(struct sim_ctx *c)
{
    __atomic_store_n(&c->live, false, __ATOMIC_RELEASE);
    ctx_drop_resources(c);
    sim_acct_uncharge(c->device, sim_cfg.ctx_bytes);
}

/* ---- devices ---- */

/* A query's first check: somewhere to write the answer (else INVALID_VALUE), then a device that exists. */
static CUresult out_and_device(const void *out, CUdevice dev)
{
    return out ? sim_device_check(dev) : CUDA_ERROR_INVALID_VALUE;
}

static CUresult device_get(CUdevice *device, int ordinal)
{
    CUresult rc = out_and_device(device, ordinal);
    if (rc == CUDA_SUCCESS)
        *device = ordinal;
    return rc;
}
SIMAPI CUresult cuDeviceGet(CUdevice *device, int ordinal) { SIM_GATED(device_get(device, ordinal)); }

static CUresult device_get_count(int *count)
{
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    *count = sim_cfg.ndevices;
    return CUDA_SUCCESS;
}
SIMAPI CUresult cuDeviceGetCount(int *count) { SIM_GATED(device_get_count(count)); }

static CUresult device_get_name(char *name, int len, CUdevice dev)
{
    CUresult rc = out_and_device(len > 0 ? name : NULL, dev);
    if (rc == CUDA_SUCCESS)
        snprintf(name, (size_t)len, "simcuda simulated GPU (test double)");
    return rc;
}
SIMAPI CUresult cuDeviceGetName(char *name, int len, CUdevice dev) { SIM_GATED(device_get_name(name, len, dev)); }

/* Deterministic per physical device (splitmix64 of its number), formatted as a version-4
 * UUID so tools that print or parse it are happy; the same on every machine and every run. */
void sim_device_uuid(int phys, CUuuid *uuid)
{
    uint64_t x = 0x73696d6375646100ull + (uint64_t)phys; /* "simcuda\0" + device */
    for (int half = 0; half < 2; half++) {
        uint64_t z = (x += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        memcpy(uuid->bytes + 8 * half, &z, 8);
    }
    uuid->bytes[6] = (char)((uuid->bytes[6] & 0x0f) | 0x40);
    uuid->bytes[8] = (char)((uuid->bytes[8] & 0x3f) | 0x80);
}

static CUresult device_get_uuid(CUuuid *uuid, CUdevice dev)
{
    CUresult rc = out_and_device(uuid, dev);
    if (rc == CUDA_SUCCESS)
        sim_device_uuid(sim_acct_physical(dev), uuid);
    return rc;
}
SIMAPI CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) { SIM_GATED(device_get_uuid(uuid, dev)); }
SIMAPI CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) { SIM_GATED(device_get_uuid(uuid, dev)); }

static CUresult device_total_mem(size_t *bytes, CUdevice dev)
{
    CUresult rc = out_and_device(bytes, dev);
    if (rc == CUDA_SUCCESS)
        *bytes = sim_cfg.total_mem;
    return rc;
}
SIMAPI CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) { SIM_GATED(device_total_mem(bytes, dev)); }

static int attribute_value(CUdevice_attribute attrib, CUdevice dev)
{
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: return 1024;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: return 1024;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: return 1024;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: return 64;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: return 2147483647;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: return 65535;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: return 65535;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: return 49152;
    case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY: return 65536;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: return 32;
    case CU_DEVICE_ATTRIBUTE_MAX_PITCH: return 2147483647;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: return 65536;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: return 1980000;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: return 132;
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: return 1;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: return 1;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: return 0x10 + sim_acct_physical(dev);
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: return 0;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: return 0;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: return 2619000;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: return 6144;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: return 52428800;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: return 2048;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: return 3;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: return 1;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT: return SIM_PITCH_ALIGN;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: return 9;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: return 0;
    case CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED: return 1;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: return 233472;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR: return 65536;
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY: return 1;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS: return 1;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: return 232448;
    case CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED: return 1;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: return 1;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: return 1;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: return 1;
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID: return -1;
    default: return 0; /* everything simcuda does not model: "not supported" */
    }
}

static CUresult device_get_attribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    CUresult rc = out_and_device(pi, dev);
    if (rc == CUDA_SUCCESS)
        *pi = attribute_value(attrib, dev);
    return rc;
}
SIMAPI CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    SIM_GATED(device_get_attribute(pi, attrib, dev));
}

static CUresult device_get_pci_bus_id(char *pciBusId, int len, CUdevice dev)
{
    CUresult rc = out_and_device(len > 0 ? pciBusId : NULL, dev);
    if (rc == CUDA_SUCCESS)
        snprintf(pciBusId, (size_t)len, "0000:%02x:00.0", 0x10 + sim_acct_physical(dev));
    return rc;
}
SIMAPI CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev)
{
    SIM_GATED(device_get_pci_bus_id(pciBusId, len, dev));
}

/* ---- primary contexts ---- */

static CUresult primary_retain(CUcontext *pctx, CUdevice dev)
{
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_device_check(dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    sim_ctx_lock();
    struct sim_ctx *c = &ctxs.primary[dev];
    c->device = dev;
    c->primary = true;
    if (ctxs.primary_refs[dev] == 0)
        rc = ctx_activate(c);
    if (rc == CUDA_SUCCESS) {
        ctxs.primary_refs[dev]++;
        *pctx = c;
    }
    sim_ctx_unlock();
    return rc;
}
SIMAPI CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) { SIM_GATED(primary_retain(pctx, dev)); }

static CUresult primary_release(CUdevice dev)
{
    CUresult rc = sim_device_check(dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    sim_ctx_lock();
    if (ctxs.primary_refs[dev] == 0)
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (--ctxs.primary_refs[dev] == 0)
        ctx_deactivate(&ctxs.primary[dev]);
    sim_ctx_unlock();
    return rc;
}
SIMAPI CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) { SIM_GATED(primary_release(dev)); }
SIMAPI CUresult cuDevicePrimaryCtxRelease(CUdevice dev) { SIM_GATED(primary_release(dev)); }

/* "Resetting the primary context does not release it": its resources go, a retained context
 * stays usable (and charged). */
static CUresult primary_reset(CUdevice dev)
{
    CUresult rc = sim_device_check(dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    sim_ctx_lock();
    if (ctxs.primary[dev].live)
        ctx_drop_resources(&ctxs.primary[dev]);
    sim_ctx_unlock();
    return CUDA_SUCCESS;
}
SIMAPI CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) { SIM_GATED(primary_reset(dev)); }
SIMAPI CUresult cuDevicePrimaryCtxReset(CUdevice dev) { SIM_GATED(primary_reset(dev)); }

static CUresult primary_get_state(CUdevice dev, unsigned int *flags, int *active)
{
    if (!flags || !active)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_device_check(dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    sim_ctx_lock();
    *flags = ctxs.primary[dev].flags;
    *active = ctxs.primary[dev].live;
    sim_ctx_unlock();
    return CUDA_SUCCESS;
}
SIMAPI CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    SIM_GATED(primary_get_state(dev, flags, active));
}

/* ---- created contexts and the context stack ---- */

static CUresult ctx_push(struct sim_ctx *c)
{
    if (tls.depth == SIM_CTX_STACK_MAX)
        return CUDA_ERROR_OUT_OF_MEMORY;
    tls.stack[tls.depth++] = c;
    return CUDA_SUCCESS;
}

static CUresult ctx_create(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_device_check(dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (tls.depth == SIM_CTX_STACK_MAX)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct sim_ctx *c = calloc(1, sizeof(*c));
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *c = (struct sim_ctx){.device = dev, .flags = flags};
    sim_ctx_lock();
    rc = ctx_activate(c);
    if (rc == CUDA_SUCCESS) {
        SIM_PUSH(ctxs.created, c);
    }
    sim_ctx_unlock();
    if (rc != CUDA_SUCCESS) {
        free(c);
        return rc;
    }
    ctx_push(c); /* a new context becomes current, as on the real driver */
    *pctx = c;
    return CUDA_SUCCESS;
}
SIMAPI CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    SIM_GATED(ctx_create(pctx, flags, dev));
}
/* v3 (execution affinity) and v4 (create params) only add parameters simcuda ignores. */
SIMAPI CUresult cuCtxCreate_v3(CUcontext *pctx, void *paramsArray, int numParams, unsigned int flags, CUdevice dev)
{
    (void)paramsArray;
    (void)numParams;
    SIM_GATED(ctx_create(pctx, flags, dev));
}
SIMAPI CUresult cuCtxCreate_v4(CUcontext *pctx, void *ctxCreateParams, unsigned int flags, CUdevice dev)
{
    (void)ctxCreateParams;
    SIM_GATED(ctx_create(pctx, flags, dev));
}

static CUresult ctx_destroy(CUcontext ctx)
{
    if (!ctx || !ctx_known(ctx) || ctx->primary)
        return CUDA_ERROR_INVALID_CONTEXT;
    sim_ctx_lock();
    CUresult rc = CUDA_ERROR_INVALID_CONTEXT;
    if (ctx->live) {
        ctx_deactivate(ctx);
        rc = CUDA_SUCCESS;
    }
    sim_ctx_unlock();
    if (rc == CUDA_SUCCESS && tls.depth && tls.stack[tls.depth - 1] == ctx)
        tls.depth--; /* destroying the current context pops it */
    return rc;
}
SIMAPI CUresult cuCtxDestroy_v2(CUcontext ctx) { SIM_GATED(ctx_destroy(ctx)); }
SIMAPI CUresult cuCtxDestroy(CUcontext ctx) { SIM_GATED(ctx_destroy(ctx)); }

static CUresult ctx_set_current(CUcontext ctx)
{
    if (ctx && !ctx_known(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (tls.depth == 0)
        return ctx ? ctx_push(ctx) : CUDA_SUCCESS;
    tls.stack[tls.depth - 1] = ctx; /* replaces the top of the stack */
    return CUDA_SUCCESS;
}
/* Setting and reading the calling thread's context touch no GPU state: not behind the checkpoint lock
 * (NVIDIA: the lock holds the calls that launch work, manage resources or change GPU state; on the H200
 * an agent thread set its context while the process was checkpointed and reached the next call). */
SIMAPI CUresult cuCtxSetCurrent(CUcontext ctx) { return sim_is_ready() ? ctx_set_current(ctx) : CUDA_ERROR_NOT_INITIALIZED; }

static CUresult ctx_get_current(CUcontext *pctx)
{
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = tls.depth ? tls.stack[tls.depth - 1] : NULL;
    return CUDA_SUCCESS;
}
SIMAPI CUresult cuCtxGetCurrent(CUcontext *pctx) { return sim_is_ready() ? ctx_get_current(pctx) : CUDA_ERROR_NOT_INITIALIZED; }

static CUresult ctx_push_current(CUcontext ctx)
{
    if (!ctx || !ctx_known(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    return ctx_push(ctx);
}
SIMAPI CUresult cuCtxPushCurrent_v2(CUcontext ctx) { SIM_GATED(ctx_push_current(ctx)); }
SIMAPI CUresult cuCtxPushCurrent(CUcontext ctx) { SIM_GATED(ctx_push_current(ctx)); }

static CUresult ctx_pop_current(CUcontext *pctx)
{
    if (tls.depth == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    struct sim_ctx *c = tls.stack[--tls.depth];
    if (pctx)
        *pctx = c;
    return CUDA_SUCCESS;
}
SIMAPI CUresult cuCtxPopCurrent_v2(CUcontext *pctx) { SIM_GATED(ctx_pop_current(pctx)); }
SIMAPI CUresult cuCtxPopCurrent(CUcontext *pctx) { SIM_GATED(ctx_pop_current(pctx)); }

/* NULL means the current context (the CUDA 13 _v2 forms take one explicitly). */
static CUresult ctx_resolve(CUcontext ctx, struct sim_ctx **out)
{
    if (!ctx)
        return sim_ctx_current(out);
    if (!sim_ctx_is_live(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    *out = ctx;
    return CUDA_SUCCESS;
}

/* All work is synchronous: once the context is valid there is nothing to wait for. */
static CUresult ctx_synchronize(CUcontext ctx)
{
    struct sim_ctx *c;
    CUresult rc = ctx_resolve(ctx, &c);
    if (rc == CUDA_SUCCESS) {
        sim_order_sync_all();   /* every stream's work seen complete (one stream order per process) */
        sim_pool_after_sync();
    }
    return rc;
}
SIMAPI CUresult cuCtxSynchronize(void) { SIM_UNHELD(ctx_synchronize(NULL)); }
SIMAPI CUresult cuCtxSynchronize_v2(CUcontext ctx) { SIM_UNHELD(ctx_synchronize(ctx)); }

static CUresult ctx_get_device(CUdevice *device, CUcontext ctx)
{
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctx *c;
    CUresult rc = ctx_resolve(ctx, &c);
    if (rc == CUDA_SUCCESS)
        *device = c->device;
    return rc;
}
SIMAPI CUresult cuCtxGetDevice(CUdevice *device) { SIM_GATED(ctx_get_device(device, NULL)); }
SIMAPI CUresult cuCtxGetDevice_v2(CUdevice *device, CUcontext ctx) { SIM_GATED(ctx_get_device(device, ctx)); }

/* ---- peer access ---- */

/* Every two distinct simulated devices can reach each other (one NVLink domain). */
static CUresult device_can_access_peer(int *can, CUdevice dev, CUdevice peer)
{
    if (!can)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_device_check(dev);
    if (rc == CUDA_SUCCESS)
        rc = sim_device_check(peer);
    if (rc == CUDA_SUCCESS)
        *can = dev != peer;
    return rc;
}
SIMAPI CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev)
{
    SIM_GATED(device_can_access_peer(canAccessPeer, dev, peerDev));
}

/* The current context gains access to peer's cuMemAlloc-family allocations, present and
 * future; VMM memory stays as cuMemSetAccess left it, as on CUDA. */
static CUresult ctx_enable_peer(CUcontext peer, unsigned flags)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!sim_ctx_is_live(peer) || peer == c)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (peer->device == c->device)
        return CUDA_ERROR_INVALID_DEVICE; /* cuDeviceCanAccessPeer says 0 */
    /* Under the ctx lock neither context can go away between the check and the entry, which
     * would leave an entry behind for a primary context retained again later. */
    sim_ctx_lock();
    rc = c->live && peer->live ? sim_mem_peer_enable(c, peer) : CUDA_ERROR_INVALID_CONTEXT;
    sim_ctx_unlock();
    return rc;
}
SIMAPI CUresult cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags)
{
    SIM_GATED(ctx_enable_peer(peerContext, Flags));
}

static CUresult ctx_disable_peer(CUcontext peer)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    return sim_ctx_is_live(peer) ? sim_mem_peer_disable(c, peer) : CUDA_ERROR_INVALID_CONTEXT;
}
SIMAPI CUresult cuCtxDisablePeerAccess(CUcontext peerContext) { SIM_GATED(ctx_disable_peer(peerContext)); }
