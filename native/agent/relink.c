/* Memory shared between processes (POSIX fds), at a restore: an importer's allocation is bound to its exporter's
 * key, the restored exporter exports its memory again, and each importer maps it at its old addresses (relink), or,
 * its exporter gone, gets zeroed memory there instead (orphan); then "resume" opens the gate (dataplane.c). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include "dataplane.h"
#include "handles.h"

/* A controller found which exporter's memory an imported allocation is: give it that key. */
int dp_bind(unsigned sid, unsigned long long key, long owner, unsigned long long owner_start, char *err, size_t errlen)
{
    reg_lock();
    struct phys *p = g_reg.all;
    while (p && p->share_sid != sid) p = p->next_all;
    int rc = 0;
    if (!p || p->kind != PHYS_IMPORTED) rc = (snprintf(err, errlen, "no imported shared allocation %u", sid), -1);
    else { p->share_key = key; p->share_owner_pid = owner; p->share_owner_start = owner_start; }
    reg_unlock();
    return rc;
}

/* Relink and orphan come between a restore that left the gate closed and "resume": only then are
 * the records still (see registry.h), and only then is there anything to do. */
static bool between_restore_and_resume(char *err, size_t errlen)
{
    struct dp_status st;
    dp_get_status(&st);
    if (st.phase == PH_RUNNING && gpucr_gate_is_closed()) return true;
    snprintf(err, errlen, "only between a restore that left the gate closed (open_gate=0) and 'resume'");
    return false;
}

static struct phys *exported_with_key(unsigned long long key)
{
    struct phys *p = g_reg.all;
    while (p && !(p->exported && p->share_key == key)) p = p->next_all;
    return p;
}

/* Asked of a restored exporter, or of one that never stopped (its application runs on, so the
 * record is looked up again after the driver call). */
int dp_export(unsigned long long key, int *fd_out, struct jb *j, char *err, size_t errlen)
{
    reg_lock();
    struct phys *p = exported_with_key(key);
    CUmemGenericAllocationHandle real = p ? p->real : 0;
    CUcontext ctx = p ? p->ctx : NULL;
    /* a dup of the agent's own fd when it has one: memory the gpucr server made is imported here, and the
     * driver does not export an imported handle again */
    int fd = real ? share_dup_own(p) : -1;
    reg_unlock();
    if (!real) { snprintf(err, errlen, "no restored exported allocation with key %llu", key); return -1; }
    if (fd < 0) {
        gpucr_use_ctx(ctx);
        CUresult rc = REAL(cuMemExportToShareableHandle)(&fd, real, 1, 0);
        if (rc != CUDA_SUCCESS) { snprintf(err, errlen, "re-exporting failed: %s", gpucr_cu_errstr(rc)); return -1; }
    }
    reg_lock();
    if ((p = exported_with_key(key))) share_keep_fd(p, fd);   /* for the next checkpoint's matching */
    reg_unlock();
    *fd_out = fd;
    jb_bool(j, "ok", true);
    jb_int(j, "key", (long long)key);
    return 0;
}

/* Whether p is memory imported under `key` that is not linked yet (the key is bound on another
 * connection: read under the lock). */
static bool unlinked_import(struct phys *p, unsigned long long key)
{
    reg_lock();
    bool yes = p->kind == PHYS_IMPORTED && p->share_key == key && reg_phys_released(p);
    reg_unlock();
    return yes;
}

/* Map the exporter's re-exported memory (fd) at the old addresses of every allocation this process
 * imported under that key (it may have imported it more than once). */
int dp_relink(unsigned long long key, int fd, char *err, size_t errlen)
{
    if (!between_restore_and_resume(err, errlen)) return -1;
    int done = 0;
    for (struct phys *p = g_reg.all; p; p = p->next_all) {
        if (!unlinked_import(p, key)) continue;
        gpucr_use_ctx(p->ctx);
        CUmemGenericAllocationHandle h = 0;
        CUresult rc = handle_import_at(p, fd, &h);
        if (rc != CUDA_SUCCESS) {
            snprintf(err, errlen, "relinking shared memory failed: %s", gpucr_cu_errstr(rc));
            return -1;
        }
        reg_lock();
        share_keep_fd(p, fd);
        share_adopt_own(p, fcntl(fd, F_DUPFD_CLOEXEC, 3), true);
        reg_unlock();
        handle_linked(p, h);
        done++;
    }
    if (!done) { snprintf(err, errlen, "no unlinked imported allocation with key %llu", key); return -1; }
    return 0;
}

/* The exporter of memory this process imported under `key` is gone (it died mid-checkpoint), so
 * nothing can be relinked: put zeroed memory of the same size on the same device at the old
 * addresses, with the same access, so the process runs on (its own data intact) instead of
 * waiting for ever with its gate closed. The controller says so in its answer. */
int dp_orphan(unsigned long long key, size_t *bytes, char *err, size_t errlen)
{
    *bytes = 0;
    if (!between_restore_and_resume(err, errlen)) return -1;
    for (struct phys *p = g_reg.all; p; p = p->next_all) {
        if (!unlinked_import(p, key)) continue;
        gpucr_use_ctx(p->ctx);
        CUdevice dev = 0;
        CUresult rc = gpucr_drv.cuCtxGetDevice(&dev);
        CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                    .location = {CU_MEM_LOCATION_TYPE_DEVICE, dev}};
        share_make_exportable(&prop);
        CUmemGenericAllocationHandle h = 0;
        if (rc == CUDA_SUCCESS) rc = REAL(cuMemCreate)(&h, p->size, &prop, 0);
        if (rc == CUDA_SUCCESS && (rc = handle_map_all(p, h)) != CUDA_SUCCESS) handle_release(h, 1, p);
        for (struct mapping *m = p->maps; m && rc == CUDA_SUCCESS; m = m->next) rc = REAL(cuMemsetD8_v2)(m->va, 0, m->size);
        if (rc != CUDA_SUCCESS) {
            snprintf(err, errlen, "replacing shared memory whose exporter is gone failed: %s", gpucr_cu_errstr(rc));
            return -1;
        }
        int own = share_keeps_fd(&prop) ? share_export_own(h) : -1;
        reg_lock();
        p->kind = PHYS_APP_VMM;   /* it is this process's own memory now */
        p->prop = prop;
        p->share_key = 0;
        share_adopt_own(p, own, share_keeps_fd(&prop));
        reg_unlock();
        handle_linked(p, h);
        *bytes += p->size;
    }
    return 0;
}
