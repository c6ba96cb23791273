/*
 * The API gate: what the driver checkpoint lock closes.
 *
 * Every entry point that touches driver state runs between sim_gate_enter and sim_gate_exit.
 * In the common path that is a counter bump under a mutex that is released before the call's
 * work starts, so any number of calls (a spin_ms kernel included) run concurrently. A LOCK
 * request closes the gate: new calls wait (they block, as on the real driver, they do not
 * fail) and the controller waits for the calls in flight to return. Opening it lets the
 * waiting callers continue.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <time.h>

#include "simcuda.h"

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv; /* signalled when inflight drops to 0 or the gate reopens */
    pthread_once_t once;
    unsigned inflight;
    bool closed;
} gate = {
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .once = PTHREAD_ONCE_INIT,
};

/* Nesting depth of the calling thread: a host function run by cuLaunchHostFunc may call the
 * API again; that inner call must not wait for a gate that waits for the outer call. */
static __thread unsigned depth;

static void gate_init(void)
{
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC); /* lock timeouts ignore wall-clock jumps */
    pthread_cond_init(&gate.cv, &attr);
    pthread_condattr_destroy(&attr);
}

CUresult sim_gate_enter(void)
{
    if (!sim_is_ready())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (depth++ > 0)
        return CUDA_SUCCESS;
    pthread_once(&gate.once, gate_init);
    pthread_mutex_lock(&gate.mu);
    while (gate.closed)
        pthread_cond_wait(&gate.cv, &gate.mu);
    gate.inflight++;
    pthread_mutex_unlock(&gate.mu);
    return CUDA_SUCCESS;
}

void sim_gate_exit(void)
{
    if (--depth > 0)
        return;
    pthread_mutex_lock(&gate.mu);
    if (--gate.inflight == 0 && gate.closed)
        pthread_cond_broadcast(&gate.cv);
    pthread_mutex_unlock(&gate.mu);
}

bool sim_gate_close(unsigned timeout_ms)
{
    pthread_once(&gate.once, gate_init);
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += timeout_ms / 1000;
    deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000L;
    }

    pthread_mutex_lock(&gate.mu);
    gate.closed = true;
    while (gate.inflight > 0) {
        int rc = timeout_ms == 0 ? pthread_cond_wait(&gate.cv, &gate.mu)
                                 : pthread_cond_timedwait(&gate.cv, &gate.mu, &deadline);
        if (rc == ETIMEDOUT && gate.inflight > 0) {
            /* Abort cleanly: the callers that queued up meanwhile go on. */
            gate.closed = false;
            pthread_cond_broadcast(&gate.cv);
            pthread_mutex_unlock(&gate.mu);
            return false;
        }
    }
    pthread_mutex_unlock(&gate.mu);
    return true;
}

void sim_gate_open(void)
{
    pthread_once(&gate.once, gate_init);
    pthread_mutex_lock(&gate.mu);
    gate.closed = false;
    pthread_cond_broadcast(&gate.cv);
    pthread_mutex_unlock(&gate.mu);
}
