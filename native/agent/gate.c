/* The checkpoint gate: every wrapped entry point that submits device work or changes device memory
 * passes through it. Open, it costs two atomic operations. A checkpoint closes it and waits, with a
 * deadline, for the calls in flight to return; callers that arrive meanwhile wait until it opens. */
#include <pthread.h>
#include <stdatomic.h>
#include "agent.h"

static atomic_int g_closed;
/* Set once a checkpoint has drained every call and synchronised the device (gpucr_gate_settle), until
 * the gate opens: from then on nothing of the application's is pending on the GPU, so a stream or event
 * query is answered "complete" without the driver (gpucr_gate_query). */
static atomic_int g_settled;
static atomic_long g_in_flight;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_opened = PTHREAD_COND_INITIALIZER;
static pthread_cond_t g_drained = PTHREAD_COND_INITIALIZER;
/* A wrapper reached from inside another wrapper on the same thread is already counted. */
static __thread int t_depth;

static void signal_drained(void)
{
    pthread_mutex_lock(&g_mu);
    pthread_cond_broadcast(&g_drained);
    pthread_mutex_unlock(&g_mu);
}

void gpucr_gate_enter(void)
{
    if (t_depth++ > 0) return;
    for (;;) {
        atomic_fetch_add(&g_in_flight, 1);
        if (!atomic_load(&g_closed)) return;
        /* Closed: step back out so the closer can drain, then wait for it to reopen. */
        if (atomic_fetch_sub(&g_in_flight, 1) == 1) signal_drained();
        pthread_mutex_lock(&g_mu);
        while (atomic_load(&g_closed)) pthread_cond_wait(&g_opened, &g_mu);
        pthread_mutex_unlock(&g_mu);
    }
}

bool gpucr_gate_query(void)
{
    if (t_depth++ > 0) return false;
    for (;;) {
        atomic_fetch_add(&g_in_flight, 1);
        if (!atomic_load(&g_closed)) return false;
        if (atomic_fetch_sub(&g_in_flight, 1) == 1) signal_drained();
        if (atomic_load(&g_settled)) { t_depth--; return true; }
        /* closed, not yet settled: wait for the gate to open or the checkpoint to settle */
        pthread_mutex_lock(&g_mu);
        while (atomic_load(&g_closed) && !atomic_load(&g_settled)) pthread_cond_wait(&g_opened, &g_mu);
        pthread_mutex_unlock(&g_mu);
    }
}

void gpucr_gate_settle(void)
{
    pthread_mutex_lock(&g_mu);
    if (atomic_load(&g_closed)) atomic_store(&g_settled, 1);
    pthread_cond_broadcast(&g_opened);
    pthread_mutex_unlock(&g_mu);
}

void gpucr_gate_leave(void)
{
    if (--t_depth > 0) return;
    if (atomic_fetch_sub(&g_in_flight, 1) == 1 && atomic_load(&g_closed)) signal_drained();
}

bool gpucr_gate_close(int64_t deadline_ns, long *in_flight_left)
{
    pthread_mutex_lock(&g_mu);
    atomic_store(&g_closed, 1);
    while (atomic_load(&g_in_flight) > 0) {
        int64_t now = gpucr_now_ns();
        if (now >= deadline_ns) {
            if (in_flight_left) *in_flight_left = atomic_load(&g_in_flight);
            atomic_store(&g_closed, 0);
            pthread_cond_broadcast(&g_opened);
            pthread_mutex_unlock(&g_mu);
            return false;
        }
        gpucr_cond_wait_step(&g_drained, &g_mu, deadline_ns);
    }
    pthread_mutex_unlock(&g_mu);
    return true;
}

void gpucr_gate_open(void)
{
    pthread_mutex_lock(&g_mu);
    atomic_store(&g_settled, 0);
    atomic_store(&g_closed, 0);
    pthread_cond_broadcast(&g_opened);
    pthread_mutex_unlock(&g_mu);
}

bool gpucr_gate_is_closed(void) { return atomic_load(&g_closed) != 0; }

void gpucr_gate_reset_after_fork(void)
{
    /* the child runs on alone: whatever the parent's threads held or had closed is not its own
     * (plain stores, as POSIX allows in a fork child) */
    atomic_store(&g_closed, 0);
    atomic_store(&g_settled, 0);
    atomic_store(&g_in_flight, 0);
    t_depth = 0;
    g_mu = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    g_opened = (pthread_cond_t)PTHREAD_COND_INITIALIZER;
    g_drained = (pthread_cond_t)PTHREAD_COND_INITIALIZER;
}
