// Kernels and the error check shared by the GPU tests' C++ programs (cuda_app.cu, pool_app.cu).
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    printf("{\"error\": \"%s: %s\"}\n", #x, cudaGetErrorString(e_)); fflush(stdout); exit(1); } } while (0)

__global__ void fill(unsigned *p, size_t n, unsigned seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = (unsigned)(i * 2654435761u) ^ seed;
}

__global__ void add(unsigned *p, size_t n, unsigned v)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] += v;
}

// position-sensitive: sum of word * (index % 1000003 + 1), wrapping in 64 bits
__global__ void checksum(const unsigned *p, size_t n, unsigned long long *out)
{
    unsigned long long s = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        s += (unsigned long long)p[i] * (i % 1000003 + 1);
    atomicAdd(out, s);
}

// The digest answer: {"digest": [checksum per buffer], "ptrs": [address per buffer]}
template <class Buf> void print_digest(const unsigned long long *sums, const std::vector<Buf> &bufs)
{
    printf("{\"digest\": [");
    for (size_t i = 0; i < bufs.size(); i++) printf("%s%llu", i ? ", " : "", sums[i]);
    printf("], \"ptrs\": [");
    for (size_t i = 0; i < bufs.size(); i++) printf("%s%llu", i ? ", " : "", (unsigned long long)(uintptr_t)bufs[i].p);
    printf("]}\n");
}
