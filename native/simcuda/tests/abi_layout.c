/*
 * Prints the layouts and enum values simcuda declares itself (simcuda_api.h), or, built with
 * -DUSE_CUDA_H, the same from the real cuda.h. run.sh compares the two outputs when a CUDA
 * toolkit is installed, so a typo in a hand-copied struct or constant cannot go unnoticed.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdint.h>

#ifdef USE_CUDA_H
#include <cuda.h>
#else
#include "../simcuda_api.h"
#endif

#define SIZE(T) printf("sizeof %s %zu\n", #T, sizeof(T));
#define FIELD(T, f) printf("%s.%s @%zu +%zu\n", #T, #f, offsetof(T, f), sizeof(((T *)0)->f));
#define V(name) printf("%s = %lld\n", #name, (long long)(name));

int main(void)
{
    SIZE(CUresult) SIZE(CUdevice) SIZE(CUdeviceptr) SIZE(CUmemGenericAllocationHandle) SIZE(CUuuid)
    SIZE(CUipcMemHandle)
    SIZE(CUmemLocation) FIELD(CUmemLocation, type) FIELD(CUmemLocation, id)
    SIZE(CUmemAllocationProp) FIELD(CUmemAllocationProp, type) FIELD(CUmemAllocationProp, requestedHandleTypes)
    FIELD(CUmemAllocationProp, location) FIELD(CUmemAllocationProp, win32HandleMetaData)
    FIELD(CUmemAllocationProp, allocFlags)
    SIZE(CUmemAccessDesc) FIELD(CUmemAccessDesc, location) FIELD(CUmemAccessDesc, flags)
    SIZE(CUmemPoolProps) FIELD(CUmemPoolProps, allocType) FIELD(CUmemPoolProps, handleTypes) FIELD(CUmemPoolProps, location)
    FIELD(CUmemPoolProps, win32SecurityAttributes) FIELD(CUmemPoolProps, maxSize) FIELD(CUmemPoolProps, usage)
    SIZE(CUmemPoolPtrExportData)
    SIZE(CUcheckpointLockArgs) FIELD(CUcheckpointLockArgs, timeoutMs) FIELD(CUcheckpointLockArgs, reserved0)
    FIELD(CUcheckpointLockArgs, reserved1)
    SIZE(CUcheckpointCheckpointArgs) SIZE(CUcheckpointUnlockArgs) SIZE(CUcheckpointGpuPair)
    SIZE(CUcheckpointRestoreArgs) FIELD(CUcheckpointRestoreArgs, gpuPairs) FIELD(CUcheckpointRestoreArgs, gpuPairsCount)
    FIELD(CUcheckpointRestoreArgs, reserved) FIELD(CUcheckpointRestoreArgs, reserved1)
#include "abi_consts.h" /* V(name) for every constant simcuda_api.h defines; made by run.sh */
    return 0;
}
