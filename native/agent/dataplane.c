/* The agent's side of a checkpoint, as one state machine of the process's phase (the LEGAL table): quiesces the
 * process, hands its memory to gpucr's data plane (which copies it, in another process: docs/server.md), takes it
 * back or adopts the plane's new memory, and hands the staged data to images. Each allocation's own steps are
 * handles.c's; relinking memory shared with other processes is relink.c's. The agent copies nothing and pins
 * nothing itself. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "pool.h"
#include "dataplane.h"
#include "deadline.h"
#include "handles.h"
#include "registry.h"
#include "settings.h"
#include "staging.h"

static struct {
    enum dp_phase phase;
    long generation;
    struct phase_times last;
    struct phase_times pending; /* the phases done so far of a checkpoint in progress */
} g_dp;
/* The data plane runs in one thread at a time (verbs.c's g_op), which reads g_dp freely; what
 * status reports (phase, generation, last) it changes only under this lock, which dp_get_status
 * takes from the channel's other threads. */
static pthread_mutex_t g_dp_mu = PTHREAD_MUTEX_INITIALIZER;
#define DP_SET(...) do { pthread_mutex_lock(&g_dp_mu); __VA_ARGS__; pthread_mutex_unlock(&g_dp_mu); } while (0)

/* ---- the process's phase: every change goes through move(), which refuses one the table does not allow ---- */
static const char *const PHASE_NAME[] = {"running", "quiesced", "handed", "copied", "parked", "on disk"};
#define R 1
/* LEGAL[from][to]. A checkpoint: running (-> quiesced, several processes) -> handed -> copied -> parked (commit);
 * undone before its commit: quiesced, handed or copied -> running (abort: the agent's fds kept the memory). An
 * image: parked -> on disk (staging dropped). A restore: parked or on disk -> running (every allocation adopted,
 * filled from staging or straight from the image; the gate may stay closed for the relink). */
static const bool LEGAL[6][6] = {
    /*              running quiesced handed copied parked on-disk */
    [PH_RUNNING]  = {0,     R,       R,     0,     0,     0},
    [PH_QUIESCED] = {R,     0,       R,     0,     0,     0},
    [PH_HANDED]   = {R,     0,       0,     R,     0,     0},
    [PH_COPIED]   = {R,     0,       0,     0,     R,     0},
    [PH_PARKED]   = {R,     0,       0,     0,     0,     R},
    [PH_ON_DISK]  = {R,     0,       0,     0,     0,     0},
};
#undef R

static void seterr(char *err, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Whether `step` may move the process from its phase to `to`; when not, err names both phases and the step. */
static bool may_move(enum dp_phase to, const char *step, char *err, size_t errlen)
{
    if (LEGAL[g_dp.phase][to]) return true;
    seterr(err, errlen, "%s refused: the process is %s, and %s does not lead from there to %s", step,
           PHASE_NAME[g_dp.phase], step, PHASE_NAME[to]);
    return false;
}

const char *dp_phase_name(enum dp_phase ph) { return PHASE_NAME[ph]; }

/* The move itself, once may_move said yes and the step is done (under the status lock). */
static void move(enum dp_phase to) { DP_SET(g_dp.phase = to); }

static double ms_since(int64_t t0) { return (double)(gpucr_now_ns() - t0) / 1e6; }

/* ---- progress, read by status on another connection while an operation runs ---- */
static unsigned long long g_progress_bytes, g_progress_steps;

static void progress(size_t bytes)
{
    __atomic_add_fetch(&g_progress_bytes, (unsigned long long)bytes, __ATOMIC_RELAXED);
    __atomic_add_fetch(&g_progress_steps, 1, __ATOMIC_RELAXED);
}

void dp_get_progress(unsigned long long *bytes, unsigned long long *steps)
{
    *bytes = __atomic_load_n(&g_progress_bytes, __ATOMIC_RELAXED);
    *steps = __atomic_load_n(&g_progress_steps, __ATOMIC_RELAXED);
}


static void seterr(char *err, size_t len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, len, fmt, ap);
    va_end(ap);
}

static const struct mapping *full_mapping(const struct phys *p)
{
    for (const struct mapping *m = p->maps; m; m = m->next)
        if (m->offset == 0 && m->size == p->size && m->ndesc > 0) return m;
    return NULL;
}

static CUdeviceptr full_mapping_va(const struct phys *p)
{
    const struct mapping *m = full_mapping(p);
    return m ? m->va : 0;
}

static int sync_job(struct deadline_job *j)
{
    for (int i = 0; i < j->nctx; i++) {
        gpucr_use_ctx(j->ctxs[i]);
        CUresult rc = gpucr_drv.cuCtxSynchronize();
        if (rc != CUDA_SUCCESS) { snprintf(j->err, sizeof j->err, "cuCtxSynchronize: %s", gpucr_cu_errstr(rc)); return -1; }
    }
    return 0;
}

/* Memory this process imported and mapped: a checkpoint unlinks it (its exporter saves the data, and a
 * restore relinks it from there). */
static bool unlinked_at_checkpoint(const struct phys *p) { return p->kind == PHYS_IMPORTED && p->maps; }

/* Gate closed, device synchronised, free pool blocks given back; nothing released. Staging is made beforehand by
 * gpucr's data plane (the agent holds it: staging.c). */
int dp_quiesce(int timeout_ms, char *err, size_t errlen)
{
    if (!may_move(PH_QUIESCED, "quiesce", err, errlen)) return -1;
    char why[512];
    dp_preflight(why, sizeof why);
    if (why[0]) { seterr(err, errlen, "refused before touching the process: %s", why); return -1; }

    struct phase_times t = {0};
    CUcontext saved = NULL;
    if (gpucr_drv.cuCtxGetCurrent) gpucr_drv.cuCtxGetCurrent(&saved);
    int64_t deadline = gpucr_now_ns() + (int64_t)timeout_ms * 1000000LL;
    int64_t t0;
    t0 = gpucr_now_ns();
    long left = 0;
    if (!gpucr_gate_close(deadline, &left)) {
        seterr(err, errlen, "%ld CUDA calls were still in flight after %d ms; checkpoint refused, the application runs on",
               left, timeout_ms);
        return -1;
    }
    t.gate = ms_since(t0);
    progress(0);
    t0 = gpucr_now_ns();
    struct deadline_job *sj = job_new(sync_job);
    if (!sj) { gpucr_gate_open(); seterr(err, errlen, "out of host memory"); return -1; }
    sj->ctxs = reg_contexts(&sj->nctx);
    int late = job_run(sj, deadline), src_rc = sj->rc;
    char serr[sizeof sj->err];
    snprintf(serr, sizeof serr, "%s", sj->err);
    job_put(sj);
    t.sync = ms_since(t0);
    progress(0);
    if (late || src_rc) {
        gpucr_gate_open();
        if (late)
            seterr(err, errlen, "device work did not finish within %d ms (a long-running kernel?); checkpoint refused, the application runs on", timeout_ms);
        else
            seterr(err, errlen, "synchronising the device failed: %s; checkpoint refused", serr);
        return -1;
    }
    gpucr_gate_settle();          /* nothing of the application's is pending on the GPU now */
    pool_trim_for_checkpoint();   /* free pool blocks go back now: only memory in use is moved */
    if (saved) gpucr_use_ctx(saved);
    g_dp.pending = t;
    move(PH_QUIESCED);
    return 0;
}

/* Every released allocation mapped again from the agent's own fd of it, the gate opened: the handover undone.
 * Those whose memory cannot be had back stay released and are said. */
static int take_back(char *err, size_t errlen)
{
    size_t given = 0, bytes = 0;
    for (struct phys *p = g_reg.all; p; p = p->next_all)
        if (p->state == AL_GIVEN) { given++; bytes += p->size; }
    if (given) {   /* refused before anything is mapped: the process stays handed over whole, gate closed */
        seterr(err, errlen, "%zu allocations (%zu MiB) were given back before the commit (a two-way switch): their "
               "data is in staging, and they are made again and filled from it first; 'gpucr restore' does", given,
               bytes >> 20);
        return -1;
    }
    if (handle_take_back_all(err, errlen)) return -1;
    staging_rewind();
    move(PH_RUNNING);
    gpucr_gate_open();
    return 0;
}

/* Undo a quiesce (nothing left the device, so reopening the gate is all) or an uncommitted handover (the agent's
 * fds kept the memory on the GPU: mapped again). A committed checkpoint is undone only by a restore. */
int dp_abort(char *err, size_t errlen)
{
    if (g_dp.phase == PH_RUNNING || g_dp.phase == PH_PARKED || g_dp.phase == PH_ON_DISK) {
        seterr(err, errlen, "no checkpoint in progress to abort (the process is %s)", PHASE_NAME[g_dp.phase]);
        return -1;
    }
    if (!may_move(PH_RUNNING, "abort", err, errlen)) return -1;
    if (g_dp.phase != PH_QUIESCED) return take_back(err, errlen);
    move(PH_RUNNING);
    staging_rewind();
    gpucr_gate_open();
    return 0;
}


/* Each movable allocation's place in the staging the plane made for it, from its start: *need, their bytes; -1 with
 * err set when one has no place (the process allocated since its staging was made). */
static int place_in_staging(bool at_checkpoint, size_t *need, char *err, size_t errlen)
{
    staging_rewind();
    for (struct phys *p = g_reg.all; p; p = p->next_all) {
        if (!reg_phys_movable(p) || reg_phys_released(p) == at_checkpoint) continue;
        int seg = -1;
        size_t off = 0;
        if (staging_take(p->size, &seg, &off)) {
            seterr(err, errlen, "staging has no room for an allocation of %zu MiB (made since gpucr's data plane made "
                   "the staging, or the staging was never made); retry: the next %s asks for more", p->size >> 20,
                   at_checkpoint ? "checkpoint" : "restore");
            return -1;
        }
        reg_lock();
        p->staging_seg = seg + 1;
        p->staging_off = off;
        reg_unlock();
        *need += p->size;
    }
    return 0;
}

/* The end of a restore, once the data plane's new memory is adopted (dp_adopt): every allocation the checkpoint
 * released is back, except memory imported from another process (relinked next, then "resume"). Nothing is
 * copied here: what is not back leaves the process checkpointed, its data still in staging. */
int dp_restore(bool drop_staging, bool open_gate, char *err, size_t errlen)
{
    if (g_dp.phase == PH_HANDED || g_dp.phase == PH_COPIED) {
        seterr(err, errlen, "its checkpoint was never committed: take it back with 'abort' (the memory never left the GPU)");
        return -1;
    }
    if (!may_move(PH_RUNNING, "restore", err, errlen)) return -1;
    size_t missing = 0;
    CUdeviceptr first = 0;
    bool unlinked = false;
    for (struct phys *p = g_reg.all; p; p = p->next_all) {
        if (reg_phys_released(p) && p->kind != PHYS_IMPORTED && !missing++) first = full_mapping_va(p);
        if (reg_phys_released(p) && p->kind == PHYS_IMPORTED) unlinked = true;
    }
    if (missing) {
        seterr(err, errlen, "%zu allocations (the first at 0x%llx) were not brought back by gpucr's data plane; the process "
               "stays checkpointed: run 'gpucr restore' again", missing, (unsigned long long)first);
        return -1;
    }
    if (unlinked && open_gate) {
        seterr(err, errlen, "memory this process imported from another is not relinked yet: restore its exporter together "
               "with it ('gpucr restore' of both processes)");
        return -1;
    }
    for (struct phys *p = g_reg.all; p; p = p->next_all) p->adopt_pending = false;
    reg_refresh_devices();   /* the driver's restore may have put the process on other GPUs (--map) */
    move(PH_RUNNING);
    if (open_gate) gpucr_gate_open();   /* else: shared memory is relinked first, then "resume" */
    /* policy: keep staging for the next cycle (fast) or give the host memory back */
    if (drop_staging || !strcmp(gpucr_setting_str(SET_STAGING_POLICY), "drop")) staging_drop();
    return 0;
}

void dp_get_status(struct dp_status *out)
{
    pthread_mutex_lock(&g_dp_mu);
    out->phase = g_dp.phase;
    out->generation = g_dp.generation;
    out->last = g_dp.last;
    pthread_mutex_unlock(&g_dp_mu);
}

void dp_reset_after_fork(void)
{
    /* the parent's staging is not the child's: forget it without driver calls */
    staging_reset_after_fork();
    memset(&g_dp, 0, sizeof g_dp);
    g_dp_mu = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
}

/* ---- the data handed to gpucr's data plane (docs/server.md): it copies the memory, through the agent's fds,
 * while the driver checkpoints the process, and at restore it makes and fills new memory whose fds the agent
 * maps at the old addresses (dp_adopt). The agent's own fd of each allocation keeps the memory on the GPU
 * until the checkpoint is committed (dp_commit): a controller or server that dies before leaves nothing lost,
 * the agent takes the memory back, with no copy (take_back). ---- */

/* Memory the server can make again as it was: device memory shared with no other process in a way gpucr cannot
 * relink (its allocation flags, e.g. GPUDirect RDMA as PyTorch's expandable segments ask, are listed for the
 * server: memory_entry). Memory exported to other processes is too: copied once, from its exporter. */
bool dp_makeable(const struct phys *p)
{
    return !p->share_unknown && p->prop.type == CU_MEM_ALLOCATION_TYPE_PINNED &&
           p->prop.location.type == CU_MEM_LOCATION_TYPE_DEVICE;
}

/* ... and that it can take at a handover: with the agent's fd of it. */
bool dp_handable(const struct phys *p) { return p->own_fd >= 0 && dp_makeable(p); }

int dp_handover(int timeout_ms, bool to_image, char *err, size_t errlen)
{
    if (!may_move(PH_HANDED, "handover", err, errlen)) return -1;
    /* checked before anything is touched, the named refusals (coverage.c) first: what the data plane cannot take
     * is refused. An import is unlinked with no copy (its exporter's memory), kept on the GPU by the agent's fd
     * of it until the checkpoint is committed, so an abort maps it again from that fd. */
    char why[512];
    dp_preflight(why, sizeof why);
    if (why[0]) { seterr(err, errlen, "refused before touching the process: %s", why); return -1; }
    reg_lock();
    long no = 0, imports = 0;
    for (struct phys *p = g_reg.all; p; p = p->next_all) {
        if (reg_phys_movable(p) && !dp_handable(p)) no++;
        else if (unlinked_at_checkpoint(p) && p->own_fd < 0) imports++;
    }
    reg_unlock();
    if (no || imports) {
        seterr(err, errlen, "gpucr's data plane cannot take every allocation (%ld without an fd of the agent's, e.g. for "
               "lack of file descriptors (raise 'ulimit -n'), or not plain device memory; %ld imported without one); "
               "checkpoint refused, the application runs on", no, imports);
        return -1;
    }
    if (g_dp.phase != PH_QUIESCED && dp_quiesce(timeout_ms, err, errlen)) return -1;
    struct phase_times t = g_dp.pending;
    CUcontext saved = NULL;
    if (gpucr_drv.cuCtxGetCurrent) gpucr_drv.cuCtxGetCurrent(&saved);
    size_t need = 0;
    if (to_image) {   /* written by the plane straight to an image: no place in staging (layout lists them at -1) */
        reg_lock();
        for (struct phys *p = g_reg.all; p; p = p->next_all)
            if (reg_phys_movable(p)) { p->staging_seg = 0; need += p->size; }
        reg_unlock();
    } else if (place_in_staging(true, &need, err, errlen)) {
        char e2[256] = "";
        take_back(e2, sizeof e2);   /* nothing was released: the gate opens again */
        if (saved) gpucr_use_ctx(saved);
        return -1;
    }
    CUresult rc = CUDA_SUCCESS;
    int64_t t0 = gpucr_now_ns();
    for (struct phys *p = g_reg.all; p && rc == CUDA_SUCCESS; p = p->next_all)
        if ((reg_phys_movable(p) || unlinked_at_checkpoint(p)) && (rc = handle_hand_over(p)) == CUDA_SUCCESS) progress(0);
    t.release = ms_since(t0);
    t.bytes_out = need;
    if (rc != CUDA_SUCCESS) {
        char e2[256] = "";
        take_back(e2, sizeof e2);
        if (saved) gpucr_use_ctx(saved);
        seterr(err, errlen, "handing the memory to the gpucr server failed: %s; the application runs on%s%s",
               gpucr_cu_errstr(rc), e2[0] ? " (" : "", e2);
        return -1;
    }
    if (saved) gpucr_use_ctx(saved);
    DP_SET(g_dp.pending = t, g_dp.phase = PH_HANDED);
    return 0;
}

/* The data plane's copy is in staging. The agent's fds still keep the memory on the GPU, until dp_commit. */
int dp_handed_done(char *err, size_t errlen)
{
    if (!may_move(PH_COPIED, "handed_done", err, errlen)) return -1;
    struct phase_times t = g_dp.pending;
    DP_SET(g_dp.phase = PH_COPIED, g_dp.last = t, g_dp.generation++);
    gpucr_log("checkpointed %llu bytes through gpucr's data plane: gate %.1f ms, sync %.1f ms, release %.1f ms",
              (unsigned long long)t.bytes_out, t.gate, t.sync, t.release);
    return 0;
}

/* The checkpoint is committed: the agent's fds let go (those of exported and imported memory too), so the
 * memory leaves the GPU once the data plane has let go of its own. */
void dp_commit(void)
{
    if (g_dp.phase != PH_COPIED) return;   /* nothing handed over under this lease */
    reg_lock();
    for (struct phys *p = g_reg.all; p; p = p->next_all)
        if ((p->state == AL_HANDED || p->state == AL_GIVEN) && reg_alloc_move(p, AL_PARKED)) share_release(p);
    reg_unlock();
    move(PH_PARKED);
}

/* At restore, after the driver's: the server made and filled new memory for the released allocations
 * from index `from` on, in order, one fd each; each is mapped at its old addresses with its old access,
 * and the fd kept as the agent's own (an imported handle cannot be exported again). */
int dp_adopt(int from, const int *fds, int nfds, int *adopted, char *err, size_t errlen)
{
    *adopted = 0;
    /* handed over and not committed: only what was given back early is adopted (a two-way switch rolled back) */
    bool given_only = g_dp.phase == PH_HANDED || g_dp.phase == PH_COPIED;
    if (g_dp.phase != PH_PARKED && g_dp.phase != PH_ON_DISK && !given_only) {
        seterr(err, errlen, "adopt refused: the process is %s, not parked", PHASE_NAME[g_dp.phase]);
        return -1;
    }
    int k = 0, i = 0;
    for (struct phys *p = g_reg.all; p && i < nfds; p = p->next_all, k++) {
        if (k < from || !reg_phys_released(p) || p->kind == PHYS_IMPORTED) continue;
        if (given_only && p->state != AL_GIVEN) continue;
        gpucr_use_ctx(p->ctx);
        CUmemGenericAllocationHandle h = 0;
        CUresult rc = handle_import_at(p, fds[i], &h);
        if (rc != CUDA_SUCCESS) {
            seterr(err, errlen, "mapping the server's memory at 0x%llx (%zu MiB) failed: %s; the process stays checkpointed",
                   (unsigned long long)(p->maps ? p->maps->va : 0), p->size >> 20, gpucr_cu_errstr(rc));
            return -1;
        }
        handle_back_in_place(p, h, fcntl(fds[i], F_DUPFD_CLOEXEC, 3), share_keeps_fd(&p->prop), true);
        p->adopt_pending = !given_only;   /* a roll-back's adoption is not undone: the abort follows it */
        i++;
        (*adopted)++;
        progress(p->size);
    }
    if (i < nfds) { seterr(err, errlen, "%d fds more than released allocations from index %d on", nfds - i, from); return -1; }
    return 0;
}

/* Each handed allocation numbered below `upto` let go now: its copy is in staging (the plane says so), and memory
 * another app waits for on the same GPU leaves it as soon as the plane lets go of its own handle too. Memory shared
 * with another process is never given back early (refused, nothing touched): its importers map it still. */
int dp_give_back(int upto, int *given, size_t *bytes, char *err, size_t errlen)
{
    *given = 0;
    *bytes = 0;
    if (g_dp.phase != PH_HANDED && g_dp.phase != PH_COPIED) {
        seterr(err, errlen, "give_back refused: the process is %s, not handed over", PHASE_NAME[g_dp.phase]);
        return -1;
    }
    reg_lock();
    int k = 0;
    for (struct phys *p = g_reg.all; p && k < upto; p = p->next_all, k++)
        if (p->state == AL_HANDED && (p->kind == PHYS_IMPORTED || p->share_sid || p->exported)) {
            reg_unlock();
            seterr(err, errlen, "give_back refused: allocation %d is shared with another process", k);
            return -1;
        }
    k = 0;
    for (struct phys *p = g_reg.all; p && k < upto; p = p->next_all, k++) {
        if (p->state != AL_HANDED || !reg_alloc_move(p, AL_GIVEN)) continue;
        share_adopt_own(p, -1, false);   /* its fd closed: nothing of ours keeps it on the GPU */
        (*given)++;
        *bytes += p->size;
        progress(p->size);
    }
    reg_unlock();
    return 0;
}

/* The restore's fill was refused after some of its memory was adopted (a controller adopts while the plane's copies
 * still run, then the plane's check of the copied bytes failed): each allocation adopted since is given back, its
 * mappings undone and the agent's fd closed, so the process is parked as before that restore, its data still in
 * staging. The plane then lets go of its own fds, and the memory leaves the GPU. */
int dp_unadopt(int *undone, char *err, size_t errlen)
{
    *undone = 0;
    if (g_dp.phase != PH_PARKED) {
        seterr(err, errlen, "unadopt refused: the process is %s, not parked", PHASE_NAME[g_dp.phase]);
        return -1;
    }
    for (struct phys *p = g_reg.all; p; p = p->next_all) {
        if (!p->adopt_pending) continue;
        CUresult rc = handle_hand_over(p);
        if (rc != CUDA_SUCCESS) {
            seterr(err, errlen, "giving back the memory adopted at 0x%llx (%zu MiB) failed: %s",
                   (unsigned long long)(p->maps ? p->maps->va : 0), p->size >> 20, gpucr_cu_errstr(rc));
            return -1;
        }
        reg_lock();
        if (reg_alloc_move(p, AL_PARKED)) share_release(p);
        p->adopt_pending = false;
        reg_unlock();
        (*undone)++;
    }
    return 0;
}

/* ---- handing the staged data to the controller (images) ---- */

int dp_layout(struct jb *j, int *fds, int *nfds, int maxfds, char *err, size_t errlen)
{
    /* while it runs: the segments prepared so far (a gpucr server pins them ahead), with no allocations. An
     * allocation with no place in staging is at segment -1: on disk (a controller fills it from the image), or
     * handed over to be written straight to an image */
    (void)err; (void)errlen;
    size_t sizes[STAGING_MAX_SEGS];
    const char *kinds[STAGING_MAX_SEGS];
    *nfds = staging_segments(fds, sizes, kinds, maxfds);
    jb_bool(j, "ok", true);
    jb_int(j, "generation", g_dp.generation);
    jb_arr(j, "segments");
    for (int i = 0; i < *nfds; i++) {
        jb_sub(j, NULL);
        jb_int(j, "index", i);
        jb_int(j, "bytes", (long long)sizes[i]);
        jb_str(j, "kind", kinds[i]);
        jb_end(j);
    }
    jb_arr_end(j);
    jb_arr(j, "allocations");
    reg_lock();
    int index = -1;
    for (struct phys *p = g_reg.all; p; p = p->next_all) {
        index++;
        if (!reg_phys_released(p)) continue;
        int seg = -1;
        size_t off = 0;   /* where in staging: an allocation with none was not moved (an import) */
        if (p->kind == PHYS_IMPORTED) continue;   /* unlinked, not moved: its exporter's */
        if (p->staging_seg) {
            seg = p->staging_seg - 1;
            off = p->staging_off;
        }
        jb_sub(j, NULL);
        jb_int(j, "index", index);   /* as the memory verb numbers it */
        jb_int(j, "va", (long long)full_mapping_va(p));
        jb_int(j, "bytes", (long long)p->size);
        jb_str(j, "kind", p->kind == PHYS_CONVERTED ? "converted" : "app_vmm");
        jb_int(j, "segment", seg);
        jb_int(j, "offset", (long long)off);
        jb_end(j);
    }
    reg_unlock();
    jb_arr_end(j);
    return 0;
}

int dp_drop_staged(char *err, size_t errlen)
{
    if (!may_move(PH_ON_DISK, "drop", err, errlen)) return -1;
    reg_lock();
    for (struct phys *p = g_reg.all; p; p = p->next_all) p->staging_seg = 0;
    reg_unlock();
    staging_drop();
    move(PH_ON_DISK);
    return 0;
}

/* Hold the staging segments gpucr's data plane made (staging_hold), while no data waits in staging: the process
 * runs (or is quiesced, staging not placed yet), or its data is only in an image. */
int dp_hold(const int *fds, int n, bool replace, int entry_fd, char *err, size_t errlen)
{
    bool idle = g_dp.phase == PH_RUNNING || g_dp.phase == PH_ON_DISK || (g_dp.phase == PH_QUIESCED && !replace);
    if (!idle && g_dp.phase != PH_PARKED) {   /* another controller's checkpoint got there first */
        seterr(err, errlen, "busy: another checkpoint of this process is in progress (it is %s)", PHASE_NAME[g_dp.phase]);
        return -1;
    }
    if (!idle) {
        seterr(err, errlen, "hold refused: the process is %s, and its staging holds its data", PHASE_NAME[g_dp.phase]);
        return -1;
    }
    return staging_hold(fds, n, replace, entry_fd, err, errlen);
}

int dp_resume(char *err, size_t errlen)
{
    if (g_dp.phase != PH_RUNNING) { seterr(err, errlen, "the process is not restored yet"); return -1; }
    for (struct phys *p = g_reg.all; p; p = p->next_all)
        if (reg_phys_released(p)) { seterr(err, errlen, "shared memory is not relinked yet"); return -1; }
    gpucr_gate_open();
    return 0;
}
