/*
 * gpucr's GPU kernels: the zero scan and the chunk digest of the data plane, over a device range cut
 * into 2 MiB chunks (the last one may be shorter). The digest ("gpucr-d128") is defined once, in the
 * docstring of its CPU reference, src/gpucr/dataplane/digest.py; this computes exactly that, and so does
 * simcuda's C copy (native/simcuda/gpucr_kernels.c). Tests hold all three bit-equal.
 *
 * Built into src/gpucr/_kernels/gpucr_kernels.fatbin by scripts/build-kernels (checked in with a stamp:
 * users need no compiler); loaded by src/gpucr/dataplane/kernels.py. extern "C": the loader finds them
 * by these names.
 *
 * Layout: one block per chunk at a time (blocks stride over chunks), its threads reading the chunk in
 * coalesced 16-byte loads, UNROLL of them in flight per thread; blockDim.x a multiple of 32, at most
 * 1024. The range must start 16-byte aligned (the loader checks). No atomics: a block reduces its own
 * chunk with warp shuffles and writes that chunk's result.
 */
#include <stdint.h>

#define GPUCR_CHUNK (2ull << 20)
#define UNROLL 8

typedef unsigned long long u64;

static constexpr u64 M = 0xDABA0B6EB09322E3ull;
static constexpr u64 K = 0x9E3779B97F4A7C15ull;
static constexpr u64 M2 = 0xBF58476D1CE4E5B9ull;
static constexpr u64 L = 0x94D049BB133111EBull;

static __device__ __forceinline__ u64 mix(u64 z) { return (z ^ (z >> 32)) * M; }

static __device__ __forceinline__ u64 lea64(u64 z)
{
    z = mix(mix(z));
    return z ^ (z >> 32);
}

/* Word i of a chunk into the two sums. i < 2^18, so its key takes a 32x64-bit multiply. */
static __device__ __forceinline__ void leaf(u64 &a, u64 &b, u64 w, uint32_t i)
{
    u64 x = lea64(w ^ ((u64)(i + 1) * K));
    u64 y = x * M2;
    a += x;
    b += y ^ (y >> 32);
}

static __device__ __forceinline__ u64 lo64(uint4 v) { return (u64)v.x | ((u64)v.y << 32); }
static __device__ __forceinline__ u64 hi64(uint4 v) { return (u64)v.z | ((u64)v.w << 32); }

/* Bytes [from, len) of a chunk (fewer than 16) as little-endian words, the last padded with zeros. */
static __device__ void tail_words(const unsigned char *chunk, u64 from, u64 len, u64 &a, u64 &b)
{
    for (u64 off = from; off < len; off += 8) {
        u64 w = 0;
        for (u64 k = 0; k < 8 && off + k < len; k++)
            w |= (u64)chunk[off + k] << (8 * k);
        leaf(a, b, w, (uint32_t)(off / 8));
    }
}

static __device__ __forceinline__ u64 warp_sum(u64 v)
{
    for (int o = 16; o; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* The block's sums of a and b, in thread 0 (the others get garbage). Ends with the block in step. */
static __device__ void block_sums(u64 &a, u64 &b)
{
    __shared__ u64 sa[32], sb[32];
    unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    a = warp_sum(a);
    b = warp_sum(b);
    if (lane == 0) {
        sa[warp] = a;
        sb[warp] = b;
    }
    __syncthreads();
    if (warp == 0) {
        unsigned nwarps = blockDim.x >> 5;
        a = warp_sum(lane < nwarps ? sa[lane] : 0);
        b = warp_sum(lane < nwarps ? sb[lane] : 0);
    }
    __syncthreads();   /* sa and sb are free for the next chunk */
}

/* out[2c], out[2c+1]: the digest of chunk c, h0 then h1 (16 little-endian bytes). */
extern "C" __global__ void gpucr_digest(const unsigned char *base, u64 nbytes, u64 *out)
{
    u64 nchunks = (nbytes + GPUCR_CHUNK - 1) / GPUCR_CHUNK;
    for (u64 c = blockIdx.x; c < nchunks; c += gridDim.x) {
        const unsigned char *chunk = base + c * GPUCR_CHUNK;
        u64 len = nbytes - c * GPUCR_CHUNK < GPUCR_CHUNK ? nbytes - c * GPUCR_CHUNK : GPUCR_CHUNK;
        const uint4 *q = (const uint4 *)chunk;
        uint32_t nq = (uint32_t)(len / 16), step = blockDim.x;
        u64 a = 0, b = 0;
        for (uint32_t first = threadIdx.x; first < nq; first += UNROLL * step) {
            uint4 v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; u++)
                if (first + u * step < nq)
                    v[u] = __ldcs(q + first + u * step);
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                uint32_t k = first + u * step;
                if (k < nq) {
                    leaf(a, b, lo64(v[u]), 2 * k);
                    leaf(a, b, hi64(v[u]), 2 * k + 1);
                }
            }
        }
        if (threadIdx.x == 0)
            tail_words(chunk, (u64)nq * 16, len, a, b);
        block_sums(a, b);
        if (threadIdx.x == 0) {
            u64 h0 = lea64(a ^ (len * L));
            out[2 * c] = h0;
            out[2 * c + 1] = lea64(b + h0);
        }
    }
}

/* flags[c]: 1 when every byte of chunk c is zero, else 0. A block leaves a chunk at its first non-zero
 * batch, so a chunk with data costs one batch's reads. */
extern "C" __global__ void gpucr_zero_scan(const unsigned char *base, u64 nbytes, unsigned char *flags)
{
    u64 nchunks = (nbytes + GPUCR_CHUNK - 1) / GPUCR_CHUNK;
    for (u64 c = blockIdx.x; c < nchunks; c += gridDim.x) {
        const unsigned char *chunk = base + c * GPUCR_CHUNK;
        u64 len = nbytes - c * GPUCR_CHUNK < GPUCR_CHUNK ? nbytes - c * GPUCR_CHUNK : GPUCR_CHUNK;
        const uint4 *q = (const uint4 *)chunk;
        uint32_t nq = (uint32_t)(len / 16), step = blockDim.x;
        int nonzero = 0;
        /* every thread runs the same batches (the loop bound is the block's), so the vote is legal */
        for (uint32_t first = 0; first < nq && !nonzero; first += UNROLL * step) {
            unsigned acc = 0;
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                uint32_t k = first + threadIdx.x + u * step;
                if (k < nq) {
                    uint4 v = __ldcs(q + k);
                    acc |= v.x | v.y | v.z | v.w;
                }
            }
            nonzero = __syncthreads_or(acc != 0);
        }
        int tail = 0;
        if (threadIdx.x == 0)
            for (u64 off = (u64)nq * 16; off < len; off++)
                tail |= chunk[off];
        nonzero = __syncthreads_or(nonzero || tail);
        if (threadIdx.x == 0)
            flags[c] = !nonzero;
    }
}
