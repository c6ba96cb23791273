/*
 * The driver checkpoint API: a real state machine, driven across processes.
 *
 * Target side: cuInit starts one control thread serving <rundir>/<pid>.ctl (mode 0600 in a
 * 0700 dir; the peer's uid is checked with SO_PEERCRED: ours or root). Each connection carries
 * one fixed-size request and gets one reply. The thread alone owns the process state:
 *   RUNNING --lock--> LOCKED --checkpoint--> CHECKPOINTED --restore--> LOCKED --unlock--> RUNNING
 * LOCK closes the API gate and waits for calls in flight (timeoutMs, 0 = for ever; on timeout
 * the gate reopens and the reply is CUDA_ERROR_TIMEOUT). The calls the lock does not hold (queries
 * and synchronizes, sim_unheld_enter) go on; one that overlaps CHECKPOINT fails it with
 * CUDA_ERROR_OPERATING_SYSTEM, one made while CHECKPOINTED kills the process: FAILED, then
 * SIGSEGV (the reply to CHECKPOINT is sent first, as the driver returns 304 before the process
 * dies). CHECKPOINT saves and frees every
 * physical allocation and stops charging contexts, so the process uses 0 bytes of device
 * memory. RESTORE first checks the device has room (else CUDA_ERROR_OUT_OF_MEMORY, still
 * CHECKPOINTED and restorable later), then puts every byte back at the same address.
 * RESTORE with GPU pairs (old UUID -> new UUID) first moves the process's ordinals onto other
 * (simulated) GPUs: see remap(). A refused remap leaves the process CHECKPOINTED.
 * A request in the wrong state gets CUDA_ERROR_ILLEGAL_STATE.
 *
 * Controller side: the cuCheckpointProcess* calls connect to the target's socket; they need
 * no cuInit. No such process: CUDA_ERROR_INVALID_VALUE. A live process with no socket (not a
 * simcuda CUDA process): CUDA_ERROR_NOT_INITIALIZED.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "simcuda.h"

#define SIM_CTL_MAGIC 0x32434d53u /* "SMC2": bump with any change to the structs below */
#define SIM_CTL_RECV_TIMEOUT_S 5  /* a controller that connects and says nothing is dropped */

enum sim_ctl_op { OP_GET_STATE = 1, OP_LOCK, OP_CHECKPOINT, OP_RESTORE, OP_UNLOCK, OP_GET_TID, OP_GET_CALLER };

struct sim_ctl_req {
    uint32_t magic;
    uint32_t op;
    uint32_t timeout_ms;
    uint32_t npairs; /* RESTORE: the GPU pairs in pairs[] */
    CUcheckpointGpuPair pairs[SIM_MAX_DEVICES];
};

struct sim_ctl_rep {
    uint32_t magic;
    int32_t result;
    int32_t state;
    int32_t tid;
};

/* ---- target side ---- */

static struct {
    CUprocessState state; /* the control thread writes it, and a dying unheld call (FAILED); read atomically */
    pid_t tid;
    pid_t caller; /* the process that asked for the last checkpoint or restore (simcudaCheckpointCaller) */
    int listen_fd;
    CUresult fail_restore;
    bool fail_lock;
    size_t checkpoint_delay_ms;
    bool die_after_reply; /* a CHECKPOINT an unheld call overlapped: the process dies once it is answered */
    char path[PATH_MAX];
} ck = {.listen_fd = -1};

/* The calls the lock does not hold, against a CHECKPOINT under way (sequentially consistent: either
 * the call sees `checkpointing` or the checkpoint sees it in flight). */
static struct {
    unsigned inflight;
    bool checkpointing;
    bool spoiled; /* one overlapped the CHECKPOINT under way */
} unheld;

bool sim_ckpt_checkpointed(void)
{
    return __atomic_load_n(&ck.state, __ATOMIC_ACQUIRE) == CU_PROCESS_STATE_CHECKPOINTED;
}

/* What the driver does to a process whose checkpoint a call got in the way of. */
static void die_failed(const char *why)
{
    __atomic_store_n(&ck.state, CU_PROCESS_STATE_FAILED, __ATOMIC_SEQ_CST);
    fprintf(stderr, "simcuda: %s: the process fails and dies (SIGSEGV), as on the driver\n", why);
    sigset_t segv;
    sigemptyset(&segv);
    sigaddset(&segv, SIGSEGV);
    signal(SIGSEGV, SIG_DFL);
    pthread_sigmask(SIG_UNBLOCK, &segv, NULL); /* the control thread blocks every signal */
    raise(SIGSEGV);
    abort();
}

CUresult sim_unheld_enter(void)
{
    if (!sim_is_ready())
        return CUDA_ERROR_NOT_INITIALIZED;
    __atomic_fetch_add(&unheld.inflight, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&unheld.checkpointing, __ATOMIC_SEQ_CST))
        __atomic_store_n(&unheld.spoiled, true, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&ck.state, __ATOMIC_SEQ_CST) == CU_PROCESS_STATE_CHECKPOINTED)
        die_failed("a stream or event query or a synchronize was called while the process is checkpointed");
    return CUDA_SUCCESS;
}

void sim_unheld_exit(void)
{
    __atomic_fetch_sub(&unheld.inflight, 1, __ATOMIC_SEQ_CST);
}

static CUresult do_checkpoint(void)
{
    size_t freed[SIM_MAX_DEVICES] = {0};
    sim_ctx_lock();
    CUresult rc = sim_mem_checkpoint(freed);
    if (rc == CUDA_SUCCESS) {
        sim_ctx_costs_locked(freed); /* contexts are part of what a checkpoint gives back */
        sim_acct_uncharge_all(freed);
    }
    sim_ctx_unlock();
    return rc;
}

/* CHECKPOINT, failed (and the process doomed) if an unheld call overlapped it. */
static CUresult checkpoint_unless_overlapped(void)
{
    __atomic_store_n(&unheld.checkpointing, true, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&unheld.inflight, __ATOMIC_SEQ_CST))
        __atomic_store_n(&unheld.spoiled, true, __ATOMIC_SEQ_CST);
    CUresult rc = do_checkpoint();
    if (rc == CUDA_SUCCESS)
        __atomic_store_n(&ck.state, CU_PROCESS_STATE_CHECKPOINTED, __ATOMIC_SEQ_CST);
    __atomic_store_n(&unheld.checkpointing, false, __ATOMIC_SEQ_CST);
    if (!__atomic_exchange_n(&unheld.spoiled, false, __ATOMIC_SEQ_CST))
        return rc;
    __atomic_store_n(&ck.state, CU_PROCESS_STATE_FAILED, __ATOMIC_SEQ_CST);
    ck.die_after_reply = true;
    return CUDA_ERROR_OPERATING_SYSTEM;
}

/* The physical device with UUID u, or -1. */
static int uuid_device(const CUuuid *u)
{
    for (int d = 0; d < sim_cfg.ndevices; d++) {
        CUuuid x;
        sim_device_uuid(d, &x);
        if (memcmp(&x, u, sizeof(x)) == 0)
            return d;
    }
    return -1;
}

/* Works out next[ordinal], the physical device each ordinal restores onto, from the current
 * map cur[] and the request's GPU pairs, which name GPUs by the UUIDs the process sees now.
 * As on CUDA (driver 580, measured on a two-GPU H200 host): pairs, when given, must name every
 * GPU of the machine on each side, a permutation, even GPUs the process never used; every UUID
 * must be a (simulated) GPU and none may appear twice on either side: else
 * CUDA_ERROR_INVALID_VALUE, and the process stays checkpointed. */
static CUresult remap(const struct sim_ctl_req *req, const int cur[SIM_MAX_DEVICES],
                      int next[SIM_MAX_DEVICES])
{
    int n = sim_cfg.ndevices, to[SIM_MAX_DEVICES];
    bool taken[SIM_MAX_DEVICES] = {false};
    if (req->npairs > SIM_MAX_DEVICES)
        return CUDA_ERROR_INVALID_VALUE;
    for (int d = 0; d < n; d++)
        to[d] = -1;
    for (uint32_t i = 0; i < req->npairs; i++) {
        int from = uuid_device(&req->pairs[i].oldUuid), onto = uuid_device(&req->pairs[i].newUuid);
        if (from < 0 || onto < 0 || to[from] >= 0 || taken[onto])
            return CUDA_ERROR_INVALID_VALUE;
        to[from] = onto;
        taken[onto] = true;
    }
    if (req->npairs && req->npairs != (uint32_t)n)
        return CUDA_ERROR_INVALID_VALUE; /* the driver wants every GPU of the machine, not only the used ones */
    for (int d = 0; d < n; d++)
        next[d] = req->npairs ? to[cur[d]] : cur[d];
    return CUDA_SUCCESS;
}

static CUresult do_restore(const struct sim_ctl_req *req)
{
    if (ck.fail_restore != CUDA_SUCCESS) { /* SIMCUDA_FAIL_RESTORE: fail once, stay restorable */
        CUresult rc = ck.fail_restore;
        ck.fail_restore = CUDA_SUCCESS;
        return rc;
    }
    size_t need[SIM_MAX_DEVICES] = {0};
    int cur[SIM_MAX_DEVICES], next[SIM_MAX_DEVICES];
    sim_ctx_lock();
    sim_mem_checkpointed_bytes(need);
    sim_ctx_costs_locked(need);
    sim_acct_devices(cur);
    CUresult rc = remap(req, cur, next);
    if (rc == CUDA_SUCCESS) {
        /* Move first: the room check and the memfds are on the GPUs restored onto. */
        sim_acct_set_devices(next);
        rc = sim_acct_charge_all(need); /* the room check: all or nothing */
        if (rc == CUDA_SUCCESS && (rc = sim_mem_restore()) != CUDA_SUCCESS)
            sim_acct_uncharge_all(need);
        if (rc != CUDA_SUCCESS)
            sim_acct_set_devices(cur);
    }
    sim_ctx_unlock();
    return rc;
}

static CUresult handle(const struct sim_ctl_req *req)
{
    switch (req->op) {
    case OP_GET_STATE:
    case OP_GET_TID:
    case OP_GET_CALLER:
        return CUDA_SUCCESS;
    case OP_LOCK:
        if (ck.state != CU_PROCESS_STATE_RUNNING)
            return CUDA_ERROR_ILLEGAL_STATE;
        if (ck.fail_lock) { /* SIMCUDA_FAIL_LOCK=1: time out once, as a call that never drains would */
            ck.fail_lock = false;
            return CUDA_ERROR_TIMEOUT;
        }
        if (!sim_gate_close(req->timeout_ms))
            return CUDA_ERROR_TIMEOUT;
        __atomic_store_n(&ck.state, CU_PROCESS_STATE_LOCKED, __ATOMIC_RELEASE);
        return CUDA_SUCCESS;
    case OP_CHECKPOINT:
        if (ck.state != CU_PROCESS_STATE_LOCKED)
            return CUDA_ERROR_ILLEGAL_STATE;
        if (ck.checkpoint_delay_ms) { /* SIMCUDA_CHECKPOINT_DELAY_MS: a driver slow or stuck, once; it then goes on */
            struct timespec ts = {.tv_sec = (time_t)(ck.checkpoint_delay_ms / 1000),
                                  .tv_nsec = (long)(ck.checkpoint_delay_ms % 1000) * 1000000L};
            nanosleep(&ts, NULL);
            ck.checkpoint_delay_ms = 0;
        }
        return checkpoint_unless_overlapped();
    case OP_RESTORE: {
        if (ck.state != CU_PROCESS_STATE_CHECKPOINTED)
            return CUDA_ERROR_ILLEGAL_STATE;
        CUresult rc = do_restore(req);
        if (rc == CUDA_SUCCESS)
            __atomic_store_n(&ck.state, CU_PROCESS_STATE_LOCKED, __ATOMIC_RELEASE);
        return rc;
    }
    case OP_UNLOCK:
        if (ck.state != CU_PROCESS_STATE_LOCKED)
            return CUDA_ERROR_ILLEGAL_STATE;
        sim_gate_open();
        __atomic_store_n(&ck.state, CU_PROCESS_STATE_RUNNING, __ATOMIC_RELEASE);
        return CUDA_SUCCESS;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
}

static bool io_full(int fd, void *buf, size_t len, bool writing)
{
    for (size_t done = 0; done < len;) {
        ssize_t n = writing ? send(fd, (char *)buf + done, len - done, MSG_NOSIGNAL)
                            : recv(fd, (char *)buf + done, len - done, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return false;
        done += (size_t)n;
    }
    return true;
}

static void serve(int fd)
{
    struct sim_ctl_rep rep = {.magic = SIM_CTL_MAGIC};
    struct ucred cred;
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || (cred.uid != geteuid() && cred.uid != 0)) {
        rep.result = CUDA_ERROR_NOT_PERMITTED;
        io_full(fd, &rep, sizeof(rep), true);
        return;
    }
    struct timeval tv = {.tv_sec = SIM_CTL_RECV_TIMEOUT_S};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    struct sim_ctl_req req;
    if (!io_full(fd, &req, sizeof(req), false))
        return;
    rep.result = req.magic == SIM_CTL_MAGIC ? handle(&req) : CUDA_ERROR_INVALID_VALUE;
    if (req.op == OP_CHECKPOINT || req.op == OP_RESTORE)
        ck.caller = cred.pid;
    rep.state = ck.state;
    rep.tid = req.op == OP_GET_CALLER ? ck.caller : ck.tid;
    io_full(fd, &rep, sizeof(rep), true);
    if (ck.die_after_reply)
        die_failed("a stream or event query or a synchronize overlapped the checkpoint (CUDA error 304)");
}

static void *ctl_main(void *arg)
{
    (void)arg;
    ck.tid = gettid();
    for (;;) {
        int fd = accept4(ck.listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EBADF || errno == EINVAL)
                return NULL; /* the socket is gone: nothing left to serve */
            if (errno != EINTR && errno != ECONNABORTED)
                usleep(10000); /* e.g. out of fds: back off instead of spinning */
            continue;
        }
        serve(fd);
        close(fd);
    }
}

static void ctl_atexit(void)
{
    if (getpid() == sim_cfg.pid)
        unlink(ck.path);
}

CUresult sim_ctl_start(void)
{
    ck.fail_restore = sim_cfg.fail_restore;
    ck.fail_lock = sim_cfg.fail_lock;
    ck.checkpoint_delay_ms = sim_cfg.checkpoint_delay_ms;
    CUresult rc = sim_rundir_path(ck.path, sizeof(ck.path), sim_cfg.pid, ".ctl");
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(ck.path) >= sizeof(sa.sun_path)) {
        fprintf(stderr, "simcuda: control socket path too long: %s\n", ck.path);
        return CUDA_ERROR_INVALID_VALUE;
    }
    strcpy(sa.sun_path, ck.path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return CUDA_ERROR_OPERATING_SYSTEM;
    unlink(ck.path); /* left by an earlier process that had our pid */
    /* The 0700 dir already keeps others out; 0600 on the socket says the same thing twice. */
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0 || chmod(ck.path, 0600) != 0 || listen(fd, 16) != 0) {
        fprintf(stderr, "simcuda: cannot listen on %s: %s\n", ck.path, strerror(errno));
        close(fd);
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    ck.listen_fd = fd;

    /* The control thread takes no signals: they belong to the application's threads. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_t th;
    int err = pthread_create(&th, NULL, ctl_main, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err != 0) {
        close(fd);
        unlink(ck.path);
        ck.listen_fd = -1;
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    pthread_detach(th);
    atexit(ctl_atexit);
    return CUDA_SUCCESS;
}

/* ---- controller side ---- */

static CUresult ctl_call(int pid, struct sim_ctl_req *req, struct sim_ctl_rep *rep)
{
    if (pid <= 0 || (kill(pid, 0) != 0 && errno == ESRCH))
        return CUDA_ERROR_INVALID_VALUE;
    char path[PATH_MAX];
    CUresult rc = sim_rundir_path(path, sizeof(path), pid, ".ctl");
    if (rc != CUDA_SUCCESS)
        return rc;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof(sa.sun_path))
        return CUDA_ERROR_INVALID_VALUE;
    strcpy(sa.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return CUDA_ERROR_OPERATING_SYSTEM;
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        int err = errno;
        close(fd);
        /* No socket, or a stale one nobody listens on: alive but not a simcuda CUDA process. */
        return err == EACCES || err == EPERM ? CUDA_ERROR_NOT_PERMITTED : CUDA_ERROR_NOT_INITIALIZED;
    }
    req->magic = SIM_CTL_MAGIC;
    bool ok = io_full(fd, req, sizeof(*req), true) && io_full(fd, rep, sizeof(*rep), false);
    close(fd);
    if (!ok) /* the target died while we waited, or hung up */
        return kill(pid, 0) != 0 && errno == ESRCH ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_UNKNOWN;
    return rep->magic == SIM_CTL_MAGIC ? rep->result : CUDA_ERROR_UNKNOWN;
}

static bool all_zero(const void *p, size_t n)
{
    for (const unsigned char *c = p; n--; c++)
        if (*c)
            return false;
    return true;
}

SIMAPI CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args)
{
    if (args && (args->reserved0 || !all_zero(args->reserved1, sizeof(args->reserved1))))
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctl_req req = {.op = OP_LOCK, .timeout_ms = args ? args->timeoutMs : 0};
    struct sim_ctl_rep rep;
    return ctl_call(pid, &req, &rep);
}

SIMAPI CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args)
{
    if (args && !all_zero(args, sizeof(*args)))
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctl_req req = {.op = OP_CHECKPOINT};
    struct sim_ctl_rep rep;
    return ctl_call(pid, &req, &rep);
}

SIMAPI CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args)
{
    struct sim_ctl_req req = {.op = OP_RESTORE};
    if (args) {
        if (!all_zero(args->reserved, sizeof(args->reserved)) || args->reserved1)
            return CUDA_ERROR_INVALID_VALUE;
        /* The target checks the pairs against its GPUs; more pairs than there can be GPUs
         * must name one twice. */
        if (args->gpuPairsCount && (!args->gpuPairs || args->gpuPairsCount > SIM_MAX_DEVICES))
            return CUDA_ERROR_INVALID_VALUE;
        req.npairs = args->gpuPairsCount;
        if (req.npairs)
            memcpy(req.pairs, args->gpuPairs, req.npairs * sizeof(req.pairs[0]));
    }
    struct sim_ctl_rep rep;
    return ctl_call(pid, &req, &rep);
}

SIMAPI CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args)
{
    if (args && !all_zero(args, sizeof(*args)))
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctl_req req = {.op = OP_UNLOCK};
    struct sim_ctl_rep rep;
    return ctl_call(pid, &req, &rep);
}

SIMAPI CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state)
{
    if (!state)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctl_req req = {.op = OP_GET_STATE};
    struct sim_ctl_rep rep;
    CUresult rc = ctl_call(pid, &req, &rep);
    if (rc == CUDA_SUCCESS)
        *state = rep.state;
    return rc;
}

/* A pid the target answers with (its restore thread, or who asked for its last checkpoint or restore). */
static CUresult ctl_get_pid(int pid, enum sim_ctl_op op, int *out)
{
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    struct sim_ctl_req req = {.op = op};
    struct sim_ctl_rep rep;
    CUresult rc = ctl_call(pid, &req, &rep);
    if (rc == CUDA_SUCCESS)
        *out = rep.tid;
    return rc;
}

SIMAPI CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid)
{
    return ctl_get_pid(pid, OP_GET_TID, tid);
}

/* The test double's own: which process asked for process pid's last checkpoint or restore (0: none yet). A gpucr
 * server asks from a helper process, not from the one that copies (gpucr/driver_helper.py says why). */
SIMAPI CUresult simcudaCheckpointCaller(int pid, int *caller)
{
    return ctl_get_pid(pid, OP_GET_CALLER, caller);
}
