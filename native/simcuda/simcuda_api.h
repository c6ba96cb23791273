/*
 * simcuda — a TEST DOUBLE of the CUDA driver (libcuda.so.1) over host memory.
 *
 * This header is the ABI simcuda exports: the CUDA driver types it needs, declared here
 * rather than taken from cuda.h so the library builds on machines without the CUDA toolkit,
 * and the prototypes of every exported entry point. Enum values and struct layouts are copied
 * from the CUDA 13.0 cuda.h; tests/abi_layout.c checks the layouts against the real header
 * wherever one is installed. Nothing here ever stands in for a result on a real GPU.
 */
#ifndef SIMCUDA_API_H
#define SIMCUDA_API_H

#include <stddef.h>
#include <stdint.h>

/* Every entry point is exported explicitly; everything else in the library is hidden.
 * Protected, not default: the symbols are exported, but references from inside the library
 * (the cuGetProcAddress table, one entry point calling another) bind to simcuda's own code.
 * With default visibility an LD_PRELOADed interposer such as gpucr's agent would capture
 * them, and cuGetProcAddress would hand the agent its own wrapper back as the "real"
 * function. The real libcuda does not return interposed pointers either. */
#ifdef SIMCUDA_BUILDING
#define SIMAPI __attribute__((visibility("protected")))
#else
#define SIMAPI /* a user of the library (the tests) */
#endif

/* ---- ABI types (CUDA 13.0, 64-bit Linux) ---- */

typedef int CUresult;
typedef int CUdevice;
typedef int CUdevice_attribute;
typedef int CUpointer_attribute;
typedef int CUmemAllocationHandleType;
typedef int CUmemAllocationGranularity_flags;
typedef int CUprocessState;
typedef int CUdriverProcAddressQueryResult;
typedef uint64_t cuuint64_t;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

typedef struct sim_ctx *CUcontext;
typedef struct sim_stream *CUstream;
typedef struct sim_event *CUevent;
typedef struct sim_module *CUmodule;
typedef struct sim_func *CUfunction;
typedef struct sim_pool *CUmemoryPool;
typedef struct sim_graph *CUgraph;
typedef void (*CUhostFn)(void *userData);

typedef struct CUuuid_st { char bytes[16]; } CUuuid;
typedef struct CUipcMemHandle_st { char reserved[64]; } CUipcMemHandle;

typedef struct CUmemLocation_st {
    int type; /* CUmemLocationType */
    int id;
} CUmemLocation;

typedef struct CUmemAllocationProp_st {
    int type;                 /* CUmemAllocationType */
    int requestedHandleTypes; /* CUmemAllocationHandleType bitmask */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

typedef struct CUmemAccessDesc_st {
    CUmemLocation location;
    int flags; /* CUmemAccess_flags */
} CUmemAccessDesc;

typedef struct CUmemPoolProps_st {
    int allocType;   /* CUmemAllocationType */
    int handleTypes; /* CUmemAllocationHandleType bitmask */
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} CUmemPoolProps;

typedef struct CUmemPoolPtrExportData_st { unsigned char reserved[64]; } CUmemPoolPtrExportData;

typedef struct CUcheckpointLockArgs_st {
    unsigned int timeoutMs; /* 0: wait for ever */
    unsigned int reserved0;
    cuuint64_t reserved1[7];
} CUcheckpointLockArgs;

typedef struct CUcheckpointCheckpointArgs_st { cuuint64_t reserved[8]; } CUcheckpointCheckpointArgs;

typedef struct CUcheckpointGpuPair_st { CUuuid oldUuid; CUuuid newUuid; } CUcheckpointGpuPair;

typedef struct CUcheckpointRestoreArgs_st {
    CUcheckpointGpuPair *gpuPairs;
    unsigned int gpuPairsCount;
    char reserved[52 - sizeof(CUcheckpointGpuPair *)];
    cuuint64_t reserved1;
} CUcheckpointRestoreArgs;

typedef struct CUcheckpointUnlockArgs_st { cuuint64_t reserved[8]; } CUcheckpointUnlockArgs;

_Static_assert(sizeof(CUmemLocation) == 8, "CUmemLocation layout");
_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp layout");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc layout");
_Static_assert(sizeof(CUmemPoolProps) == 88, "CUmemPoolProps layout");
_Static_assert(sizeof(CUmemPoolPtrExportData) == 64, "CUmemPoolPtrExportData layout");
_Static_assert(sizeof(CUcheckpointLockArgs) == 64, "CUcheckpointLockArgs layout");
_Static_assert(sizeof(CUcheckpointCheckpointArgs) == 64, "CUcheckpointCheckpointArgs layout");
_Static_assert(sizeof(CUcheckpointRestoreArgs) == 64, "CUcheckpointRestoreArgs layout");
_Static_assert(sizeof(CUcheckpointUnlockArgs) == 64, "CUcheckpointUnlockArgs layout");
_Static_assert(sizeof(CUipcMemHandle) == 64, "CUipcMemHandle layout");

/* ---- the values simcuda uses (cuda.h enums) ---- */

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_OPERATING_SYSTEM = 304,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704,
    CUDA_ERROR_PEER_ACCESS_NOT_ENABLED = 705,
    CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE = 708,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
    CUDA_ERROR_NOT_PERMITTED = 800,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_TIMEOUT = 909,
    CUDA_ERROR_UNKNOWN = 999,
};

enum {
    CU_PROCESS_STATE_RUNNING = 0,
    CU_PROCESS_STATE_LOCKED = 1,
    CU_PROCESS_STATE_CHECKPOINTED = 2,
    CU_PROCESS_STATE_FAILED = 3,
};

enum {
    CU_MEM_ALLOCATION_TYPE_PINNED = 1,
    CU_MEM_LOCATION_TYPE_DEVICE = 1,
    CU_MEM_HANDLE_TYPE_NONE = 0,
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1,
    CU_MEM_HANDLE_TYPE_FABRIC = 8,
    CU_MEM_ACCESS_FLAGS_PROT_NONE = 0,
    CU_MEM_ACCESS_FLAGS_PROT_READ = 1,
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0,
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1,
};

enum {
    CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES = 1,
    CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC = 2,
    CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES = 3,
    CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4,
    CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT = 5,
    CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH = 6,
    CU_MEMPOOL_ATTR_USED_MEM_CURRENT = 7,
    CU_MEMPOOL_ATTR_USED_MEM_HIGH = 8,
};

enum {
    CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT = 0,
    CU_GRAPH_MEM_ATTR_USED_MEM_HIGH = 1,
    CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT = 2,
    CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH = 3,
};

enum {
    CU_STREAM_CAPTURE_STATUS_NONE = 0,
    CU_STREAM_CAPTURE_STATUS_ACTIVE = 1,
    CU_STREAM_CAPTURE_MODE_RELAXED = 2,
};

enum {
    CU_MEMORYTYPE_HOST = 1,
    CU_MEMORYTYPE_DEVICE = 2,
};

enum {
    CU_POINTER_ATTRIBUTE_CONTEXT = 1,
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
    CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3,
    CU_POINTER_ATTRIBUTE_HOST_POINTER = 4,
    CU_POINTER_ATTRIBUTE_IS_MANAGED = 8,
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
    CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11,
    CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12,
    CU_POINTER_ATTRIBUTE_MAPPED = 13,
};

enum {
    CU_GET_PROC_ADDRESS_DEFAULT = 0,
    CU_GET_PROC_ADDRESS_LEGACY_STREAM = 1,
    CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM = 2,
    CU_GET_PROC_ADDRESS_SUCCESS = 0,
    CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
    CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2,
};

enum {
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1,
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X = 2,
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y = 3,
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z = 4,
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X = 5,
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y = 6,
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z = 7,
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK = 8,
    CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY = 9,
    CU_DEVICE_ATTRIBUTE_WARP_SIZE = 10,
    CU_DEVICE_ATTRIBUTE_MAX_PITCH = 11,
    CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK = 12,
    CU_DEVICE_ATTRIBUTE_CLOCK_RATE = 13,
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
    CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY = 19,
    CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS = 31,
    CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33,
    CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID = 34,
    CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE = 36,
    CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH = 37,
    CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38,
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR = 39,
    CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT = 40,
    CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41,
    CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID = 50,
    CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT = 51,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
    CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED = 78,
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81,
    CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR = 82,
    CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY = 83,
    CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS = 89,
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97,
    CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED = 99,
    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103,
    CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED = 115,
    CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID = 134,
};

#define CU_STREAM_LEGACY ((CUstream)0x1)
#define CU_STREAM_PER_THREAD ((CUstream)0x2)
#define CU_EVENT_DISABLE_TIMING 0x2

/* ---- exported entry points ---- */

/* errors, version, entry-point lookup (never gated) */
SIMAPI CUresult cuGetErrorString(CUresult error, const char **pStr);
SIMAPI CUresult cuGetErrorName(CUresult error, const char **pStr);
SIMAPI CUresult cuDriverGetVersion(int *driverVersion);
SIMAPI CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
SIMAPI CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *symbolStatus);

/* initialisation and devices */
SIMAPI CUresult cuInit(unsigned int flags);
SIMAPI CUresult cuDeviceGet(CUdevice *device, int ordinal);
SIMAPI CUresult cuDeviceGetCount(int *count);
SIMAPI CUresult cuDeviceGetName(char *name, int len, CUdevice dev);
SIMAPI CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev);
SIMAPI CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev);
SIMAPI CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
SIMAPI CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev);
SIMAPI CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev);

/* contexts */
SIMAPI CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
SIMAPI CUresult cuDevicePrimaryCtxRelease(CUdevice dev);
SIMAPI CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);
SIMAPI CUresult cuDevicePrimaryCtxReset(CUdevice dev);
SIMAPI CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev);
SIMAPI CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active);
SIMAPI CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev);
SIMAPI CUresult cuCtxCreate_v3(CUcontext *pctx, void *paramsArray, int numParams, unsigned int flags, CUdevice dev);
SIMAPI CUresult cuCtxCreate_v4(CUcontext *pctx, void *ctxCreateParams, unsigned int flags, CUdevice dev);
SIMAPI CUresult cuCtxDestroy(CUcontext ctx);
SIMAPI CUresult cuCtxDestroy_v2(CUcontext ctx);
SIMAPI CUresult cuCtxSetCurrent(CUcontext ctx);
SIMAPI CUresult cuCtxGetCurrent(CUcontext *pctx);
SIMAPI CUresult cuCtxPushCurrent(CUcontext ctx);
SIMAPI CUresult cuCtxPushCurrent_v2(CUcontext ctx);
SIMAPI CUresult cuCtxPopCurrent(CUcontext *pctx);
SIMAPI CUresult cuCtxPopCurrent_v2(CUcontext *pctx);
SIMAPI CUresult cuCtxSynchronize(void);
SIMAPI CUresult cuCtxSynchronize_v2(CUcontext ctx);
SIMAPI CUresult cuCtxGetDevice(CUdevice *device);
SIMAPI CUresult cuCtxGetDevice_v2(CUdevice *device, CUcontext ctx);

/* peer access (cuMemAlloc-family memory only; VMM memory takes cuMemSetAccess per device) */
SIMAPI CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev);
SIMAPI CUresult cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags);
SIMAPI CUresult cuCtxDisablePeerAccess(CUcontext peerContext);

/* device memory: plain allocations */
SIMAPI CUresult cuMemGetInfo_v2(size_t *free, size_t *total);
SIMAPI CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
SIMAPI CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                   unsigned int ElementSizeBytes);
SIMAPI CUresult cuMemFree_v2(CUdeviceptr dptr);
SIMAPI CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr);
SIMAPI CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags);
SIMAPI CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
SIMAPI CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
SIMAPI CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream);
SIMAPI CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream);
SIMAPI CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr);

/* device memory: stream-ordered pools */
SIMAPI CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream);
SIMAPI CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream);
SIMAPI CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props);
SIMAPI CUresult cuMemPoolDestroy(CUmemoryPool pool);
SIMAPI CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value);
SIMAPI CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value);
SIMAPI CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep);
SIMAPI CUresult cuMemPoolSetAccess(CUmemoryPool pool, const CUmemAccessDesc *map, size_t count);
SIMAPI CUresult cuMemPoolGetAccess(int *flags, CUmemoryPool memPool, CUmemLocation *location);
SIMAPI CUresult cuMemPoolExportToShareableHandle(void *handle_out, CUmemoryPool pool, CUmemAllocationHandleType handleType,
                                                 unsigned long long flags);
SIMAPI CUresult cuMemPoolExportPointer(CUmemPoolPtrExportData *shareData_out, CUdeviceptr ptr);
SIMAPI CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev);
SIMAPI CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev);
SIMAPI CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool);
/* graph memory: simcuda has no graphs, so none is ever held; trimming succeeds with nothing to do */
SIMAPI CUresult cuDeviceGraphMemTrim(CUdevice device);
SIMAPI CUresult cuDeviceGetGraphMemAttribute(CUdevice device, int attr, void *value);
SIMAPI CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr);
SIMAPI CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags);
SIMAPI CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags);
SIMAPI CUresult cuIpcCloseMemHandle(CUdeviceptr dptr);

/* device memory: virtual memory management */
SIMAPI CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                              CUmemAllocationGranularity_flags option);
SIMAPI CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                    unsigned long long flags);
SIMAPI CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size);
SIMAPI CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags);
SIMAPI CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
SIMAPI CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                         unsigned long long flags);
SIMAPI CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
SIMAPI CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
SIMAPI CUresult cuMemGetAccess(unsigned long long *flags, const CUmemLocation *location, CUdeviceptr ptr);
SIMAPI CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr);
SIMAPI CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                       CUmemGenericAllocationHandle handle);
SIMAPI CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                             CUmemAllocationHandleType handleType, unsigned long long flags);
typedef struct {
    unsigned int numDevices;
    size_t size;
    unsigned long long handleTypes;
    unsigned long long flags;
} CUmulticastObjectProp;
SIMAPI CUresult cuMulticastCreate(CUmemGenericAllocationHandle *mcHandle, const CUmulticastObjectProp *prop);
SIMAPI CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                               CUmemAllocationHandleType shHandleType);

/* host memory */
SIMAPI CUresult cuMemAllocHost_v2(void **pp, size_t bytesize);
SIMAPI CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags);
SIMAPI CUresult cuMemFreeHost(void *p);
SIMAPI CUresult cuMemHostRegister(void *p, size_t bytesize, unsigned int Flags);
SIMAPI CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags);
SIMAPI CUresult cuMemHostUnregister(void *p);
SIMAPI CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int Flags);

/* copies and memsets (all synchronous; _ptds/_ptsz variants share the code) */
SIMAPI CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount);
SIMAPI CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount);
SIMAPI CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream);
SIMAPI CUresult cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream);
SIMAPI CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount);
SIMAPI CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount);
SIMAPI CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount);
SIMAPI CUresult cuMemcpyDtoH_v2_ptds(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount);
SIMAPI CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount);
SIMAPI CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount);
SIMAPI CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount, CUstream hStream);
SIMAPI CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                          CUstream hStream);
SIMAPI CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream);
SIMAPI CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream);
SIMAPI CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream);
SIMAPI CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                          CUstream hStream);
SIMAPI CUresult cuMemcpyPeer(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice, CUcontext srcContext,
                             size_t ByteCount);
SIMAPI CUresult cuMemcpyPeer_ptds(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                                  CUcontext srcContext, size_t ByteCount);
SIMAPI CUresult cuMemcpyPeerAsync(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                                  CUcontext srcContext, size_t ByteCount, CUstream hStream);
SIMAPI CUresult cuMemcpyPeerAsync_ptsz(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                                       CUcontext srcContext, size_t ByteCount, CUstream hStream);
SIMAPI CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N);
SIMAPI CUresult cuMemsetD8_v2_ptds(CUdeviceptr dstDevice, unsigned char uc, size_t N);
SIMAPI CUresult cuMemsetD16_v2(CUdeviceptr dstDevice, unsigned short us, size_t N);
SIMAPI CUresult cuMemsetD16_v2_ptds(CUdeviceptr dstDevice, unsigned short us, size_t N);
SIMAPI CUresult cuMemsetD32_v2(CUdeviceptr dstDevice, unsigned int ui, size_t N);
SIMAPI CUresult cuMemsetD32_v2_ptds(CUdeviceptr dstDevice, unsigned int ui, size_t N);
SIMAPI CUresult cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream);
SIMAPI CUresult cuMemsetD8Async_ptsz(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream);
SIMAPI CUresult cuMemsetD16Async(CUdeviceptr dstDevice, unsigned short us, size_t N, CUstream hStream);
SIMAPI CUresult cuMemsetD16Async_ptsz(CUdeviceptr dstDevice, unsigned short us, size_t N, CUstream hStream);
SIMAPI CUresult cuMemsetD32Async(CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream);
SIMAPI CUresult cuMemsetD32Async_ptsz(CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream);

/* streams, events, host functions */
SIMAPI CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags);
SIMAPI CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority);
SIMAPI CUresult cuStreamDestroy(CUstream hStream);
SIMAPI CUresult cuStreamDestroy_v2(CUstream hStream);
SIMAPI CUresult cuStreamSynchronize(CUstream hStream);
SIMAPI CUresult cuStreamSynchronize_ptsz(CUstream hStream);
SIMAPI CUresult cuStreamQuery(CUstream hStream);
SIMAPI CUresult cuStreamQuery_ptsz(CUstream hStream);
SIMAPI CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags);
SIMAPI CUresult cuEventRecord(CUevent hEvent, CUstream hStream);
SIMAPI CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream);
SIMAPI CUresult cuEventSynchronize(CUevent hEvent);
SIMAPI CUresult cuEventQuery(CUevent hEvent);
SIMAPI CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags);
SIMAPI CUresult cuStreamWaitEvent_ptsz(CUstream hStream, CUevent hEvent, unsigned int Flags);
SIMAPI CUresult cuStreamIsCapturing(CUstream hStream, int *captureStatus);
SIMAPI CUresult cuStreamIsCapturing_ptsz(CUstream hStream, int *captureStatus);
SIMAPI CUresult cuStreamBeginCapture_v2(CUstream hStream, int mode);
SIMAPI CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, int mode);
SIMAPI CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph);
SIMAPI CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph);
SIMAPI CUresult cuGraphDestroy(CUgraph hGraph);
SIMAPI CUresult cuEventDestroy(CUevent hEvent);
SIMAPI CUresult cuEventDestroy_v2(CUevent hEvent);
SIMAPI CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd);
SIMAPI CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd);
SIMAPI CUresult cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData);
SIMAPI CUresult cuLaunchHostFunc_ptsz(CUstream hStream, CUhostFn fn, void *userData);

/* modules and builtin kernels */
SIMAPI CUresult cuModuleLoadData(CUmodule *module, const void *image);
SIMAPI CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name);
SIMAPI CUresult cuModuleUnload(CUmodule hmod);
SIMAPI CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                               unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                               unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra);
SIMAPI CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                    unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                    unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                    void **kernelParams, void **extra);

/* the driver checkpoint API: called by a controller about a target pid; needs no cuInit */
SIMAPI CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args);
SIMAPI CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args);
SIMAPI CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args);
SIMAPI CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args);
SIMAPI CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state);
SIMAPI CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid);

/* simcuda's own extensions (not CUDA): identify the test double, read usage like nvidia-smi */
SIMAPI int simcudaIsSimulated(void);
SIMAPI CUresult simcudaDeviceMemUsed(int device, size_t *used, size_t *total);
/* The path standing in for /dev/nvidia<phys> (simcuda's device node); processes on that GPU hold it open. */
SIMAPI CUresult simcudaDeviceNode(int phys, char *buf, size_t len);
SIMAPI CUresult simcudaProcessMemUsed(int pid, size_t *used);
/* Host memory another process has pinned through its driver (registered or allocated pinned): what no
 * real driver tells, so that a test can show gpucr pins nothing in an application. */
SIMAPI CUresult simcudaProcessHostPinned(int pid, size_t *bytes);
/* One process's bytes on physical device `device` (NVML's per-process usage on a real GPU). */
SIMAPI CUresult simcudaProcessDeviceMemUsed(int pid, int device, size_t *used);
/* The pids holding memory or a context on physical device `phys` (NVML's compute processes); and whether
 * two physical devices are joined by NVLink (SIMCUDA_NVLINK: "0-1,2-3" or "none"; unset: all pairs). */
SIMAPI CUresult simcudaDeviceProcesses(int phys, int *pids, int *n);
SIMAPI CUresult simcudaDevicesNvlinked(int a, int b, int *joined);
/* Which process asked for process pid's last checkpoint or restore (0: none yet): a gpucr server asks from a
 * helper, not from the process that copies. */
SIMAPI CUresult simcudaCheckpointCaller(int pid, int *caller);
/* The stream-ordering model (order.c): the position of the last work enqueued on a stream, and
 * whether the next work on a stream is ordered after a position (1), not (0), or a bad stream (-1). */
SIMAPI CUresult simcudaStreamPosition(CUstream s, unsigned long long *id, unsigned long long *seq);
SIMAPI int simcudaStreamOrdered(CUstream s, unsigned long long id, unsigned long long seq);
/* Asynchronous copies so far in this process whose host side was not wholly inside one pinned range
 * (cuMemHostRegister or cuMemHostAlloc): the real driver copies those as pageable memory, through its
 * own staging buffers and far slower, so the gpucr server's copies must never be such a copy. */
SIMAPI CUresult simcudaPageableAsyncCopies(unsigned long long *n);

#endif /* SIMCUDA_API_H */
