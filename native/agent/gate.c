/* The checkpoint gate: every wrapped entry point that submits device work or changes device memory
 * passes through it. Open, it costs two atomic operations. A checkpoint closes it and waits, with a
 * deadline, for the calls in flight to return; callers that arrive meanwhile wait until it opens. */
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include "agent.h"
#include "json.h"
#include "settings.h"

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
/* The swap service (issue 27). When a call that submits work or changes memory last went through the open gate
 * (gpucr_now_ns; 0: never), for idle parking: one relaxed store per call, no lock. */
static atomic_llong g_last_submit_ns;
/* When such a call first met the closed gate since it closed (0: none): the demand that brings a parked app back.
 * The waiting thread only sets it and writes the watch's eventfd: no lock, no connection, out of the in-flight
 * count. Cleared when the gate opens, so it is forwarded once per park. */
static atomic_llong g_demand_ns;
/* every demanding call that found the gate closed, counted (its first since the gate closed sets g_demand_ns), and
 * the count when a watch last answered: a decline re-notes a demand counted after that answer (the server never saw
 * it), where clearing it would leave that thread waiting, unnoted, for ever */
static atomic_llong g_demands;
static atomic_llong g_demands_answered;
static atomic_int g_demand_fd = -1;
static atomic_long g_opens;   /* how many times the gate opened: a watch answers when someone else's restore opens it */   /* the eventfd a `watch` waits on; -1 until the first watch makes it */

static void signal_drained(void)
{
    pthread_mutex_lock(&g_mu);
    pthread_cond_broadcast(&g_drained);
    pthread_mutex_unlock(&g_mu);
}

void gpucr_gate_wake_watch(void)
{
    int fd = atomic_load(&g_demand_fd);
    uint64_t one = 1;
    if (fd >= 0 && write(fd, &one, sizeof one) < 0) { /* a full counter is already a wake-up */ }
}

/* The first demanding call at the closed gate since it closed (or since the server declined the last one): noted
 * once, the watch woken. GPUCR_TEST_LOSE_WAKES notes it without the wake: the swap service's net must find it. */
static void raise_demand(void)
{
    atomic_fetch_add(&g_demands, 1);
    long long none = 0;
    if (atomic_compare_exchange_strong(&g_demand_ns, &none, (long long)gpucr_now_ns())
        && !gpucr_setting_on(SET_TEST_LOSE_WAKES))
        gpucr_gate_wake_watch();
}

/* The server declined this demand (not a park of its own, or its resume failed): the next demanding call of this
 * closed period is noted again, so a later demand is never locked out by one answered already. */
void gpucr_gate_demand_declined(long long demand_ns)
{
    long long seen = demand_ns;
    if (!demand_ns || !atomic_compare_exchange_strong(&g_demand_ns, &seen, 0)) return;
    if (atomic_load(&g_demands) != atomic_load(&g_demands_answered) && atomic_load(&g_closed)) {
        long long none = 0;   /* came after the watch's answer: a demand of its own (this watch sees it at once) */
        atomic_compare_exchange_strong(&g_demand_ns, &none, (long long)gpucr_now_ns());
    }
}

long long gpucr_gate_demands_answered(void)
{
    long long n = atomic_load(&g_demands);
    atomic_store(&g_demands_answered, n);
    return n;
}

/* Through the gate; at the closed gate, wait for it to open: for ever, or (limit_ms > 0) at most that long, then false
 * with the thread outside the gate. */
static bool enter_within(bool demand, long long limit_ms)
{
    if (t_depth++ > 0) return true;
    demand = demand && !gpucr_agent_thread();   /* the agent's own work (staging ahead) is nobody's demand */
    int64_t deadline = 0;
    for (;;) {
        atomic_fetch_add(&g_in_flight, 1);
        if (!atomic_load(&g_closed)) {
            if (demand) atomic_store_explicit(&g_last_submit_ns, (long long)gpucr_now_ns(), memory_order_relaxed);
            return true;
        }
        /* Closed: step back out so the closer can drain, then wait for it to reopen. */
        if (atomic_fetch_sub(&g_in_flight, 1) == 1) signal_drained();
        if (demand) raise_demand();
        if (limit_ms > 0 && !deadline) deadline = gpucr_now_ns() + limit_ms * 1000000LL;
        pthread_mutex_lock(&g_mu);
        while (atomic_load(&g_closed) && (!deadline || gpucr_now_ns() < deadline)) {
            if (deadline) gpucr_cond_wait_step(&g_opened, &g_mu, deadline);
            else pthread_cond_wait(&g_opened, &g_mu);
        }
        bool late = atomic_load(&g_closed) != 0;
        pthread_mutex_unlock(&g_mu);
        if (late) { t_depth--; return false; }
    }
}

static void enter(bool demand) { enter_within(demand, 0); }

void gpucr_gate_enter(void) { enter(true); }
void gpucr_gate_enter_waiting(void) { enter(false); }

long long gpucr_gate_wait_limit_ms(void) { return gpucr_setting_int(SET_SWAP_WAIT_LIMIT_MS); }

bool gpucr_gate_enter_alloc(void) { return enter_within(true, gpucr_gate_wait_limit_ms()); }

int gpucr_gate_step_out(void)
{
    int depth = t_depth;
    if (depth > 0) { t_depth = 1; gpucr_gate_leave(); }
    return depth;
}

bool gpucr_gate_step_in(int depth, long long limit_ms)
{
    if (depth <= 0) return true;
    /* the allocation goes on: demand, should its app have been parked meanwhile */
    bool in = enter_within(true, limit_ms);
    if (!in) atomic_fetch_add(&g_in_flight, 1);   /* past the limit: counted in again without the driver, for the
                                                     * caller's own leave; it only returns out-of-memory from here */
    t_depth = depth;
    return in;
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
    atomic_store(&g_demand_ns, 0);
    atomic_fetch_add(&g_opens, 1);
    pthread_cond_broadcast(&g_opened);
    pthread_mutex_unlock(&g_mu);
    gpucr_gate_wake_watch();   /* a watch waiting for demand learns the park is over */
}

void gpucr_gate_json(struct jb *j)
{
    long long last = atomic_load_explicit(&g_last_submit_ns, memory_order_relaxed), demand = atomic_load(&g_demand_ns);
    jb_sub(j, "swap");
    jb_int(j, "now_ns", (long long)gpucr_now_ns());   /* CLOCK_MONOTONIC: the server's clock too */
    jb_int(j, "last_submit_ns", last);
    jb_int(j, "demand_ns", demand);
    jb_int(j, "demands", atomic_load(&g_demands));   /* demanding calls that found the gate closed, ever */
    jb_end(j);
}

/* The eventfd made once, by the channel's thread (never by a waiting application thread). */
int gpucr_gate_demand_fd(void)
{
    int fd = atomic_load(&g_demand_fd);
    if (fd >= 0) return fd;
    int made = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK), none = -1;
    if (made < 0) return -1;
    if (!atomic_compare_exchange_strong(&g_demand_fd, &none, made)) { close(made); return none; }
    return made;
}

/* For the swap service's watch (watch.c): the demand noted since the gate closed (0: none), how many times the
 * gate opened, and the eventfd a watch waits on (made once, by the channel's thread, never by an app thread). */
long long gpucr_gate_demand_ns(void) { return atomic_load(&g_demand_ns); }
long gpucr_gate_opens(void) { return atomic_load(&g_opens); }

bool gpucr_gate_is_closed(void) { return atomic_load(&g_closed) != 0; }

void gpucr_gate_reset_after_fork(void)
{
    /* the child runs on alone: whatever the parent's threads held or had closed is not its own
     * (plain stores, as POSIX allows in a fork child) */
    atomic_store(&g_closed, 0);
    atomic_store(&g_settled, 0);
    atomic_store(&g_in_flight, 0);
    atomic_store(&g_demand_ns, 0);
    atomic_store(&g_last_submit_ns, 0);
    if (atomic_load(&g_demand_fd) >= 0) close(atomic_load(&g_demand_fd));
    atomic_store(&g_demand_fd, -1);
    t_depth = 0;
    g_mu = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    g_opened = (pthread_cond_t)PTHREAD_COND_INITIALIZER;
    g_drained = (pthread_cond_t)PTHREAD_COND_INITIALIZER;
}
