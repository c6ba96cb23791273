/*
 * Simulated device memory.
 *
 * Device pointers are host addresses inside one big PROT_NONE reservation (the arena), so a
 * device pointer keeps its value across checkpoint/restore exactly as on a real GPU, and
 * copies are plain memcpy once the range has been validated. The VMM model is the driver's:
 *   reservation  a VA range handed out from the arena (first fit, 2 MiB granules)
 *   physical     a memfd of whole granules, named by a small handle id never reused; memory made
 *                with the POSIX-fd handle type is an object of objects.c instead, which lives
 *                while any process holds a handle or an exported fd of it, as on the driver
 *   mapping      physical memory mmap'ed MAP_SHARED|MAP_FIXED into a reservation, PROT_NONE
 *                until cuMemSetAccess, so code that forgets SetAccess faults as on a GPU.
 *                Access is kept per device; the host view is the union of all devices' access.
 * cuMemAlloc & co. are the same three steps done internally ("owned" reservations); they are
 * accessible from their context's device and from contexts with peer access to it.
 * Physical memory is freed when its handle is released and nothing maps it any more.
 *
 * All of this is under one rwlock: copies and kernels hold it shared while they touch memory,
 * so nothing is unmapped under them; everything that changes the maps holds it exclusive.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "simcuda.h"

/* Data regions of a memfd saved at checkpoint; untouched (hole) pages are neither copied nor
 * re-created, so a large, mostly unwritten allocation costs no host memory while saved. */
struct sim_run {
    size_t off, len;
};

struct sim_phys {
    struct sim_phys *next;
    CUmemGenericAllocationHandle id;
    size_t size; /* whole granules */
    int fd;      /* memfd; -1 while checkpointed, and for an object (opened only while used: phys_fd) */
    int device;
    uint64_t obj;  /* objects.c's id when exportable as a POSIX fd (0: a private memfd) */
    int obj_phys;  /* the physical GPU the object is on */
    bool imported; /* from another handle's export: the driver will not export it again */
    CUmemAllocationProp prop;
    unsigned handle_refs; /* create/import: 1; +1 per retain; -1 per release */
    unsigned map_count;
    size_t charged; /* bytes charged to accounting: size, or 0 when imported (the exporter pays) */
    void *saved;    /* checkpoint copy: a private mapping of size bytes */
    struct sim_run *runs;
    size_t nruns;
};

struct sim_alloc;

/* An fd of ph's memory for one use (close it with phys_fd_done): a memfd stays open, an object's
 * data is opened anew. -1: gone. */
static int phys_fd(const struct sim_phys *ph)
{
    return ph->obj ? sim_obj_data(ph->obj, ph->obj_phys) : ph->fd;
}

static void phys_fd_done(const struct sim_phys *ph, int fd)
{
    if (ph->obj && fd >= 0)
        close(fd);
}


struct sim_resv {
    struct sim_resv *next;
    uintptr_t va;
    size_t size;
    struct sim_alloc *owner; /* non-NULL: made by cuMemAlloc & co., not by the application */
};

struct sim_alloc {
    struct sim_alloc *next;
    uintptr_t va;
    size_t size; /* as requested: what cuMemGetAddressRange reports */
    enum sim_alloc_kind kind;
    struct sim_ctx *ctx;
    struct sim_resv *resv;
    struct sim_phys *phys;
};

struct sim_map {
    uintptr_t va;
    size_t size;
    size_t offset;
    struct sim_phys *phys;
    struct sim_alloc *owner;
    struct sim_ctx *ctx;
    struct sim_pos work[SIM_MAP_WORK]; /* the last asynchronous copy touching it per stream (seq 0: none) */
    unsigned char prot[]; /* CU_MEM_ACCESS_FLAGS_PROT_* per granule and device: see map_access */
};

/* cuCtxEnablePeerAccess: ctx reaches peer's cuMemAlloc-family memory. Kept here, not with the
 * contexts, because accessibility is decided under the memory lock. */
struct sim_peer {
    struct sim_peer *next;
    const struct sim_ctx *ctx, *peer;
};

struct sim_host {
    struct sim_host *next;
    uintptr_t p;
    size_t size;
    bool allocated; /* by cuMemAllocHost/cuMemHostAlloc (we unmap it) rather than registered */
    struct sim_ctx *ctx;
};

struct sim_extent {
    struct sim_extent *next;
    uintptr_t start;
    size_t size;
};

static struct {
    pthread_rwlock_t lock;
    uintptr_t base;
    size_t size;
    struct sim_extent *free; /* sorted by address, coalesced */
    struct sim_resv *resvs;
    struct sim_phys *phys;
    struct sim_alloc *allocs;
    struct sim_host *hosts;
    struct sim_map **maps; /* sorted by va, non-overlapping */
    struct sim_peer *peers;
    size_t nmaps, cap;
    CUmemGenericAllocationHandle next_id;
    bool checkpointed;
} mem = {.lock = PTHREAD_RWLOCK_INITIALIZER};

void sim_mem_rdlock(void) { pthread_rwlock_rdlock(&mem.lock); }
void sim_mem_unlock(void) { pthread_rwlock_unlock(&mem.lock); }
static void wrlock(void) { pthread_rwlock_wrlock(&mem.lock); }

bool sim_mem_in_arena(uintptr_t p) { return p >= mem.base && p - mem.base < mem.size; }

/* ---- the arena and its free list ---- */

CUresult sim_mem_init(void)
{
    /* 1 TiB of address space costs nothing with MAP_NORESERVE; halve until the system lets us
     * have it (a ulimit -v, a small VA on some sandboxes). Over-reserve one granule and trim
     * so the arena, and thus every device pointer, is 2 MiB aligned. */
    for (size_t size = 1ull << 40; size >= 1ull << 30; size >>= 1) {
        size_t len = size + SIM_GRANULE;
        void *p = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED)
            continue;
        uintptr_t raw = (uintptr_t)p, base = sim_round_up(raw, SIM_GRANULE);
        if (base > raw)
            munmap(p, base - raw);
        if (raw + len > base + size)
            munmap((void *)(base + size), raw + len - (base + size));
        struct sim_extent *e = malloc(sizeof(*e));
        if (!e) {
            munmap((void *)base, size);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        *e = (struct sim_extent){.start = base, .size = size};
        mem.base = base;
        mem.size = size;
        mem.free = e;
        return CUDA_SUCCESS;
    }
    fprintf(stderr, "simcuda: cannot reserve address space for device memory\n");
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* Cuts [a, a+size) out of free extent *link (which contains it). */
static CUresult extent_cut(struct sim_extent **link, uintptr_t a, size_t size)
{
    struct sim_extent *e = *link;
    uintptr_t end = e->start + e->size;
    size_t pre = a - e->start, post = end - (a + size);
    if (pre && post) {
        struct sim_extent *tail = malloc(sizeof(*tail));
        if (!tail)
            return CUDA_ERROR_OUT_OF_MEMORY;
        *tail = (struct sim_extent){.next = e->next, .start = a + size, .size = post};
        e->size = pre;
        e->next = tail;
    } else if (pre) {
        e->size = pre;
    } else if (post) {
        e->start = a + size;
        e->size = post;
    } else {
        *link = e->next;
        free(e);
    }
    return CUDA_SUCCESS;
}

/* Takes size bytes of VA: at hint if that range is free, else the first fit with align. */
static CUresult va_take(uintptr_t hint, size_t size, size_t align, uintptr_t *out)
{
    if (hint && hint % align == 0) {
        for (struct sim_extent **l = &mem.free; *l; l = &(*l)->next)
            if (hint >= (*l)->start && hint - (*l)->start <= (*l)->size && size <= (*l)->start + (*l)->size - hint) {
                *out = hint;
                return extent_cut(l, hint, size);
            }
    }
    for (struct sim_extent **l = &mem.free; *l; l = &(*l)->next) {
        uintptr_t a = sim_round_up((*l)->start, align), end = (*l)->start + (*l)->size;
        if (a < end && size <= end - a) {
            *out = a;
            return extent_cut(l, a, size);
        }
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static void va_give(uintptr_t start, size_t size)
{
    struct sim_extent **l = &mem.free, *prev = NULL;
    while (*l && (*l)->start < start) {
        prev = *l;
        l = &(*l)->next;
    }
    struct sim_extent *next = *l;
    if (prev && prev->start + prev->size == start) {
        prev->size += size;
        if (next && start + size == next->start) {
            prev->size += next->size;
            prev->next = next->next;
            free(next);
        }
    } else if (next && start + size == next->start) {
        next->start = start;
        next->size += size;
    } else {
        struct sim_extent *e = malloc(sizeof(*e));
        if (!e) /* the range stays PROT_NONE and unused: a leak of address space only */
            return;
        *e = (struct sim_extent){.next = next, .start = start, .size = size};
        *l = e;
    }
}

static struct sim_resv *resv_containing(uintptr_t va, size_t size)
{
    for (struct sim_resv *r = mem.resvs; r; r = r->next)
        if (va >= r->va && va - r->va < r->size && size <= r->va + r->size - va)
            return r;
    return NULL;
}

static void resv_remove(struct sim_resv *r)
{
    for (struct sim_resv **l = &mem.resvs; *l; l = &(*l)->next)
        if (*l == r) {
            *l = r->next;
            break;
        }
    va_give(r->va, r->size);
    free(r);
}

/* Puts a fresh PROT_NONE reservation over [va, va+size): what an unmapped range looks like. */
static bool reserve_fixed(uintptr_t va, size_t size)
{
    return mmap((void *)va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) !=
           MAP_FAILED;
}

/* ---- the sorted mapping table ---- */

/* Index of the first mapping starting at or after va. */
static size_t map_lower_bound(uintptr_t va)
{
    size_t lo = 0, hi = mem.nmaps;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (mem.maps[mid]->va < va)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* The mapping containing p, and its index. */
static struct sim_map *map_find(uintptr_t p, size_t *idx)
{
    size_t i = map_lower_bound(p + 1); /* first mapping starting after p */
    if (i == 0)
        return NULL;
    struct sim_map *m = mem.maps[i - 1];
    if (p - m->va >= m->size)
        return NULL;
    if (idx)
        *idx = i - 1;
    return m;
}

static int prot_of(int access_flags)
{
    switch (access_flags) {
    case CU_MEM_ACCESS_FLAGS_PROT_READWRITE: return PROT_READ | PROT_WRITE;
    case CU_MEM_ACCESS_FLAGS_PROT_READ: return PROT_READ;
    default: return PROT_NONE;
    }
}

/* Granule g's access flags, one byte per device ordinal. */
static unsigned char *map_access(const struct sim_map *m, size_t g)
{
    return (unsigned char *)m->prot + g * (size_t)sim_cfg.ndevices;
}

/* Every device shares the one host view of the memory, so a granule's page protection is the
 * most permissive access any device has: none at all still faults on the host. */
static int granule_prot(const struct sim_map *m, size_t g)
{
    const unsigned char *a = map_access(m, g);
    int flags = CU_MEM_ACCESS_FLAGS_PROT_NONE;
    for (int d = 0; d < sim_cfg.ndevices; d++)
        flags |= a[d];
    return prot_of(flags);
}

/* Re-applies the protections of granules [g, end) of a mapping, one mprotect per run of
 * equal protection. */
static bool map_apply_prot(const struct sim_map *m, size_t g, size_t end)
{
    bool ok = true;
    while (g < end) {
        int prot = granule_prot(m, g);
        size_t h = g + 1;
        while (h < end && granule_prot(m, h) == prot)
            h++;
        ok = mprotect((void *)(m->va + g * SIM_GRANULE), (h - g) * SIM_GRANULE, prot) == 0 && ok;
        g = h;
    }
    return ok;
}

/* An application mapping starts inaccessible to every device; cuMemAlloc's (owner) is
 * read-write for its context's device. */
static CUresult map_insert_locked(uintptr_t va, size_t size, size_t offset, struct sim_phys *ph,
                                  struct sim_alloc *owner, struct sim_ctx *ctx)
{
    size_t i = map_lower_bound(va);
    if ((i < mem.nmaps && mem.maps[i]->va < va + size) ||
        (i > 0 && mem.maps[i - 1]->va + mem.maps[i - 1]->size > va))
        return CUDA_ERROR_INVALID_VALUE; /* already mapped */
    if (mem.nmaps == mem.cap) {
        size_t cap = mem.cap ? mem.cap * 2 : 64;
        struct sim_map **maps = realloc(mem.maps, cap * sizeof(*maps));
        if (!maps)
            return CUDA_ERROR_OUT_OF_MEMORY;
        mem.maps = maps;
        mem.cap = cap;
    }
    size_t ngran = size / SIM_GRANULE;
    struct sim_map *m = calloc(1, sizeof(*m) + ngran * (size_t)sim_cfg.ndevices);
    if (!m)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *m = (struct sim_map){.va = va, .size = size, .offset = offset, .phys = ph, .owner = owner, .ctx = ctx};
    for (size_t g = 0; owner && g < ngran; g++)
        map_access(m, g)[ctx->device] = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    int fd = phys_fd(ph);
    void *got = fd < 0 ? MAP_FAILED
                       : mmap((void *)va, size, owner ? PROT_READ | PROT_WRITE : PROT_NONE, MAP_SHARED | MAP_FIXED, fd,
                              (off_t)offset);
    phys_fd_done(ph, fd);
    if (got == MAP_FAILED) {
        free(m);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    memmove(&mem.maps[i + 1], &mem.maps[i], (mem.nmaps - i) * sizeof(*mem.maps));
    mem.maps[i] = m;
    mem.nmaps++;
    ph->map_count++;
    return CUDA_SUCCESS;
}

static void phys_maybe_free(struct sim_phys *ph);

static void map_remove_locked(size_t i)
{
    struct sim_map *m = mem.maps[i];
    reserve_fixed(m->va, m->size);
    memmove(&mem.maps[i], &mem.maps[i + 1], (mem.nmaps - i - 1) * sizeof(*mem.maps));
    mem.nmaps--;
    m->phys->map_count--;
    phys_maybe_free(m->phys);
    free(m);
}

/* Checks that [va, va+size) is covered without holes by consecutive mappings of the
 * application's (not cuMemAlloc's); returns the index of the first. whole: the range must
 * start and end on mapping boundaries (unmap takes whole mappings only). */
static CUresult map_cover(uintptr_t va, size_t size, bool whole, size_t *first)
{
    size_t i;
    if (!map_find(va, &i) || (whole && mem.maps[i]->va != va))
        return CUDA_ERROR_INVALID_VALUE;
    *first = i;
    for (uintptr_t end = va + size;;) {
        struct sim_map *m = mem.maps[i];
        uintptr_t mend = m->va + m->size;
        if (m->owner || (whole && mend > end))
            return CUDA_ERROR_INVALID_VALUE;
        if (mend >= end)
            return CUDA_SUCCESS;
        if (++i >= mem.nmaps || mem.maps[i]->va != mend)
            return CUDA_ERROR_INVALID_VALUE; /* hole */
    }
}

static bool peer_enabled_locked(const struct sim_ctx *ctx, const struct sim_ctx *peer)
{
    for (struct sim_peer *e = mem.peers; e; e = e->next)
        if (e->ctx == ctx && e->peer == peer)
            return true;
    return false;
}

/* Does work in ctx reach granule g of m with `need` access? cuMemAlloc memory is read-write
 * wherever it is reachable at all; VMM memory has what cuMemSetAccess gave ctx's device. */
static bool map_grants(const struct sim_map *m, size_t g, const struct sim_ctx *ctx, int need,
                       enum sim_engine engine)
{
    if (m->owner)
        return engine == SIM_ENGINE_COPY || m->ctx->device == ctx->device || peer_enabled_locked(ctx, m->ctx);
    return (map_access(m, g)[ctx->device] & need) == need;
}

bool sim_mem_host_pinned_locked(uintptr_t p, size_t n)
{
    bool in = false;
    for (struct sim_host *h = mem.hosts; h && !in; h = h->next)
        in = p >= h->p && p - h->p < h->size && n <= h->p + h->size - p;
    return in;
}

bool sim_mem_host_pinned(uintptr_t p, size_t n)
{
    sim_mem_rdlock();
    bool in = sim_mem_host_pinned_locked(p, n);
    sim_mem_unlock();
    return in;
}

bool sim_mem_accessible(const struct sim_ctx *ctx, uintptr_t p, size_t n, int need, enum sim_engine engine)
{
    if (n == 0)
        return true;
    if (p + n < p)
        return false;
    if (!sim_mem_in_arena(p)) { /* pinned host memory is device-accessible (unified addressing) */
        for (struct sim_host *h = mem.hosts; h; h = h->next)
            if (p >= h->p && p - h->p < h->size && n <= h->p + h->size - p)
                return true;
        return false;
    }
    size_t i;
    if (!map_find(p, &i))
        return false;
    for (uintptr_t end = p + n;;) {
        struct sim_map *m = mem.maps[i];
        uintptr_t stop = end < m->va + m->size ? end : m->va + m->size;
        for (size_t g = (p - m->va) / SIM_GRANULE; g <= (stop - 1 - m->va) / SIM_GRANULE; g++)
            if (!map_grants(m, g, ctx, need, engine))
                return false;
        if (stop == end)
            return true;
        p = stop;
        if (++i >= mem.nmaps || mem.maps[i]->va != p)
            return false; /* hole */
    }
}

/* ---- physical memory ---- */

static struct sim_phys *phys_by_handle(CUmemGenericAllocationHandle h)
{
    for (struct sim_phys *ph = mem.phys; ph; ph = ph->next)
        if (ph->id == h && ph->handle_refs > 0)
            return ph;
    return NULL;
}

static int memfd_for(int device, size_t size)
{
    char name[32];
    /* Import reads the device back, maybe in another process: name the physical device. */
    snprintf(name, sizeof(name), "simcuda:dev=%d", sim_acct_physical(device));
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd >= 0 && ftruncate(fd, (off_t)size) != 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

/* Gives ph (device, size, prop set) its backing: an object when it may be exported as a POSIX fd. */
static bool phys_back(struct sim_phys *ph)
{
    if (!(ph->prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) || ph->imported)
        return (ph->fd = memfd_for(ph->device, ph->size)) >= 0;
    ph->obj_phys = sim_acct_physical(ph->device);
    int fd = sim_obj_create(ph->obj_phys, ph->size, &ph->obj);
    if (fd >= 0)
        close(fd); /* a handle costs no fd on the driver: thousands of them must not run out of fds */
    return fd >= 0;
}

/* Lets go of ph's backing: an object others still hold stays alive (and counted) without us. */
static void phys_unback(struct sim_phys *ph)
{
    if (ph->fd >= 0)
        close(ph->fd);
    ph->fd = -1;
    if (ph->obj)
        sim_obj_drop(ph->obj, ph->obj_phys, ph->charged > 0);
    ph->obj = 0;
}

/* Charges and creates physical memory; the caller links it in under the write lock. */
static CUresult phys_new(size_t size, const CUmemAllocationProp *prop, struct sim_phys **out)
{
    int dev = prop->location.id;
    CUresult rc = sim_acct_charge(dev, size);
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_phys *ph = calloc(1, sizeof(*ph));
    if (ph)
        *ph = (struct sim_phys){.size = size, .fd = -1, .device = dev, .prop = *prop, .handle_refs = 1, .charged = size};
    if (!ph || !phys_back(ph)) {
        free(ph);
        sim_acct_uncharge(dev, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = ph;
    return CUDA_SUCCESS;
}

static void phys_link_locked(struct sim_phys *ph)
{
    ph->id = ++mem.next_id;
    SIM_PUSH(mem.phys, ph);
}

/* Frees physical memory that is not (or no longer) in the list. */
static void phys_destroy(struct sim_phys *ph)
{
    phys_unback(ph);
    if (ph->saved)
        munmap(ph->saved, ph->size);
    free(ph->runs);
    sim_acct_uncharge(ph->device, ph->charged);
    free(ph);
}

/* Physical memory goes when its handle is released and nothing maps it any more. */
static void phys_maybe_free(struct sim_phys *ph)
{
    if (ph->handle_refs > 0 || ph->map_count > 0)
        return;
    for (struct sim_phys **l = &mem.phys; *l; l = &(*l)->next)
        if (*l == ph) {
            *l = ph->next;
            break;
        }
    phys_destroy(ph);
}

/* ---- VMM ---- */

CUresult sim_vmm_reserve(CUdeviceptr *va, size_t size, size_t align, CUdeviceptr hint)
{
    struct sim_resv *r = calloc(1, sizeof(*r));
    if (!r)
        return CUDA_ERROR_OUT_OF_MEMORY;
    wrlock();
    uintptr_t a;
    CUresult rc = va_take((uintptr_t)hint, size, align, &a);
    if (rc == CUDA_SUCCESS) {
        *r = (struct sim_resv){.next = mem.resvs, .va = a, .size = size};
        mem.resvs = r;
        *va = a;
    }
    sim_mem_unlock();
    if (rc != CUDA_SUCCESS)
        free(r);
    return rc;
}

CUresult sim_vmm_free(CUdeviceptr va, size_t size)
{
    wrlock();
    struct sim_resv *r = resv_containing(va, size);
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    /* Only a whole reservation of the application's, with nothing mapped in it. */
    if (r && !r->owner && r->va == va && r->size == size) {
        size_t i = map_lower_bound(va);
        if (i >= mem.nmaps || mem.maps[i]->va >= va + size) {
            resv_remove(r);
            rc = CUDA_SUCCESS;
        }
    }
    sim_mem_unlock();
    return rc;
}

CUresult sim_vmm_create(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop)
{
    struct sim_phys *ph;
    CUresult rc = phys_new(size, prop, &ph);
    if (rc != CUDA_SUCCESS)
        return rc;
    wrlock();
    phys_link_locked(ph);
    *h = ph->id;
    sim_mem_unlock();
    return CUDA_SUCCESS;
}

CUresult sim_vmm_release(CUmemGenericAllocationHandle h)
{
    wrlock();
    struct sim_phys *ph = phys_by_handle(h);
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    if (ph) {
        ph->handle_refs--;
        phys_maybe_free(ph); /* still mapped: freed by the last unmap */
        rc = CUDA_SUCCESS;
    }
    sim_mem_unlock();
    return rc;
}

CUresult sim_vmm_map(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle h, struct sim_ctx *ctx)
{
    wrlock();
    struct sim_phys *ph = phys_by_handle(h);
    struct sim_resv *r = resv_containing(va, size);
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    if (ph && r && !r->owner && offset <= ph->size && size <= ph->size - offset)
        rc = map_insert_locked(va, size, offset, ph, NULL, ctx);
    sim_mem_unlock();
    return rc;
}

/* Guards the mappings' work records, which copies note under the read lock. */
static pthread_mutex_t work_mu = PTHREAD_MUTEX_INITIALIZER;

void sim_vmm_note_work(uintptr_t p, size_t n, struct sim_pos pos)
{
    if (!sim_mem_in_arena(p))
        return;
    sim_mem_rdlock();
    size_t i;
    if (map_find(p, &i)) {
        pthread_mutex_lock(&work_mu);
        for (; i < mem.nmaps && mem.maps[i]->va < p + n; i++) {
            struct sim_pos *w = mem.maps[i]->work;
            int k = 0;
            while (k < SIM_MAP_WORK && w[k].seq && w[k].id != pos.id)
                k++;
            /* every record taken by other streams: one is forgotten (a check missed, never a false one) */
            w[k < SIM_MAP_WORK ? k : (int)(pos.seq % SIM_MAP_WORK)] = pos;
        }
        pthread_mutex_unlock(&work_mu);
    }
    sim_mem_unlock();
}

bool sim_vmm_work_ordered(CUstream s, uintptr_t p, size_t n)
{
    size_t i;
    if (n == 0 || !sim_mem_in_arena(p) || !map_find(p, &i))
        return true;
    bool ordered = true;
    pthread_mutex_lock(&work_mu);
    for (; ordered && i < mem.nmaps && mem.maps[i]->va < p + n; i++)
        for (int k = 0; ordered && k < SIM_MAP_WORK; k++)
            if (mem.maps[i]->work[k].seq)
                ordered = sim_order_relation(s, mem.maps[i]->work[k]) != 0;
    pthread_mutex_unlock(&work_mu);
    return ordered;
}

/* Whether an asynchronous copy the host has not seen complete still touches mappings i.. below end. */
static bool work_pending(size_t i, uintptr_t end)
{
    for (; i < mem.nmaps && mem.maps[i]->va < end; i++)
        for (int k = 0; k < SIM_MAP_WORK; k++)
            if (mem.maps[i]->work[k].seq && !sim_order_pos_done(mem.maps[i]->work[k]))
                return true;
    return false;
}

CUresult sim_vmm_unmap(CUdeviceptr va, size_t size)
{
    wrlock();
    size_t i;
    CUresult rc = map_cover(va, size, true, &i);
    /* CUDA leaves unmapping memory that queued work still uses undefined (on a GPU: a fault, or bytes
     * lost); the test double refuses it, so the suite sees what a GPU run might only sometimes show */
    if (rc == CUDA_SUCCESS && work_pending(i, va + size)) {
        fprintf(stderr, "simcuda: cuMemUnmap of memory an asynchronous copy may still use: synchronize its stream "
                        "first\n");
        rc = CUDA_ERROR_ILLEGAL_STATE;
    }
    if (rc == CUDA_SUCCESS)
        while (i < mem.nmaps && mem.maps[i]->va < va + size)
            map_remove_locked(i);
    sim_mem_unlock();
    return rc;
}

/* Descriptors apply in order, so a later one for the same device wins, and devices no
 * descriptor names keep their access, as on CUDA. */
CUresult sim_vmm_set_access(CUdeviceptr va, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    wrlock();
    size_t i;
    CUresult rc = map_cover(va, size, false, &i);
    for (uintptr_t p = va, end = va + size; rc == CUDA_SUCCESS && p < end; i++) {
        struct sim_map *m = mem.maps[i];
        uintptr_t stop = end < m->va + m->size ? end : m->va + m->size;
        size_t g0 = (p - m->va) / SIM_GRANULE, g1 = (stop - m->va) / SIM_GRANULE;
        for (size_t g = g0; g < g1; g++)
            for (size_t k = 0; k < count; k++)
                map_access(m, g)[desc[k].location.id] = (unsigned char)desc[k].flags;
        if (!map_apply_prot(m, g0, g1))
            rc = CUDA_ERROR_OUT_OF_MEMORY; /* the kernel ran out of VMAs for the host view */
        p = stop;
    }
    sim_mem_unlock();
    return rc;
}

CUresult sim_vmm_get_access(CUdeviceptr va, int dev, int *flags)
{
    sim_mem_rdlock();
    struct sim_map *m = map_find(va, NULL);
    if (m)
        *flags = map_access(m, (va - m->va) / SIM_GRANULE)[dev];
    sim_mem_unlock();
    return m ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult sim_mem_peer_enable(const struct sim_ctx *ctx, const struct sim_ctx *peer)
{
    struct sim_peer *e = malloc(sizeof(*e));
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    wrlock();
    CUresult rc = CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
    if (!peer_enabled_locked(ctx, peer)) {
        *e = (struct sim_peer){.next = mem.peers, .ctx = ctx, .peer = peer};
        mem.peers = e;
        rc = CUDA_SUCCESS;
    }
    sim_mem_unlock();
    if (rc != CUDA_SUCCESS)
        free(e);
    return rc;
}

/* Removes ctx's peer access to peer; with peer NULL, every entry naming ctx on either side. */
static bool peers_remove_locked(const struct sim_ctx *ctx, const struct sim_ctx *peer)
{
    bool found = false;
    for (struct sim_peer **l = &mem.peers, *e; (e = *l);) {
        bool match = peer ? e->ctx == ctx && e->peer == peer : e->ctx == ctx || e->peer == ctx;
        if (match) {
            *l = e->next;
            free(e);
            found = true;
        } else {
            l = &e->next;
        }
    }
    return found;
}

CUresult sim_mem_peer_disable(const struct sim_ctx *ctx, const struct sim_ctx *peer)
{
    wrlock();
    bool found = peers_remove_locked(ctx, peer);
    sim_mem_unlock();
    return found ? CUDA_SUCCESS : CUDA_ERROR_PEER_ACCESS_NOT_ENABLED;
}

CUresult sim_vmm_retain(CUmemGenericAllocationHandle *h, CUdeviceptr va)
{
    wrlock();
    struct sim_map *m = map_find(va, NULL);
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    if (m && !m->owner) { /* cuMemAlloc memory has no handle the application may hold */
        m->phys->handle_refs++;
        *h = m->phys->id;
        rc = CUDA_SUCCESS;
    }
    sim_mem_unlock();
    return rc;
}

CUresult sim_vmm_get_prop(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h)
{
    sim_mem_rdlock();
    struct sim_phys *ph = phys_by_handle(h);
    if (ph)
        *prop = ph->prop;
    sim_mem_unlock();
    return ph ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* As on the driver, an exported fd is a new open of the control file (<rundir>/nvidiactl, as
 * /dev/nvidiactl): every export, of any allocation and in any process, has the same st_dev/st_ino,
 * so fstat cannot tell two apart (measured on the H200: reference/fdident_probe.py). It holds the
 * memory's object (objects.c) alive until its last dup is closed, in whatever process. An imported
 * handle cannot be exported again (measured: the driver says invalid argument). */
CUresult sim_vmm_export_fd(int *fd, CUmemGenericAllocationHandle h)
{
    sim_mem_rdlock();
    struct sim_phys *ph = phys_by_handle(h);
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    if (ph && ph->obj && !ph->imported) {
        int e = sim_obj_export(ph->obj);
        if (e >= 0)
            *fd = e;
        rc = e >= 0 ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
    }
    sim_mem_unlock();
    return rc;
}

/* A fabric handle (64 bytes) names the memory across nodes; simcuda exports one so a client sees the
 * export happen, but nothing can import it (there is no second node). */
CUresult sim_vmm_export_fabric(void *out, CUmemGenericAllocationHandle h)
{
    sim_mem_rdlock();
    struct sim_phys *ph = phys_by_handle(h);
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    if (ph && (ph->prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_FABRIC)) {
        memset(out, 0, 64);
        snprintf(out, 64, "simcuda-fabric:%ld:%llu", (long)getpid(), (unsigned long long)h);
        rc = CUDA_SUCCESS;
    }
    sim_mem_unlock();
    return rc;
}

CUresult sim_vmm_import_fd(CUmemGenericAllocationHandle *h, int fd)
{
    /* Only an fd simcuda exported (possibly in another process) of memory still alive; its GPU must
     * be one this process sees. */
    struct stat st;
    int phys, dev;
    uint64_t id = sim_obj_of_fd(fd);
    int own = id ? sim_obj_open(id, &phys) : -1;
    if (own < 0)
        return CUDA_ERROR_INVALID_VALUE;
    if ((dev = sim_acct_ordinal(phys)) < 0 || fstat(own, &st) != 0 || st.st_size <= 0 || st.st_size % SIM_GRANULE) {
        close(own);
        sim_obj_drop(id, phys, false);
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct sim_phys *ph = calloc(1, sizeof(*ph));
    if (!ph) {
        close(own);
        sim_obj_drop(id, phys, false);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = dev}};
    /* charged 0: the maker pays while it holds the memory, then the object itself (objects.c) */
    close(own); /* opened again when used (phys_fd) */
    *ph = (struct sim_phys){.size = (size_t)st.st_size, .fd = -1, .device = dev, .prop = prop, .handle_refs = 1,
                            .obj = id, .obj_phys = phys, .imported = true};
    wrlock();
    phys_link_locked(ph);
    *h = ph->id;
    sim_mem_unlock();
    return CUDA_SUCCESS;
}

/* ---- cuMemAlloc & co.: reserve + create + map + set access, done internally ---- */

static void alloc_destroy_locked(struct sim_alloc *a)
{
    size_t i;
    if (map_find(a->va, &i))
        map_remove_locked(i); /* drops the mapping's reference to the physical memory */
    a->phys->handle_refs--;
    phys_maybe_free(a->phys);
    resv_remove(a->resv);
    for (struct sim_alloc **l = &mem.allocs; *l; l = &(*l)->next)
        if (*l == a) {
            *l = a->next;
            break;
        }
    free(a);
}

CUresult sim_alloc(CUdeviceptr *va, size_t size, enum sim_alloc_kind kind, struct sim_ctx *ctx)
{
    size_t span = sim_round_up(size, SIM_GRANULE);
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = ctx->device}};
    struct sim_phys *ph;
    CUresult rc = phys_new(span, &prop, &ph);
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sim_alloc *a = calloc(1, sizeof(*a));
    struct sim_resv *r = calloc(1, sizeof(*r));
    uintptr_t addr = 0;
    wrlock();
    rc = a && r ? va_take(0, span, SIM_GRANULE, &addr) : CUDA_ERROR_OUT_OF_MEMORY;
    if (rc == CUDA_SUCCESS) {
        rc = map_insert_locked(addr, span, 0, ph, a, ctx);
        if (rc != CUDA_SUCCESS)
            va_give(addr, span);
    }
    if (rc == CUDA_SUCCESS) {
        phys_link_locked(ph); /* its handle reference belongs to the allocation */
        *r = (struct sim_resv){.next = mem.resvs, .va = addr, .size = span, .owner = a};
        mem.resvs = r;
        *a = (struct sim_alloc){.next = mem.allocs, .va = addr, .size = size, .kind = kind, .ctx = ctx, .resv = r,
                                .phys = ph};
        mem.allocs = a;
        *va = addr;
    }
    sim_mem_unlock();
    if (rc != CUDA_SUCCESS) {
        free(a);
        free(r);
        phys_destroy(ph);
    }
    return rc;
}

static struct sim_alloc *alloc_at(uintptr_t va)
{
    struct sim_map *m = map_find(va, NULL);
    return m && m->owner && m->owner->va == va ? m->owner : NULL;
}

CUresult sim_free(CUdeviceptr va)
{
    wrlock();
    struct sim_alloc *a = alloc_at(va);
    if (a)
        alloc_destroy_locked(a);
    sim_mem_unlock();
    return a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult sim_ptrinfo(CUdeviceptr p, struct sim_ptrinfo *info)
{
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    sim_mem_rdlock();
    struct sim_map *m = sim_mem_in_arena(p) ? map_find(p, NULL) : NULL;
    if (m && m->owner) {
        struct sim_alloc *a = m->owner;
        if (p - a->va < a->size) { /* not in the rounding slack behind the allocation */
            *info = (struct sim_ptrinfo){.memory_type = CU_MEMORYTYPE_DEVICE, .base = a->va, .size = a->size,
                                         .ctx = a->ctx, .device = m->phys->device, .kind = a->kind};
            rc = CUDA_SUCCESS;
        }
    } else if (m) {
        *info = (struct sim_ptrinfo){.memory_type = CU_MEMORYTYPE_DEVICE, .base = m->va, .size = m->size,
                                     .ctx = m->ctx, .device = m->phys->device, .vmm = true};
        rc = CUDA_SUCCESS;
    } else {
        for (struct sim_host *h = mem.hosts; h; h = h->next)
            if (p >= h->p && p - h->p < h->size) {
                *info = (struct sim_ptrinfo){.memory_type = CU_MEMORYTYPE_HOST, .base = h->p, .size = h->size,
                                             .ctx = h->ctx, .device = h->ctx ? h->ctx->device : 0};
                rc = CUDA_SUCCESS;
                break;
            }
    }
    sim_mem_unlock();
    return rc;
}

static void host_remove_locked(struct sim_host **link)
{
    struct sim_host *h = *link;
    *link = h->next;
    if (h->allocated)
        munmap((void *)h->p, h->size);
    sim_acct_host_pinned(-(long long)h->size);
    free(h);
}

void sim_mem_drop_ctx(struct sim_ctx *ctx)
{
    /* As on the real driver, a context takes its cuMemAlloc-family allocations, its pinned
     * host memory and its peer access with it; VMM memory belongs to the device and stays. */
    wrlock();
    peers_remove_locked(ctx, NULL);
    for (struct sim_alloc *a = mem.allocs, *next; a; a = next) {
        next = a->next;
        if (a->ctx == ctx)
            alloc_destroy_locked(a);
    }
    for (struct sim_host **l = &mem.hosts; *l;) {
        if ((*l)->ctx == ctx)
            host_remove_locked(l);
        else
            l = &(*l)->next;
    }
    sim_mem_unlock();
}

/* ---- host memory ---- */

static bool host_overlaps_locked(uintptr_t p, size_t size)
{
    for (struct sim_host *h = mem.hosts; h; h = h->next)
        if (p < h->p + h->size && h->p < p + size)
            return true;
    return false;
}

static CUresult host_add(uintptr_t p, size_t size, bool allocated, struct sim_ctx *ctx)
{
    struct sim_host *h = malloc(sizeof(*h));
    if (!h)
        return CUDA_ERROR_OUT_OF_MEMORY;
    wrlock();
    CUresult rc = CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    if (!host_overlaps_locked(p, size)) {
        *h = (struct sim_host){.next = mem.hosts, .p = p, .size = size, .allocated = allocated, .ctx = ctx};
        mem.hosts = h;
        sim_acct_host_pinned((long long)size);
        rc = CUDA_SUCCESS;
    }
    sim_mem_unlock();
    if (rc != CUDA_SUCCESS)
        free(h);
    return rc;
}

CUresult sim_host_alloc(void **pp, size_t size, unsigned flags, struct sim_ctx *ctx)
{
    (void)flags; /* portable / device-mapped / write-combined: all the same for host memory */
    size_t len = sim_round_up(size, (size_t)sysconf(_SC_PAGESIZE));
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = host_add((uintptr_t)p, len, true, ctx);
    if (rc != CUDA_SUCCESS)
        munmap(p, len);
    else
        *pp = p;
    return rc;
}

static CUresult host_remove(void *p, bool allocated, CUresult not_found)
{
    wrlock();
    CUresult rc = not_found;
    for (struct sim_host **l = &mem.hosts; *l; l = &(*l)->next)
        if ((*l)->p == (uintptr_t)p && (*l)->allocated == allocated) {
            host_remove_locked(l);
            rc = CUDA_SUCCESS;
            break;
        }
    sim_mem_unlock();
    return rc;
}

CUresult sim_host_free(void *p)
{
    return host_remove(p, true, CUDA_ERROR_INVALID_VALUE);
}

CUresult sim_host_register(void *p, size_t size, unsigned flags, struct sim_ctx *ctx)
{
    (void)flags;
    uintptr_t a = (uintptr_t)p;
    if (sim_mem_in_arena(a) || sim_mem_in_arena(a + size - 1))
        return CUDA_ERROR_INVALID_VALUE;
    /* The real driver pins the pages, so an unmapped range fails; msync says whether every
     * page of the (page-aligned) range is mapped without touching any of them. */
    size_t page = (size_t)sysconf(_SC_PAGESIZE), start = a / page * page;
    if (msync((void *)start, sim_round_up(a + size, page) - start, MS_ASYNC) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    return host_add(a, size, false, ctx);
}

CUresult sim_host_unregister(void *p)
{
    return host_remove(p, false, CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
}

/* ---- checkpoint / restore of physical memory ---- */

/* Records the data regions of ph's memfd and copies them into ph->saved. */
static bool phys_save(struct sim_phys *ph)
{
    int fd = phys_fd(ph);
    void *buf = fd < 0 ? MAP_FAILED : mmap(NULL, ph->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED) {
        phys_fd_done(ph, fd);
        return false;
    }
    size_t cap = 0;
    for (off_t off = 0; off < (off_t)ph->size;) {
        off_t data = lseek(fd, off, SEEK_DATA), hole;
        if (data < 0 && errno == ENXIO)
            break; /* only holes from here on */
        if (data < 0) { /* no SEEK_DATA support: treat the rest as data */
            data = off;
            hole = (off_t)ph->size;
        } else {
            hole = lseek(fd, data, SEEK_HOLE);
            if (hole < 0 || hole > (off_t)ph->size)
                hole = (off_t)ph->size;
        }
        if (ph->nruns == cap) {
            cap = cap ? cap * 2 : 8;
            struct sim_run *runs = realloc(ph->runs, cap * sizeof(*runs));
            if (!runs)
                goto fail;
            ph->runs = runs;
        }
        ph->runs[ph->nruns++] = (struct sim_run){(size_t)data, (size_t)(hole - data)};
        for (off_t o = data; o < hole;) {
            ssize_t n = pread(fd, (char *)buf + o, (size_t)(hole - o), o);
            if (n <= 0)
                goto fail;
            o += n;
        }
        off = hole;
    }
    ph->saved = buf;
    phys_fd_done(ph, fd);
    return true;
fail:
    phys_fd_done(ph, fd);
    munmap(buf, ph->size);
    free(ph->runs);
    ph->runs = NULL;
    ph->nruns = 0;
    return false;
}

static void phys_drop_saved(struct sim_phys *ph)
{
    munmap(ph->saved, ph->size);
    ph->saved = NULL;
    free(ph->runs);
    ph->runs = NULL;
    ph->nruns = 0;
}

CUresult sim_mem_checkpoint(size_t charged[SIM_MAX_DEVICES])
{
    wrlock();
    if (mem.checkpointed) {
        sim_mem_unlock();
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    /* Copy everything first, so that running out of host memory changes nothing. */
    for (struct sim_phys *ph = mem.phys; ph; ph = ph->next) {
        if (!phys_save(ph)) {
            for (struct sim_phys *q = mem.phys; q != ph; q = q->next)
                phys_drop_saved(q);
            sim_mem_unlock();
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    /* Then give the "device" memory back: the addresses stay reserved, inaccessible. */
    for (size_t i = 0; i < mem.nmaps; i++)
        reserve_fixed(mem.maps[i]->va, mem.maps[i]->size);
    /* Memory others still hold through exported fds stays on the GPU without us (objects.c);
     * memory only they hold is not ours any more and is neither copied nor refused. */
    for (struct sim_phys *ph = mem.phys; ph; ph = ph->next) {
        phys_unback(ph);
        charged[ph->device] += ph->charged;
    }
    mem.checkpointed = true;
    sim_mem_unlock();
    return CUDA_SUCCESS;
}

unsigned sim_mem_checkpointed_bytes(size_t need[SIM_MAX_DEVICES])
{
    unsigned mask = 0;
    sim_mem_rdlock();
    for (struct sim_phys *ph = mem.phys; ph; ph = ph->next) {
        need[ph->device] += ph->charged;
        mask |= 1u << ph->device;
    }
    sim_mem_unlock();
    return mask;
}

static bool phys_refill(struct sim_phys *ph)
{
    if (!phys_back(ph))
        return false;
    int fd = phys_fd(ph);
    bool ok = fd >= 0;
    for (size_t r = 0; ok && r < ph->nruns; r++) {
        for (size_t o = ph->runs[r].off, end = o + ph->runs[r].len; ok && o < end;) {
            ssize_t n = pwrite(fd, (char *)ph->saved + o, end - o, (off_t)o);
            ok = n > 0;
            o += ok ? (size_t)n : 0;
        }
    }
    phys_fd_done(ph, fd);
    if (!ok)
        phys_unback(ph);
    return ok;
}

CUresult sim_mem_restore(void)
{
    wrlock();
    if (!mem.checkpointed) {
        sim_mem_unlock();
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    /* Refill every memfd first, then map: a failure in either step is undone below. */
    CUresult rc = CUDA_SUCCESS;
    for (struct sim_phys *ph = mem.phys; ph && rc == CUDA_SUCCESS; ph = ph->next)
        if (!phys_refill(ph))
            rc = CUDA_ERROR_OUT_OF_MEMORY;
    size_t mapped = 0;
    while (rc == CUDA_SUCCESS && mapped < mem.nmaps) {
        struct sim_map *m = mem.maps[mapped];
        int fd = phys_fd(m->phys);
        void *got = fd < 0 ? MAP_FAILED : mmap((void *)m->va, m->size, PROT_NONE, MAP_SHARED | MAP_FIXED, fd, (off_t)m->offset);
        phys_fd_done(m->phys, fd);
        if (got == MAP_FAILED) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            map_apply_prot(m, 0, m->size / SIM_GRANULE);
            mapped++;
        }
    }
    if (rc != CUDA_SUCCESS) {
        /* Undo, so the process stays checkpointed and a later restore can succeed. */
        for (size_t i = 0; i < mapped; i++)
            reserve_fixed(mem.maps[i]->va, mem.maps[i]->size);
        for (struct sim_phys *q = mem.phys; q; q = q->next)
            phys_unback(q);
    } else {
        for (struct sim_phys *q = mem.phys; q; q = q->next)
            phys_drop_saved(q);
        mem.checkpointed = false;
    }
    sim_mem_unlock();
    return rc;
}
