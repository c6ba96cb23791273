/* Peer access. cuCtxEnablePeerAccess opens a context's plain allocations to another device; the
 * driver does that only for native memory, not for the VMM memory the agent put in its place, so
 * the agent grants the peer device access to those mappings itself (and to later ones, alloc.c),
 * and records it so that a restore maps them again with the same access. */
#include <stdlib.h>
#include "registry.h"

/* Give `dev` access to every converted allocation of `owner` (on), or take it away (off): the
 * mappings are listed under the registry lock, the driver asked without it, and each change
 * recorded under it again. */
static CUresult set_peer_access(CUcontext owner, CUdevice dev, bool on)
{
    CUmemAccessDesc d = {{CU_MEM_LOCATION_TYPE_DEVICE, dev},
                         on ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_NONE};
    CUresult first = CUDA_SUCCESS;
    reg_lock();
    if (reg_peer_set(owner, dev, on)) first = CUDA_ERROR_OUT_OF_MEMORY;
    size_t n = 0, k = 0;
    for (struct phys *p = g_reg.all; p; p = p->next_all)
        if (p->kind == PHYS_CONVERTED && p->ctx == owner && !p->pool_seg)
            for (struct mapping *m = p->maps; m; m = m->next) n++;
    struct { CUdeviceptr va; size_t size; } *maps = n ? malloc(sizeof *maps * n) : NULL;
    for (struct phys *p = g_reg.all; p && maps; p = p->next_all)
        if (p->kind == PHYS_CONVERTED && p->ctx == owner && !p->pool_seg)
            for (struct mapping *m = p->maps; m; m = m->next) { maps[k].va = m->va; maps[k].size = m->size; k++; }
    reg_unlock();
    if (n && !maps) return CUDA_ERROR_OUT_OF_MEMORY;
    for (size_t i = 0; i < k; i++) {
        CUresult rc = REAL(cuMemSetAccess)(maps[i].va, maps[i].size, &d, 1);
        if (rc != CUDA_SUCCESS) { if (first == CUDA_SUCCESS) first = rc; continue; }
        reg_lock();
        struct mapping *m = hmap_get(&g_reg.map_by_va, maps[i].va);
        if (m) reg_map_merge_access(m, &d, 1);
        reg_unlock();
    }
    free(maps);
    return first;
}

GPUCR_EXPORT CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned flags)
{
    gpucr_init();
    if (!REAL(cuCtxEnablePeerAccess)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    CUresult rc = REAL(cuCtxEnablePeerAccess)(peer, flags);
    CUdevice dev = 0;
    if (rc == CUDA_SUCCESS && gpucr_drv.cuCtxGetDevice(&dev) == CUDA_SUCCESS) {
        CUresult grc = set_peer_access(peer, dev, true);
        if (grc != CUDA_SUCCESS) {   /* all or nothing: the application sees the failure, no half-open state */
            gpucr_warn("cuCtxEnablePeerAccess: could not open the VMM allocations gpucr made of the peer's "
                       "memory to device %d: %s", dev, gpucr_cu_errstr(grc));
            set_peer_access(peer, dev, false);
            CUresult drc = REAL(cuCtxDisablePeerAccess)(peer);
            if (drc != CUDA_SUCCESS) gpucr_cu_warn(drc, "cuCtxDisablePeerAccess (undoing a half-made grant)");
            rc = grc;
        }
    }
    gpucr_gate_leave();
    return rc;
}

GPUCR_EXPORT CUresult cuCtxDisablePeerAccess(CUcontext peer)
{
    gpucr_init();
    if (!REAL(cuCtxDisablePeerAccess)) return CUDA_ERROR_NOT_SUPPORTED;
    gpucr_gate_enter();
    CUresult rc = REAL(cuCtxDisablePeerAccess)(peer);
    CUdevice dev = 0;
    /* a revocation the driver refuses leaves the mapping more open than asked, never less; the
     * record forgets it either way, so a restore maps it as the application last asked */
    if (rc == CUDA_SUCCESS && gpucr_drv.cuCtxGetDevice(&dev) == CUDA_SUCCESS) set_peer_access(peer, dev, false);
    gpucr_gate_leave();
    return rc;
}
