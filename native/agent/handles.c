/* One allocation's life cycle at a checkpoint: its physical memory released for gpucr's data plane (the agent's fd
 * keeping it on the GPU), and back at its addresses with the access it had: mapped again from that fd (take back),
 * imported from the plane's new memory (adopt, dataplane.c) or from its exporter's (relink.c). The application
 * holds as many references to its handle afterwards as before. No phase is checked here: dataplane.c does that. */
#include <stdio.h>
#include "handles.h"

/* Release `refs` references of handle h of p; each failure logged (the memory may stay on the GPU). */
void handle_release(CUmemGenericAllocationHandle h, int refs, const struct phys *p)
{
    for (int i = 0; i < refs; i++) {
        CUresult rc = REAL(cuMemRelease)(h);
        if (rc != CUDA_SUCCESS) {
            gpucr_cu_warn(rc, "cuMemRelease (%zu MiB at 0x%llx; its device memory may stay allocated)", p->size >> 20,
                          (unsigned long long)(p->maps ? p->maps->va : 0));
            return;
        }
    }
}

/* Unmap p's mappings before `upto` (all when NULL), e.g. to undo a re-map that failed half way. */
static void unmap_upto(const struct phys *p, const struct mapping *upto)
{
    for (const struct mapping *m = p->maps; m && m != upto; m = m->next) {
        CUresult rc = REAL(cuMemUnmap)(m->va, m->size);
        if (rc != CUDA_SUCCESS) gpucr_cu_warn(rc, "cuMemUnmap (%zu bytes at 0x%llx)", m->size, (unsigned long long)m->va);
    }
}

/* Map handle h at every mapping of p, with the access each had; all or nothing. */
CUresult handle_map_all(const struct phys *p, CUmemGenericAllocationHandle h)
{
    for (const struct mapping *m = p->maps; m; m = m->next) {
        CUresult rc = REAL(cuMemMap)(m->va, m->size, m->offset, h, 0);
        if (rc == CUDA_SUCCESS && m->ndesc && (rc = REAL(cuMemSetAccess)(m->va, m->size, m->desc, (size_t)m->ndesc)) != CUDA_SUCCESS)
            unmap_upto(p, m->next);   /* this one too */
        else if (rc != CUDA_SUCCESS)
            unmap_upto(p, m);
        if (rc != CUDA_SUCCESS) return rc;
    }
    return CUDA_SUCCESS;
}

/* p's memory is back at its addresses as handle h, with `own` the agent's fd of it (`adopted`: memory the
 * gpucr server made): recorded, and the application holds as many references to the handle as before the
 * checkpoint, no more and no fewer. */
void handle_back_in_place(struct phys *p, CUmemGenericAllocationHandle h, int own, bool fd_wanted, bool adopted)
{
    reg_lock();
    reg_set_real(p, h);
    share_adopt_own(p, own, fd_wanted);
    p->adopted = adopted;
    int refs = p->app_refs;
    reg_alloc_move(p, AL_LIVE);
    reg_unlock();
    if (p->kind != PHYS_APP_VMM) return;
    if (refs == 0) handle_release(h, 1, p);
    for (int i = 1; i < refs; i++) {
        CUmemGenericAllocationHandle again;
        CUresult rrc = REAL(cuMemRetainAllocationHandle)(&again, (void *)(uintptr_t)p->maps->va);
        if (rrc != CUDA_SUCCESS)
            gpucr_cu_warn(rrc, "cuMemRetainAllocationHandle (the application's reference %d of 0x%llx)", i + 1,
                          (unsigned long long)p->maps->va);
    }
}

/* p's memory is back, as handle h: record it; the application's handle count decides whether h is kept. */
void handle_linked(struct phys *p, CUmemGenericAllocationHandle h)
{
    reg_lock();
    reg_set_real(p, h);
    int refs = p->app_refs;
    reg_alloc_move(p, AL_LIVE);
    reg_unlock();
    if (refs == 0) handle_release(h, 1, p);   /* the application had released its handle: mappings hold it */
}

/* Memory handed over as a POSIX fd, imported and mapped at every mapping of p with its access; all or
 * nothing (*h is the new handle). */
CUresult handle_import_at(const struct phys *p, int fd, CUmemGenericAllocationHandle *h)
{
    CUresult rc = REAL(cuMemImportFromShareableHandle)(h, (void *)(intptr_t)fd, 1);
    if (rc == CUDA_SUCCESS && (rc = handle_map_all(p, *h)) != CUDA_SUCCESS) handle_release(*h, 1, p);
    return rc;
}

/* Give back the physical memory of an allocation for gpucr's data plane to copy; the agent's own fd keeps it on
 * the GPU until the commit (dp_commit). */
CUresult handle_hand_over(struct phys *p)
{
    gpucr_use_ctx(p->ctx);
    for (struct mapping *m = p->maps; m; m = m->next) {
        CUresult rc = REAL(cuMemUnmap)(m->va, m->size);
        if (rc != CUDA_SUCCESS) {
            CUresult mrc;
            for (struct mapping *n = p->maps; n != m; n = n->next) {   /* put back what was unmapped */
                if ((mrc = REAL(cuMemMap)(n->va, n->size, n->offset, p->real, 0)) != CUDA_SUCCESS ||
                    (n->ndesc && (mrc = REAL(cuMemSetAccess)(n->va, n->size, n->desc, (size_t)n->ndesc)) != CUDA_SUCCESS))
                    gpucr_cu_warn(mrc, "mapping 0x%llx again after a failed release", (unsigned long long)n->va);
            }
            return rc;
        }
    }
    reg_lock();
    int refs = p->kind == PHYS_CONVERTED ? 1 : p->app_refs;
    CUmemGenericAllocationHandle real = p->real;
    reg_set_real(p, 0);
    reg_alloc_move(p, AL_HANDED);
    reg_unlock();
    handle_release(real, refs, p);
    return CUDA_SUCCESS;
}

/* Every released allocation mapped again from the agent's own fd of it (the memory never left the GPU; an import
 * is its exporter's memory, held by the same fd it was imported from): a handover undone. Those whose memory
 * cannot be had back stay released: -1, and err says the first. */
int handle_take_back_all(char *err, size_t errlen)
{
    CUresult first = CUDA_SUCCESS;
    for (struct phys *p = g_reg.all; p; p = p->next_all) {
        if (!reg_phys_released(p) || p->own_fd < 0) continue;
        gpucr_use_ctx(p->ctx);
        CUmemGenericAllocationHandle h = 0;
        CUresult rc = handle_import_at(p, p->own_fd, &h);
        if (rc != CUDA_SUCCESS) {
            if (first == CUDA_SUCCESS)
                snprintf(err, errlen, "taking back %zu MiB at 0x%llx failed: %s", p->size >> 20,
                       (unsigned long long)(p->maps ? p->maps->va : 0), gpucr_cu_errstr(rc));
            first = rc;
            continue;
        }
        if (p->kind == PHYS_IMPORTED) handle_linked(p, h);
        else handle_back_in_place(p, h, p->own_fd, true, p->adopted);   /* the same fd: the same memory */
    }
    return first == CUDA_SUCCESS ? 0 : -1;
}
