/* The few CUDA driver types the agent needs, declared here so the agent builds without cuda.h
 * (and without cuda.h's macros that rename cuMemAlloc to cuMemAlloc_v2 and so on).
 * Layouts follow CUDA 13.0's cuda.h. */
#ifndef GPUCR_CUTYPES_H
#define GPUCR_CUTYPES_H
#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef unsigned long long cuuint64_t;
typedef unsigned int cuuint32_t;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUfunc_st *CUfunction;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUarray_st *CUarray;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef void (*CUhostFn)(void *userData);
typedef int cudaError_t;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_DEINITIALIZED = 4,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_TIMEOUT = 909,
    CUDA_ERROR_UNKNOWN = 999,
};

/* cuGetProcAddress flags and query results */
enum { CU_GET_PROC_ADDRESS_LEGACY_STREAM = 1, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM = 2 };

typedef struct { int type; int id; } CUmemLocation;               /* type 1 = device */
typedef struct {
    int type;                   /* 1 = pinned */
    int requestedHandleTypes;   /* 1 = POSIX fd */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct { unsigned char compressionType, gpuDirectRDMACapable; unsigned short usage; unsigned char reserved[4]; } allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc; /* flags 3 = read/write */
typedef struct {
    int allocType, handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} CUmemPoolProps;
typedef struct { unsigned char reserved[64]; } CUmemPoolPtrExportData;
enum { CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC = 2, CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES = 3,
       CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4,
       CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT = 5, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH = 6,
       CU_MEMPOOL_ATTR_USED_MEM_CURRENT = 7, CU_MEMPOOL_ATTR_USED_MEM_HIGH = 8 };
enum { CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT = 0, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT = 2 };
enum { CU_STREAM_CAPTURE_STATUS_NONE = 0 };
#define CU_STREAM_LEGACY ((CUstream)0x1)
#define CU_STREAM_PER_THREAD ((CUstream)0x2)

enum { CU_MEM_ALLOCATION_TYPE_PINNED = 1, CU_MEM_LOCATION_TYPE_DEVICE = 1, CU_MEM_ACCESS_FLAGS_PROT_NONE = 0,
       CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
       CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0, CU_MEM_HANDLE_TYPE_NONE = 0 };
enum { CU_STREAM_NON_BLOCKING = 1 };
enum { CU_EVENT_DISABLE_TIMING = 2 };
enum { CU_MEMHOSTREGISTER_PORTABLE = 1 };

#endif
