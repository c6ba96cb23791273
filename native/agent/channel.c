/* The control channel: one Unix socket per process, <runtime dir>/<pid>-<pid namespace inode>.sock,
 * in a directory only its user can enter. Requests are single lines "VERB key=value ...", at most
 * 4 KiB; each answer is one JSON line. Only the same user or root may connect (SO_PEERCRED).
 * docs/security.md says what each check stops. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include "admit.h"
#include "dataplane.h"
#include "pool.h"
#include "registry.h"
#include "settings.h"
#include "staging.h"
#include "json.h"

#define MAX_REQUEST 4096
#define MAX_CLIENTS 8
#define PROTOCOL 4                 /* gpucr/agent.py PROTOCOL: the controller refuses any other */
#define IDLE_TIMEOUT_S 30          /* a connection that never asked for a change (status, a monitor) */
#define EVICT_GRACE_MS 500         /* an idle connection younger than this is not evicted */
#define ACTED_TIMEOUT_S 3600       /* a controller's connection between its steps (driver lock, checkpoint) */

static char g_sock[300];
static ino_t g_sock_ino;           /* what we bound: at exit only that is removed */
static char g_group[128];   /* GPUCR_GROUP, read once at start: the application may change its environment later */
static int g_listen = -1;
static pthread_mutex_t g_op = PTHREAD_MUTEX_INITIALIZER;   /* one change (checkpoint, restore...) at a time */
/* Changes hold it for writing; a read of the staging's layout for reading, and only if no change holds or
 * waits for it: a reader (a gpucr server's pin-ahead loop, `gpucr status`) never makes a change "busy". */
static pthread_rwlock_t g_state = PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP;
static atomic_bool g_changing;       /* status's "busy": a change holds g_op (read without taking it) */
static atomic_bool g_rolling_back;   /* status says so: a new controller waits for it instead of "busy" */
/* The checkpoint held now was committed by its controller (on purpose), at this level; the driver's state tells
 * whether it is still as that controller left it (a restore killed after the driver's steps leaves it "running"). */
enum committed { COMMITTED_NONE, COMMITTED_DATA, COMMITTED_FULL };
static atomic_int g_committed;
/* requests served since the channel started (a fork child counts its own), status says it: a test caps the
 * round trips a checkpoint and a restore take, so that no move adds one unseen */
static atomic_ulong g_requests_served;
static pthread_mutex_t g_clients_mu = PTHREAD_MUTEX_INITIALIZER;


/* Whether the process has loaded a CUDA driver, through the agent or on its own. */
static bool cuda_present(void)
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

static void reply_hello(struct jb *j)
{
    jb_bool(j, "ok", true);
    jb_str(j, "agent", "gpucr");
    jb_int(j, "protocol", PROTOCOL);
    jb_int(j, "pid", getpid());
    jb_int(j, "uid", getuid());
    jb_bool(j, "cuda", cuda_present());
    jb_bool(j, "simulated", simulated_driver());
    jb_str(j, "group", g_group);
}

static void reply_status(struct jb *j)
{
    struct dp_status st;
    dp_get_status(&st);
    jb_bool(j, "ok", true);
    jb_int(j, "pid", getpid());
    jb_bool(j, "cuda", cuda_present());
    jb_bool(j, "simulated", simulated_driver());
    jb_str(j, "state", dp_checkpointed(st.phase) ? "checkpointed" : "running");
    jb_str(j, "phase", dp_phase_name(st.phase));
    /* between the phases of a checkpoint of several processes: still (gate closed), nothing released */
    jb_str(j, "checkpoint_phase", st.phase == PH_HANDED || st.phase == PH_COPIED ? "handed" :
                                  st.phase == PH_QUIESCED ? "quiesced" : "");
    jb_str(j, "group", g_group);
    jb_bool(j, "staged", dp_staged(st.phase));
    jb_bool(j, "busy", atomic_load(&g_changing));   /* a checkpoint, restore or roll-back is running now */
    jb_bool(j, "rolling_back", atomic_load(&g_rolling_back));
    /* parked on purpose (`gpucr recover` leaves it alone), not by a controller that died or a failed restore */
    int committed = dp_checkpointed(st.phase) ? atomic_load(&g_committed) : COMMITTED_NONE;
    jb_bool(j, "committed", committed != COMMITTED_NONE);
    jb_str(j, "committed_level", committed == COMMITTED_FULL ? "full" : committed == COMMITTED_DATA ? "data" : "");
    jb_bool(j, "gate_closed", gpucr_gate_is_closed());
    unsigned long long pbytes, psteps;
    dp_get_progress(&pbytes, &psteps);   /* a controller waiting on another connection watches these move */
    jb_sub(j, "progress");
    jb_int(j, "bytes", (long long)pbytes);
    jb_int(j, "steps", (long long)psteps);
    jb_end(j);
    jb_int(j, "generation", st.generation);
    jb_int(j, "requests_served", (long long)atomic_load(&g_requests_served));   /* this status among them */
    struct pool_stats ps;
    pool_get_stats(&ps, !dp_checkpointed(st.phase));   /* before the registry lock: pool.c takes its own first */
    reg_lock();
    long n = 0, conv = 0, app = 0, kept = 0;
    size_t moved = 0, left = 0;
    for (struct phys *p = g_reg.all; p; p = p->next_all) {
        n++;
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
    jb_end(j);
    coverage_json(j, &ps);
    dp_devices_json(j);
    reg_unlock();
    struct staging_info si;
    staging_get_info(&si);
    jb_int(j, "staging_bytes", (long long)si.bytes);
    jb_int(j, "staging_segments", si.segments);
    jb_str(j, "staging", si.kind);
    admit_status_json(j, si.memory_bytes);
    jb_sub(j, "last_cycle_ms");
    jb_dbl(j, "staging", st.last.staging);
    jb_dbl(j, "gate", st.last.gate);
    jb_dbl(j, "sync", st.last.sync);
    jb_dbl(j, "release", st.last.release);
    jb_int(j, "bytes_out", (long long)st.last.bytes_out);
    jb_end(j);
    char why[512];
    dp_preflight(why, sizeof why);
    jb_str(j, "refusal", why);
    dp_shared_json(j);
    gpucr_gate_json(j);
}

static long long arg_ll(const char *req, const char *key, long long dflt, long long max)
{
    char pat[64];
    snprintf(pat, sizeof pat, " %s=", key);
    const char *p = strstr(req, pat);
    if (!p) return dflt;
    char *end;
    long long v = strtoll(p + strlen(pat), &end, 10);
    if (end == p + strlen(pat) || (*end && *end != ' ') || v < 0 || v > max) return -1;
    return v;
}

/* a flag or a count of milliseconds (at most a day); -1 when malformed */
static int arg_int(const char *req, const char *key, int dflt) { return (int)arg_ll(req, key, dflt, 24LL * 3600 * 1000); }

#define reply_error jb_error

/* fds a request may carry: one for a relink, a batch of new memory for adopt */
#define MAX_IN_FDS 64

/* One connection. A checkpoint asked for with lease=1 belongs to its connection until the
 * controller says "commit": if the connection ends first (the controller died), the agent rolls
 * the process back to running by itself. */
struct client {
    int fd;
    bool lease;                 /* this connection's checkpoint is not committed yet */
    bool stage_lease;           /* it made staging to fill from an image, not used yet: dropped if it ends first */
    int fds[STAGING_MAX_SEGS];  /* to send with the answer (SCM_RIGHTS) */
    int nfds;
    bool close_sent;            /* the fds sent are ours to close afterwards (a re-export) */
    int in[MAX_IN_FDS];         /* received with the request (SCM_RIGHTS) */
    int nin;
    bool acted;                 /* it asked for a change (handle_op): a controller, never evicted as idle */
    int slot;                   /* its place in g_slots while it holds it */
    unsigned long id;
};

#define BUSY "busy: another checkpoint or restore of this process is in progress"

/* A change takes g_op (`wait`: blocking, else a second controller is told "busy"), then the state lock once the
 * layout reads in flight are done (they are short). */
static bool begin_change(bool wait)
{
    if (wait) pthread_mutex_lock(&g_op);
    else if (pthread_mutex_trylock(&g_op) != 0) return false;
    pthread_rwlock_wrlock(&g_state);
    atomic_store(&g_changing, true);
    return true;
}

static void end_change(void)
{
    atomic_store(&g_changing, false);
    pthread_rwlock_unlock(&g_state);
    pthread_mutex_unlock(&g_op);
}

/* The staging's segments and where each allocation lies in them: read while no change runs, and refused as
 * "busy" (never waited for) while one does. */
static void handle_layout(struct jb *j, struct client *c)
{
    if (!cuda_present()) { reply_error(j, "the process has not loaded the CUDA driver: nothing to checkpoint"); return; }
    if (pthread_rwlock_tryrdlock(&g_state) != 0) { reply_error(j, BUSY); return; }
    char err[600] = "";
    if (dp_layout(j, c->fds, &c->nfds, STAGING_MAX_SEGS, err, sizeof err)) { c->nfds = 0; reply_error(j, err); }
    pthread_rwlock_unlock(&g_state);
}

/* Starts a new checkpoint, or a step of a restore or abort: the committed one is no longer as its controller left it
 * (a restore's controller that dies after its `adopt` leaves it half restored, stuck). */
static bool leaves_a_committed_checkpoint(const char *verb)
{
    static const char *const verbs[] = {"quiesce", "handover", "restore", "adopt", "relink", "orphan", "resume", "abort"};
    for (size_t i = 0; i < sizeof verbs / sizeof *verbs; i++)
        if (!strcmp(verb, verbs[i])) return true;
    return false;
}

/* Requests that change the process: one at a time (a second controller is told "busy"). */
static void handle_op(const char *verb, const char *req, struct jb *j, struct client *c)
{
    int timeout_ms = arg_int(req, "timeout_ms", 30000);
    int drop = arg_int(req, "drop_staging", 0), lease = arg_int(req, "lease", 0);
    if (timeout_ms <= 0) { reply_error(j, "timeout_ms must be a positive number of milliseconds"); return; }
    if (drop < 0 || drop > 1 || lease < 0 || lease > 1) {
        reply_error(j, "drop_staging and lease must be 0 or 1");
        return;
    }
    if (!cuda_present()) { reply_error(j, "the process has not loaded the CUDA driver: nothing to checkpoint"); return; }
    c->acted = true;
    if (!begin_change(false)) { reply_error(j, BUSY); return; }
    if (leaves_a_committed_checkpoint(verb)) atomic_store(&g_committed, COMMITTED_NONE);   /* a failed restore leaves it stuck */
    gpucr_init();
    char err[600] = "";
    int rc;
    bool status_after = true;
    if (!strcmp(verb, "quiesce")) {
        /* staging ready, gate closed, device still: the first phase of a checkpoint of several processes */
        rc = dp_quiesce(timeout_ms, err, sizeof err);
        if (rc == 0 && lease) c->lease = true;
    } else if (!strcmp(verb, "handover")) {
        /* gpucr's data plane copies the data (docs/server.md); lease=1: undone unless committed */
        rc = dp_handover(timeout_ms, err, sizeof err);
        if (rc == 0 && lease) c->lease = true;
    } else if (!strcmp(verb, "handed_done")) {
        rc = dp_handed_done(err, sizeof err);
    } else if (!strcmp(verb, "adopt")) {
        long long from = arg_ll(req, "from", -1, INT32_MAX);
        int adopted = 0;
        rc = from < 0 ? (snprintf(err, sizeof err, "adopt takes from=INDEX and the new memory's fds"), -1)
                      : dp_adopt((int)from, c->in, c->nin, &adopted, err, sizeof err);
        if (rc == 0) { jb_bool(j, "ok", true); jb_int(j, "adopted", adopted); }
        status_after = false;
    } else if (!strcmp(verb, "abort")) {
        rc = dp_abort(err, sizeof err);
        if (rc == 0) c->lease = false;
    } else if (!strcmp(verb, "restore")) {
        int open_gate = arg_int(req, "open_gate", 1);
        rc = open_gate < 0 || open_gate > 1 ? (snprintf(err, sizeof err, "open_gate must be 0 or 1"), -1)
                                             : dp_restore(drop == 1, open_gate == 1, err, sizeof err);
        if (rc == 0) c->lease = false;
    } else if (!strcmp(verb, "drop")) {
        rc = dp_drop_staged(err, sizeof err);
    } else if (!strcmp(verb, "export")) {
        long long key = arg_ll(req, "key", -1, INT64_MAX);
        int fd = -1;
        rc = key <= 0 ? (snprintf(err, sizeof err, "export takes key=KEY of an exported allocation"), -1)
                      : dp_export((unsigned long long)key, &fd, j, err, sizeof err);
        if (rc == 0) { c->fds[0] = fd; c->nfds = 1; c->close_sent = true; }
        status_after = false;
    } else if (!strcmp(verb, "relink")) {
        long long key = arg_ll(req, "key", -1, INT64_MAX);
        if (c->nin < 1) rc = (snprintf(err, sizeof err, "relink needs the shared memory's file descriptor attached"), -1);
        else if (key <= 0) rc = (snprintf(err, sizeof err, "relink takes key=KEY"), -1);
        else rc = dp_relink((unsigned long long)key, c->in[0], err, sizeof err);
    } else if (!strcmp(verb, "orphan")) {
        long long key = arg_ll(req, "key", -1, INT64_MAX);
        size_t bytes = 0;
        rc = key <= 0 ? (snprintf(err, sizeof err, "orphan takes key=KEY"), -1)
                      : dp_orphan((unsigned long long)key, &bytes, err, sizeof err);
        if (rc == 0) { jb_bool(j, "ok", true); jb_int(j, "bytes", (long long)bytes); }
        status_after = false;
    } else if (!strcmp(verb, "resume")) {
        rc = dp_resume(err, sizeof err);
    } else {   /* stage; lease=1: a controller fills it from an image itself, then adopts or restores */
        rc = dp_stage(err, sizeof err);
        if (rc == 0 && lease) c->stage_lease = true;
    }
    /* staging filled in part must never be restored from: once used (or dropped), it is no longer at stake */
    if (rc == 0 && (!strcmp(verb, "adopt") || !strcmp(verb, "restore") || !strcmp(verb, "drop"))) c->stage_lease = false;
    end_change();
    if (rc) { c->nfds = 0; reply_error(j, err); return; }
    if (status_after) reply_status(j);
}

/* Only a checkpoint under this connection's lease is committed, with the level it was made at (full=1: the driver
 * holds it checkpointed too). */
static void handle_commit(const char *req, struct jb *j, struct client *c)
{
    int full = arg_int(req, "full", -1);
    if (full < 0 || full > 1) { reply_error(j, "commit takes full=1 (level full) or full=0 (level data)"); return; }
    if (c->lease) {   /* the agent's fds of the memory let go: from now on the checkpoint is not undone */
        begin_change(true);
        dp_commit();
        end_change();
        atomic_store(&g_committed, full ? COMMITTED_FULL : COMMITTED_DATA);
    }
    c->lease = false;
    jb_bool(j, "ok", true);
}

static void handle(const char *req, struct jb *j, struct client *c)
{
    char verb[32] = "";
    size_t vl = strcspn(req, " ");
    if (vl == 0 || vl >= sizeof verb) { reply_error(j, "malformed request: expected 'VERB [key=value ...]'"); return; }
    atomic_fetch_add(&g_requests_served, 1);
    memcpy(verb, req, vl);
    jb_open(j);
    if (!strcmp(verb, "hello")) reply_hello(j);
    else if (!strcmp(verb, "status")) reply_status(j);
    else if (!strcmp(verb, "commit")) handle_commit(req, j, c);
    else if (!strcmp(verb, "layout")) handle_layout(j, c);
    else if (!strcmp(verb, "shared")) {
        /* the agent's own fds of shared memory, for a controller to tell who shares what (never ours to close) */
        long long from = arg_ll(req, "from", 0, INT32_MAX);
        if (from < 0) reply_error(j, "shared takes from=INDEX");
        else dp_shared_fds(j, (int)from, c->fds, &c->nfds, STAGING_MAX_SEGS);
    }
    else if (!strcmp(verb, "memory")) {
        /* every managed allocation with a dup of the agent's fd of it, for a gpucr server to import */
        long long from = arg_ll(req, "from", 0, INT32_MAX);
        if (from < 0) reply_error(j, "memory takes from=INDEX");
        else { dp_memory_fds(j, (int)from, c->fds, &c->nfds, STAGING_MAX_SEGS); c->close_sent = c->nfds > 0; }
    }
    else if (!strcmp(verb, "watch")) gpucr_gate_watch(j, req, c->fd);   /* the swap service: until demand (gate.c) */
    else if (!strcmp(verb, "contexts")) {   /* the controller asks only while the driver does not hold the process */
        jb_bool(j, "ok", true);
        jb_int(j, "contexts", gpucr_contexts_held());
    }
    else if (!strcmp(verb, "bind")) {
        long long sid = arg_ll(req, "sid", -1, UINT32_MAX), key = arg_ll(req, "key", -1, INT64_MAX);
        long long owner = arg_ll(req, "owner", 0, INT32_MAX), start = arg_ll(req, "owner_start", 0, INT64_MAX);
        char err[200];
        if (sid <= 0 || key <= 0 || owner < 0 || start < 0) reply_error(j, "bind takes sid=N key=KEY owner=PID owner_start=T");
        else if (dp_bind((unsigned)sid, (unsigned long long)key, (long)owner, (unsigned long long)start, err, sizeof err))
            reply_error(j, err);
        else jb_bool(j, "ok", true);
    }
    else if (!strcmp(verb, "quiesce") || !strcmp(verb, "abort") || !strcmp(verb, "restore") ||
             !strcmp(verb, "drop") || !strcmp(verb, "stage") || !strcmp(verb, "export") ||
             !strcmp(verb, "relink") || !strcmp(verb, "orphan") || !strcmp(verb, "resume") ||
             !strcmp(verb, "handover") || !strcmp(verb, "handed_done") || !strcmp(verb, "adopt"))
        handle_op(verb, req, j, c);
    else reply_error(j, "unknown request verb");
}

/* Only the process's own user or root; `why` says who was refused. Through a user namespace, a user
 * with no uid in it (host root seen from a container is one) appears as the overflow uid. */
static bool peer_allowed(int fd, char *why, size_t len)
{
    struct ucred cr;
    socklen_t clen = sizeof cr;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &clen) != 0) { snprintf(why, len, "permission denied"); return false; }
    if (cr.uid == getuid() || cr.uid == 0) return true;
    long overflow = 65534;
    FILE *f = fopen("/proc/sys/kernel/overflowuid", "re");
    if (f) { if (fscanf(f, "%ld", &overflow) != 1) overflow = 65534; fclose(f); }
    if ((long)cr.uid == overflow)
        snprintf(why, len, "permission denied: the peer has uid %u, the overflow uid: a user with no uid in this process's "
                 "user namespace (host root seen from inside a container is one) cannot control it; run gpucr inside "
                 "the process's namespaces, as its user or that namespace's root", (unsigned)cr.uid);
    else
        snprintf(why, len, "permission denied: only the process's own user or root may control it (peer uid %u)",
                 (unsigned)cr.uid);
    return false;
}

/* Send the answer; file descriptors, if any, ride along with its first byte. */
static void send_answer(struct client *c, struct jb *j)
{
    jb_close(j);
    size_t off = 0;
    if (c->nfds > 0) {
        char ctl[CMSG_SPACE(sizeof(int) * STAGING_MAX_SEGS)];
        memset(ctl, 0, sizeof ctl);
        struct iovec iov = {j->buf, j->len};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl,
                            .msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)c->nfds)};
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)c->nfds);
        memcpy(CMSG_DATA(cm), c->fds, sizeof(int) * (size_t)c->nfds);
        ssize_t n = sendmsg(c->fd, &mh, MSG_NOSIGNAL);
        if (c->close_sent)
            for (int i = 0; i < c->nfds; i++) close(c->fds[i]);
        c->close_sent = false;
        c->nfds = 0;
        if (n <= 0) return;
        off = (size_t)n;
    }
    while (off < j->len) {
        ssize_t n = send(c->fd, j->buf + off, j->len - off, MSG_NOSIGNAL);
        if (n <= 0) return;
        off += (size_t)n;
    }
}

/* The controller that made staging for an image's data (stage lease=1) is gone before it used it: what it read
 * may be in part, so it is dropped; the process stays checkpointed, the image its source. */
static void drop_abandoned_staging(void)
{
    begin_change(true);
    struct dp_status st;
    dp_get_status(&st);
    char err[200];
    if (st.phase == PH_PARKED && dp_drop_staged(err, sizeof err) == 0)
        gpucr_warn("the controller went away while it read an image: the staging it filled in part is dropped, "
                   "restore from the image");
    end_change();
}

/* The controller that checkpointed under a lease is gone before committing: undo it. */
static void roll_back_abandoned(void)
{
    long long delay = gpucr_setting_int(SET_TEST_ROLLBACK_DELAY_MS);
    if (delay) usleep((useconds_t)delay * 1000);
    begin_change(true);
    atomic_store(&g_rolling_back, true);
    struct dp_status st;
    dp_get_status(&st);
    char aerr[200];
    if (st.phase == PH_HANDED || st.phase == PH_COPIED) {
        /* the memory is still on the GPU, held by the agent's fds: mapped again, no copy. While the driver holds
         * the process checkpointed this fails, and 'gpucr recover' (or a restore) takes it back after the driver's */
        if (dp_abort(aerr, sizeof aerr) == 0)
            gpucr_warn("the controller went away before committing the checkpoint: taken back, the application runs on");
        else gpucr_warn("taking back the memory handed to gpucr's data plane failed: %s; run 'gpucr recover'", aerr);
    } else if (st.phase == PH_QUIESCED) {   /* nothing was released yet: reopening the gate undoes it */
        if (dp_abort(aerr, sizeof aerr) == 0)
            gpucr_warn("the controller went away during a checkpoint: aborted, the application runs on");
    }
    atomic_store(&g_rolling_back, false);
    end_change();
}

/* ---- connections: at most MAX_CLIENTS at once. One that never asked for a change times out after
 * IDLE_TIMEOUT_S and is the first to go when a newcomer needs its slot, so idle connections (a hung
 * monitor, `gpucr status` left open) never keep out a controller that acts. ---- */
struct slot { unsigned long id; int fd; bool busy, acted; int64_t last_ns; };   /* id 0: free */
static struct slot g_slots[MAX_CLIENTS];
static unsigned long g_next_id;

/* Idle for a while (a newcomer gets EVICT_GRACE_MS to send its request), with no request waiting, and
 * never a controller's. */
static bool evictable(const struct slot *s, int64_t now)
{
    struct pollfd pf = {.fd = s->fd, .events = POLLIN};
    return !s->busy && !s->acted && now - s->last_ns >= EVICT_GRACE_MS * 1000000LL && poll(&pf, 1, 0) == 0;
}

/* A slot for c: a free one, else that of the oldest idle connection that never acted (shut down: its
 * thread sees the end and goes). False when every slot serves a request or a controller. */
static bool take_slot(struct client *c)
{
    pthread_mutex_lock(&g_clients_mu);
    int k = -1, idle = -1;
    int64_t now = gpucr_now_ns();
    for (int i = 0; i < MAX_CLIENTS; i++) {
        if (!g_slots[i].id) { k = i; break; }
        if (evictable(&g_slots[i], now) && (idle < 0 || g_slots[i].last_ns < g_slots[idle].last_ns)) idle = i;
    }
    if (k < 0 && idle >= 0) { shutdown(g_slots[idle].fd, SHUT_RDWR); k = idle; }
    if (k >= 0) {
        c->slot = k;
        c->id = ++g_next_id;
        g_slots[k] = (struct slot){c->id, c->fd, false, false, gpucr_now_ns()};
    }
    pthread_mutex_unlock(&g_clients_mu);
    return k >= 0;
}

/* Between requests (busy false) the connection is idle since now; once it acted it is a controller's. */
static void mark_slot(struct client *c, bool busy)
{
    pthread_mutex_lock(&g_clients_mu);
    struct slot *s = &g_slots[c->slot];
    if (s->id == c->id) { s->busy = busy; s->acted = c->acted || c->lease; s->last_ns = gpucr_now_ns(); }
    pthread_mutex_unlock(&g_clients_mu);
}

static void leave_slot(struct client *c)
{
    pthread_mutex_lock(&g_clients_mu);
    if (g_slots[c->slot].id == c->id) g_slots[c->slot].id = 0;   /* not if a newcomer took it */
    pthread_mutex_unlock(&g_clients_mu);
}

static void set_idle_timeout(int fd, int seconds)
{
    struct timeval tv = {seconds, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
}

static void *serve_client(void *arg)
{
    struct client *cp = arg, c = *cp;
    free(cp);
    struct jb j = {0};
    char *req = malloc(MAX_REQUEST + 1);
    size_t have = 0;
    if (!req) goto out;
    for (;;) {
        /* requests may carry file descriptors (relink, adopt): keep up to MAX_IN_FDS, close any others */
        char ctl[CMSG_SPACE(sizeof(int) * MAX_IN_FDS)];
        struct iovec iov = {req + have, MAX_REQUEST - have};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl, .msg_controllen = sizeof ctl};
        ssize_t n = recvmsg(c.fd, &mh, MSG_CMSG_CLOEXEC);
        if (n <= 0) break;
        for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
            if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
            int nfd = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            int *got = (int *)CMSG_DATA(cm);
            for (int i = 0; i < nfd; i++) {
                if (c.nin < MAX_IN_FDS) c.in[c.nin++] = got[i];
                else close(got[i]);
            }
        }
        have += (size_t)n;
        char *nl;
        bool acted = c.acted;
        mark_slot(&c, true);
        while ((nl = memchr(req, '\n', have))) {
            *nl = 0;
            size_t used = (size_t)(nl - req) + 1;
            if (memchr(req, 0, used - 1)) reply_error(&j, "malformed request: NUL byte");
            else handle(req, &j, &c);
            send_answer(&c, &j);
            for (int i = 0; i < c.nin; i++) close(c.in[i]);   /* a request's fds live as long as the request */
            c.nin = 0;
            memmove(req, req + used, have - used);
            have -= used;
        }
        mark_slot(&c, false);
        if (c.acted && !acted) set_idle_timeout(c.fd, ACTED_TIMEOUT_S);   /* a controller between its steps */
        if (have == MAX_REQUEST) {
            reply_error(&j, "request too long (at most 4096 bytes)");
            send_answer(&c, &j);
            /* read what the client still sends, briefly, so closing does not reset the answer away */
            shutdown(c.fd, SHUT_WR);
            set_idle_timeout(c.fd, 1);
            while (recv(c.fd, req, MAX_REQUEST, 0) > 0) {}
            break;
        }
    }
out:
    for (int i = 0; i < c.nin; i++) close(c.in[i]);
    leave_slot(&c);
    if (c.lease) roll_back_abandoned();
    if (c.stage_lease) drop_abandoned_staging();
    jb_free(&j);
    free(req);
    close(c.fd);
    return NULL;
}

/* Answer a connection that is not served, and close it; what it already sent is read first (briefly),
 * so closing does not reset the answer away. */
static void refuse(int fd, const char *why)
{
    struct jb j = {0};
    struct client c = {.fd = fd};
    reply_error(&j, why);
    send_answer(&c, &j);
    jb_free(&j);
    shutdown(fd, SHUT_WR);
    char sink[512];
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    while (poll(&pf, 1, 200) > 0 && recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0) {}
    close(fd);
}

static void *accept_loop(void *arg)
{
    (void)arg;
    for (;;) {
        int fd = accept4(g_listen, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) { if (errno == EINTR || errno == ECONNABORTED) continue; break; }
        char why[400];
        if (!peer_allowed(fd, why, sizeof why)) { refuse(fd, why); continue; }   /* before it can take a slot */
        /* a client that says nothing, or stops mid-request, must not hold its slot for long */
        set_idle_timeout(fd, IDLE_TIMEOUT_S);
        struct client *c = calloc(1, sizeof *c);
        if (c) c->fd = fd;
        if (!c || !take_slot(c)) { free(c); refuse(fd, "busy: too many connections"); continue; }
        pthread_t th;
        if (pthread_create(&th, NULL, serve_client, c) != 0) {
            leave_slot(c);
            free(c);
            refuse(fd, "busy: too many connections");
            continue;
        }
        pthread_setname_np(th, "gpucr-client");
        pthread_detach(th);
    }
    return NULL;
}

static void remove_socket(void)
{
    struct stat st;
    /* only the socket we bound: after a crash another process may hold the name */
    if (g_sock[0] && g_listen >= 0 && lstat(g_sock, &st) == 0 && st.st_ino == g_sock_ino) unlink(g_sock);
}

/* Nothing listens there any more (its process died without removing it). */
static bool socket_stale(const char *path)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    bool stale = fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0 && errno == ECONNREFUSED;
    if (fd >= 0) close(fd);
    return stale;
}

/* Move the listening socket to its name, never over another's: a live agent of the same pid in another
 * run keeps its socket; a stale one (its process died) is replaced. */
static int publish(const char *tmp)
{
    for (int tries = 0; tries < 2; tries++) {
        int rc = renameat2(AT_FDCWD, tmp, AT_FDCWD, g_sock, RENAME_NOREPLACE);
        if (rc != 0 && (errno == ENOSYS || errno == EINVAL)) {   /* no renameat2 here: link is no-replace too */
            rc = link(tmp, g_sock);
            if (rc == 0) unlink(tmp);
        }
        if (rc == 0) return 0;
        if (errno != EEXIST || !socket_stale(g_sock)) break;
        unlink(g_sock);
    }
    return -1;
}

void gpucr_channel_start(void)
{
    const char *g_dir = gpucr_make_runtime_dir();
    if (!g_dir) return;
    struct stat ns;
    unsigned long long pidns = stat("/proc/self/ns/pid", &ns) == 0 ? (unsigned long long)ns.st_ino : 0;
    /* pids repeat across pid namespaces sharing a dir: the namespace is part of the name */
    snprintf(g_sock, sizeof g_sock, "%s/%d-%llu.sock", g_dir, (int)getpid(), pidns);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return;
    /* Bound under a temporary name and renamed once listening: a controller that sees the socket can
     * connect to it (between bind and listen it would be refused). */
    char tmp[sizeof g_sock + 32];
    snprintf(tmp, sizeof tmp, "%s/.%d-%llu.%llx.new", g_dir, (int)getpid(), pidns, (unsigned long long)gpucr_now_ns());
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(g_sock) >= sizeof sa.sun_path || strlen(tmp) >= sizeof sa.sun_path) {
        close(fd);
        gpucr_warn("runtime dir path too long: %s", g_dir);
        return;
    }
    strcpy(sa.sun_path, tmp);
    mode_t old = umask(0177);   /* the socket is born 0600 */
    int rc = bind(fd, (struct sockaddr *)&sa, sizeof sa);
    umask(old);
    if (rc != 0 || listen(fd, 8) != 0 || publish(tmp) != 0) {
        gpucr_warn("cannot listen on %s: %s", g_sock, errno == EEXIST ? "a live agent already listens there" : strerror(errno));
        if (rc == 0) unlink(tmp);
        close(fd);
        return;
    }
    struct stat st;
    g_sock_ino = lstat(g_sock, &st) == 0 ? st.st_ino : 0;
    g_listen = fd;
    gpucr_runtime_dir_up(true);
    gpucr_spawn_detached(accept_loop, NULL, "gpucr-channel");   /* it must not take signals meant for the application */
    gpucr_log("control channel at %s", g_sock);
}

/* ---- fork (agent.h says what may be done where) ---- */
static atomic_bool g_start_pending;   /* a fork child that has not used CUDA yet: no channel until it does */

static void before_fork(void) { reg_lock(); }
static void after_fork_parent(void) { reg_unlock(); }

static void after_fork_child(void)
{
    gpucr_gate_reset_after_fork();
    gpucr_room_reset_after_fork();
    reg_reset_after_fork();
    dp_reset_after_fork();
    /* The parent's socket and connections are the parent's: close our copies (a copy would keep a
     * controller's connection open after the parent closed it), never unlink the socket. */
    if (g_listen >= 0) close(g_listen);
    g_listen = -1;
    g_sock[0] = 0;
    gpucr_runtime_dir_up(false);
    for (int i = 0; i < MAX_CLIENTS; i++)
        if (g_slots[i].id) close(g_slots[i].fd);
    memset(g_slots, 0, sizeof g_slots);
    g_op = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    g_state = (pthread_rwlock_t)PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP;   /* a layout read mid-fork */
    atomic_store(&g_changing, false);
    atomic_store(&g_committed, COMMITTED_NONE);
    atomic_store(&g_requests_served, 0);
    g_clients_mu = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    atomic_store(&g_rolling_back, false);
    atomic_store(&g_start_pending, true);
}

void gpucr_channel_first_use(void)
{
    if (!atomic_load_explicit(&g_start_pending, memory_order_relaxed)) return;
    if (!atomic_exchange(&g_start_pending, false)) return;   /* another thread of the child started it */
    gpucr_channel_start();
}

__attribute__((constructor)) static void agent_start(void)
{
    const char *off = getenv("GPUCR_AGENT_DISABLE");
    if (off && *off && *off != '0') return;
    /* checked against settings.def: a name longer than g_group holds is refused with a warning, not cut */
    _Static_assert(sizeof g_group == 127 + 1, "GPUCR_GROUP's most in settings.def");
    snprintf(g_group, sizeof g_group, "%s", gpucr_setting_str(SET_GROUP));
    share_raise_nofile();   /* the agent keeps an fd of every GPU allocation */
    gpucr_on_first_use(gpucr_channel_first_use);
    gpucr_channel_start();
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
    atexit(remove_socket);
}

__attribute__((destructor)) static void agent_stop(void) { remove_socket(); }
