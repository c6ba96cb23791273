/* A plain C program linked against the driver (libcuda.so.1), as a C++ application would be: one
 * buffer through the exported symbol, one through cuGetProcAddress (the runtime's way). It prints
 * READY, then on each line of stdin checks its buffers and prints OK or BAD. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, int);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemcpyHtoD_v2(CUdeviceptr, const void *, size_t);
CUresult cuMemcpyDtoH_v2(void *, CUdeviceptr, size_t);
CUresult cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);

#define N (8u << 20)
#define CHECK(x) do { CUresult rc_ = (x); if (rc_) { printf("FAIL %s: %d\n", #x, rc_); return 1; } } while (0)

static int same(CUdeviceptr p, const unsigned char *want)
{
    unsigned char *got = malloc(N);
    int ok = got && cuMemcpyDtoH_v2(got, p, N) == 0 && memcmp(got, want, N) == 0;
    free(got);
    return ok;
}

int main(void)
{
    CUcontext ctx;
    CUdeviceptr a = 0, b = 0;
    CHECK(cuInit(0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, 0));
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuMemAlloc_v2(&a, N));
    CUresult (*alloc)(CUdeviceptr *, size_t) = NULL;
    int status = 0;
    CHECK(cuGetProcAddress_v2("cuMemAlloc", (void **)&alloc, 12000, 0, &status));
    CHECK(alloc(&b, N));
    unsigned char *pa = malloc(N), *pb = malloc(N);
    for (unsigned i = 0; i < N; i++) { pa[i] = (unsigned char)(i * 7 + 1); pb[i] = (unsigned char)(i * 13 + 5); }
    CHECK(cuMemcpyHtoD_v2(a, pa, N));
    CHECK(cuMemcpyHtoD_v2(b, pb, N));
    printf("READY %llx %llx\n", a, b);
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
        printf(same(a, pa) && same(b, pb) ? "OK\n" : "BAD\n");
        fflush(stdout);
    }
    return 0;
}
