/* What the agent reports to a controller: hello and status (the channel's own state handed in by verbs.c), the
 * GPUs it uses, and its listings with fds over SCM_RIGHTS (docs/server.md, "Handing the fds to a controller"): the
 * memory it manages, for a gpucr data plane to import, and the memory it shares with other processes. Each page
 * is bounded (docs/security.md); the registry lock is held while a page is written. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sys/resource.h>
#include <stdio.h>
#include <unistd.h>
#include "dataplane.h"
#include "pool.h"
#include "registry.h"
#include "report.h"
#include "settings.h"
#include "staging.h"

#define PROTOCOL 4                 /* gpucr/agent.py PROTOCOL: the controller refuses any other */

static char g_group[128];   /* GPUCR_GROUP, read once at start: the application may change its environment later */

void report_read_group(void)
{
    /* checked against settings.def: a name longer than g_group holds is refused with a warning, not cut */
    _Static_assert(sizeof g_group == 127 + 1, "GPUCR_GROUP's most in settings.def");
    snprintf(g_group, sizeof g_group, "%s", gpucr_setting_str(SET_GROUP));
}

/* Whether the process has loaded a CUDA driver, through the agent or on its own. */
bool report_cuda_present(void)
{
    if (gpucr_cuda_loaded()) return true;
    void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (h) dlclose(h);
    return h != NULL;
}

/* Whether the driver the process loaded is simcuda, the test double: asked of the library itself,
 * also when the process has not called through the agent yet (it may have called cuInit directly). */
static bool simulated_driver(void)
{
    if (gpucr_cuda_loaded() && gpucr_drv.simcudaIsSimulated) return gpucr_drv.simcudaIsSimulated();
    void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (!h) return false;
    int (*is_sim)(void) = (int (*)(void))gpucr_real_dlsym(h, "simcudaIsSimulated");
    dlclose(h);
    return is_sim && is_sim();
}

void report_hello(struct jb *j)
{
    jb_bool(j, "ok", true);
    jb_str(j, "agent", "gpucr");
    jb_int(j, "protocol", PROTOCOL);
    jb_int(j, "pid", getpid());
    jb_int(j, "uid", getuid());
    jb_bool(j, "cuda", report_cuda_present());
    jb_bool(j, "simulated", simulated_driver());
    jb_str(j, "group", g_group);
}

/* The settings by which the data plane makes this process's staging and keeps its host budget, as the process
 * was started with them (its environment may change later; the plane reads them here, never there). */
static void staging_settings_json(struct jb *j)
{
    jb_sub(j, "staging_settings");
    jb_str(j, "staging", gpucr_setting_str(SET_STAGING));
    jb_int(j, "segment_mib", gpucr_setting_int(SET_STAGING_SEGMENT_MIB));
    jb_str(j, "host_budget", gpucr_setting_str(SET_HOST_BUDGET));
    jb_str(j, "test_cgroup_root", gpucr_setting_str(SET_TEST_CGROUP_ROOT));
    jb_end(j);
}

void report_status(struct jb *j, const struct dp_status *st, const struct channel_state *cs)
{
    jb_bool(j, "ok", true);
    jb_int(j, "pid", getpid());
    jb_bool(j, "cuda", report_cuda_present());
    jb_bool(j, "simulated", simulated_driver());
    jb_str(j, "state", dp_checkpointed(st->phase) ? "checkpointed" : "running");
    jb_str(j, "phase", dp_phase_name(st->phase));
    /* between the phases of a checkpoint of several processes: still (gate closed), nothing released */
    jb_str(j, "checkpoint_phase", st->phase == PH_HANDED || st->phase == PH_COPIED ? "handed" :
                                  st->phase == PH_QUIESCED ? "quiesced" : "");
    jb_str(j, "group", g_group);
    jb_bool(j, "staged", dp_staged(st->phase));
    jb_bool(j, "busy", cs->busy);   /* a checkpoint, restore or roll-back is running now */
    jb_bool(j, "rolling_back", cs->rolling_back);
    /* parked on purpose (`gpucr recover` leaves it alone), not by a controller that died or a failed restore */
    int committed = dp_checkpointed(st->phase) ? cs->committed : COMMITTED_NONE;
    jb_bool(j, "committed", committed != COMMITTED_NONE);
    jb_str(j, "committed_level", committed == COMMITTED_FULL ? "full" : committed == COMMITTED_DATA ? "data" : "");
    jb_bool(j, "gate_closed", gpucr_gate_is_closed());
    unsigned long long pbytes, psteps;
    dp_get_progress(&pbytes, &psteps);   /* a controller waiting on another connection watches these move */
    jb_sub(j, "progress");
    jb_int(j, "bytes", (long long)pbytes);
    jb_int(j, "steps", (long long)psteps);
    jb_end(j);
    jb_int(j, "generation", st->generation);
    jb_int(j, "requests_served", (long long)cs->requests_served);   /* this status among them */
    struct pool_stats ps;
    pool_get_stats(&ps, !dp_checkpointed(st->phase));   /* before the registry lock: pool.c takes its own first */
    reg_lock();
    long n = 0, conv = 0, app = 0, kept = 0, pieces = 0, fds = 0;
    size_t moved = 0, left = 0;
    for (struct phys *p = g_reg.all; p; p = p->next_all) {
        n++;
        pieces += p->piece_tail || p->next_piece;
        fds += p->own_fd >= 0;
        if (p->kind == PHYS_CONVERTED) conv++; else if (p->kind == PHYS_APP_VMM) app++;
        if (reg_phys_released(p) || reg_phys_movable(p)) moved += p->size;
        else { kept++; left += p->size; }
    }
    jb_sub(j, "allocations");
    jb_int(j, "tracked", n);
    jb_int(j, "converted", conv);
    jb_int(j, "app_vmm", app);
    jb_int(j, "tracked_bytes", (long long)moved);
    jb_int(j, "vmm_left_to_driver", kept);
    jb_int(j, "vmm_left_to_driver_bytes", (long long)left);
    jb_int(j, "native", g_reg.native_count);
    jb_int(j, "native_bytes", (long long)g_reg.native_bytes);
    jb_int(j, "pool", g_reg.pool_count);
    jb_int(j, "pool_bytes", (long long)g_reg.pool_bytes);
    jb_int(j, "managed", g_reg.managed_count);
    jb_int(j, "managed_bytes", (long long)g_reg.managed_bytes);
    jb_int(j, "ipc_exports", g_reg.ipc_exports);
    jb_int(j, "not_exportable", g_reg.unexportable);
    jb_int(j, "pieces", pieces);   /* each its own memory and fd (alloc.c, GPUCR_PIECE_BYTES) */
    jb_int(j, "own_fds", fds);
    struct rlimit rl;
    jb_int(j, "fd_limit", getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY ? (long long)rl.rlim_cur : 0);
    jb_end(j);
    coverage_json(j, &ps);
    dp_devices_json(j);
    reg_unlock();
    struct staging_info si;
    staging_get_info(&si);
    jb_int(j, "staging_bytes", (long long)si.bytes);
    jb_int(j, "staging_segments", si.segments);
    jb_str(j, "staging", si.kind);
    jb_int(j, "staging_memory_bytes", (long long)si.memory_bytes);   /* the host budget's (not file:DIR) */
    /* what to ask gpucr's data plane to make before the next checkpoint, or before data is read from an image */
    if (st->phase == PH_RUNNING || st->phase == PH_QUIESCED || st->phase == PH_ON_DISK)
        staging_plan_json(j, st->phase != PH_ON_DISK);
    staging_settings_json(j);
    jb_sub(j, "last_cycle_ms");
    jb_dbl(j, "gate", st->last.gate);
    jb_dbl(j, "sync", st->last.sync);
    jb_dbl(j, "release", st->last.release);
    jb_int(j, "bytes_out", (long long)st->last.bytes_out);
    jb_end(j);
    char why[512];
    dp_preflight(why, sizeof why);
    jb_str(j, "refusal", why);
    dp_shared_json(j);
    gpucr_gate_json(j);
}

/* Bytes of the plain allocations in `map` that are on device dev. */
static size_t native_on(const struct hmap *map, int dev)
{
    size_t n = 0;
    uint64_t key;
    void *val;
    for (size_t i = 0; (i = hmap_next(map, i, &key, &val)) < map->cap; i++)
        if (reg_native_dev(val) == dev) n += reg_native_size(val);
    return n;
}

/* The GPUs the process uses, as its contexts were made (the controller checks a restore's
 * --map against them); the caller holds the registry lock. */
void dp_devices_json(struct jb *j)
{
    jb_arr(j, "devices");
    for (int i = 0; i < g_reg.nctx; i++) {
        int k = 0, dev = g_reg.ctxs[i].dev;
        while (k < i && g_reg.ctxs[k].dev != dev) k++;
        if (k < i) continue;   /* a second context on the same device */
        const unsigned char *u = g_reg.ctxs[i].uuid;
        char uuid[48];
        reg_uuid_text(u, uuid);
        size_t bytes = 0, adopted = 0, resident = 0;
        for (struct phys *p = g_reg.all; p; p = p->next_all)
            if (p->kind != PHYS_IMPORTED && p->prop.location.id == dev) {
                bytes += p->size;
                if (p->adopted && !reg_phys_released(p)) adopted += p->size;
                if (p->state == AL_HANDED || p->state == AL_LIVE) resident += p->size;
            }
        jb_sub(j, NULL);
        jb_int(j, "ordinal", dev);
        jb_str(j, "uuid", uuid);
        jb_int(j, "vmm_bytes", (long long)bytes);
        /* held now but made by the gpucr server: per-process counts leave it out, the controller adds it */
        jb_int(j, "adopted_bytes", (long long)adopted);
        /* on the GPU now: live, or handed over but not committed (our fds keep it; a switch's controller died), so
         * a restore makes only the rest */
        jb_int(j, "resident_bytes", (long long)resident);
        jb_int(j, "driver_bytes", (long long)(native_on(&g_reg.native_by_va, dev) + native_on(&g_reg.pool_by_va, dev)));
        jb_end(j);
    }
    jb_arr_end(j);
}

/* ---- memory shared with other processes through POSIX fds (share.c says how it is named) ---- */

/* One page of a listing of the allocations `listed` picks (all when NULL), from the from-th of them on,
 * with at most maxfds fds: `entry` writes one allocation's fields and gives the fd to send with it (-1:
 * none); "total", "fd_index", the closing "next" (-1 after the last page) and the registry lock are the
 * pager's. "total" (how many the whole listing has) comes first: a controller bounds the listing by it. */
static void fd_page(struct jb *j, const char *key, int from, int *fds, int *nfds, int maxfds,
                    bool (*listed)(const struct phys *), int (*entry)(struct jb *, const struct phys *, int index))
{
    *nfds = 0;
    jb_bool(j, "ok", true);
    reg_lock();
    int total = 0;
    for (struct phys *p = g_reg.all; p; p = p->next_all) total += !listed || listed(p);
    jb_int(j, "total", total);
    jb_arr(j, key);
    int k = 0, next = -1;
    for (struct phys *p = g_reg.all; p; p = p->next_all) {
        if (listed && !listed(p)) continue;
        if (k++ < from) continue;
        if (*nfds >= maxfds) { next = k - 1; break; }
        jb_sub(j, NULL);
        int fd = entry(j, p, k - 1);
        jb_int(j, "fd_index", fd >= 0 ? *nfds : -1);
        jb_end(j);
        if (fd >= 0) fds[(*nfds)++] = fd;
    }
    reg_unlock();
    jb_arr_end(j);
    jb_int(j, "next", next);
}

static bool is_shared(const struct phys *p) { return p->share_sid != 0; }

/* a shared allocation, with the agent's own dup of its fd when it still has one (never ours to close) */
static int shared_entry(struct jb *j, const struct phys *p, int index)
{
    (void)index;
    jb_int(j, "sid", p->share_sid);
    jb_str(j, "role", p->kind == PHYS_IMPORTED ? "importer" : "exporter");
    jb_int(j, "key", (long long)p->share_key);
    if (p->kind == PHYS_IMPORTED) jb_int(j, "owner", p->share_owner_pid);
    jb_int(j, "bytes", (long long)p->size);
    return p->share_ndups ? p->share_dups[0] : -1;
}

/* The shared allocations from the n-th on, with the agent's fd of each that still has one (for a
 * controller to compare with other processes'; at most maxfds fds, the rest on a later call). */
int dp_shared_fds(struct jb *j, int from, int *fds, int *nfds, int maxfds)
{
    fd_page(j, "shared", from, fds, nfds, maxfds, is_shared, shared_entry);
    return 0;
}

static const char *kind_name(const struct phys *p)
{
    if (p->pool_seg) return "pool";
    return p->kind == PHYS_CONVERTED ? "converted" : p->kind == PHYS_APP_VMM ? "app_vmm" : "imported";
}

/* a managed allocation, with a dup of the agent's fd of it, sent and then closed: a free on another
 * thread meanwhile cannot make it another file */
static int memory_entry(struct jb *j, const struct phys *p, int index)
{
    int fd = share_dup_own(p);
    jb_int(j, "index", index);
    jb_str(j, "kind", kind_name(p));
    jb_int(j, "bytes", (long long)p->size);
    jb_int(j, "device", reg_ctx_device(p->ctx));   /* the GPU of the context it was made in */
    char uuid[48];
    reg_ctx_uuid(p->ctx, uuid);
    jb_str(j, "uuid", uuid);   /* the same GPU for a process that numbers them otherwise (a server) */
    jb_bool(j, "released", reg_phys_released(p));
    jb_str(j, "state", reg_alloc_state_name(p->state));   /* live | handed | parked */
    jb_bool(j, "not_exportable", p->own_fd_missing);
    jb_bool(j, "movable", reg_phys_movable(p));
    /* a server can take it at a handover (else it refuses), or, released, make it again at a restore */
    jb_bool(j, "handable", reg_phys_released(p) ? dp_makeable(p) : dp_handable(p));
    jb_int(j, "rdma", p->prop.allocFlags.gpuDirectRDMACapable);
    jb_int(j, "compression", p->prop.allocFlags.compressionType);
    jb_int(j, "usage", p->prop.allocFlags.usage);
    jb_arr(j, "maps");
    for (const struct mapping *m = p->maps; m; m = m->next) {
        jb_sub(j, NULL);
        jb_int(j, "va", (long long)m->va);
        jb_int(j, "bytes", (long long)m->size);
        jb_int(j, "offset", (long long)m->offset);
        jb_end(j);
    }
    jb_arr_end(j);
    return fd;
}

int dp_memory_fds(struct jb *j, int from, int *fds, int *nfds, int maxfds)
{
    fd_page(j, "memory", from, fds, nfds, maxfds, NULL, memory_entry);
    return 0;
}

void dp_shared_json(struct jb *j)
{
    jb_arr(j, "shared");
    reg_lock();
    for (struct phys *p = g_reg.all; p; p = p->next_all) {
        if (!p->share_sid) continue;
        jb_sub(j, NULL);
        jb_int(j, "sid", p->share_sid);
        jb_str(j, "role", p->kind == PHYS_IMPORTED ? "importer" : "exporter");
        jb_int(j, "key", (long long)p->share_key);
        if (p->kind == PHYS_IMPORTED) {
            jb_int(j, "owner", p->share_owner_pid);
            jb_int(j, "owner_start", (long long)p->share_owner_start);
        }
        jb_int(j, "bytes", (long long)p->size);
        jb_bool(j, "unlinked", reg_phys_released(p));
        jb_int(j, "open_fds", share_open_fds(p));
        jb_end(j);
    }
    reg_unlock();
    jb_arr_end(j);
}
