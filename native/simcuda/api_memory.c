/*
 * Memory entry points: argument checking and the context each call needs, in front of the
 * data structures in memory.c. Every call here needs a current context (strict on purpose:
 * a caller that works on simcuda also sets up a context the way the real driver expects).
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "simcuda.h"

#define CU_MEM_ATTACH_GLOBAL 0x1
#define CU_MEM_ATTACH_HOST 0x2
#define CU_MEMHOSTALLOC_MASK 0x7     /* PORTABLE | DEVICEMAP | WRITECOMBINED */
#define CU_MEMHOSTREGISTER_MASK 0xf  /* PORTABLE | DEVICEMAP | IOMEMORY | READ_ONLY */

static bool granule_aligned(uint64_t v) { return v % SIM_GRANULE == 0; }

/* ---- plain allocations ---- */

static CUresult mem_get_info(size_t *free, size_t *total)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (free)
        *free = sim_acct_free(c->device);
    if (total)
        *total = sim_cfg.total_mem;
    return CUDA_SUCCESS;
}
SIMAPI CUresult cuMemGetInfo_v2(size_t *free, size_t *total) { SIM_GATED(mem_get_info(free, total)); }

static CUresult mem_alloc(CUdeviceptr *dptr, size_t size, enum sim_alloc_kind kind)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!dptr || size == 0 || size > SIZE_MAX - SIM_GRANULE)
        return CUDA_ERROR_INVALID_VALUE;
    return sim_alloc(dptr, size, kind, c);
}
SIMAPI CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    if (sim_fault_injected("cuMemAlloc_v2"))
        return CUDA_ERROR_UNKNOWN;
    SIM_GATED(mem_alloc(dptr, bytesize, SIM_ALLOC_PLAIN));
}

static CUresult mem_alloc_pitch(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned elem)
{
    if (!pitch || width == 0 || height == 0 || (elem != 4 && elem != 8 && elem != 16))
        return CUDA_ERROR_INVALID_VALUE;
    size_t p = sim_round_up(width, SIM_PITCH_ALIGN);
    if (p < width || height > SIZE_MAX / p)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = mem_alloc(dptr, p * height, SIM_ALLOC_PLAIN);
    if (rc == CUDA_SUCCESS)
        *pitch = p;
    return rc;
}
SIMAPI CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                   unsigned int ElementSizeBytes)
{
    SIM_GATED(mem_alloc_pitch(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes));
}

static CUresult mem_free(CUdeviceptr dptr)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS || sim_pool_free_sync(dptr, &rc))   /* a pool's memory goes back through its pool */
        return rc;
    return sim_free(dptr);
}
SIMAPI CUresult cuMemFree_v2(CUdeviceptr dptr) { SIM_GATED(mem_free(dptr)); }

/* What dptr is part of, when it is memory of `type` (else CUDA_ERROR_NOT_FOUND): asked, as of the driver, from a
 * thread with a current context. */
static CUresult ptrinfo_of(CUdeviceptr dptr, int type, struct sim_ptrinfo *info)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    return sim_ptrinfo(dptr, info) == CUDA_SUCCESS && info->memory_type == type ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

static CUresult mem_get_address_range(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    struct sim_ptrinfo info;
    CUresult rc = ptrinfo_of(dptr, CU_MEMORYTYPE_DEVICE, &info);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (pbase)
        *pbase = info.base;
    if (psize)
        *psize = info.size;
    return CUDA_SUCCESS;
}
SIMAPI CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    SIM_GATED(mem_get_address_range(pbase, psize, dptr));
}

/* Managed memory is device-style memory remembered as managed: enough for tools that must
 * notice it (the driver checkpoint does not support UVM, so gpucr refuses it). */
static CUresult mem_alloc_managed(CUdeviceptr *dptr, size_t size, unsigned flags)
{
    if (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST)
        return CUDA_ERROR_INVALID_VALUE;
    return mem_alloc(dptr, size, SIM_ALLOC_MANAGED);
}
SIMAPI CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    SIM_GATED(mem_alloc_managed(dptr, bytesize, flags));
}

/* Stream-ordered pool memory (cuMemAllocAsync, cuMemFreeAsync, pools): pool.c. */

/* ---- pointer attributes ---- */

static CUresult pointer_get_attribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr)
{
    if (!data)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ptrinfo info;
    if (sim_ptrinfo(ptr, &info) != CUDA_SUCCESS)
        return CUDA_ERROR_INVALID_VALUE; /* not memory the driver knows */
    bool device = info.memory_type == CU_MEMORYTYPE_DEVICE;
    switch (attribute) {
    case CU_POINTER_ATTRIBUTE_CONTEXT: *(CUcontext *)data = info.ctx; break;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *(unsigned int *)data = (unsigned)info.memory_type; break;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *(CUdeviceptr *)data = ptr; break; /* unified addressing */
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
        if (device)
            return CUDA_ERROR_INVALID_VALUE; /* device memory has no host view */
        *(void **)data = (void *)(uintptr_t)ptr;
        break;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: *(unsigned int *)data = device && !info.vmm && info.kind == SIM_ALLOC_MANAGED; break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data = info.device; break;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *(CUdeviceptr *)data = info.base; break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *(size_t *)data = info.size; break;
    case CU_POINTER_ATTRIBUTE_MAPPED: *(unsigned int *)data = 1; break;
    default: return CUDA_ERROR_NOT_SUPPORTED;
    }
    return CUDA_SUCCESS;
}
SIMAPI CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr)
{
    SIM_GATED(pointer_get_attribute(data, attribute, ptr));
}

/* ---- legacy IPC: handles can be made (so tools can see an export happened), not opened ---- */

#define SIM_IPC_MAGIC "simcuda-ipc"

static CUresult ipc_get_mem_handle(CUipcMemHandle *handle, CUdeviceptr dptr)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_ptrinfo info;
    if (!handle || sim_ptrinfo(dptr, &info) != CUDA_SUCCESS || info.memory_type != CU_MEMORYTYPE_DEVICE ||
        info.vmm || info.kind != SIM_ALLOC_PLAIN || info.base != dptr)
        return CUDA_ERROR_INVALID_VALUE; /* only the base of a cuMemAlloc allocation */
    struct {
        char magic[16];
        int32_t pid;
        uint32_t reserved;
        uint64_t base, size;
    } h = {.magic = SIM_IPC_MAGIC, .pid = (int32_t)getpid(), .base = info.base, .size = info.size};
    _Static_assert(sizeof(h) <= sizeof(*handle), "IPC handle payload");
    memset(handle, 0, sizeof(*handle));
    memcpy(handle, &h, sizeof(h));
    return CUDA_SUCCESS;
}
SIMAPI CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr) { SIM_GATED(ipc_get_mem_handle(pHandle, dptr)); }

static CUresult ipc_open_mem_handle(CUdeviceptr *pdptr, const CUipcMemHandle *handle)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pdptr || memcmp(handle->reserved, SIM_IPC_MAGIC, sizeof(SIM_IPC_MAGIC)) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_ERROR_NOT_SUPPORTED;
}
SIMAPI CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    (void)Flags;
    SIM_GATED(ipc_open_mem_handle(pdptr, &handle));
}
SIMAPI CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    (void)Flags;
    SIM_GATED(ipc_open_mem_handle(pdptr, &handle));
}

static CUresult ipc_close_mem_handle(CUdeviceptr dptr)
{
    (void)dptr;
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    return rc != CUDA_SUCCESS ? rc : CUDA_ERROR_INVALID_VALUE; /* nothing can have been opened */
}
SIMAPI CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) { SIM_GATED(ipc_close_mem_handle(dptr)); }

/* ---- virtual memory management ---- */

static CUresult check_location(const CUmemLocation *loc)
{
    if (loc->type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    return sim_device_check(loc->id) == CUDA_SUCCESS ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

static CUresult check_prop(const CUmemAllocationProp *prop)
{
    if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED)
        return CUDA_ERROR_INVALID_VALUE;
    return check_location(&prop->location);
}

static CUresult mem_get_allocation_granularity(size_t *granularity, const CUmemAllocationProp *prop,
                                               CUmemAllocationGranularity_flags option)
{
    if (!granularity || (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = check_prop(prop);
    if (rc == CUDA_SUCCESS)
        *granularity = SIM_GRANULE;
    return rc;
}
SIMAPI CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                              CUmemAllocationGranularity_flags option)
{
    SIM_GATED(mem_get_allocation_granularity(granularity, prop, option));
}

static CUresult mem_address_reserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                    unsigned long long flags)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!ptr || size == 0 || !granule_aligned(size) || flags != 0 || (alignment & (alignment - 1)))
        return CUDA_ERROR_INVALID_VALUE;
    /* addr is a hint: honoured when that range is free, otherwise any range will do. */
    return sim_vmm_reserve(ptr, size, alignment > SIM_GRANULE ? alignment : SIM_GRANULE, addr);
}
SIMAPI CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                    unsigned long long flags)
{
    SIM_GATED(mem_address_reserve(ptr, size, alignment, addr, flags));
}

static CUresult mem_address_free(CUdeviceptr ptr, size_t size)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    return rc != CUDA_SUCCESS ? rc : sim_vmm_free(ptr, size);
}
SIMAPI CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) { SIM_GATED(mem_address_free(ptr, size)); }

static CUresult mem_create(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                           unsigned long long flags)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!handle || size == 0 || !granule_aligned(size) || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = check_prop(prop)) != CUDA_SUCCESS)
        return rc;
    if (prop->requestedHandleTypes & ~(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC))
        return CUDA_ERROR_NOT_SUPPORTED; /* win32 handles */
    return sim_vmm_create(handle, size, prop);
}
SIMAPI CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags)
{
    if (sim_fault_injected("cuMemCreate"))
        return CUDA_ERROR_UNKNOWN;
    SIM_GATED(mem_create(handle, size, prop, flags));
}

static CUresult mem_release(CUmemGenericAllocationHandle handle)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    return rc != CUDA_SUCCESS ? rc : sim_vmm_release(handle);
}
SIMAPI CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    if (sim_fault_injected("cuMemRelease"))
        return CUDA_ERROR_UNKNOWN;
    SIM_GATED(mem_release(handle));
}

static CUresult mem_map(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                        unsigned long long flags)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (size == 0 || flags != 0 || !granule_aligned(ptr) || !granule_aligned(size) || !granule_aligned(offset))
        return CUDA_ERROR_INVALID_VALUE;
    return sim_vmm_map(ptr, size, offset, handle, c);
}
SIMAPI CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                         unsigned long long flags)
{
    if (sim_fault_injected("cuMemMap"))
        return CUDA_ERROR_UNKNOWN;
    SIM_GATED(mem_map(ptr, size, offset, handle, flags));
}

static CUresult mem_unmap(CUdeviceptr ptr, size_t size)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (size == 0 || !granule_aligned(ptr) || !granule_aligned(size))
        return CUDA_ERROR_INVALID_VALUE;
    return sim_vmm_unmap(ptr, size);
}
SIMAPI CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    if (sim_fault_injected("cuMemUnmap"))
        return CUDA_ERROR_UNKNOWN;
    SIM_GATED(mem_unmap(ptr, size));
}

static CUresult mem_set_access(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!desc || count == 0 || size == 0 || !granule_aligned(ptr) || !granule_aligned(size))
        return CUDA_ERROR_INVALID_VALUE;
    /* All descriptors are checked before any applies: a refused call changes nothing. */
    for (size_t i = 0; i < count; i++) {
        if ((rc = check_location(&desc[i].location)) != CUDA_SUCCESS)
            return rc;
        int f = desc[i].flags;
        if (f != CU_MEM_ACCESS_FLAGS_PROT_NONE && f != CU_MEM_ACCESS_FLAGS_PROT_READ &&
            f != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            return CUDA_ERROR_INVALID_VALUE;
    }
    return sim_vmm_set_access(ptr, size, desc, count);
}
SIMAPI CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    if (sim_fault_injected("cuMemSetAccess"))
        return CUDA_ERROR_UNKNOWN;
    SIM_GATED(mem_set_access(ptr, size, desc, count));
}

static CUresult mem_get_access(unsigned long long *flags, const CUmemLocation *location, CUdeviceptr ptr)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!flags || !location)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = check_location(location)) != CUDA_SUCCESS)
        return rc;
    int f;
    if ((rc = sim_vmm_get_access(ptr, location->id, &f)) == CUDA_SUCCESS)
        *flags = (unsigned long long)f;
    return rc;
}
SIMAPI CUresult cuMemGetAccess(unsigned long long *flags, const CUmemLocation *location, CUdeviceptr ptr)
{
    SIM_GATED(mem_get_access(flags, location, ptr));
}

static CUresult mem_retain_allocation_handle(CUmemGenericAllocationHandle *handle, void *addr)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    return handle ? sim_vmm_retain(handle, (CUdeviceptr)(uintptr_t)addr) : CUDA_ERROR_INVALID_VALUE;
}
SIMAPI CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    SIM_GATED(mem_retain_allocation_handle(handle, addr));
}

static CUresult mem_get_properties(CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    return prop ? sim_vmm_get_prop(prop, handle) : CUDA_ERROR_INVALID_VALUE;
}
SIMAPI CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle)
{
    SIM_GATED(mem_get_properties(prop, handle));
}

/* POSIX fds only: the exported fd is a dup of the memfd, so an importer in another process
 * maps the very same pages (real sharing). Allowed only if requested at cuMemCreate. */
static CUresult mem_export(void *shareable, CUmemGenericAllocationHandle handle, CUmemAllocationHandleType type,
                           unsigned long long flags)
{
    if (sim_fault_injected("cuMemExportToShareableHandle"))
        return CUDA_ERROR_UNKNOWN;
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!shareable || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (type == CU_MEM_HANDLE_TYPE_FABRIC)
        return sim_vmm_export_fabric(shareable, handle);
    if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_NOT_SUPPORTED;
    return sim_vmm_export_fd((int *)shareable, handle);
}
SIMAPI CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                             CUmemAllocationHandleType handleType, unsigned long long flags)
{
    SIM_GATED(mem_export(shareableHandle, handle, handleType, flags));
}

/* Multicast objects are only created, never bound or mapped: enough for a client to see that a
 * process made one (NCCL's NVLS does), which no checkpoint covers. */
static CUresult multicast_create(CUmemGenericAllocationHandle *h, const CUmulticastObjectProp *prop)
{
    static unsigned long long next = 1ULL << 62;
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!h || !prop || prop->numDevices == 0 || prop->size == 0 || !granule_aligned(prop->size) || prop->flags)
        return CUDA_ERROR_INVALID_VALUE;
    *h = __atomic_add_fetch(&next, 1, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}
SIMAPI CUresult cuMulticastCreate(CUmemGenericAllocationHandle *mcHandle, const CUmulticastObjectProp *prop)
{
    SIM_GATED(multicast_create(mcHandle, prop));
}

static CUresult mem_import(CUmemGenericAllocationHandle *handle, void *os_handle, CUmemAllocationHandleType type)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!handle)
        return CUDA_ERROR_INVALID_VALUE;
    if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_NOT_SUPPORTED;
    return sim_vmm_import_fd(handle, (int)(intptr_t)os_handle);
}
SIMAPI CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                               CUmemAllocationHandleType shHandleType)
{
    /* Measured on the H200 (driver 580): while its process is checkpointed, an import fails at once with
     * CUDA_ERROR_OPERATING_SYSTEM instead of waiting at the lock as other calls do (a thread of the
     * process importing its own exported fd then); after restore and unlock it works again. */
    if (sim_ckpt_checkpointed())
        return CUDA_ERROR_OPERATING_SYSTEM;
    SIM_GATED(mem_import(handle, osHandle, shHandleType));
}

/* ---- host memory: already usable, only remembered (pinned memory counts as accessible) ---- */

static CUresult mem_host_alloc(void **pp, size_t size, unsigned flags)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pp || size == 0 || (flags & ~CU_MEMHOSTALLOC_MASK))
        return CUDA_ERROR_INVALID_VALUE;
    return sim_host_alloc(pp, size, flags, c);
}
SIMAPI CUresult cuMemAllocHost_v2(void **pp, size_t bytesize) { SIM_GATED(mem_host_alloc(pp, bytesize, 0)); }
SIMAPI CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags) { SIM_GATED(mem_host_alloc(pp, bytesize, Flags)); }

static CUresult mem_free_host(void *p)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    return rc != CUDA_SUCCESS ? rc : sim_host_free(p);
}
SIMAPI CUresult cuMemFreeHost(void *p) { SIM_GATED(mem_free_host(p)); }

static CUresult mem_host_register(void *p, size_t size, unsigned flags)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!p || size == 0 || (flags & ~CU_MEMHOSTREGISTER_MASK) || (uintptr_t)p + size < (uintptr_t)p)
        return CUDA_ERROR_INVALID_VALUE;
    return sim_host_register(p, size, flags, c);
}
SIMAPI CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags)
{
    SIM_GATED(mem_host_register(p, bytesize, Flags));
}
SIMAPI CUresult cuMemHostRegister(void *p, size_t bytesize, unsigned int Flags)
{
    SIM_GATED(mem_host_register(p, bytesize, Flags));
}

/* No current context needed: the real driver unregisters from any thread, one with no context too
 * (the registration names its own); asking for one here broke every unpin on a thread that had none. */
SIMAPI CUresult cuMemHostUnregister(void *p) { SIM_GATED(sim_host_unregister(p)); }

static CUresult mem_host_get_device_pointer(CUdeviceptr *pdptr, void *p, unsigned flags)
{
    struct sim_ptrinfo info;
    CUresult rc = ptrinfo_of((CUdeviceptr)(uintptr_t)p, CU_MEMORYTYPE_HOST, &info);
    if (rc != CUDA_SUCCESS && rc != CUDA_ERROR_NOT_FOUND)
        return rc;
    if (rc != CUDA_SUCCESS || !pdptr || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    *pdptr = (CUdeviceptr)(uintptr_t)p; /* unified addressing: the same address */
    return CUDA_SUCCESS;
}
SIMAPI CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int Flags)
{
    SIM_GATED(mem_host_get_device_pointer(pdptr, p, Flags));
}
