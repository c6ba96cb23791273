#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include "bounce.h"
#include "settings.h"

/* Slots of 64 MiB (a chunk of the data plane) for a large process: 16 of them (the default 1 GiB
 * ring) keep the link busy on the H200 with 16 threads. A smaller process gets two smaller slots
 * that together hold its data, and a chunk larger than a slot goes through it in pieces. */
#define SLOT_MAX ((size_t)64 << 20)
#define SLOT_MIN ((size_t)2 << 20)
#define MAX_SLOTS 256                   /* GPUCR_BOUNCE_MIB's most, 16 GiB, in 64 MiB slots */

struct job { CUcontext ctx; CUstream s; CUevent ev; CUdeviceptr dev; char *host; size_t n; bool out; int slot; };

/* An event marks a slot's device copy; events belong to a context, so each device's context that
 * copies through the ring has its own set, made when it first needs one. */
struct ctx_events { CUcontext ctx; CUevent ev[MAX_SLOTS]; };

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;          /* a slot, a job or the last job's end */
    char *ring;
    size_t bytes, slot;         /* the ring's size and each slot's */
    int nslots;
    bool slot_busy[MAX_SLOTS];
    struct ctx_events **evs;    /* one set per context that copies (grown as needed) */
    int nevs, evs_cap;
    struct job q[MAX_SLOTS];    /* at most one queued job per slot */
    int qhead, qlen, running;
    CUresult first_err;
    bool ready;
    int nthreads;
    char problem[200];          /* why the last preparation failed ("" when it did not) */
    CUcontext ring_ctx;         /* the context the ring is pinned in: the pinning ends with it */
} B = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

/* Read once, at load (settings.h): staging is pinned or not for the life of the process. On by
 * default: measured on the H200 (llama3-8b, 69 GiB), a checkpoint at level full took 2.49 s with the
 * ring against 3.21 s with pinned staging, because the driver's own checkpoint then has 1 GiB of
 * pinned memory to handle instead of all of staging. GPUCR_BOUNCE_MIB=0 keeps staging pinned instead. */
static size_t ring_max(void) { return (size_t)gpucr_setting_int(SET_BOUNCE_MIB) << 20; }

bool bounce_enabled(void) { return ring_max() > 0; }

bool bounce_ready(void)
{
    pthread_mutex_lock(&B.mu);
    bool r = B.ready;
    pthread_mutex_unlock(&B.mu);
    return r;
}

bool bounce_problem(char *out, size_t len)
{
    pthread_mutex_lock(&B.mu);
    bool has = B.problem[0] != 0;
    if (has) snprintf(out, len, "%s", B.problem);
    pthread_mutex_unlock(&B.mu);
    return has;
}

size_t bounce_pinned_bytes(void)
{
    pthread_mutex_lock(&B.mu);
    size_t n = B.ready ? B.bytes : 0;
    pthread_mutex_unlock(&B.mu);
    return n;
}

/* One chunk: out, wait for the device's copy into the slot, then copy it to staging; in, copy the
 * staging into the slot, start the device's copy and wait for it before the slot is reused. */
static CUresult run_job(const struct job *j)
{
    char *slot = B.ring + (size_t)j->slot * B.slot;
    CUevent ev = j->ev;
    CUresult crc = gpucr_drv.cuCtxSetCurrent(j->ctx);
    if (crc != CUDA_SUCCESS) return crc;
    if (j->out) {
        CUresult rc = gpucr_drv.cuEventSynchronize(ev);
        if (rc == CUDA_SUCCESS) memcpy(j->host, slot, j->n);
        return rc;
    }
    memcpy(slot, j->host, j->n);
    CUresult rc = REAL(cuMemcpyHtoDAsync_v2)(j->dev, slot, j->n, j->s);
    if (rc == CUDA_SUCCESS) rc = gpucr_drv.cuEventRecord(ev, j->s);
    if (rc == CUDA_SUCCESS) rc = gpucr_drv.cuEventSynchronize(ev);
    return rc;
}

static void *worker(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&B.mu);
    for (;;) {
        while (B.qlen == 0) pthread_cond_wait(&B.cv, &B.mu);
        struct job j = B.q[B.qhead];
        B.qhead = (B.qhead + 1) % MAX_SLOTS;
        B.qlen--;
        B.running++;
        bool skip = B.first_err != CUDA_SUCCESS;   /* after an error the rest is not worth moving */
        pthread_mutex_unlock(&B.mu);
        CUresult rc = skip ? CUDA_SUCCESS : run_job(&j);
        pthread_mutex_lock(&B.mu);
        if (rc != CUDA_SUCCESS && B.first_err == CUDA_SUCCESS) B.first_err = rc;
        B.slot_busy[j.slot] = false;
        B.running--;
        pthread_cond_broadcast(&B.cv);
    }
    return NULL;
}

static int default_threads(void)
{
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);   /* the copies are CPU work: one thread a core, up to 16 */
    return cpus < 1 ? 1 : cpus > 16 ? 16 : (int)cpus;
}

/* Give the driver the ring back (its events stay: they belong to contexts, not to the memory). */
static void drop_ring_locked(void)
{
    if (!B.ring) return;
    CUresult rc = gpucr_drv.cuMemHostUnregister(B.ring);
    if (rc != CUDA_SUCCESS) gpucr_cu_warn(rc, "cuMemHostUnregister (the %zu MiB bounce ring)", B.bytes >> 20);
    munmap(B.ring, B.bytes);
    B.ring = NULL;
    B.bytes = B.slot = 0;
    B.nslots = 0;
    B.ready = false;
}

struct ring_shape { size_t slot; int nslots; };

/* The ring for `need` bytes: as many 64 MiB slots as the data fills, up to GPUCR_BOUNCE_MIB; for
 * less data, two slots that together hold it (a 16 MiB process pins 16 MiB), of at least 2 MiB. */
static struct ring_shape ring_shape_for(size_t need)
{
    size_t max = ring_max(), nslots = (need + SLOT_MAX - 1) / SLOT_MAX;
    if (nslots > max / SLOT_MAX) nslots = max / SLOT_MAX;
    if (nslots > MAX_SLOTS) nslots = MAX_SLOTS;
    if (nslots < 2) nslots = 2;   /* one slot fills while the other drains */
    size_t slot = (need + nslots - 1) / nslots;
    slot = (slot + SLOT_MIN - 1) / SLOT_MIN * SLOT_MIN;
    if (slot > SLOT_MAX) slot = SLOT_MAX;
    if (slot > max / nslots) slot = max / nslots / SLOT_MIN * SLOT_MIN;
    if (slot < SLOT_MIN) slot = SLOT_MIN;
    return (struct ring_shape){slot, (int)nslots};
}

/* Copy threads for a ring of nslots: GPUCR_BOUNCE_THREADS (0: one a core, up to 16), but no more
 * than the slots, since each thread works on one slot at a time. Started as the ring grows; they
 * stay for the life of the process. False if none runs. */
static bool start_threads_locked(int nslots)
{
    int want = (int)gpucr_setting_int(SET_BOUNCE_THREADS);
    if (want == 0) want = default_threads();
    if (want > nslots) want = nslots;
    while (B.nthreads < want && gpucr_spawn_detached(worker, NULL)) B.nthreads++;
    return B.nthreads > 0;
}

int bounce_prepare(CUcontext ctx, const size_t *sizes, int n, char *err, size_t errlen)
{
    size_t need = 0;
    for (int i = 0; i < n; i++) need += sizes[i];
    pthread_mutex_lock(&B.mu);
    /* Sized to the data, up to the configured ring: a ring that is too small for it, or more than
     * twice what it needs (the process shrank), is made anew; it is never in use here (no copy runs). */
    struct ring_shape shape = ring_shape_for(need);
    size_t bytes = (size_t)shape.nslots * shape.slot;
    int rc = 0;
    CUresult cr0;
    if (B.ready && B.bytes >= bytes && B.bytes <= 2 * bytes) goto out;
    rc = -1;
    drop_ring_locked();
    char *ring = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (ring == MAP_FAILED) {
        snprintf(err, errlen, "cannot map %zu MiB for the bounce ring", bytes >> 20);
        goto out;
    }
    /* a fork child (a DataLoader worker) must not copy or keep the ring */
    if (madvise(ring, bytes, MADV_DONTFORK)) gpucr_warn("madvise(MADV_DONTFORK) of the bounce ring: %s", strerror(errno));
    if ((cr0 = gpucr_drv.cuCtxSetCurrent(ctx)) != CUDA_SUCCESS) {
        snprintf(err, errlen, "cannot pin the bounce ring: cuCtxSetCurrent: %s", gpucr_cu_errstr(cr0));
        munmap(ring, bytes);
        goto out;
    }
    /* GPUCR_TEST_FAIL_RING=1: the test suite's stand-in for a driver that will not pin the ring */
    CUresult cr = gpucr_setting_on(SET_TEST_FAIL_RING) ? CUDA_ERROR_OUT_OF_MEMORY
                                                           : gpucr_drv.cuMemHostRegister_v2(ring, bytes, CU_MEMHOSTREGISTER_PORTABLE);
    if (cr != CUDA_SUCCESS) {
        snprintf(err, errlen, "cannot pin the %zu MiB bounce ring: %s", bytes >> 20, gpucr_cu_errstr(cr));
        munmap(ring, bytes);
        goto out;
    }
    if (!start_threads_locked(shape.nslots)) {
        snprintf(err, errlen, "cannot start the bounce copy threads");
        if ((cr0 = gpucr_drv.cuMemHostUnregister(ring)) != CUDA_SUCCESS) gpucr_cu_warn(cr0, "cuMemHostUnregister (the bounce ring)");
        munmap(ring, bytes);
        goto out;
    }
    B.ring = ring;
    B.bytes = bytes;
    B.slot = shape.slot;
    B.nslots = shape.nslots;
    B.ring_ctx = ctx;
    B.ready = true;
    rc = 0;
    gpucr_log("bounce ring: %zu MiB pinned in %d slots of %zu MiB, %d copy threads", bytes >> 20, B.nslots,
              B.slot >> 20, B.nthreads);
out:
    if (rc) snprintf(B.problem, sizeof B.problem, "%s", err);
    else B.problem[0] = 0;
    pthread_mutex_unlock(&B.mu);
    return rc;
}

/* The event of a slot in ctx, made on first use (the caller holds B.mu, ctx is current); NULL with *rc
 * set when it cannot be made. */
static CUevent slot_event_locked(CUcontext ctx, int slot, CUresult *rc)
{
    struct ctx_events *e = NULL;
    for (int i = 0; i < B.nevs && !e; i++)
        if (B.evs[i]->ctx == ctx) e = B.evs[i];
    if (!e) {
        if (B.nevs == B.evs_cap) {
            int cap = B.evs_cap ? B.evs_cap * 2 : 4;
            struct ctx_events **a = realloc(B.evs, sizeof *a * (size_t)cap);
            if (!a) { *rc = CUDA_ERROR_OUT_OF_MEMORY; return NULL; }
            B.evs = a;
            B.evs_cap = cap;
        }
        if (!(e = calloc(1, sizeof *e))) { *rc = CUDA_ERROR_OUT_OF_MEMORY; return NULL; }
        e->ctx = ctx;
        B.evs[B.nevs++] = e;
    }
    if (!e->ev[slot] && (*rc = gpucr_drv.cuEventCreate(&e->ev[slot], CU_EVENT_DISABLE_TIMING)) != CUDA_SUCCESS) {
        gpucr_cu_warn(*rc, "cuEventCreate (bounce slot %d, context %p)", slot, (void *)ctx);
        e->ev[slot] = NULL;
    }
    return e->ev[slot];
}

/* Queue one piece of at most a slot (B.mu held; it is released while waiting for a free slot). */
static CUresult submit_piece_locked(CUcontext ctx, CUstream s, CUdeviceptr dev, char *host, size_t n, bool out)
{
    int slot = -1;
    while (slot < 0) {
        for (int i = 0; i < B.nslots && slot < 0; i++) if (!B.slot_busy[i]) slot = i;
        if (slot < 0) pthread_cond_wait(&B.cv, &B.mu);
    }
    B.slot_busy[slot] = true;
    CUresult rc = gpucr_drv.cuCtxSetCurrent(ctx);
    CUevent ev = rc == CUDA_SUCCESS ? slot_event_locked(ctx, slot, &rc) : NULL;
    if (rc == CUDA_SUCCESS && out) {   /* the device's copy is queued here, on the caller's stream, in order */
        rc = REAL(cuMemcpyDtoHAsync_v2)(B.ring + (size_t)slot * B.slot, dev, n, s);
        if (rc == CUDA_SUCCESS) rc = gpucr_drv.cuEventRecord(ev, s);
    }
    if (rc != CUDA_SUCCESS) {
        B.slot_busy[slot] = false;
        return rc;
    }
    B.q[(B.qhead + B.qlen) % MAX_SLOTS] = (struct job){ctx, s, ev, dev, host, n, out, slot};
    B.qlen++;
    pthread_cond_broadcast(&B.cv);
    return CUDA_SUCCESS;
}

CUresult bounce_submit(CUcontext ctx, CUstream s, CUdeviceptr dev, void *host, size_t n, bool out)
{
    pthread_mutex_lock(&B.mu);
    CUresult rc = B.ready ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;   /* no ring: never wait for a slot */
    for (size_t off = 0; off < n && rc == CUDA_SUCCESS; off += B.slot) {
        size_t len = n - off < B.slot ? n - off : B.slot;
        rc = submit_piece_locked(ctx, s, dev + off, (char *)host + off, len, out);
    }
    pthread_mutex_unlock(&B.mu);
    return rc;
}

CUresult bounce_wait(void)
{
    pthread_mutex_lock(&B.mu);
    while (B.qlen > 0 || B.running > 0) pthread_cond_wait(&B.cv, &B.mu);
    CUresult rc = B.first_err;
    B.first_err = CUDA_SUCCESS;
    pthread_mutex_unlock(&B.mu);
    return rc;
}

void bounce_forget_context(CUcontext ctx)
{
    pthread_mutex_lock(&B.mu);
    for (int i = 0; i < B.nevs; i++)
        if (B.evs[i]->ctx == ctx) { free(B.evs[i]); B.evs[i--] = B.evs[--B.nevs]; }   /* its events end with it */
    if (B.ring && B.ring_ctx == ctx) drop_ring_locked();   /* ctx is current: unpinned now, pinned anew when next needed */
    pthread_mutex_unlock(&B.mu);
}

void bounce_reset_after_fork(void)
{
    /* the parent's ring (never inherited: MADV_DONTFORK), threads and events are not the child's */
    memset(&B, 0, sizeof B);
    B.mu = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    B.cv = (pthread_cond_t)PTHREAD_COND_INITIALIZER;
}
