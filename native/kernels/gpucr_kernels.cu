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
 * 1024. The range must start 16-byte aligned (the loader checks). A block reduces its own chunk with
 * warp shuffles and writes that chunk's result; the check's atomics run only on a mismatch.
 *
 * Two kinds: over one range (gpucr_zero_scan, gpucr_digest: a launch per allocation), and over a table
 * of ranges in device memory (gpucr_scan_table, gpucr_check_table: one launch for many allocations,
 * the data plane's). Each table entry names the place of its first chunk among the table's chunks
 * (`first`, ascending), so a block finds the range of its chunk by a binary search and results go to
 * one array indexed by that place: a sweep made of several launches, each over a slice of the table,
 * fills one result array.
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

/* Bytes [from, len) of a chunk (fewer than 16) as little-endian words, the last padded with zeros;
 * returns the words or-ed (non-zero: a byte is). */
static __device__ u64 tail_words(const unsigned char *chunk, u64 from, u64 len, u64 &a, u64 &b)
{
    u64 any = 0;
    for (u64 off = from; off < len; off += 8) {
        u64 w = 0;
        for (u64 k = 0; k < 8 && off + k < len; k++)
            w |= (u64)chunk[off + k] << (8 * k);
        leaf(a, b, w, (uint32_t)(off / 8));
        any |= w;
    }
    return any;
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

/* The digest of one chunk (len bytes, at most GPUCR_CHUNK) by the whole block: h0 and h1 in thread 0.
 * ZERO: also whether every byte is zero (*zero, thread 0), from the same reads: the data plane's scan
 * reads each chunk once for both. Every thread must call it (it syncs the block). */
template <bool ZERO>
static __device__ __forceinline__ void chunk_digest(const unsigned char *chunk, u64 len, u64 &h0, u64 &h1, int &zero)
{
    const uint4 *q = (const uint4 *)chunk;
    uint32_t nq = (uint32_t)(len / 16), step = blockDim.x;
    u64 a = 0, b = 0;
    unsigned acc = 0;
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
                if (ZERO)
                    acc |= v[u].x | v[u].y | v[u].z | v[u].w;
                leaf(a, b, lo64(v[u]), 2 * k);
                leaf(a, b, hi64(v[u]), 2 * k + 1);
            }
        }
    }
    if (threadIdx.x == 0 && tail_words(chunk, (u64)nq * 16, len, a, b))
        acc = 1;
    if (ZERO)
        zero = !__syncthreads_or(acc != 0);
    block_sums(a, b);
    if (threadIdx.x == 0) {
        h0 = lea64(a ^ (len * L));
        h1 = lea64(b + h0);
    }
}

static __device__ __forceinline__ u64 chunk_len(u64 nbytes, u64 c)
{
    return nbytes - c * GPUCR_CHUNK < GPUCR_CHUNK ? nbytes - c * GPUCR_CHUNK : GPUCR_CHUNK;
}

/* out[2c], out[2c+1]: the digest of chunk c, h0 then h1 (16 little-endian bytes). */
extern "C" __global__ void gpucr_digest(const unsigned char *base, u64 nbytes, u64 *out)
{
    u64 nchunks = (nbytes + GPUCR_CHUNK - 1) / GPUCR_CHUNK;
    for (u64 c = blockIdx.x; c < nchunks; c += gridDim.x) {
        u64 h0, h1;
        int zero;
        chunk_digest<false>(base + c * GPUCR_CHUNK, chunk_len(nbytes, c), h0, h1, zero);
        if (threadIdx.x == 0) {
            out[2 * c] = h0;
            out[2 * c + 1] = h1;
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
        u64 len = chunk_len(nbytes, c);
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

/* ---- over a table of ranges ---- */

/* One range of a table: nbytes at base (16-byte aligned), whose chunk k is the table's chunk first + k. */
struct gpucr_range {
    u64 base;
    u64 nbytes;
    u64 first;
};

/* The entry of t[0..n) that holds the table's chunk c: the last whose first is at most c. */
static __device__ u64 locate(const gpucr_range *t, u64 n, u64 c)
{
    u64 lo = 0, hi = n;
    while (hi - lo > 1) {
        u64 mid = lo + (hi - lo) / 2;
        if (t[mid].first <= c)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* The table's chunks [*from, *to) that t[0..n) holds. */
static __device__ void table_span(const gpucr_range *t, u64 n, u64 *from, u64 *to)
{
    *from = n ? t[0].first : 0;
    *to = n ? t[n - 1].first + (t[n - 1].nbytes + GPUCR_CHUNK - 1) / GPUCR_CHUNK : 0;
}

/* The digest of every chunk c of the ranges t[0..n) (ZERO: and whether it is all zero), handed to
 * done(c, h0, h1, zero) in thread 0: the two table kernels' common sweep. */
template <bool ZERO, typename Done>
static __device__ __forceinline__ void over_table(const gpucr_range *t, u64 n, Done done)
{
    u64 from, to;
    table_span(t, n, &from, &to);
    for (u64 c = from + blockIdx.x; c < to; c += gridDim.x) {
        const gpucr_range r = t[locate(t, n, c)];
        u64 k = c - r.first, h0, h1;
        int zero;
        chunk_digest<ZERO>((const unsigned char *)r.base + k * GPUCR_CHUNK, chunk_len(r.nbytes, k), h0, h1, zero);
        if (threadIdx.x == 0)
            done(c, h0, h1, zero);
    }
}

/* For every chunk c of the ranges t[0..n): flags[c] = 1 when all its bytes are zero (else 0), and its
 * digest at digests[2c], digests[2c+1], each chunk read once. */
extern "C" __global__ void gpucr_scan_table(const gpucr_range *t, u64 n, unsigned char *flags, u64 *digests)
{
    over_table<true>(t, n, [=](u64 c, u64 h0, u64 h1, int zero) {
        flags[c] = (unsigned char)zero;
        digests[2 * c] = h0;
        digests[2 * c + 1] = h1;
    });
}

/* For every chunk c of the ranges t[0..n), its digest compared with expected[2c], expected[2c+1]: on a
 * mismatch result[0] counts it and result[1] keeps the least such c (set result to {0, ~0} first). */
extern "C" __global__ void gpucr_check_table(const gpucr_range *t, u64 n, const u64 *expected, u64 *result)
{
    over_table<false>(t, n, [=](u64 c, u64 h0, u64 h1, int) {
        if (h0 != expected[2 * c] || h1 != expected[2 * c + 1]) {
            atomicAdd(&result[0], 1ull);
            atomicMin(&result[1], c);
        }
    });
}
