/* Allocation wrappers. Plain allocations of at least GPUCR_MIN_VMM_BYTES (default: one VMM granule,
 * 2 MiB on the H200) become VMM reserve+create+map, so the agent can later release the physical
 * memory and re-create it at the same address. Smaller ones stay native (the driver's checkpoint
 * moves them) because each VMM allocation costs a whole granule. The application's own VMM calls are
 * recorded so the data plane can move that memory too. */
#include <stdlib.h>
#include <string.h>
#include "registry.h"

static size_t g_min_vmm = (size_t)-1;   /* set at first use */
static int g_convert = -1;

static size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

enum { HANDLE_POSIX_FD = 1, HANDLE_FABRIC = 8 };   /* CUmemAllocationHandleType */

static void read_settings(void)
{
    if (g_convert >= 0) return;
    const char *native = getenv("GPUCR_NATIVE_ALLOC");
    g_convert = !(native && *native && *native != '0');
    const char *min = getenv("GPUCR_MIN_VMM_BYTES");
    g_min_vmm = min && *min ? strtoull(min, NULL, 0) : 0;   /* 0: one granule */
}

static void device_prop(CUmemAllocationProp *prop, CUdevice dev)
{
    memset(prop, 0, sizeof *prop);
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = dev;
}

/* Allocate `size` bytes as VMM; CUDA_ERROR_NOT_SUPPORTED means "use the native path instead". */
static CUresult alloc_vmm(CUdeviceptr *dptr, size_t size)
{
    CUcontext ctx = NULL;
    CUdevice dev = 0;
    if (!gpucr_drv.cuCtxGetCurrent || gpucr_drv.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx) return CUDA_ERROR_NOT_SUPPORTED;
    if (gpucr_drv.cuCtxGetDevice(&dev) != CUDA_SUCCESS) return CUDA_ERROR_NOT_SUPPORTED;
    CUmemAllocationProp prop;
    device_prop(&prop, dev);
    size_t gran = 0;
    if (gpucr_drv.cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || !gran)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (size < (g_min_vmm ? g_min_vmm : gran)) return CUDA_ERROR_NOT_SUPPORTED;

    size_t rsize = round_up(size, gran);
    CUdeviceptr va = 0;
    CUmemGenericAllocationHandle h = 0;
    CUresult rc = gpucr_drv.cuMemAddressReserve(&va, rsize, gran, 0, 0);
    if (rc != CUDA_SUCCESS) return CUDA_ERROR_NOT_SUPPORTED;
    rc = REAL(cuMemCreate)(&h, rsize, &prop, 0);
    if (rc != CUDA_SUCCESS) {
        gpucr_drv.cuMemAddressFree(va, rsize);
        /* out of memory is the application's answer, not a reason to try the other path */
        return rc == CUDA_ERROR_OUT_OF_MEMORY ? rc : CUDA_ERROR_NOT_SUPPORTED;
    }
    /* its own device, and every device that was given peer access to this context: a plain
     * allocation is open to them, so the VMM one that stands in for it must be too */
    CUmemAccessDesc acc[MAX_ACCESS] = {{{CU_MEM_LOCATION_TYPE_DEVICE, dev}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE}};
    int nacc = 1;
    reg_lock();
    uint32_t peers = reg_peer_devs(ctx);
    reg_unlock();
    for (int d = 0; d < 32 && nacc < MAX_ACCESS; d++)
        if ((peers >> d & 1) && d != dev) acc[nacc++] = (CUmemAccessDesc){{CU_MEM_LOCATION_TYPE_DEVICE, d}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    rc = REAL(cuMemMap)(va, rsize, 0, h, 0);
    if (rc == CUDA_SUCCESS) {
        rc = REAL(cuMemSetAccess)(va, rsize, acc, (size_t)nacc);
        if (rc != CUDA_SUCCESS) REAL(cuMemUnmap)(va, rsize);
    }
    if (rc != CUDA_SUCCESS) {
        REAL(cuMemRelease)(h);
        gpucr_drv.cuMemAddressFree(va, rsize);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    reg_lock();
    struct phys *p = reg_phys_new(PHYS_CONVERTED, h, rsize, &prop, ctx);
    struct mapping *m = p ? reg_map_add(p, va, rsize, 0) : NULL;
    if (m) {
        reg_map_merge_access(m, acc, (size_t)nacc);
        p->resv_va = va; p->resv_size = rsize; p->user_size = size;
        hmap_put(&g_reg.conv_by_va, va, p);
    }
    reg_unlock();
    if (!m) {
        REAL(cuMemUnmap)(va, rsize); REAL(cuMemRelease)(h); gpucr_drv.cuMemAddressFree(va, rsize);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *dptr = va;
    return CUDA_SUCCESS;
}

static void note_native(struct hmap *map, size_t *bytes, long *count, CUdeviceptr ptr, size_t size)
{
    CUcontext ctx = NULL;
    CUdevice dev = -1;
    if (gpucr_drv.cuCtxGetDevice(&dev) != CUDA_SUCCESS) dev = -1;
    reg_lock();
    if (gpucr_drv.cuCtxGetCurrent && gpucr_drv.cuCtxGetCurrent(&ctx) == CUDA_SUCCESS) reg_note_ctx(ctx);
    hmap_put(map, ptr, reg_native_value(size, dev));
    *bytes += size;
    (*count)++;
    reg_unlock();
}

/* Forget a native allocation; true if `map` had it. */
static bool forget_native(struct hmap *map, size_t *bytes, long *count, CUdeviceptr ptr)
{
    reg_lock();
    void *v = hmap_del(map, ptr);
    if (v) { *bytes -= reg_native_size(v); (*count)--; }
    reg_unlock();
    return v != NULL;
}

GPUCR_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size)
{
    gpucr_init();
    read_settings();
    if (!REAL(cuMemAlloc_v2)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    CUresult rc = CUDA_ERROR_NOT_SUPPORTED;
    if (g_convert && dptr && size) rc = alloc_vmm(dptr, size);
    if (rc == CUDA_ERROR_NOT_SUPPORTED) {
        rc = REAL(cuMemAlloc_v2)(dptr, size);
        if (rc == CUDA_SUCCESS) note_native(&g_reg.native_by_va, &g_reg.native_bytes, &g_reg.native_count, *dptr, size);
    }
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t w, size_t h, unsigned elem)
{
    gpucr_init();
    read_settings();
    if (!REAL(cuMemAllocPitch_v2)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    CUresult rc = CUDA_ERROR_NOT_SUPPORTED;
    if (g_convert && dptr && pitch && w && h && (elem == 4 || elem == 8 || elem == 16)) {
        /* the pitch the driver would choose: rows aligned to the texture pitch alignment */
        int align = 512;
        CUdevice dev = 0;
        if (gpucr_drv.cuCtxGetDevice && gpucr_drv.cuCtxGetDevice(&dev) == CUDA_SUCCESS && gpucr_drv.cuDeviceGetAttribute) {
            int a = 0;
            if (gpucr_drv.cuDeviceGetAttribute(&a, 14 /* TEXTURE_PITCH_ALIGNMENT */, dev) == CUDA_SUCCESS && a > align) align = a;
        }
        size_t p = round_up(w, (size_t)align);
        rc = alloc_vmm(dptr, p * h);
        if (rc == CUDA_SUCCESS) *pitch = p;
    }
    if (rc == CUDA_ERROR_NOT_SUPPORTED) {
        rc = REAL(cuMemAllocPitch_v2)(dptr, pitch, w, h, elem);
        if (rc == CUDA_SUCCESS) note_native(&g_reg.native_by_va, &g_reg.native_bytes, &g_reg.native_count, *dptr, *pitch * h);
    }
    gpucr_gate_leave();
    return rc;
}

CUresult alloc_free_converted(struct phys *p)
{
    CUresult rc = REAL(cuMemUnmap)(p->resv_va, p->resv_size);
    if (rc != CUDA_SUCCESS) return rc;   /* still mapped: keep the record, the memory is still there */
    REAL(cuMemRelease)(p->real);
    gpucr_drv.cuMemAddressFree(p->resv_va, p->resv_size);
    reg_phys_free(p);
    return CUDA_SUCCESS;
}

GPUCR_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    gpucr_init();
    if (!REAL(cuMemFree_v2)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    reg_lock();
    struct phys *p = dptr ? hmap_get(&g_reg.conv_by_va, dptr) : NULL;
    CUresult rc;
    if (p) {
        /* cuMemFree waits for work using the memory; unmapping under running work is undefined */
        CUcontext cur = NULL, own = p->ctx;   /* p is gone after reg_phys_free */
        gpucr_drv.cuCtxGetCurrent(&cur);
        if (cur != own) gpucr_drv.cuCtxSetCurrent(own);
        gpucr_drv.cuCtxSynchronize();
        rc = alloc_free_converted(p);
        if (cur != own) gpucr_drv.cuCtxSetCurrent(cur);
        reg_unlock();
    } else {
        reg_unlock();
        rc = REAL(cuMemFree_v2)(dptr);
        if (rc == CUDA_SUCCESS && !forget_native(&g_reg.native_by_va, &g_reg.native_bytes, &g_reg.native_count, dptr))
            forget_native(&g_reg.managed_by_va, &g_reg.managed_bytes, &g_reg.managed_count, dptr);
    }
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned flags)
{
    gpucr_init();
    if (!REAL(cuMemAllocManaged)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    CUresult rc = REAL(cuMemAllocManaged)(dptr, size, flags);
    if (rc == CUDA_SUCCESS) note_native(&g_reg.managed_by_va, &g_reg.managed_bytes, &g_reg.managed_count, *dptr, size);
    gpucr_gate_leave();
    return rc;
}

/* Stream-ordered pool memory stays with the driver, whose checkpoint moves it. */
#define POOL_ALLOC(sym, params, args)                                                              \
    GPUCR_EXPORT CUresult sym params                                                               \
    {                                                                                              \
        gpucr_init();                                                                              \
        if (!REAL(sym)) return CUDA_ERROR_NOT_SUPPORTED;                                           \
        gpucr_gate_enter();                                                                        \
        CUresult rc = REAL(sym) args;                                                              \
        if (rc == CUDA_SUCCESS) note_native(&g_reg.pool_by_va, &g_reg.pool_bytes, &g_reg.pool_count, *dptr, size); \
        gpucr_gate_leave();                                                                        \
        return rc;                                                                                 \
    }
POOL_ALLOC(cuMemAllocAsync, (CUdeviceptr *dptr, size_t size, CUstream st), (dptr, size, st))
POOL_ALLOC(cuMemAllocAsync_ptsz, (CUdeviceptr *dptr, size_t size, CUstream st), (dptr, size, st))
POOL_ALLOC(cuMemAllocFromPoolAsync, (CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream st), (dptr, size, pool, st))
POOL_ALLOC(cuMemAllocFromPoolAsync_ptsz, (CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream st), (dptr, size, pool, st))

#define POOL_FREE(sym)                                                                             \
    GPUCR_EXPORT CUresult sym(CUdeviceptr dptr, CUstream st)                                       \
    {                                                                                              \
        gpucr_init();                                                                              \
        if (!REAL(sym)) return CUDA_ERROR_NOT_SUPPORTED;                                           \
        gpucr_gate_enter();                                                                        \
        CUresult rc = REAL(sym)(dptr, st);                                                         \
        if (rc == CUDA_SUCCESS) forget_native(&g_reg.pool_by_va, &g_reg.pool_bytes, &g_reg.pool_count, dptr); \
        gpucr_gate_leave();                                                                        \
        return rc;                                                                                 \
    }
POOL_FREE(cuMemFreeAsync)
POOL_FREE(cuMemFreeAsync_ptsz)

GPUCR_EXPORT CUresult cuIpcGetMemHandle(void *handle, CUdeviceptr dptr)
{
    gpucr_init();
    if (!REAL(cuIpcGetMemHandle)) return CUDA_ERROR_NOT_SUPPORTED;
    reg_lock();
    bool converted = reg_phys_containing(dptr) != NULL;
    reg_unlock();
    if (converted) {
        gpucr_warn("cuIpcGetMemHandle: this allocation was made checkpointable (VMM) by gpucr and cannot be "
                   "exported with legacy CUDA IPC; run with GPUCR_NATIVE_ALLOC=1 to keep allocations native "
                   "(such a process cannot be checkpointed while the export is live)");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    CUresult rc = REAL(cuIpcGetMemHandle)(handle, dptr);
    if (rc == CUDA_SUCCESS) { reg_lock(); g_reg.ipc_exports++; reg_unlock(); }
    return rc;
}

/* ---- the application's own VMM ---- */

static CUmemGenericAllocationHandle to_real(uint64_t app_handle, struct phys **out)
{
    struct phys *p = hmap_get(&g_reg.by_app_handle, app_handle);
    if (out) *out = p;
    return p ? p->real : app_handle;
}

GPUCR_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop,
                                  unsigned long long flags)
{
    gpucr_init();
    if (!REAL(cuMemCreate)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    CUresult rc = REAL(cuMemCreate)(h, size, prop, flags);
    if (rc == CUDA_SUCCESS) {
        CUcontext ctx = NULL;
        gpucr_drv.cuCtxGetCurrent(&ctx);
        reg_lock();
        struct phys *p = reg_phys_new(PHYS_APP_VMM, *h, size, prop, ctx);
        if (p) *h = p->app_handle;
        reg_unlock();
    }
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *shareable, int type)
{
    gpucr_init();
    if (!REAL(cuMemImportFromShareableHandle)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    CUresult rc = REAL(cuMemImportFromShareableHandle)(h, shareable, type);
    if (rc == CUDA_SUCCESS) {
        CUcontext ctx = NULL;
        gpucr_drv.cuCtxGetCurrent(&ctx);
        reg_lock();
        struct phys *p = reg_phys_new(PHYS_IMPORTED, *h, 0, NULL, ctx);
        if (p) {
            *h = p->app_handle;
            if (type == HANDLE_POSIX_FD) share_keep_fd(p, (int)(intptr_t)shareable);
            else p->share_unknown = true;
            if (type == HANDLE_FABRIC) g_reg.fabric_shares++;
        }
        reg_unlock();
    }
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h)
{
    gpucr_init();
    if (!REAL(cuMemRelease)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    reg_lock();
    struct phys *p;
    CUresult rc = REAL(cuMemRelease)(to_real(h, &p));
    if (rc == CUDA_SUCCESS && p && --p->app_refs <= 0) {
        p->app_refs = 0;
        if (!p->maps) reg_phys_free(p);   /* memory is gone once neither a handle nor a mapping holds it */
    }
    reg_unlock();
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                               unsigned long long flags)
{
    gpucr_init();
    if (!REAL(cuMemMap)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    reg_lock();
    struct phys *p;
    CUresult rc = REAL(cuMemMap)(va, size, offset, to_real(h, &p), flags);
    if (rc == CUDA_SUCCESS && p) {
        if (p->kind == PHYS_IMPORTED && !p->size) p->size = offset + size;
        reg_map_add(p, va, size, offset);
    }
    reg_unlock();
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuMemUnmap(CUdeviceptr va, size_t size)
{
    gpucr_init();
    if (!REAL(cuMemUnmap)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    reg_lock();
    CUresult rc = REAL(cuMemUnmap)(va, size);
    if (rc == CUDA_SUCCESS) {
        /* a range may span several mappings laid end to end */
        for (CUdeviceptr a = va; a < va + size;) {
            struct mapping *m = hmap_get(&g_reg.map_by_va, a);
            if (!m) break;
            struct phys *p = m->phys;
            a += m->size;
            reg_map_remove(m);
            if (!p->maps && p->app_refs == 0 && p->kind != PHYS_CONVERTED) reg_phys_free(p);
        }
    }
    reg_unlock();
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuMemSetAccess(CUdeviceptr va, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    gpucr_init();
    if (!REAL(cuMemSetAccess)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    reg_lock();
    CUresult rc = REAL(cuMemSetAccess)(va, size, desc, count);
    if (rc == CUDA_SUCCESS) {
        for (CUdeviceptr a = va; a < va + size;) {
            struct mapping *m = hmap_get(&g_reg.map_by_va, a);
            if (!m) break;
            reg_map_merge_access(m, desc, count);
            a += m->size;
        }
    }
    reg_unlock();
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr)
{
    gpucr_init();
    if (!REAL(cuMemRetainAllocationHandle)) return CUDA_ERROR_NOT_SUPPORTED;
    reg_lock();
    CUresult rc = REAL(cuMemRetainAllocationHandle)(h, addr);
    if (rc == CUDA_SUCCESS) {
        struct phys *p = hmap_get(&g_reg.by_real_handle, *h);
        if (p && p->kind != PHYS_CONVERTED) { p->app_refs++; *h = p->app_handle; }
    }
    reg_unlock();
    return rc;
}

GPUCR_EXPORT CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type,
                                                   unsigned long long flags)
{
    gpucr_init();
    if (!REAL(cuMemExportToShareableHandle)) return CUDA_ERROR_NOT_SUPPORTED;
    reg_lock();
    struct phys *p;
    CUresult rc = REAL(cuMemExportToShareableHandle)(out, to_real(h, &p), type, flags);
    if (rc == CUDA_SUCCESS && p) {
        p->exported = true;
        if (type == HANDLE_POSIX_FD) {
            if (!p->share_key) p->share_key = share_new_key();
            share_keep_fd(p, *(int *)out);
        } else {
            p->share_unknown = true;
        }
        if (type == HANDLE_FABRIC) g_reg.fabric_shares++;
    }
    reg_unlock();
    return rc;
}

GPUCR_EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h)
{
    gpucr_init();
    if (!REAL(cuMemGetAllocationPropertiesFromHandle)) return CUDA_ERROR_NOT_SUPPORTED;
    reg_lock();
    CUmemGenericAllocationHandle real = to_real(h, NULL);
    reg_unlock();
    return REAL(cuMemGetAllocationPropertiesFromHandle)(prop, real);
}

/* Multicast objects (NCCL's NVLS) bind memory of several GPUs into one address: neither the driver's
 * checkpoint nor gpucr covers them, so the process is refused before it is touched. */
GPUCR_EXPORT CUresult cuMulticastCreate(CUmemGenericAllocationHandle *h, const void *prop)
{
    gpucr_init();
    if (!REAL(cuMulticastCreate)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    CUresult rc = REAL(cuMulticastCreate)(h, prop);
    if (rc == CUDA_SUCCESS) { reg_lock(); g_reg.multicast_objects++; reg_unlock(); }
    gpucr_gate_leave();
    return rc;
}
