/*
 * gpucr's own kernels (native/kernels/gpucr_kernels.cu) on simulated device memory, so the CPU suite
 * runs gpucr's zero scan and chunk digest through the same driver calls as on a GPU. The digest
 * ("gpucr-d128") is defined in src/gpucr/dataplane/digest.py; this computes exactly that, and
 * tests/test_digest.py holds the two bit-equal.
 *
 * The module is gpucr's fatbin itself, as the loader hands it to cuModuleLoadData: recognised by the
 * fatbin header's magic and the names of its kernels inside it (scripts/build-kernels leaves it
 * uncompressed). Arguments and results as on the GPU: (base, nbytes, out), out one byte per 2 MiB
 * chunk (zero scan) or two little-endian u64 per chunk (digest); over a table of ranges in device
 * memory, (table, n, flags, digests) for the scan and (table, n, expected, result) for the check, each
 * chunk found by the same binary search as on the GPU.
 *
 * The check reads memory that copies on other streams have just written (a restore's fill): what CUDA
 * orders it after is what it may read. So it refuses, with CUDA_ERROR_ILLEGAL_STATE and a line on
 * stderr, to read a mapping whose last asynchronous copies are not ordered before it (the same stream,
 * events waited on, or seen complete by the host): on a GPU it would hash bytes not landed yet, and a
 * wrong verdict would come only sometimes.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <string.h>

#include "simcuda.h"

#define CHUNK ((uint64_t)2 << 20)
#define FATBIN_MAX (64u << 20)   /* a sanity bound on the header's size */

static const uint64_t M = 0xDABA0B6EB09322E3ull, K = 0x9E3779B97F4A7C15ull, M2 = 0xBF58476D1CE4E5B9ull,
                      L = 0x94D049BB133111EBull;

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the digest reads little-endian words");

struct fatbin_header {
    uint32_t magic;
    uint16_t version;
    uint16_t header_size;
    uint64_t fat_size;
};

bool sim_gpucr_image(const void *image)
{
    /* the magic a byte at a time: none of its bytes is NUL, so a shorter string image stops it at its end */
    static const unsigned char magic[4] = {0x50, 0xED, 0x55, 0xBA};
    for (size_t i = 0; i < sizeof(magic); i++)
        if (((const unsigned char *)image)[i] != magic[i])
            return false;
    struct fatbin_header h;
    memcpy(&h, image, sizeof(h));
    if (h.header_size < sizeof(h) || h.fat_size > FATBIN_MAX)
        return false;
    size_t n = h.header_size + h.fat_size;
    static const char *const names[] = {"gpucr_zero_scan", "gpucr_digest", "gpucr_scan_table", "gpucr_check_table"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (!memmem(image, n, names[i], strlen(names[i]) + 1))   /* with its NUL: the whole name */
            return false;
    return true;
}

static uint64_t mix(uint64_t z) { return (z ^ (z >> 32)) * M; }

static uint64_t lea64(uint64_t z)
{
    z = mix(mix(z));
    return z ^ (z >> 32);
}

static void chunk_digest(const unsigned char *p, uint64_t len, uint64_t out[2])
{
    uint64_t a = 0, b = 0;
    for (uint64_t off = 0, i = 0; off < len; off += 8, i++) {
        uint64_t w = 0;   /* a last partial word is padded with zeros */
        memcpy(&w, p + off, len - off < 8 ? len - off : 8);
        uint64_t x = lea64(w ^ (i + 1) * K), y = x * M2;
        a += x;
        b += y ^ (y >> 32);
    }
    out[0] = lea64(a ^ len * L);
    out[1] = lea64(b + out[0]);
}

static bool chunk_zero(const unsigned char *p, uint64_t len)
{
    for (uint64_t off = 0; off < len; off++)
        if (p[off])
            return false;
    return true;
}

#define ARG(type, i) (*(const type *)params[i])

/* Runs `each` over the chunks of (base, nbytes), writing `out_each` bytes per chunk at out. */
static CUresult over_chunks(const struct sim_ctx *ctx, void **params, size_t out_each,
                            void (*each)(const unsigned char *p, uint64_t len, unsigned char *out))
{
    uintptr_t base = ARG(CUdeviceptr, 0);
    uint64_t nbytes = ARG(unsigned long long, 1);
    uintptr_t out = ARG(CUdeviceptr, 2);
    uint64_t nchunks = (nbytes + CHUNK - 1) / CHUNK;
    CUresult rc = CUDA_ERROR_ILLEGAL_ADDRESS;
    sim_mem_rdlock();
    if (nchunks <= SIZE_MAX / out_each &&
        sim_mem_accessible(ctx, base, nbytes, CU_MEM_ACCESS_FLAGS_PROT_READ, SIM_ENGINE_SM) &&
        sim_mem_accessible(ctx, out, nchunks * out_each, CU_MEM_ACCESS_FLAGS_PROT_READWRITE, SIM_ENGINE_SM)) {
        for (uint64_t c = 0; c < nchunks; c++) {
            uint64_t len = nbytes - c * CHUNK < CHUNK ? nbytes - c * CHUNK : CHUNK;
            each((const unsigned char *)base + c * CHUNK, len, (unsigned char *)out + c * out_each);
        }
        rc = CUDA_SUCCESS;
    }
    sim_mem_unlock();
    return rc;
}

static void digest_into(const unsigned char *p, uint64_t len, unsigned char *out)
{
    uint64_t h[2];
    chunk_digest(p, len, h);
    memcpy(out, h, sizeof(h));
}

static void zero_into(const unsigned char *p, uint64_t len, unsigned char *out) { *out = chunk_zero(p, len); }

CUresult sim_k_gpucr_digest(const struct sim_ctx *ctx, CUstream stream, void **params)
{
    (void)stream;
    return over_chunks(ctx, params, 16, digest_into);
}

CUresult sim_k_gpucr_zero_scan(const struct sim_ctx *ctx, CUstream stream, void **params)
{
    (void)stream;
    return over_chunks(ctx, params, 1, zero_into);
}

/* ---- over a table of ranges (gpucr_range in the .cu) ---- */

struct range {
    uint64_t base, nbytes, first;
};

#define TABLE_MAX ((uint64_t)1 << 24)   /* a sanity bound on the entries of one launch */

/* The entry of t[0..n) holding the table's chunk c: the last whose first is at most c (as on the GPU). */
static uint64_t locate(const struct range *t, uint64_t n, uint64_t c)
{
    uint64_t lo = 0, hi = n;
    while (hi - lo > 1) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (t[mid].first <= c)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* The launch's table (params 0 and 1), checked readable with every range in it, and the table's chunks
 * [*from, *to) it holds; the caller holds the memory lock. false: a bad address or size. */
static bool table_of(const struct sim_ctx *ctx, void **params, const struct range **t, uint64_t *n, uint64_t *from,
                     uint64_t *to)
{
    uintptr_t table = ARG(CUdeviceptr, 0);
    *n = ARG(unsigned long long, 1);
    if (*n > TABLE_MAX ||
        !sim_mem_accessible(ctx, table, *n * sizeof(struct range), CU_MEM_ACCESS_FLAGS_PROT_READ, SIM_ENGINE_SM))
        return false;
    *t = (const struct range *)table;
    for (uint64_t i = 0; i < *n; i++)
        if ((*t)[i].base % 16 || (*t)[i].nbytes > UINT64_MAX - CHUNK ||
            !sim_mem_accessible(ctx, (*t)[i].base, (*t)[i].nbytes, CU_MEM_ACCESS_FLAGS_PROT_READ, SIM_ENGINE_SM))
            return false;
    *from = *n ? (*t)[0].first : 0;
    *to = *n ? (*t)[*n - 1].first + ((*t)[*n - 1].nbytes + CHUNK - 1) / CHUNK : 0;
    return *to >= *from && *to <= UINT64_MAX / 16;
}

/* The chunk c of the table, as a kernel reads it: its bytes and length. */
static const unsigned char *table_chunk(const struct range *t, uint64_t n, uint64_t c, uint64_t *len)
{
    const struct range *r = &t[locate(t, n, c)];
    uint64_t k = c - r->first;
    *len = r->nbytes - k * CHUNK < CHUNK ? r->nbytes - k * CHUNK : CHUNK;
    return (const unsigned char *)r->base + k * CHUNK;
}

/* Whether the check's stream is ordered after every copy that touched the ranges it reads; else a line
 * on stderr and CUDA_ERROR_ILLEGAL_STATE. */
static CUresult check_ordered(CUstream stream, const struct range *t, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        if (!sim_vmm_work_ordered(stream, t[i].base, t[i].nbytes)) {
            fprintf(stderr, "simcuda: gpucr_check_table reads memory at %#llx that a copy not ordered before it may "
                            "still write: make its stream wait for the copies' events\n",
                    (unsigned long long)t[i].base);
            return CUDA_ERROR_ILLEGAL_STATE;
        }
    return CUDA_SUCCESS;
}

/* Chunk c's digest h against the expected one: a mismatch counted in result[0], the least c kept in result[1]. */
static void compare(uint64_t c, const uint64_t h[2], const unsigned char *expected, unsigned char *result)
{
    uint64_t want[2], res[2];
    memcpy(want, expected + 16 * c, sizeof(want));
    if (h[0] == want[0] && h[1] == want[1])
        return;
    memcpy(res, result, sizeof(res));
    res[0]++;
    res[1] = c < res[1] ? c : res[1];
    memcpy(result, res, sizeof(res));
}

/* A table kernel, as on the GPU: every chunk of the table digested, and then for the scan its zero flag and
 * digest written (params 2 and 3: flags, digests), for the check compared (params 2 and 3: expected digests,
 * the verdict). */
static CUresult over_table(const struct sim_ctx *ctx, CUstream stream, void **params, bool scan)
{
    uintptr_t a = ARG(CUdeviceptr, 2), b = ARG(CUdeviceptr, 3);
    const struct range *t = NULL;
    uint64_t n = 0, from = 0, to = 0;
    CUresult rc = CUDA_ERROR_ILLEGAL_ADDRESS;
    sim_mem_rdlock();
    if (table_of(ctx, params, &t, &n, &from, &to) &&
        sim_mem_accessible(ctx, scan ? a + from : a + 16 * from, scan ? to - from : 16 * (to - from),
                           scan ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_READ, SIM_ENGINE_SM) &&
        sim_mem_accessible(ctx, scan ? b + 16 * from : b, scan ? 16 * (to - from) : 16, CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                           SIM_ENGINE_SM))
        rc = scan ? CUDA_SUCCESS : check_ordered(stream, t, n);   /* a scan reads what copies out read too */
    for (uint64_t c = from; rc == CUDA_SUCCESS && c < to; c++) {
        uint64_t len, h[2];
        const unsigned char *p = table_chunk(t, n, c, &len);   /* len set before it is passed */
        chunk_digest(p, len, h);
        if (scan) {
            zero_into(p, len, (unsigned char *)a + c);
            memcpy((unsigned char *)b + 16 * c, h, sizeof(h));
        } else {
            compare(c, h, (const unsigned char *)a, (unsigned char *)b);
        }
    }
    sim_mem_unlock();
    return rc;
}

CUresult sim_k_gpucr_scan_table(const struct sim_ctx *ctx, CUstream stream, void **params)
{
    return over_table(ctx, stream, params, true);
}

CUresult sim_k_gpucr_check_table(const struct sim_ctx *ctx, CUstream stream, void **params)
{
    return over_table(ctx, stream, params, false);
}
