/* Allocation wrappers. Plain allocations of at least GPUCR_MIN_VMM_BYTES (default: one VMM granule,
 * 2 MiB on the H200) become VMM reserve+create+map, so the agent can later release the physical
 * memory and re-create it at the same address. Smaller ones stay native (the driver's checkpoint
 * moves them) because each VMM allocation costs a whole granule. The application's own VMM calls are
 * recorded so the data plane can move that memory too. */
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "pool.h"
#include "registry.h"
#include "settings.h"

static size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

enum { HANDLE_POSIX_FD = 1, HANDLE_FABRIC = 8 };   /* CUmemAllocationHandleType */

/* Settings are read once (settings.def, pthread_once): no wrapper sees them change. */
static bool convert_plain(void) { return !gpucr_setting_on(SET_NATIVE_ALLOC); }
static size_t min_vmm_bytes(void) { return (size_t)gpucr_setting_int(SET_MIN_VMM_BYTES); }   /* 0: one granule */

static void device_prop(CUmemAllocationProp *prop, CUdevice dev)
{
    memset(prop, 0, sizeof *prop);
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = dev;
}

static void free_addresses(CUdeviceptr va, size_t size)
{
    CUresult rc = gpucr_drv.cuMemAddressFree(va, size);
    if (rc != CUDA_SUCCESS) gpucr_cu_warn(rc, "cuMemAddressFree of %zu bytes at 0x%llx", size, (unsigned long long)va);
}

/* The most pieces one allocation is made of: a KV cache of 140 GiB in 32 MiB pieces is 4,480. */
#define MAX_PIECES 8192

/* Give back what alloc_vmm made when it cannot be used: the first `mapped` of its n pieces mapped (each failure
 * logged: memory may stay behind). */
static void undo_vmm(CUdeviceptr va, size_t size, const CUmemGenericAllocationHandle *h, const size_t *psize, int n,
                     int mapped)
{
    CUresult rc;
    size_t off = 0;
    for (int k = 0; k < n; off += psize[k], k++) {
        if (k < mapped && (rc = REAL(cuMemUnmap)(va + off, psize[k])) != CUDA_SUCCESS)
            gpucr_cu_warn(rc, "cuMemUnmap of %zu bytes at 0x%llx", psize[k], (unsigned long long)(va + off));
        if ((rc = REAL(cuMemRelease)(h[k])) != CUDA_SUCCESS) gpucr_cu_warn(rc, "cuMemRelease of %zu bytes", psize[k]);
    }
    free_addresses(va, size);
}

/* How many pieces an allocation of rsize bytes is made of (GPUCR_PIECE_BYTES, rounded to the granule): each its own
 * physical memory, so a two-way switch gives a large allocation back as it goes out. One when pieces are off, when
 * it is smaller than GPUCR_PIECES_FROM or no larger than a piece, or when its fds (one each, the agent's own) would
 * not fit: said once. */
static int pieces_of(size_t rsize, size_t gran, size_t *piece)
{
    size_t want = (size_t)gpucr_setting_int(SET_PIECE_BYTES);
    *piece = want ? round_up(want, gran) : rsize;
    if (!want || rsize <= *piece || rsize < (size_t)gpucr_setting_int(SET_PIECES_FROM)) { *piece = rsize; return 1; }
    size_t n = (rsize + *piece - 1) / *piece;
    if (n > MAX_PIECES) { *piece = round_up((rsize + MAX_PIECES - 1) / MAX_PIECES, gran); n = (rsize + *piece - 1) / *piece; }
    if (share_fds_left((int)n)) return (int)n;
    static atomic_bool said;
    if (!atomic_exchange(&said, true))
        gpucr_warn("too few file descriptors left to make an allocation of %zu MiB in %zu pieces (one fd each): made "
                   "in one piece, which a two-way switch frees only whole (raise 'ulimit -Hn')", rsize >> 20, n);
    *piece = rsize;
    return 1;
}

/* Allocate `size` bytes as VMM; CUDA_ERROR_NOT_SUPPORTED means "use the native path instead". */
static CUresult alloc_vmm(CUdeviceptr *dptr, size_t size)
{
    CUcontext ctx = NULL;
    CUdevice dev = 0;
    if (!gpucr_drv.cuCtxGetCurrent || gpucr_drv.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx) return CUDA_ERROR_NOT_SUPPORTED;
    if (gpucr_drv.cuCtxGetDevice(&dev) != CUDA_SUCCESS) return CUDA_ERROR_NOT_SUPPORTED;
    CUmemAllocationProp prop;
    device_prop(&prop, dev);
    share_make_exportable(&prop);
    size_t gran = 0;
    if (gpucr_drv.cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || !gran)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (size < (min_vmm_bytes() ? min_vmm_bytes() : gran)) return CUDA_ERROR_NOT_SUPPORTED;

    size_t rsize = round_up(size, gran), piece = 0;
    int n = pieces_of(rsize, gran, &piece);
    CUmemGenericAllocationHandle *h = calloc((size_t)n, sizeof *h);
    size_t *psize = calloc((size_t)n, sizeof *psize);
    if (!h || !psize) { free(h); free(psize); return CUDA_ERROR_NOT_SUPPORTED; }
    CUdeviceptr va = 0;
    CUresult rc = gpucr_drv.cuMemAddressReserve(&va, rsize, gran, 0, 0);
    if (rc != CUDA_SUCCESS) { free(h); free(psize); return CUDA_ERROR_NOT_SUPPORTED; }
    int made = 0;
    for (size_t off = 0; made < n && rc == CUDA_SUCCESS; off += psize[made], made++) {
        psize[made] = rsize - off < piece ? rsize - off : piece;
        if ((rc = REAL(cuMemCreate)(&h[made], psize[made], &prop, 0)) != CUDA_SUCCESS) break;
    }
    if (rc != CUDA_SUCCESS) {
        undo_vmm(va, rsize, h, psize, made, 0);
        free(h); free(psize);
        /* out of memory is the application's answer, not a reason to try the other path */
        return rc == CUDA_ERROR_OUT_OF_MEMORY ? rc : CUDA_ERROR_NOT_SUPPORTED;
    }
    /* its own device, and every device that was given peer access to this context: a plain
     * allocation is open to them, so the VMM one that stands in for it must be too */
    CUmemAccessDesc acc[MAX_ACCESS] = {{{CU_MEM_LOCATION_TYPE_DEVICE, dev}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE}};
    int nacc = 1;
    reg_lock();
    uint32_t peers = reg_peer_devs(ctx);
    reg_unlock();
    for (int d = 0; d < 32 && nacc < MAX_ACCESS; d++)
        if ((peers >> d & 1) && d != dev) acc[nacc++] = (CUmemAccessDesc){{CU_MEM_LOCATION_TYPE_DEVICE, d}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    int mapped = 0;
    for (size_t off = 0; mapped < n; off += psize[mapped], mapped++) {
        if ((rc = REAL(cuMemMap)(va + off, psize[mapped], 0, h[mapped], 0)) != CUDA_SUCCESS) break;
        if ((rc = REAL(cuMemSetAccess)(va + off, psize[mapped], acc, (size_t)nacc)) != CUDA_SUCCESS) { mapped++; break; }
    }
    if (rc != CUDA_SUCCESS) {
        undo_vmm(va, rsize, h, psize, n, mapped);
        free(h); free(psize);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    reg_learn_ctx(ctx);
    bool ok = true;
    struct phys *first = NULL, *prev = NULL;
    size_t off = 0;
    for (int k = 0; k < n; off += psize[k], k++) {
        int own = share_keeps_fd(&prop) ? share_export_own(h[k]) : -1;
        reg_lock();
        struct phys *p = ok ? reg_phys_new(PHYS_CONVERTED, h[k], psize[k], &prop, ctx) : NULL;
        struct mapping *m = p ? reg_map_add(p, va + off, psize[k], 0) : NULL;
        if (p) share_adopt_own(p, own, share_keeps_fd(&prop));
        else if (own >= 0) close(own);
        if (m) reg_map_merge_access(m, acc, (size_t)nacc);
        if (p && k == 0) {
            p->resv_va = va; p->resv_size = rsize; p->user_size = size;
            first = p;
            ok = m && reg_put(&g_reg.conv_by_va, va, p, "an allocation") == 0;
        } else if (p) {
            p->piece_tail = true;
            prev->next_piece = p;
        }
        ok = ok && m;
        if (p) prev = p;
        reg_unlock();
    }
    if (!ok) {   /* not recorded whole: given back, the application is told no */
        reg_lock();
        for (struct phys *p = first, *next; p; p = next) { next = p->next_piece; reg_phys_free(p); }
        reg_unlock();
        undo_vmm(va, rsize, h, psize, n, n);
        free(h); free(psize);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    free(h); free(psize);
    *dptr = va;
    return CUDA_SUCCESS;
}

GPUCR_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size)
{
    gpucr_init();
    if (!REAL(cuMemAlloc_v2)) return CUDA_ERROR_NOT_SUPPORTED;
    if (!gpucr_gate_enter_alloc()) return CUDA_ERROR_OUT_OF_MEMORY;   /* parked past the swap wait limit */
    CUresult rc = CUDA_ERROR_NOT_SUPPORTED;
    for (int room = 0; room < 2; room++) {   /* retried once when the gpucr server made room (room.c) */
        rc = CUDA_ERROR_NOT_SUPPORTED;
        if (convert_plain() && dptr && size) rc = alloc_vmm(dptr, size);
        if (rc == CUDA_ERROR_NOT_SUPPORTED) {
            rc = REAL(cuMemAlloc_v2)(dptr, size);
            if (rc == CUDA_SUCCESS) note_native(&g_reg.native_by_va, &g_reg.native_bytes, &g_reg.native_count, *dptr, size);
        }
        if (rc != CUDA_ERROR_OUT_OF_MEMORY || room || !gpucr_room_ask(size)) break;
    }
    if (rc == CUDA_SUCCESS) gpucr_room_allocated();
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t w, size_t h, unsigned elem)
{
    gpucr_init();
    if (!REAL(cuMemAllocPitch_v2)) return CUDA_ERROR_NOT_SUPPORTED;
    if (!gpucr_gate_enter_alloc()) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = CUDA_ERROR_NOT_SUPPORTED;
    if (convert_plain() && dptr && pitch && w && h && (elem == 4 || elem == 8 || elem == 16)) {
        /* the pitch the driver would choose: rows aligned to the texture pitch alignment */
        int align = 512;
        CUdevice dev = 0;
        if (gpucr_drv.cuCtxGetDevice && gpucr_drv.cuCtxGetDevice(&dev) == CUDA_SUCCESS && gpucr_drv.cuDeviceGetAttribute) {
            int a = 0;
            if (gpucr_drv.cuDeviceGetAttribute(&a, 14 /* TEXTURE_PITCH_ALIGNMENT */, dev) == CUDA_SUCCESS && a > align) align = a;
        }
        size_t p = round_up(w, (size_t)align);
        rc = alloc_vmm(dptr, p * h);
        if (rc == CUDA_ERROR_OUT_OF_MEMORY && gpucr_room_ask(p * h)) rc = alloc_vmm(dptr, p * h);   /* room.c */
        if (rc == CUDA_SUCCESS) *pitch = p;
    }
    if (rc == CUDA_ERROR_NOT_SUPPORTED) {
        rc = REAL(cuMemAllocPitch_v2)(dptr, pitch, w, h, elem);
        if (rc == CUDA_ERROR_OUT_OF_MEMORY && gpucr_room_ask(w * h)) rc = REAL(cuMemAllocPitch_v2)(dptr, pitch, w, h, elem);
        if (rc == CUDA_SUCCESS) note_native(&g_reg.native_by_va, &g_reg.native_bytes, &g_reg.native_count, *dptr, *pitch * h);
    }
    gpucr_gate_leave();
    return rc;
}

CUresult alloc_free_converted(CUdeviceptr va)
{
    reg_lock();
    struct phys *p = hmap_get(&g_reg.conv_by_va, va);
    size_t size = p ? p->resv_size : 0;
    int n = 0;
    for (struct phys *q = p; q; q = q->next_piece) n++;
    struct { CUdeviceptr va; size_t size; CUmemGenericAllocationHandle real; } *piece = n ? calloc((size_t)n, sizeof *piece) : NULL;
    int k = 0;
    for (struct phys *q = p; q && piece; q = q->next_piece, k++)
        piece[k].va = q->maps ? q->maps->va : va, piece[k].size = q->size, piece[k].real = q->real;
    reg_unlock();
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    if (!piece) return CUDA_ERROR_OUT_OF_MEMORY;
    for (k = 0; k < n; k++) {   /* each piece's own mapping */
        CUresult rc = REAL(cuMemUnmap)(piece[k].va, piece[k].size);
        if (rc != CUDA_SUCCESS && k == 0) { free(piece); return rc; }   /* still mapped: keep the record */
        if (rc != CUDA_SUCCESS) gpucr_cu_warn(rc, "cuMemUnmap of the piece at 0x%llx", (unsigned long long)piece[k].va);
    }
    /* Forgotten before the addresses are given back: once they are, another thread's allocation may
     * get them and be recorded under the same address. */
    reg_lock();
    if ((p = hmap_get(&g_reg.conv_by_va, va)))
        for (struct phys *q = p, *next; q; q = next) { next = q->next_piece; reg_phys_free(q); }
    reg_unlock();
    for (k = 0; k < n; k++) {
        CUresult rrc = REAL(cuMemRelease)(piece[k].real);
        if (rrc != CUDA_SUCCESS) gpucr_cu_warn(rrc, "cuMemRelease of the %zu bytes at 0x%llx", piece[k].size,
                                               (unsigned long long)piece[k].va);
    }
    free(piece);
    free_addresses(va, size);
    return CUDA_SUCCESS;
}

/* Make ctx current (if it is not), remembering which was; each failure logged. */
static CUcontext switch_to(CUcontext ctx)
{
    CUcontext cur = NULL;
    if (gpucr_drv.cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur != ctx) gpucr_use_ctx(ctx);
    return cur;
}

static void switch_back(CUcontext was, CUcontext ctx)
{
    if (was != ctx) gpucr_use_ctx(was);
}

GPUCR_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    gpucr_init();
    if (!REAL(cuMemFree_v2)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    CUresult rc;
    if (pool_free_sync(dptr, &rc)) { gpucr_gate_leave(); return rc; }   /* stream-ordered memory freed plainly */
    reg_lock();
    struct phys *p = dptr ? hmap_get(&g_reg.conv_by_va, dptr) : NULL;
    CUcontext own = p ? p->ctx : NULL;
    reg_unlock();
    if (p) {
        /* cuMemFree waits for work using the memory; unmapping under running work is undefined.
         * The wait is done without the registry lock: status and other threads go on meanwhile. */
        CUcontext was = switch_to(own);
        rc = gpucr_drv.cuCtxSynchronize();
        if (rc != CUDA_SUCCESS) gpucr_cu_warn(rc, "cuCtxSynchronize (before freeing 0x%llx)", (unsigned long long)dptr);
        rc = alloc_free_converted(dptr);
        switch_back(was, own);
    } else {
        void *v = take_native(&g_reg.native_by_va, &g_reg.native_bytes, &g_reg.native_count, dptr), *mv = NULL;
        if (!v) mv = take_native(&g_reg.managed_by_va, &g_reg.managed_bytes, &g_reg.managed_count, dptr);
        rc = REAL(cuMemFree_v2)(dptr);
        if (rc != CUDA_SUCCESS && v) keep_native(&g_reg.native_by_va, &g_reg.native_bytes, &g_reg.native_count, dptr, v);
        if (rc != CUDA_SUCCESS && mv) keep_native(&g_reg.managed_by_va, &g_reg.managed_bytes, &g_reg.managed_count, dptr, mv);
    }
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned flags)
{
    gpucr_init();
    if (!REAL(cuMemAllocManaged)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    CUresult rc = REAL(cuMemAllocManaged)(dptr, size, flags);
    if (rc == CUDA_SUCCESS) note_native(&g_reg.managed_by_va, &g_reg.managed_bytes, &g_reg.managed_count, *dptr, size);
    gpucr_gate_leave();
    return rc;
}

/* Stream-ordered allocation (cuMemAllocAsync and the pools) is served by pool.c
 * (the calls: pool_alloc.c, mempool.c). */

GPUCR_EXPORT CUresult cuIpcGetMemHandle(void *handle, CUdeviceptr dptr)
{
    gpucr_init();
    if (!REAL(cuIpcGetMemHandle)) return CUDA_ERROR_NOT_SUPPORTED;
    reg_lock();
    bool converted = reg_phys_containing(dptr) != NULL;
    reg_unlock();
    if (converted) {
        gpucr_warn("cuIpcGetMemHandle: this allocation was made checkpointable (VMM) by gpucr and cannot be "
                   "exported with legacy CUDA IPC; run with GPUCR_NATIVE_ALLOC=1 to keep allocations native "
                   "(such a process cannot be checkpointed while the export is live)");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    CUresult rc = REAL(cuIpcGetMemHandle)(handle, dptr);
    if (rc == CUDA_SUCCESS) { reg_lock(); g_reg.ipc_exports++; reg_unlock(); }
    return rc;
}

/* ---- the application's own VMM ----
 * Each wrapper looks up the driver's handle under the registry lock, calls the driver without it,
 * and records the result under it again, finding the record anew by the application's handle (the
 * application may have released it meanwhile from another thread). */

/* The driver's handle for an application's handle: its record's, else the handle itself. */
static CUmemGenericAllocationHandle to_real(uint64_t app_handle)
{
    reg_lock();
    struct phys *p = hmap_get(&g_reg.by_app_handle, app_handle);
    CUmemGenericAllocationHandle real = p ? p->real : app_handle;
    reg_unlock();
    return real;
}

GPUCR_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop,
                                  unsigned long long flags)
{
    gpucr_init();
    if (!REAL(cuMemCreate)) return CUDA_ERROR_NOT_SUPPORTED;
    if (!gpucr_gate_enter_alloc()) return CUDA_ERROR_OUT_OF_MEMORY;
    CUmemAllocationProp mine;
    bool added = false;
    if (prop) {
        mine = *prop;
        added = share_make_exportable(&mine);
        prop = &mine;
    }
    CUresult rc = REAL(cuMemCreate)(h, size, prop, flags);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY && gpucr_room_ask(size)) rc = REAL(cuMemCreate)(h, size, prop, flags);
    if (rc == CUDA_SUCCESS) {
        gpucr_room_allocated();
        CUcontext ctx = NULL;
        gpucr_drv.cuCtxGetCurrent(&ctx);
        reg_learn_ctx(ctx);
        bool keep = share_keeps_fd(prop);
        int own = keep ? share_export_own(*h) : -1;
        reg_lock();
        struct phys *p = reg_phys_new(PHYS_APP_VMM, *h, size, prop, ctx);
        if (p) {
            *h = p->app_handle;
            p->fd_type_added = added;
            share_adopt_own(p, own, keep);
        } else if (own >= 0) {
            close(own);
        }
        reg_unlock();
    }
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *shareable, int type)
{
    gpucr_init();
    if (!REAL(cuMemImportFromShareableHandle)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    CUresult rc = REAL(cuMemImportFromShareableHandle)(h, shareable, type);
    if (rc == CUDA_SUCCESS) {
        CUcontext ctx = NULL;
        gpucr_drv.cuCtxGetCurrent(&ctx);
        reg_learn_ctx(ctx);
        reg_lock();
        struct phys *p = reg_phys_new(PHYS_IMPORTED, *h, 0, NULL, ctx);
        if (p) {
            *h = p->app_handle;
            if (type == HANDLE_POSIX_FD) {
                share_keep_fd(p, (int)(intptr_t)shareable);
                /* the driver will not export an imported handle again: this dup answers the application's export */
                share_adopt_own(p, fcntl((int)(intptr_t)shareable, F_DUPFD_CLOEXEC, 3), true);
            } else {
                p->share_unknown = true;
            }
            if (type == HANDLE_FABRIC) g_reg.fabric_shares++;
        }
        reg_unlock();
    }
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h)
{
    gpucr_init();
    if (!REAL(cuMemRelease)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    CUresult rc = REAL(cuMemRelease)(to_real(h));
    if (rc == CUDA_SUCCESS) {
        reg_lock();
        struct phys *p = hmap_get(&g_reg.by_app_handle, h);
        if (p && --p->app_refs <= 0) {
            p->app_refs = 0;
            if (!p->maps) reg_phys_free(p);   /* memory is gone once neither a handle nor a mapping holds it */
        }
        reg_unlock();
    }
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                               unsigned long long flags)
{
    gpucr_init();
    if (!REAL(cuMemMap)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    CUresult rc = REAL(cuMemMap)(va, size, offset, to_real(h), flags);
    if (rc == CUDA_SUCCESS) {
        reg_lock();
        struct phys *p = hmap_get(&g_reg.by_app_handle, h);
        if (p) {
            if (p->kind == PHYS_IMPORTED && !p->size) p->size = offset + size;
            reg_map_add(p, va, size, offset);
        }
        reg_unlock();
    }
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuMemUnmap(CUdeviceptr va, size_t size)
{
    gpucr_init();
    if (!REAL(cuMemUnmap)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    CUresult rc = REAL(cuMemUnmap)(va, size);
    if (rc == CUDA_SUCCESS) {
        reg_lock();
        /* a range may span several mappings laid end to end */
        for (CUdeviceptr a = va; a < va + size;) {
            struct mapping *m = hmap_get(&g_reg.map_by_va, a);
            if (!m) break;
            struct phys *p = m->phys;
            a += m->size;
            reg_map_remove(m);
            if (!p->maps && p->app_refs == 0 && p->kind != PHYS_CONVERTED) reg_phys_free(p);
        }
        reg_unlock();
    }
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuMemSetAccess(CUdeviceptr va, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    gpucr_init();
    if (!REAL(cuMemSetAccess)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    CUresult rc = REAL(cuMemSetAccess)(va, size, desc, count);
    if (rc == CUDA_SUCCESS) {
        reg_lock();
        for (CUdeviceptr a = va; a < va + size;) {
            struct mapping *m = hmap_get(&g_reg.map_by_va, a);
            if (!m) break;
            reg_map_merge_access(m, desc, count);
            a += m->size;
        }
        reg_unlock();
    }
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr)
{
    gpucr_init();
    if (!REAL(cuMemRetainAllocationHandle)) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = REAL(cuMemRetainAllocationHandle)(h, addr);
    if (rc == CUDA_SUCCESS) {
        reg_lock();
        struct phys *p = hmap_get(&g_reg.by_real_handle, *h);
        if (p && p->kind != PHYS_CONVERTED) { p->app_refs++; *h = p->app_handle; }
        reg_unlock();
    }
    return rc;
}

GPUCR_EXPORT CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type,
                                                   unsigned long long flags)
{
    gpucr_init();
    if (!REAL(cuMemExportToShareableHandle)) return CUDA_ERROR_NOT_SUPPORTED;
    /* the agent's own fd answers it when there is one: it is the memory's, and it also serves memory
     * this process imported (which the driver would refuse to export again) */
    int dup = -1;
    if (type == HANDLE_POSIX_FD && out) {
        reg_lock();
        struct phys *p = hmap_get(&g_reg.by_app_handle, h);
        dup = p ? share_dup_own(p) : -1;
        reg_unlock();
    }
    CUresult rc = dup >= 0 ? CUDA_SUCCESS : REAL(cuMemExportToShareableHandle)(out, to_real(h), type, flags);
    if (dup >= 0) *(int *)out = dup;
    if (rc == CUDA_SUCCESS) {
        reg_lock();
        struct phys *p = hmap_get(&g_reg.by_app_handle, h);
        if (p) {
            p->exported = true;
            if (type == HANDLE_POSIX_FD) {
                if (!p->share_key) p->share_key = share_new_key();
                share_keep_fd(p, *(int *)out);
            } else {
                p->share_unknown = true;
            }
            if (type == HANDLE_FABRIC) g_reg.fabric_shares++;
        }
        reg_unlock();
    }
    return rc;
}

GPUCR_EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h)
{
    gpucr_init();
    if (!REAL(cuMemGetAllocationPropertiesFromHandle)) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = REAL(cuMemGetAllocationPropertiesFromHandle)(prop, to_real(h));
    if (rc == CUDA_SUCCESS && prop) {
        /* what the application asked for, not the handle type the agent added */
        reg_lock();
        struct phys *p = hmap_get(&g_reg.by_app_handle, h);
        if (p && p->fd_type_added) prop->requestedHandleTypes &= ~HANDLE_POSIX_FD;
        reg_unlock();
    }
    return rc;
}

/* Multicast objects (NCCL's NVLS) bind memory of several GPUs into one address: neither the driver's
 * checkpoint nor gpucr covers them, so the process is refused before it is touched. */
GPUCR_EXPORT CUresult cuMulticastCreate(CUmemGenericAllocationHandle *h, const void *prop)
{
    gpucr_init();
    if (!REAL(cuMulticastCreate)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    CUresult rc = REAL(cuMulticastCreate)(h, prop);
    if (rc == CUDA_SUCCESS) { reg_lock(); g_reg.multicast_objects++; reg_unlock(); }
    gpucr_gate_leave();
    return rc;
}
