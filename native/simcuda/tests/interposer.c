/*
 * A stand-in for an LD_PRELOAD interposer (what gpucr's agent is): it defines cuMemAlloc_v2.
 * test_simcuda's "interposed" role checks that direct calls reach it while cuGetProcAddress
 * still returns simcuda's own function.
 */
typedef int CUresult;
typedef unsigned long long CUdeviceptr;

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, unsigned long bytesize);

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, unsigned long bytesize)
{
    (void)dptr;
    (void)bytesize;
    return 4242;
}
