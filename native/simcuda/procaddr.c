/*
 * cuGetProcAddress over a static table of simcuda's own entry points.
 *
 * The lookup is by base name ("cuMemAlloc"), CUDA version and stream flavour, as the driver
 * does it: among the table rows for the name whose version is <= the requested one, the
 * newest wins; with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM a per-thread row is
 * preferred when one qualifies, otherwise the legacy row is used. Rows with a NULL function
 * are ABI versions CUDA has but simcuda does not implement (mostly the 32-bit-pointer v1
 * forms): resolving to one must fail rather than hand back a function of another signature.
 *
 * No dlsym here on purpose: the library under test (gpucr's agent) overrides dlsym.
 */
#include <string.h>

#include "simcuda.h"

struct proc_entry {
    const char *name; /* base name */
    int version;      /* the CUDA version that introduced this ABI */
    bool per_thread;  /* a _ptds/_ptsz variant */
    void *fn;
};

#define E(name, version, fn) {name, version, false, (void *)(fn)}
#define PT(name, version, fn) {name, version, true, (void *)(fn)}
#define ABSENT(name, version) {name, version, false, NULL}

static const struct proc_entry table[] = {
    E("cuGetErrorString", 6000, cuGetErrorString),
    E("cuGetErrorName", 6000, cuGetErrorName),
    E("cuInit", 2000, cuInit),
    E("cuDriverGetVersion", 2020, cuDriverGetVersion),
    E("cuGetProcAddress", 11030, cuGetProcAddress),
    E("cuGetProcAddress", 12000, cuGetProcAddress_v2),

    E("cuDeviceGet", 2000, cuDeviceGet),
    E("cuDeviceGetCount", 2000, cuDeviceGetCount),
    E("cuDeviceGetName", 2000, cuDeviceGetName),
    E("cuDeviceGetUuid", 9020, cuDeviceGetUuid),
    E("cuDeviceGetUuid", 11040, cuDeviceGetUuid_v2),
    ABSENT("cuDeviceTotalMem", 2000),
    E("cuDeviceTotalMem", 3020, cuDeviceTotalMem_v2),
    E("cuDeviceGetAttribute", 2000, cuDeviceGetAttribute),
    E("cuDeviceGetPCIBusId", 4010, cuDeviceGetPCIBusId),

    E("cuDevicePrimaryCtxRetain", 7000, cuDevicePrimaryCtxRetain),
    E("cuDevicePrimaryCtxRelease", 7000, cuDevicePrimaryCtxRelease),
    E("cuDevicePrimaryCtxRelease", 11000, cuDevicePrimaryCtxRelease_v2),
    E("cuDevicePrimaryCtxReset", 7000, cuDevicePrimaryCtxReset),
    E("cuDevicePrimaryCtxReset", 11000, cuDevicePrimaryCtxReset_v2),
    E("cuDevicePrimaryCtxGetState", 7000, cuDevicePrimaryCtxGetState),
    ABSENT("cuCtxCreate", 2000),
    E("cuCtxCreate", 3020, cuCtxCreate_v2),
    E("cuCtxCreate", 11040, cuCtxCreate_v3),
    E("cuCtxCreate", 12050, cuCtxCreate_v4),
    E("cuCtxDestroy", 2000, cuCtxDestroy),
    E("cuCtxDestroy", 4000, cuCtxDestroy_v2),
    E("cuCtxSetCurrent", 4000, cuCtxSetCurrent),
    E("cuCtxGetCurrent", 4000, cuCtxGetCurrent),
    E("cuCtxPushCurrent", 2000, cuCtxPushCurrent),
    E("cuCtxPushCurrent", 4000, cuCtxPushCurrent_v2),
    E("cuCtxPopCurrent", 2000, cuCtxPopCurrent),
    E("cuCtxPopCurrent", 4000, cuCtxPopCurrent_v2),
    E("cuCtxSynchronize", 2000, cuCtxSynchronize),
    E("cuCtxSynchronize", 13000, cuCtxSynchronize_v2),
    E("cuCtxGetDevice", 2000, cuCtxGetDevice),
    E("cuCtxGetDevice", 13000, cuCtxGetDevice_v2),
    E("cuDeviceCanAccessPeer", 4000, cuDeviceCanAccessPeer),
    E("cuCtxEnablePeerAccess", 4000, cuCtxEnablePeerAccess),
    E("cuCtxDisablePeerAccess", 4000, cuCtxDisablePeerAccess),

    ABSENT("cuMemGetInfo", 2000),
    E("cuMemGetInfo", 3020, cuMemGetInfo_v2),
    ABSENT("cuMemAlloc", 2000),
    E("cuMemAlloc", 3020, cuMemAlloc_v2),
    ABSENT("cuMemAllocPitch", 2000),
    E("cuMemAllocPitch", 3020, cuMemAllocPitch_v2),
    ABSENT("cuMemFree", 2000),
    E("cuMemFree", 3020, cuMemFree_v2),
    ABSENT("cuMemGetAddressRange", 2000),
    E("cuMemGetAddressRange", 3020, cuMemGetAddressRange_v2),
    E("cuMemAllocManaged", 6000, cuMemAllocManaged),
    E("cuMemAllocAsync", 11020, cuMemAllocAsync),
    PT("cuMemAllocAsync", 11020, cuMemAllocAsync_ptsz),
    E("cuMemFreeAsync", 11020, cuMemFreeAsync),
    PT("cuMemFreeAsync", 11020, cuMemFreeAsync_ptsz),
    E("cuMemAllocFromPoolAsync", 11020, cuMemAllocFromPoolAsync),
    PT("cuMemAllocFromPoolAsync", 11020, cuMemAllocFromPoolAsync_ptsz),
    E("cuMemPoolCreate", 11020, cuMemPoolCreate),
    E("cuMemPoolDestroy", 11020, cuMemPoolDestroy),
    E("cuMemPoolSetAttribute", 11020, cuMemPoolSetAttribute),
    E("cuMemPoolGetAttribute", 11020, cuMemPoolGetAttribute),
    E("cuMemPoolTrimTo", 11020, cuMemPoolTrimTo),
    E("cuMemPoolSetAccess", 11020, cuMemPoolSetAccess),
    E("cuMemPoolGetAccess", 11020, cuMemPoolGetAccess),
    E("cuMemPoolExportToShareableHandle", 11020, cuMemPoolExportToShareableHandle),
    E("cuMemPoolExportPointer", 11020, cuMemPoolExportPointer),
    E("cuDeviceGetDefaultMemPool", 11020, cuDeviceGetDefaultMemPool),
    E("cuDeviceGetMemPool", 11020, cuDeviceGetMemPool),
    E("cuDeviceSetMemPool", 11020, cuDeviceSetMemPool),
    E("cuDeviceGraphMemTrim", 11040, cuDeviceGraphMemTrim),
    E("cuDeviceGetGraphMemAttribute", 11040, cuDeviceGetGraphMemAttribute),
    E("cuPointerGetAttribute", 4000, cuPointerGetAttribute),
    E("cuIpcGetMemHandle", 4010, cuIpcGetMemHandle),
    E("cuIpcOpenMemHandle", 4010, cuIpcOpenMemHandle),
    E("cuIpcOpenMemHandle", 11000, cuIpcOpenMemHandle_v2),
    E("cuIpcCloseMemHandle", 4010, cuIpcCloseMemHandle),

    E("cuMemGetAllocationGranularity", 10020, cuMemGetAllocationGranularity),
    E("cuMemAddressReserve", 10020, cuMemAddressReserve),
    E("cuMemAddressFree", 10020, cuMemAddressFree),
    E("cuMemCreate", 10020, cuMemCreate),
    E("cuMemRelease", 10020, cuMemRelease),
    E("cuMemMap", 10020, cuMemMap),
    E("cuMemUnmap", 10020, cuMemUnmap),
    E("cuMemSetAccess", 10020, cuMemSetAccess),
    E("cuMemGetAccess", 10020, cuMemGetAccess),
    E("cuMemRetainAllocationHandle", 11000, cuMemRetainAllocationHandle),
    E("cuMemGetAllocationPropertiesFromHandle", 10020, cuMemGetAllocationPropertiesFromHandle),
    E("cuMemExportToShareableHandle", 10020, cuMemExportToShareableHandle),
    E("cuMulticastCreate", 12010, cuMulticastCreate),
    E("cuMemImportFromShareableHandle", 10020, cuMemImportFromShareableHandle),

    ABSENT("cuMemAllocHost", 2000),
    E("cuMemAllocHost", 3020, cuMemAllocHost_v2),
    E("cuMemHostAlloc", 2020, cuMemHostAlloc),
    E("cuMemFreeHost", 2000, cuMemFreeHost),
    E("cuMemHostRegister", 4000, cuMemHostRegister),
    E("cuMemHostRegister", 6050, cuMemHostRegister_v2),
    E("cuMemHostUnregister", 4000, cuMemHostUnregister),
    ABSENT("cuMemHostGetDevicePointer", 2020),
    E("cuMemHostGetDevicePointer", 3020, cuMemHostGetDevicePointer_v2),

    E("cuMemcpy", 4000, cuMemcpy),
    PT("cuMemcpy", 7000, cuMemcpy_ptds),
    E("cuMemcpyAsync", 4000, cuMemcpyAsync),
    PT("cuMemcpyAsync", 7000, cuMemcpyAsync_ptsz),
    ABSENT("cuMemcpyHtoD", 2000),
    E("cuMemcpyHtoD", 3020, cuMemcpyHtoD_v2),
    PT("cuMemcpyHtoD", 7000, cuMemcpyHtoD_v2_ptds),
    ABSENT("cuMemcpyDtoH", 2000),
    E("cuMemcpyDtoH", 3020, cuMemcpyDtoH_v2),
    PT("cuMemcpyDtoH", 7000, cuMemcpyDtoH_v2_ptds),
    ABSENT("cuMemcpyDtoD", 2000),
    E("cuMemcpyDtoD", 3020, cuMemcpyDtoD_v2),
    PT("cuMemcpyDtoD", 7000, cuMemcpyDtoD_v2_ptds),
    ABSENT("cuMemcpyHtoDAsync", 2000),
    E("cuMemcpyHtoDAsync", 3020, cuMemcpyHtoDAsync_v2),
    PT("cuMemcpyHtoDAsync", 7000, cuMemcpyHtoDAsync_v2_ptsz),
    ABSENT("cuMemcpyDtoHAsync", 2000),
    E("cuMemcpyDtoHAsync", 3020, cuMemcpyDtoHAsync_v2),
    PT("cuMemcpyDtoHAsync", 7000, cuMemcpyDtoHAsync_v2_ptsz),
    ABSENT("cuMemcpyDtoDAsync", 3000),
    E("cuMemcpyDtoDAsync", 3020, cuMemcpyDtoDAsync_v2),
    PT("cuMemcpyDtoDAsync", 7000, cuMemcpyDtoDAsync_v2_ptsz),
    E("cuMemcpyPeer", 4000, cuMemcpyPeer),
    PT("cuMemcpyPeer", 7000, cuMemcpyPeer_ptds),
    E("cuMemcpyPeerAsync", 4000, cuMemcpyPeerAsync),
    PT("cuMemcpyPeerAsync", 7000, cuMemcpyPeerAsync_ptsz),
    ABSENT("cuMemsetD8", 2000),
    E("cuMemsetD8", 3020, cuMemsetD8_v2),
    PT("cuMemsetD8", 7000, cuMemsetD8_v2_ptds),
    ABSENT("cuMemsetD16", 2000),
    E("cuMemsetD16", 3020, cuMemsetD16_v2),
    PT("cuMemsetD16", 7000, cuMemsetD16_v2_ptds),
    ABSENT("cuMemsetD32", 2000),
    E("cuMemsetD32", 3020, cuMemsetD32_v2),
    PT("cuMemsetD32", 7000, cuMemsetD32_v2_ptds),
    E("cuMemsetD8Async", 3020, cuMemsetD8Async),
    PT("cuMemsetD8Async", 7000, cuMemsetD8Async_ptsz),
    E("cuMemsetD16Async", 3020, cuMemsetD16Async),
    PT("cuMemsetD16Async", 7000, cuMemsetD16Async_ptsz),
    E("cuMemsetD32Async", 3020, cuMemsetD32Async),
    PT("cuMemsetD32Async", 7000, cuMemsetD32Async_ptsz),

    E("cuStreamCreate", 2000, cuStreamCreate),
    E("cuStreamCreateWithPriority", 5050, cuStreamCreateWithPriority),
    E("cuStreamDestroy", 2000, cuStreamDestroy),
    E("cuStreamDestroy", 4000, cuStreamDestroy_v2),
    E("cuStreamSynchronize", 2000, cuStreamSynchronize),
    PT("cuStreamSynchronize", 7000, cuStreamSynchronize_ptsz),
    E("cuStreamQuery", 2000, cuStreamQuery),
    PT("cuStreamQuery", 7000, cuStreamQuery_ptsz),
    E("cuStreamWaitEvent", 3020, cuStreamWaitEvent),
    PT("cuStreamWaitEvent", 7000, cuStreamWaitEvent_ptsz),
    E("cuStreamIsCapturing", 10000, cuStreamIsCapturing),
    PT("cuStreamIsCapturing", 10000, cuStreamIsCapturing_ptsz),
    E("cuStreamBeginCapture", 10010, cuStreamBeginCapture_v2),
    PT("cuStreamBeginCapture", 10010, cuStreamBeginCapture_v2_ptsz),
    E("cuStreamEndCapture", 10000, cuStreamEndCapture),
    PT("cuStreamEndCapture", 10000, cuStreamEndCapture_ptsz),
    E("cuGraphDestroy", 10000, cuGraphDestroy),
    E("cuEventQuery", 2000, cuEventQuery),
    E("cuEventCreate", 2000, cuEventCreate),
    E("cuEventRecord", 2000, cuEventRecord),
    PT("cuEventRecord", 7000, cuEventRecord_ptsz),
    E("cuEventSynchronize", 2000, cuEventSynchronize),
    E("cuEventDestroy", 2000, cuEventDestroy),
    E("cuEventDestroy", 4000, cuEventDestroy_v2),
    E("cuEventElapsedTime", 2000, cuEventElapsedTime),
    E("cuEventElapsedTime", 12080, cuEventElapsedTime_v2),
    E("cuLaunchHostFunc", 10000, cuLaunchHostFunc),
    PT("cuLaunchHostFunc", 10000, cuLaunchHostFunc_ptsz),

    E("cuModuleLoadData", 2000, cuModuleLoadData),
    E("cuModuleGetFunction", 2000, cuModuleGetFunction),
    E("cuModuleUnload", 2000, cuModuleUnload),
    E("cuLaunchKernel", 4000, cuLaunchKernel),
    PT("cuLaunchKernel", 7000, cuLaunchKernel_ptsz),

    E("cuCheckpointProcessLock", 12080, cuCheckpointProcessLock),
    E("cuCheckpointProcessCheckpoint", 12080, cuCheckpointProcessCheckpoint),
    E("cuCheckpointProcessRestore", 12080, cuCheckpointProcessRestore),
    E("cuCheckpointProcessUnlock", 12080, cuCheckpointProcessUnlock),
    E("cuCheckpointProcessGetState", 12080, cuCheckpointProcessGetState),
    E("cuCheckpointProcessGetRestoreThreadId", 12080, cuCheckpointProcessGetRestoreThreadId),
};

/* The newest row for name with version <= max_version and the given flavour. */
static const struct proc_entry *best(const char *name, int max_version, bool per_thread)
{
    const struct proc_entry *b = NULL;
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++) {
        const struct proc_entry *e = &table[i];
        if (e->per_thread == per_thread && e->version <= max_version && strcmp(e->name, name) == 0 &&
            (!b || e->version > b->version))
            b = e;
    }
    return b;
}

static bool known(const char *name)
{
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++)
        if (strcmp(table[i].name, name) == 0)
            return true;
    return false;
}

SIMAPI CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *symbolStatus)
{
    if (!symbol || !pfn || (flags & ~(cuuint64_t)(CU_GET_PROC_ADDRESS_LEGACY_STREAM |
                                                   CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)))
        return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    if (cudaVersion > SIM_DRIVER_VERSION) /* newer than this driver: as documented for cuda.h */
        return CUDA_ERROR_INVALID_VALUE;
    /* DEFAULT means per-thread only for code built with per-thread default streams, which
     * the driver cannot know: it is the legacy flavour here. */
    const struct proc_entry *e = NULL;
    if (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)
        e = best(symbol, cudaVersion, true);
    if (!e)
        e = best(symbol, cudaVersion, false);
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
    if (!e)
        status = known(symbol) ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    else if (!e->fn)
        status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND; /* an ABI version simcuda lacks */
    if (symbolStatus)
        *symbolStatus = status;
    if (status != CU_GET_PROC_ADDRESS_SUCCESS)
        return CUDA_ERROR_NOT_FOUND;
    *pfn = e->fn;
    return CUDA_SUCCESS;
}

SIMAPI CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    return cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, NULL);
}
