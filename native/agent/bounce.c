#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include "bounce.h"

#define SLOT ((size_t)64 << 20)        /* a chunk of the data plane */
#define MAX_SLOTS 256
#define MAX_THREADS 32

struct job { CUcontext ctx; CUstream s; CUdeviceptr dev; char *host; size_t n; bool out; int slot; };

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;          /* a slot, a job or the last job's end */
    char *ring;
    size_t bytes;
    int nslots;
    bool slot_busy[MAX_SLOTS];
    CUevent ev[MAX_SLOTS];
    struct job q[MAX_SLOTS];    /* at most one queued job per slot */
    int qhead, qlen, running;
    CUresult first_err;
    bool ready;
} B = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

/* Read once: staging is pinned or not for the life of the process, whatever the application later
 * does to its environment; and this is asked for every chunk copied. */
static long g_ring_mib = -1;
static pthread_once_t g_ring_once = PTHREAD_ONCE_INIT;
static void read_ring_mib(void) { g_ring_mib = gpucr_env_long("GPUCR_BOUNCE_MIB", 0); }

bool bounce_enabled(void)
{
    pthread_once(&g_ring_once, read_ring_mib);
    return g_ring_mib > 0;
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
    char *slot = B.ring + (size_t)j->slot * SLOT;
    CUevent ev = B.ev[j->slot];
    gpucr_drv.cuCtxSetCurrent(j->ctx);
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

int bounce_prepare(CUcontext ctx, char *err, size_t errlen)
{
    pthread_mutex_lock(&B.mu);
    if (B.ready) { pthread_mutex_unlock(&B.mu); return 0; }
    bounce_enabled();   /* reads the setting */
    int nslots = (int)(((size_t)g_ring_mib << 20) / SLOT);
    if (nslots < 2) nslots = 2;
    if (nslots > MAX_SLOTS) nslots = MAX_SLOTS;
    int nthreads = (int)gpucr_env_long("GPUCR_BOUNCE_THREADS", 8);
    if (nthreads < 1) nthreads = 1;
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    size_t bytes = (size_t)nslots * SLOT;
    int rc = -1;
    char *ring = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (ring == MAP_FAILED) {
        snprintf(err, errlen, "cannot map %zu MiB for the bounce ring", bytes >> 20);
        goto out;
    }
    gpucr_drv.cuCtxSetCurrent(ctx);
    CUresult cr = gpucr_drv.cuMemHostRegister_v2(ring, bytes, CU_MEMHOSTREGISTER_PORTABLE);
    for (int i = 0; cr == CUDA_SUCCESS && i < nslots; i++) cr = gpucr_drv.cuEventCreate(&B.ev[i], CU_EVENT_DISABLE_TIMING);
    if (cr != CUDA_SUCCESS) {
        snprintf(err, errlen, "cannot pin the %zu MiB bounce ring: %s", bytes >> 20, gpucr_cu_errstr(cr));
        munmap(ring, bytes);   /* events already made are few and harmless: not worth undoing here */
        goto out;
    }
    int started = 0;
    for (int i = 0; i < nthreads; i++) started += gpucr_spawn_detached(worker, NULL);
    if (!started) { snprintf(err, errlen, "cannot start the bounce copy threads"); goto out; }
    B.ring = ring;
    B.bytes = bytes;
    B.nslots = nslots;
    B.ready = true;
    rc = 0;
    gpucr_log("bounce ring: %zu MiB pinned in %d slots, %d copy threads", bytes >> 20, nslots, started);
out:
    pthread_mutex_unlock(&B.mu);
    return rc;
}

CUresult bounce_submit(CUcontext ctx, CUstream s, CUdeviceptr dev, void *host, size_t n, bool out)
{
    pthread_mutex_lock(&B.mu);
    int slot = -1;
    while (slot < 0) {
        for (int i = 0; i < B.nslots && slot < 0; i++) if (!B.slot_busy[i]) slot = i;
        if (slot < 0) pthread_cond_wait(&B.cv, &B.mu);
    }
    B.slot_busy[slot] = true;
    CUresult rc = CUDA_SUCCESS;
    if (out) {   /* the device's copy is queued here, on the caller's stream, in order */
        gpucr_drv.cuCtxSetCurrent(ctx);
        rc = REAL(cuMemcpyDtoHAsync_v2)(B.ring + (size_t)slot * SLOT, dev, n, s);
        if (rc == CUDA_SUCCESS) rc = gpucr_drv.cuEventRecord(B.ev[slot], s);
    }
    if (rc != CUDA_SUCCESS) {
        B.slot_busy[slot] = false;
        pthread_mutex_unlock(&B.mu);
        return rc;
    }
    B.q[(B.qhead + B.qlen) % MAX_SLOTS] = (struct job){ctx, s, dev, host, n, out, slot};
    B.qlen++;
    pthread_cond_broadcast(&B.cv);
    pthread_mutex_unlock(&B.mu);
    return CUDA_SUCCESS;
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

void bounce_reset_after_fork(void)
{
    /* the parent's ring and threads are not the child's; its pinning is not ours to undo */
    if (B.ring) munmap(B.ring, B.bytes);
    memset(&B, 0, sizeof B);
    pthread_mutex_init(&B.mu, NULL);
    pthread_cond_init(&B.cv, NULL);
}
