/*
 * Device work: copies, memsets, streams, events, host functions, modules and builtin kernels.
 *
 * Everything runs synchronously on the calling thread at enqueue time, so an "async" call has
 * finished when it returns and every stream is always idle. Streams and events still exist as
 * objects with lifetimes, so handle misuse is caught. The per-thread-stream variants
 * (_ptds/_ptsz) behave exactly like the legacy ones (with synchronous work they are equal)
 * but are separate functions, so a caller can tell which one cuGetProcAddress handed out.
 * Variants call the shared static code, never another exported entry point: a call through
 * the PLT could land in an interposer (gpucr's agent) and be counted twice.
 *
 * Kernels come from two images: a pseudo-image, any NUL-terminated string starting
 * "simcuda-builtin", whose functions are the builtins below; and gpucr's own fatbin, whose
 * kernels run in C (gpucr_kernels.c). A kernel validates its pointer arguments like the copies
 * do, and fails with CUDA_ERROR_ILLEGAL_ADDRESS instead of faulting.
 *
 * Work runs in a context: the stream's, or the current one for the NULL and special streams.
 * Its device is the one whose access to the memory counts (sim_mem_accessible).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sys/uio.h>
#include <unistd.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "simcuda.h"

#define SIM_IMAGE_PREFIX "simcuda-builtin"

/* ---- builtin kernels: params[i] points at the i-th argument's value, as on CUDA ---- */

#define ARG(type, i) (*(const type *)params[i])

/* Whether a kernel in ctx reaches [p, p+n) with `need` access; caller holds the read lock. */
static bool reaches(const struct sim_ctx *ctx, uintptr_t p, size_t n, int need)
{
    return sim_mem_accessible(ctx, p, n, need, SIM_ENGINE_SM);
}

/* fill_u32 and add_u32: v written to, or added to, each of n 32-bit words at p */
static CUresult u32_kernel(const struct sim_ctx *ctx, void **params, bool add)
{
    uintptr_t p = ARG(CUdeviceptr, 0);
    unsigned v = ARG(unsigned, 1);
    unsigned long long n = ARG(unsigned long long, 2);
    CUresult rc = CUDA_ERROR_ILLEGAL_ADDRESS;
    sim_mem_rdlock();
    if (n <= SIZE_MAX / 4 && reaches(ctx, p, n * 4, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)) {
        for (uint32_t *q = (uint32_t *)p; n--; q++)
            *q = add ? *q + v : v;
        rc = CUDA_SUCCESS;
    }
    sim_mem_unlock();
    return rc;
}

static CUresult k_fill_u32(const struct sim_ctx *ctx, CUstream stream, void **params)
{
    (void)stream;
    return u32_kernel(ctx, params, false);
}

static CUresult k_add_u32(const struct sim_ctx *ctx, CUstream stream, void **params)
{
    (void)stream;
    return u32_kernel(ctx, params, true);
}

/* A long-running kernel: holds no lock, only its place in the API gate. */
static CUresult k_spin_ms(const struct sim_ctx *ctx, CUstream stream, void **params)
{
    (void)stream;
    (void)ctx;
    unsigned ms = ARG(unsigned, 0);
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
    return CUDA_SUCCESS;
}

static CUresult k_checksum_u32(const struct sim_ctx *ctx, CUstream stream, void **params)
{
    (void)stream;
    uintptr_t p = ARG(CUdeviceptr, 0);
    unsigned long long n = ARG(unsigned long long, 1);
    uintptr_t out = ARG(CUdeviceptr, 2);
    CUresult rc = CUDA_ERROR_ILLEGAL_ADDRESS;
    sim_mem_rdlock();
    if (n <= SIZE_MAX / 4 && reaches(ctx, p, n * 4, CU_MEM_ACCESS_FLAGS_PROT_READ) &&
        reaches(ctx, out, 8, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)) {
        uint64_t sum = 0;
        for (const uint32_t *q = (const uint32_t *)p; n--;)
            sum += *q++;
        memcpy((void *)out, &sum, sizeof(sum));
        rc = CUDA_SUCCESS;
    }
    sim_mem_unlock();
    return rc;
}

struct builtin {
    const char *name;
    unsigned nparams;
    CUresult (*run)(const struct sim_ctx *ctx, CUstream stream, void **params);
};

static const struct builtin builtins[] = {
    {"fill_u32", 3, k_fill_u32},
    {"add_u32", 3, k_add_u32},
    {"spin_ms", 1, k_spin_ms},
    {"checksum_u32", 3, k_checksum_u32},
};
#define NBUILTINS (sizeof(builtins) / sizeof(builtins[0]))

static const struct builtin gpucr_kernels[] = {
    {"gpucr_zero_scan", 3, sim_k_gpucr_zero_scan},
    {"gpucr_digest", 3, sim_k_gpucr_digest},
    {"gpucr_scan_table", 4, sim_k_gpucr_scan_table},
    {"gpucr_check_table", 4, sim_k_gpucr_check_table},
};
#define NGPUCR (sizeof(gpucr_kernels) / sizeof(gpucr_kernels[0]))
#define MAX_FUNCS (NBUILTINS > NGPUCR ? NBUILTINS : NGPUCR)

/* ---- objects ---- */

struct sim_stream {
    struct sim_stream *next;
    struct sim_ctx *ctx;
    unsigned flags;
    int priority;
};

struct sim_event {
    struct sim_event *next;
    struct sim_ctx *ctx;
    unsigned flags;
    bool recorded;
    struct sim_clock clock;   /* the order it recorded (order.c) */
    struct timespec when;
};

struct sim_func {
    struct sim_module *mod;
    const struct builtin *builtin;
};

struct sim_module {
    struct sim_module *next;
    struct sim_ctx *ctx;
    size_t nfuncs;   /* of the image's table: the builtins or gpucr's kernels */
    struct sim_func funcs[MAX_FUNCS];
};

static struct {
    pthread_mutex_t mu;
    struct sim_stream *streams;
    struct sim_event *events;
    struct sim_module *modules;
} ex = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* Unlinks obj from a singly linked list of any of the object types above (next comes first). */
#define LIST_REMOVE(head, obj)                                                                 \
    do {                                                                                       \
        for (__typeof__(head) *l_ = &(head); *l_; l_ = &(*l_)->next)                           \
            if (*l_ == (obj)) {                                                                \
                *l_ = (obj)->next;                                                             \
                break;                                                                         \
            }                                                                                  \
    } while (0)

#define LIST_CONTAINS(head, obj, found)                                                        \
    do {                                                                                       \
        found = false;                                                                         \
        for (__typeof__(head) x_ = (head); x_ && !found; x_ = x_->next)                        \
            found = x_ == (obj);                                                               \
    } while (0)

/* The context of stream s: cur for the NULL and special streams. */
static CUresult stream_ctx(CUstream s, struct sim_ctx *cur, struct sim_ctx **out)
{
    if (s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD) {
        *out = cur;
        return CUDA_SUCCESS;
    }
    bool found;
    pthread_mutex_lock(&ex.mu);
    LIST_CONTAINS(ex.streams, s, found);
    if (found)
        *out = s->ctx; /* never freed, so still safe to use if the stream goes meanwhile */
    pthread_mutex_unlock(&ex.mu);
    return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult sim_stream_check(CUstream s)
{
    struct sim_ctx *c;
    return stream_ctx(s, NULL, &c);
}

static bool event_known_locked(struct sim_event *e)
{
    bool found;
    LIST_CONTAINS(ex.events, e, found);
    return found;
}

void sim_exec_drop_ctx(struct sim_ctx *ctx)
{
    pthread_mutex_lock(&ex.mu);
    for (struct sim_stream **l = &ex.streams, *s; (s = *l);)
        if (s->ctx == ctx) {
            *l = s->next;
            sim_order_forget(s);   /* its order id free again: else ids run out and every stream shares one */
            free(s);
        } else {
            l = &s->next;
        }
    for (struct sim_event **l = &ex.events, *e; (e = *l);)
        if (e->ctx == ctx) {
            *l = e->next;
            free(e);
        } else {
            l = &e->next;
        }
    for (struct sim_module **l = &ex.modules, *m; (m = *l);)
        if (m->ctx == ctx) {
            *l = m->next;
            free(m);
        } else {
            l = &m->next;
        }
    pthread_mutex_unlock(&ex.mu);
}

/* The context and stream every piece of work needs; *ctx is the one the work runs in. */
static CUresult work_at(CUstream stream, struct sim_ctx **ctx, struct sim_pos *pos)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc == CUDA_SUCCESS) rc = stream_ctx(stream, c, ctx);
    if (rc == CUDA_SUCCESS) *pos = sim_order_op(stream);   /* its place in the stream's order */
    return rc;
}

static CUresult work_ctx(CUstream stream, struct sim_ctx **ctx)
{
    struct sim_pos p;
    return work_at(stream, ctx, &p);
}

static CUresult work_begin(CUstream stream)
{
    struct sim_ctx *c;
    return work_ctx(stream, &c);
}

/* ---- copies ---- */

enum side { SIDE_DEVICE, SIDE_HOST, SIDE_ANY };

/* A device side must be device (or pinned host) memory the copy's context reaches; a host
 * side is not checked, as the real driver does not; SIDE_ANY (cuMemcpy) is device if in the
 * arena. */
static bool side_ok(const struct sim_ctx *ctx, enum side side, uintptr_t p, size_t n, int need)
{
    if (side == SIDE_HOST || (side == SIDE_ANY && !sim_mem_in_arena(p)))
        return true;
    return sim_mem_accessible(ctx, p, n, need, SIM_ENGINE_COPY);
}

static bool host_side(enum side side, uintptr_t p)
{
    return side == SIDE_HOST || (side == SIDE_ANY && !sim_mem_in_arena(p));
}

/* A copy with a side in pinned host memory, as the driver's DMA does it: from and to the pages
 * themselves, never faulting the process. The driver keeps pinned pages even when their file is
 * truncated under it (the copy lands in pages the file no longer has); simcuda cannot hold pages a
 * file let go, so there the kernel copies (process_vm_writev on ourselves) and a page that is gone
 * fails the copy with an error instead of a SIGBUS. */
static CUresult copy_pinned(uintptr_t dst, uintptr_t src, size_t n)
{
    struct iovec from = {(void *)src, n}, to = {(void *)dst, n};
    ssize_t done = process_vm_writev(getpid(), &from, 1, &to, 1, 0);
    if (done == (ssize_t)n)
        return CUDA_SUCCESS;
    if (done < 0 && (errno == ENOSYS || errno == EPERM)) {   /* a sandbox without it: as pageable memory */
        memmove((void *)dst, (const void *)src, n);
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_ILLEGAL_ADDRESS;
}

static bool pinned_side_locked(enum side side, uintptr_t p, size_t n)
{
    return host_side(side, p) && sim_mem_host_pinned_locked(p, n);
}

/* dctx and sctx: the contexts reaching each side (the work's own context but for
 * cuMemcpyPeer). */
static CUresult copy_in(const struct sim_ctx *dctx, uintptr_t dst, enum side dside, const struct sim_ctx *sctx,
                        uintptr_t src, enum side sside, size_t n)
{
    CUresult rc = CUDA_SUCCESS;
    sim_mem_rdlock();
    if (side_ok(dctx, dside, dst, n, CU_MEM_ACCESS_FLAGS_PROT_READWRITE) &&
        side_ok(sctx, sside, src, n, CU_MEM_ACCESS_FLAGS_PROT_READ)) {
        if (pinned_side_locked(dside, dst, n) || pinned_side_locked(sside, src, n))
            rc = copy_pinned(dst, src, n);
        else
            memmove((void *)dst, (const void *)src, n);
    } else
        rc = CUDA_ERROR_INVALID_VALUE;
    sim_mem_unlock();
    return rc;
}

static CUresult copy_at(uintptr_t dst, enum side dside, uintptr_t src, enum side sside, size_t n, CUstream stream,
                        struct sim_pos *pos)
{
    struct sim_ctx *c;
    CUresult rc = work_at(stream, &c, pos);
    if (rc != CUDA_SUCCESS || n == 0)
        return rc;
    return copy_in(c, dst, dside, c, src, sside, n);
}

/* A synchronous copy (on the legacy stream) returns once done, and so once the work before it on that
 * stream is: the host has seen it all complete. */
static CUresult copy(uintptr_t dst, enum side dside, uintptr_t src, enum side sside, size_t n, CUstream stream)
{
    struct sim_pos p;
    CUresult rc = copy_at(dst, dside, src, sside, n, stream, &p);
    if (rc == CUDA_SUCCESS) sim_order_sync_stream(stream);
    return rc;
}

/* Each side is reached by its own context's device; a copy engine needs no peer access. */
static CUresult copy_peer_at(uintptr_t dst, CUcontext dctx, uintptr_t src, CUcontext sctx, size_t n, CUstream stream,
                             struct sim_pos *pos)
{
    struct sim_ctx *c;
    CUresult rc = work_at(stream, &c, pos);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!sim_ctx_is_live(dctx) || !sim_ctx_is_live(sctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    return n == 0 ? CUDA_SUCCESS : copy_in(dctx, dst, SIDE_DEVICE, sctx, src, SIDE_DEVICE, n);
}

static CUresult copy_peer(uintptr_t dst, CUcontext dctx, uintptr_t src, CUcontext sctx, size_t n, CUstream stream)
{
    struct sim_pos p;
    CUresult rc = copy_peer_at(dst, dctx, src, sctx, n, stream, &p);
    if (rc == CUDA_SUCCESS) sim_order_sync_stream(stream);
    return rc;
}

/* An asynchronous copy is done when the host has seen it done, not when it returns (simcuda runs it at
 * once, but a GPU does not): the memory it touches remembers its place in the stream's order, and is
 * not unmapped before that (sim_vmm_unmap; the server's data plane once could have). */
static CUresult noted(CUresult rc, uintptr_t dst, uintptr_t src, size_t n, struct sim_pos p)
{
    if (rc == CUDA_SUCCESS && n) {
        sim_vmm_note_work(dst, n, p);
        sim_vmm_note_work(src, n, p);
    }
    return rc;
}

/* simcudaPageableAsyncCopies: asynchronous copies whose host side is not inside one pinned range */
static _Atomic unsigned long long pageable_async;

static CUresult copy_async(uintptr_t dst, enum side dside, uintptr_t src, enum side sside, size_t n, CUstream stream)
{
    struct sim_pos p;
    CUresult rc = noted(copy_at(dst, dside, src, sside, n, stream, &p), dst, src, n, p);
    if (rc == CUDA_SUCCESS && n && ((host_side(dside, dst) && !sim_mem_host_pinned(dst, n)) ||
                                    (host_side(sside, src) && !sim_mem_host_pinned(src, n))))
        pageable_async++;
    return rc;
}

SIMAPI CUresult simcudaPageableAsyncCopies(unsigned long long *n)
{
    if (!n)
        return CUDA_ERROR_INVALID_VALUE;
    *n = pageable_async;
    return CUDA_SUCCESS;
}

static CUresult copy_peer_async(uintptr_t dst, CUcontext dctx, uintptr_t src, CUcontext sctx, size_t n, CUstream stream)
{
    struct sim_pos p;
    return noted(copy_peer_at(dst, dctx, src, sctx, n, stream, &p), dst, src, n, p);
}

#define U(p) ((uintptr_t)(p))

SIMAPI CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount)
{
    SIM_GATED(copy(U(dst), SIDE_ANY, U(src), SIDE_ANY, ByteCount, NULL));
}
SIMAPI CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount)
{
    SIM_GATED(copy(U(dst), SIDE_ANY, U(src), SIDE_ANY, ByteCount, NULL));
}

SIMAPI CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream)
{
    if (sim_fault_injected("cuMemcpyAsync"))
        return CUDA_ERROR_UNKNOWN;
    SIM_GATED(copy_async(U(dst), SIDE_ANY, U(src), SIDE_ANY, ByteCount, hStream));
}
SIMAPI CUresult cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream)
{
    SIM_GATED(copy_async(U(dst), SIDE_ANY, U(src), SIDE_ANY, ByteCount, hStream));
}

SIMAPI CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
{
    SIM_GATED(copy(U(dstDevice), SIDE_DEVICE, U(srcHost), SIDE_HOST, ByteCount, NULL));
}
SIMAPI CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
{
    SIM_GATED(copy(U(dstDevice), SIDE_DEVICE, U(srcHost), SIDE_HOST, ByteCount, NULL));
}

SIMAPI CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    SIM_GATED(copy(U(dstHost), SIDE_HOST, U(srcDevice), SIDE_DEVICE, ByteCount, NULL));
}
SIMAPI CUresult cuMemcpyDtoH_v2_ptds(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    SIM_GATED(copy(U(dstHost), SIDE_HOST, U(srcDevice), SIDE_DEVICE, ByteCount, NULL));
}

SIMAPI CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount)
{
    SIM_GATED(copy(U(dstDevice), SIDE_DEVICE, U(srcDevice), SIDE_DEVICE, ByteCount, NULL));
}
SIMAPI CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount)
{
    SIM_GATED(copy(U(dstDevice), SIDE_DEVICE, U(srcDevice), SIDE_DEVICE, ByteCount, NULL));
}

SIMAPI CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount, CUstream hStream)
{
    SIM_GATED(copy_async(U(dstDevice), SIDE_DEVICE, U(srcHost), SIDE_HOST, ByteCount, hStream));
}
SIMAPI CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                          CUstream hStream)
{
    SIM_GATED(copy_async(U(dstDevice), SIDE_DEVICE, U(srcHost), SIDE_HOST, ByteCount, hStream));
}

SIMAPI CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream)
{
    SIM_GATED(copy_async(U(dstHost), SIDE_HOST, U(srcDevice), SIDE_DEVICE, ByteCount, hStream));
}
SIMAPI CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream)
{
    SIM_GATED(copy_async(U(dstHost), SIDE_HOST, U(srcDevice), SIDE_DEVICE, ByteCount, hStream));
}

SIMAPI CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream)
{
    SIM_GATED(copy_async(U(dstDevice), SIDE_DEVICE, U(srcDevice), SIDE_DEVICE, ByteCount, hStream));
}
SIMAPI CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                          CUstream hStream)
{
    SIM_GATED(copy_async(U(dstDevice), SIDE_DEVICE, U(srcDevice), SIDE_DEVICE, ByteCount, hStream));
}

SIMAPI CUresult cuMemcpyPeer(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice, CUcontext srcContext,
                             size_t ByteCount)
{
    SIM_GATED(copy_peer(U(dstDevice), dstContext, U(srcDevice), srcContext, ByteCount, NULL));
}
SIMAPI CUresult cuMemcpyPeer_ptds(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                                  CUcontext srcContext, size_t ByteCount)
{
    SIM_GATED(copy_peer(U(dstDevice), dstContext, U(srcDevice), srcContext, ByteCount, NULL));
}

SIMAPI CUresult cuMemcpyPeerAsync(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                                  CUcontext srcContext, size_t ByteCount, CUstream hStream)
{
    SIM_GATED(copy_peer_async(U(dstDevice), dstContext, U(srcDevice), srcContext, ByteCount, hStream));
}
SIMAPI CUresult cuMemcpyPeerAsync_ptsz(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                                       CUcontext srcContext, size_t ByteCount, CUstream hStream)
{
    SIM_GATED(copy_peer_async(U(dstDevice), dstContext, U(srcDevice), srcContext, ByteCount, hStream));
}

/* ---- memsets ---- */

/* A memset runs on the device like a kernel: no unified-addressing reach into other devices. *pos: its
 * place in the stream's order. */
static CUresult memset_at(uintptr_t dst, uint32_t value, unsigned elem, size_t n, CUstream stream, struct sim_pos *pos)
{
    struct sim_ctx *c;
    CUresult rc = work_at(stream, &c, pos);
    if (rc != CUDA_SUCCESS || n == 0)
        return rc;
    if (dst % elem != 0 || n > SIZE_MAX / elem)
        return CUDA_ERROR_INVALID_VALUE;
    sim_mem_rdlock();
    if (!sim_mem_accessible(c, dst, n * elem, CU_MEM_ACCESS_FLAGS_PROT_READWRITE, SIM_ENGINE_SM))
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (elem == 1)
        memset((void *)dst, (int)value, n);
    else if (elem == 2)
        for (uint16_t *p = (uint16_t *)dst; n--;)
            *p++ = (uint16_t)value;
    else
        for (uint32_t *p = (uint32_t *)dst; n--;)
            *p++ = value;
    sim_mem_unlock();
    return rc;
}

static CUresult memset_n(uintptr_t dst, uint32_t value, unsigned elem, size_t n, CUstream stream)
{
    struct sim_pos p;
    return memset_at(dst, value, elem, n, stream, &p);
}

/* An asynchronous memset, like an asynchronous copy, is remembered by the memory it writes: not unmapped, nor
 * read by gpucr's check, before it is ordered first (noted). */
static CUresult memset_async(uintptr_t dst, uint32_t value, unsigned elem, size_t n, CUstream stream)
{
    struct sim_pos p;
    CUresult rc = memset_at(dst, value, elem, n, stream, &p);
    if (rc == CUDA_SUCCESS && n)
        sim_vmm_note_work(dst, n * elem, p);
    return rc;
}

SIMAPI CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N) { SIM_GATED(memset_n(U(dstDevice), uc, 1, N, NULL)); }
SIMAPI CUresult cuMemsetD8_v2_ptds(CUdeviceptr dstDevice, unsigned char uc, size_t N) { SIM_GATED(memset_n(U(dstDevice), uc, 1, N, NULL)); }
SIMAPI CUresult cuMemsetD16_v2(CUdeviceptr dstDevice, unsigned short us, size_t N) { SIM_GATED(memset_n(U(dstDevice), us, 2, N, NULL)); }
SIMAPI CUresult cuMemsetD16_v2_ptds(CUdeviceptr dstDevice, unsigned short us, size_t N) { SIM_GATED(memset_n(U(dstDevice), us, 2, N, NULL)); }
SIMAPI CUresult cuMemsetD32_v2(CUdeviceptr dstDevice, unsigned int ui, size_t N) { SIM_GATED(memset_n(U(dstDevice), ui, 4, N, NULL)); }
SIMAPI CUresult cuMemsetD32_v2_ptds(CUdeviceptr dstDevice, unsigned int ui, size_t N) { SIM_GATED(memset_n(U(dstDevice), ui, 4, N, NULL)); }

SIMAPI CUresult cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream)
{
    SIM_GATED(memset_async(U(dstDevice), uc, 1, N, hStream));
}
SIMAPI CUresult cuMemsetD8Async_ptsz(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream)
{
    SIM_GATED(memset_async(U(dstDevice), uc, 1, N, hStream));
}
SIMAPI CUresult cuMemsetD16Async(CUdeviceptr dstDevice, unsigned short us, size_t N, CUstream hStream)
{
    SIM_GATED(memset_async(U(dstDevice), us, 2, N, hStream));
}
SIMAPI CUresult cuMemsetD16Async_ptsz(CUdeviceptr dstDevice, unsigned short us, size_t N, CUstream hStream)
{
    SIM_GATED(memset_async(U(dstDevice), us, 2, N, hStream));
}
SIMAPI CUresult cuMemsetD32Async(CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream)
{
    SIM_GATED(memset_async(U(dstDevice), ui, 4, N, hStream));
}
SIMAPI CUresult cuMemsetD32Async_ptsz(CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream)
{
    SIM_GATED(memset_async(U(dstDevice), ui, 4, N, hStream));
}

/* ---- streams ---- */

static CUresult stream_create(CUstream *ph, unsigned flags, int priority)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!ph || (flags & ~1u)) /* CU_STREAM_DEFAULT or CU_STREAM_NON_BLOCKING */
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_stream *s = malloc(sizeof(*s));
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&ex.mu);
    *s = (struct sim_stream){.next = ex.streams, .ctx = c, .flags = flags, .priority = priority};
    ex.streams = s;
    pthread_mutex_unlock(&ex.mu);
    *ph = s;
    return CUDA_SUCCESS;
}
SIMAPI CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags) { SIM_GATED(stream_create(phStream, Flags, 0)); }
SIMAPI CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority)
{
    SIM_GATED(stream_create(phStream, flags, priority));
}

static CUresult stream_destroy(CUstream s)
{
    bool found;
    pthread_mutex_lock(&ex.mu);
    LIST_CONTAINS(ex.streams, s, found);
    if (found)
        LIST_REMOVE(ex.streams, s);
    pthread_mutex_unlock(&ex.mu);
    if (!found)
        return CUDA_ERROR_INVALID_HANDLE;
    sim_order_forget(s);
    free(s);
    return CUDA_SUCCESS;
}
SIMAPI CUresult cuStreamDestroy_v2(CUstream hStream) { SIM_GATED(stream_destroy(hStream)); }
SIMAPI CUresult cuStreamDestroy(CUstream hStream) { SIM_GATED(stream_destroy(hStream)); }

/* Work is done when enqueued, so synchronize and query succeed for any valid stream; the host
 * has then seen the stream's work complete (order.c), and pools may give memory back. */
static CUresult stream_sync(CUstream s)
{
    CUresult rc = work_begin(s);
    if (rc == CUDA_SUCCESS) {
        sim_order_sync_stream(s);
        sim_pool_after_sync();
    }
    return rc;
}
static CUresult stream_query(CUstream s)
{
    CUresult rc = work_begin(s);
    if (rc == CUDA_SUCCESS) sim_order_sync_stream(s);
    return rc;
}
SIMAPI CUresult cuStreamSynchronize(CUstream hStream) { SIM_UNHELD(stream_sync(hStream)); }
SIMAPI CUresult cuStreamSynchronize_ptsz(CUstream hStream) { SIM_UNHELD(stream_sync(hStream)); }
SIMAPI CUresult cuStreamQuery(CUstream hStream) { SIM_UNHELD(stream_query(hStream)); }
SIMAPI CUresult cuStreamQuery_ptsz(CUstream hStream) { SIM_UNHELD(stream_query(hStream)); }

static CUresult stream_is_capturing(CUstream s, int *status)
{
    CUresult rc = status ? sim_stream_check(s) : CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS) *status = sim_graph_capture_status(s);
    return rc;
}
SIMAPI CUresult cuStreamIsCapturing(CUstream hStream, int *captureStatus) { SIM_GATED(stream_is_capturing(hStream, captureStatus)); }
SIMAPI CUresult cuStreamIsCapturing_ptsz(CUstream hStream, int *captureStatus)
{
    SIM_GATED(stream_is_capturing(hStream, captureStatus));
}

static CUresult launch_host_func(CUstream stream, CUhostFn fn, void *user_data)
{
    CUresult rc = work_begin(stream);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!fn)
        return CUDA_ERROR_INVALID_VALUE;
    fn(user_data); /* no lock held: the function may call the API (the gate allows nesting) */
    return CUDA_SUCCESS;
}
SIMAPI CUresult cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData)
{
    SIM_GATED(launch_host_func(hStream, fn, userData));
}
SIMAPI CUresult cuLaunchHostFunc_ptsz(CUstream hStream, CUhostFn fn, void *userData)
{
    SIM_GATED(launch_host_func(hStream, fn, userData));
}

/* ---- events ---- */

static CUresult event_create(CUevent *ph, unsigned flags)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!ph || (flags & ~0x7u)) /* BLOCKING_SYNC | DISABLE_TIMING | INTERPROCESS */
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_event *e = malloc(sizeof(*e));
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&ex.mu);
    *e = (struct sim_event){.next = ex.events, .ctx = c, .flags = flags};
    ex.events = e;
    pthread_mutex_unlock(&ex.mu);
    *ph = e;
    return CUDA_SUCCESS;
}
SIMAPI CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags) { SIM_GATED(event_create(phEvent, Flags)); }

static CUresult event_record(CUevent e, CUstream stream)
{
    CUresult rc = work_begin(stream);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&ex.mu);
    if (event_known_locked(e)) {
        clock_gettime(CLOCK_MONOTONIC, &e->when);
        e->recorded = true;
        sim_order_record(&e->clock, stream);
    } else {
        rc = CUDA_ERROR_INVALID_HANDLE;
    }
    pthread_mutex_unlock(&ex.mu);
    return rc;
}
SIMAPI CUresult cuEventRecord(CUevent hEvent, CUstream hStream) { SIM_GATED(event_record(hEvent, hStream)); }
SIMAPI CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream) { SIM_GATED(event_record(hEvent, hStream)); }

static CUresult event_synchronize(CUevent e)
{
    pthread_mutex_lock(&ex.mu);
    bool known = event_known_locked(e);
    if (known) sim_order_sync_clock(&e->clock);
    pthread_mutex_unlock(&ex.mu);
    if (known) sim_pool_after_sync();
    return known ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}
SIMAPI CUresult cuEventSynchronize(CUevent hEvent) { SIM_UNHELD(event_synchronize(hEvent)); }

/* Complete once the host has seen what it recorded complete (order.c: completion is observed at
 * synchronize points), so a caller must be ready for CUDA_ERROR_NOT_READY, as on a GPU. */
static CUresult event_query(CUevent e)
{
    pthread_mutex_lock(&ex.mu);
    CUresult rc = !event_known_locked(e) ? CUDA_ERROR_INVALID_HANDLE
                  : sim_order_done(&e->clock) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
    pthread_mutex_unlock(&ex.mu);
    return rc;
}
SIMAPI CUresult cuEventQuery(CUevent hEvent) { SIM_UNHELD(event_query(hEvent)); }

static CUresult stream_wait_event(CUstream s, CUevent e, unsigned flags)
{
    if (flags & ~1u) /* CU_EVENT_WAIT_DEFAULT or CU_EVENT_WAIT_EXTERNAL */
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = work_begin(s);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&ex.mu);
    if (!event_known_locked(e))
        rc = CUDA_ERROR_INVALID_HANDLE;
    else if (e->recorded)   /* an event never recorded is complete: nothing to wait for */
        sim_order_wait(s, &e->clock);
    pthread_mutex_unlock(&ex.mu);
    return rc;
}
SIMAPI CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags) { SIM_GATED(stream_wait_event(hStream, hEvent, Flags)); }
SIMAPI CUresult cuStreamWaitEvent_ptsz(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    SIM_GATED(stream_wait_event(hStream, hEvent, Flags));
}

static CUresult event_destroy(CUevent e)
{
    pthread_mutex_lock(&ex.mu);
    bool known = event_known_locked(e);
    if (known)
        LIST_REMOVE(ex.events, e);
    pthread_mutex_unlock(&ex.mu);
    if (known)
        free(e);
    return known ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}
SIMAPI CUresult cuEventDestroy_v2(CUevent hEvent) { SIM_GATED(event_destroy(hEvent)); }
SIMAPI CUresult cuEventDestroy(CUevent hEvent) { SIM_GATED(event_destroy(hEvent)); }

static CUresult event_elapsed(float *ms, CUevent start, CUevent end)
{
    if (!ms)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&ex.mu);
    if (event_known_locked(start) && event_known_locked(end) && start->recorded && end->recorded &&
        !((start->flags | end->flags) & CU_EVENT_DISABLE_TIMING)) {
        *ms = (float)((double)(end->when.tv_sec - start->when.tv_sec) * 1e3 +
                      (double)(end->when.tv_nsec - start->when.tv_nsec) / 1e6);
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&ex.mu);
    return rc;
}
SIMAPI CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    SIM_GATED(event_elapsed(pMilliseconds, hStart, hEnd));
}
SIMAPI CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    SIM_GATED(event_elapsed(pMilliseconds, hStart, hEnd));
}

/* ---- modules and launches ---- */

static CUresult module_load_data(CUmodule *pmod, const void *image)
{
    struct sim_ctx *c;
    CUresult rc = sim_ctx_current(&c);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pmod || !image)
        return CUDA_ERROR_INVALID_VALUE;
    const struct builtin *table = builtins;
    size_t n = NBUILTINS;
    if (strncmp((const char *)image, SIM_IMAGE_PREFIX, strlen(SIM_IMAGE_PREFIX)) != 0) {
        if (!sim_gpucr_image(image))
            return CUDA_ERROR_INVALID_IMAGE; /* another cubin/PTX/fatbin: simcuda runs no GPU code */
        table = gpucr_kernels;
        n = NGPUCR;
    }
    struct sim_module *m = calloc(1, sizeof(*m));
    if (!m)
        return CUDA_ERROR_OUT_OF_MEMORY;
    m->ctx = c;
    m->nfuncs = n;
    for (size_t i = 0; i < n; i++)
        m->funcs[i] = (struct sim_func){.mod = m, .builtin = &table[i]};
    SIM_PUSH_LOCKED(&ex.mu, ex.modules, m);
    *pmod = m;
    return CUDA_SUCCESS;
}
SIMAPI CUresult cuModuleLoadData(CUmodule *module, const void *image) { SIM_GATED(module_load_data(module, image)); }

static CUresult module_get_function(CUfunction *pf, CUmodule mod, const char *name)
{
    if (!pf || !name)
        return CUDA_ERROR_INVALID_VALUE;
    bool found;
    CUresult rc = CUDA_ERROR_NOT_FOUND;
    pthread_mutex_lock(&ex.mu);
    LIST_CONTAINS(ex.modules, mod, found);
    if (!found)
        rc = CUDA_ERROR_INVALID_HANDLE;
    for (size_t i = 0; found && i < mod->nfuncs; i++)
        if (strcmp(mod->funcs[i].builtin->name, name) == 0) {
            *pf = &mod->funcs[i];
            rc = CUDA_SUCCESS;
            break;
        }
    pthread_mutex_unlock(&ex.mu);
    return rc;
}
SIMAPI CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
    SIM_GATED(module_get_function(hfunc, hmod, name));
}

static CUresult module_unload(CUmodule mod)
{
    bool found;
    pthread_mutex_lock(&ex.mu);
    LIST_CONTAINS(ex.modules, mod, found);
    if (found)
        LIST_REMOVE(ex.modules, mod);
    pthread_mutex_unlock(&ex.mu);
    if (!found)
        return CUDA_ERROR_INVALID_HANDLE;
    free(mod);
    return CUDA_SUCCESS;
}
SIMAPI CUresult cuModuleUnload(CUmodule hmod) { SIM_GATED(module_unload(hmod)); }

/* The builtin behind a function handle, if its module is still loaded. */
static const struct builtin *function_builtin(CUfunction f)
{
    const struct builtin *b = NULL;
    pthread_mutex_lock(&ex.mu);
    for (struct sim_module *m = ex.modules; m && !b; m = m->next)
        if (f >= &m->funcs[0] && f < &m->funcs[m->nfuncs])
            b = f->builtin;
    pthread_mutex_unlock(&ex.mu);
    return b;
}

static CUresult launch_kernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                              unsigned bz, CUstream stream, void **params, void **extra)
{
    struct sim_ctx *c;
    CUresult rc = work_ctx(stream, &c);
    if (rc != CUDA_SUCCESS)
        return rc;
    const struct builtin *b = function_builtin(f);
    if (!b)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!gx || !gy || !gz || !bx || !by || !bz || (uint64_t)bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    if (!params)
        return extra ? CUDA_ERROR_NOT_SUPPORTED : CUDA_ERROR_INVALID_VALUE; /* no packed-buffer launches */
    for (unsigned i = 0; i < b->nparams; i++)
        if (!params[i])
            return CUDA_ERROR_INVALID_VALUE;
    /* The grid shape does not matter: a builtin does all of its work in one call. No lock is
     * held here, so a long kernel only occupies its place in the API gate. */
    return b->run(c, stream, params);
}
SIMAPI CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                               unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                               unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra)
{
    (void)sharedMemBytes;
    SIM_GATED(launch_kernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, kernelParams,
                            extra));
}
SIMAPI CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                    unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                    unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                    void **kernelParams, void **extra)
{
    (void)sharedMemBytes;
    SIM_GATED(launch_kernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, kernelParams,
                            extra));
}
