/* The channel's requests: each line "VERB key=value ..." parsed and answered (one JSON object), the verb table, and
 * the lease: one change (checkpoint, restore...) at a time, and a checkpoint asked for with lease=1 undone when its
 * controller's connection ends before "commit". channel.c carries the bytes; report.c writes hello and status. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "dataplane.h"
#include "report.h"
#include "settings.h"
#include "verbs.h"

#define reply_error jb_error

static pthread_mutex_t g_op = PTHREAD_MUTEX_INITIALIZER;   /* one change (checkpoint, restore...) at a time */
/* Changes hold it for writing; a read of the staging's layout for reading, and only if no change holds or
 * waits for it: a reader (a gpucr server's pin-ahead loop, `gpucr status`) never makes a change "busy". */
static pthread_rwlock_t g_state = PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP;
static atomic_bool g_changing;       /* status's "busy": a change holds g_op (read without taking it) */
static atomic_bool g_rolling_back;   /* status says so: a new controller waits for it instead of "busy" */
/* The checkpoint held now was committed by its controller (on purpose), at this level (enum committed); the driver's
 * state tells whether it is still as that controller left it (a restore killed after the driver's steps leaves it
 * "running"). */
static atomic_int g_committed;

bool gpucr_parked_at_data_level(void) { return atomic_load(&g_committed) == COMMITTED_DATA; }
/* requests served since the channel started (a fork child counts its own), status says it: a test caps the
 * round trips a checkpoint and a restore take, so that no move adds one unseen */
static atomic_ulong g_requests_served;

static void reply_status(struct jb *j)
{
    struct dp_status st;
    dp_get_status(&st);
    struct channel_state cs = {atomic_load(&g_changing), atomic_load(&g_rolling_back), atomic_load(&g_committed),
                               atomic_load(&g_requests_served)};
    report_status(j, &st, &cs);
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
    if (!report_cuda_present()) { reply_error(j, "the process has not loaded the CUDA driver: nothing to checkpoint"); return; }
    if (pthread_rwlock_tryrdlock(&g_state) != 0) { reply_error(j, BUSY); return; }
    char err[600] = "";
    if (dp_layout(j, c->fds, &c->nfds, STAGING_MAX_SEGS, err, sizeof err)) { c->nfds = 0; reply_error(j, err); }
    pthread_rwlock_unlock(&g_state);
}

/* Starts a new checkpoint, or a step of a restore or abort: the committed one is no longer as its controller left it
 * (a restore's controller that dies after its `adopt` leaves it half restored, stuck). */
static bool leaves_a_committed_checkpoint(const char *verb)
{
    static const char *const verbs[] = {"quiesce", "handover", "restore", "adopt", "relink", "orphan", "resume", "abort", "unadopt"};
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
    if (!report_cuda_present()) { reply_error(j, "the process has not loaded the CUDA driver: nothing to checkpoint"); return; }
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
        int image = arg_int(req, "image", 0);
        rc = image < 0 || image > 1 ? (snprintf(err, sizeof err, "image must be 0 or 1"), -1)
                                    : dp_handover(timeout_ms, image == 1, err, sizeof err);
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
    } else if (!strcmp(verb, "give_back")) {
        long long upto = arg_ll(req, "upto", -1, INT32_MAX);
        int given = 0;
        size_t bytes = 0;
        rc = upto < 0 ? (snprintf(err, sizeof err, "give_back takes upto=INDEX"), -1)
                      : dp_give_back((int)upto, &given, &bytes, err, sizeof err);
        if (rc == 0) { jb_bool(j, "ok", true); jb_int(j, "given", given); jb_int(j, "bytes", (long long)bytes); }
        status_after = false;
    } else if (!strcmp(verb, "unadopt")) {
        int undone = 0;
        rc = dp_unadopt(&undone, err, sizeof err);
        if (rc == 0) { jb_bool(j, "ok", true); jb_int(j, "undone", undone); }
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
    } else if (!strcmp(verb, "hold")) {
        /* the staging segments gpucr's data plane made, entry=1: the last fd is the budget's ledger entry */
        int replace = arg_int(req, "replace", 0), entry = arg_int(req, "entry", 0);
        if (replace < 0 || replace > 1 || entry < 0 || entry > 1 || c->nin < entry)
            rc = (snprintf(err, sizeof err, "hold takes replace=0|1 entry=0|1 and the segments' fds (the entry's last)"), -1);
        else rc = dp_hold(c->in, c->nin - entry, replace == 1, entry ? c->in[c->nin - 1] : -1, err, sizeof err);
    } else {   /* resume */
        rc = dp_resume(err, sizeof err);
    }
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

void verbs_handle(const char *req, struct jb *j, struct client *c)
{
    char verb[32] = "";
    size_t vl = strcspn(req, " ");
    if (vl == 0 || vl >= sizeof verb) { reply_error(j, "malformed request: expected 'VERB [key=value ...]'"); return; }
    atomic_fetch_add(&g_requests_served, 1);
    memcpy(verb, req, vl);
    jb_open(j);
    if (!strcmp(verb, "hello")) report_hello(j);
    else if (!strcmp(verb, "status")) {
        /* controller=1: a checkpoint's or restore's controller, whose connection lives through the request's steps,
         * silent for as long as its copies take (a fill from a slow disk): never timed out as idle nor evicted */
        if (arg_int(req, "controller", 0) == 1) c->acted = true;
        reply_status(j);
    }
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
    else if (!strcmp(verb, "watch")) {   /* the swap service: until demand (watch.c) */
        /* a server's watch lives between two watches too (while it resumes, parks others for room, ...): like a
         * controller's, its connection is never evicted as idle nor timed out after IDLE_TIMEOUT_S (channel.c) */
        c->acted = true;
        if (!c->watches) { c->watches = true; gpucr_room_watching(1); }   /* until the connection ends (room.c) */
        gpucr_gate_watch(j, req, c->fd);
    }
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
             !strcmp(verb, "drop") || !strcmp(verb, "export") ||
             !strcmp(verb, "relink") || !strcmp(verb, "orphan") || !strcmp(verb, "resume") ||
             !strcmp(verb, "handover") || !strcmp(verb, "handed_done") || !strcmp(verb, "adopt") ||
             !strcmp(verb, "unadopt") || !strcmp(verb, "hold") || !strcmp(verb, "give_back"))
        handle_op(verb, req, j, c);
    else reply_error(j, "unknown request verb");
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
        else gpucr_warn("the controller went away before committing the checkpoint, and its memory cannot be taken back "
                        "now (%s: the driver holds the process checkpointed, if its controller got that far): the "
                        "process stays checkpointed, its data on the GPU; 'gpucr restore %d' brings it back",
                        aerr, (int)getpid());
    } else if (st.phase == PH_QUIESCED) {   /* nothing was released yet: reopening the gate undoes it */
        if (dp_abort(aerr, sizeof aerr) == 0)
            gpucr_warn("the controller went away during a checkpoint: aborted, the application runs on");
    }
    atomic_store(&g_rolling_back, false);
    end_change();
}

void verbs_connection_ended(const struct client *c)
{
    if (c->lease) roll_back_abandoned();
    if (c->watches) gpucr_room_watching(-1);
}

/* The child of fork(): no change runs in it (agent.h says what may be done there). */
void verbs_reset_after_fork(void)
{
    g_op = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    g_state = (pthread_rwlock_t)PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP;   /* a layout read mid-fork */
    atomic_store(&g_changing, false);
    atomic_store(&g_committed, COMMITTED_NONE);
    atomic_store(&g_requests_served, 0);
    atomic_store(&g_rolling_back, false);
}
