/*
 * gpucr's own kernels (native/kernels/gpucr_kernels.cu) on simulated device memory, so the CPU suite
 * runs gpucr's zero scan and chunk digest through the same driver calls as on a GPU. The digest
 * ("gpucr-d128") is defined in src/gpucr/dataplane/digest.py; this computes exactly that, and
 * tests/test_digest.py holds the two bit-equal.
 *
 * The module is gpucr's fatbin itself, as the loader hands it to cuModuleLoadData: recognised by the
 * fatbin header's magic and the names of both kernels inside it (scripts/build-kernels leaves it
 * uncompressed). Arguments and results as on the GPU: (base, nbytes, out), out one byte per 2 MiB
 * chunk (zero scan) or two little-endian u64 per chunk (digest).
 */
#define _GNU_SOURCE
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
    static const char *const names[] = {"gpucr_zero_scan", "gpucr_digest"};
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

CUresult sim_k_gpucr_digest(const struct sim_ctx *ctx, void **params)
{
    return over_chunks(ctx, params, 16, digest_into);
}

CUresult sim_k_gpucr_zero_scan(const struct sim_ctx *ctx, void **params)
{
    return over_chunks(ctx, params, 1, zero_into);
}
