/* Room on demand (issue 27): an allocation the driver refuses for lack of GPU memory asks the gpucr server, through
 * the `watch` it keeps on this process (gate.c), to park other apps on the GPU; it is retried once if the server
 * made room. With no watch waiting (no swap service) the error goes back as before, at once.
 *
 * The asking thread steps out of the gate while it waits (its own app may be parked meanwhile) and takes only this
 * file's locks, never one a checkpoint takes. One request at a time per process. */
#include <pthread.h>
#include <stdatomic.h>
#include "agent.h"
#include "json.h"

#define ROOM_WAIT_NS (60LL * 1000000000LL)   /* the server parks and answers within its own deadlines */

enum { ROOM_NONE, ROOM_ASKED, ROOM_FORWARDED, ROOM_GRANTED, ROOM_REFUSED };
static pthread_mutex_t g_one = PTHREAD_MUTEX_INITIALIZER;   /* one request at a time */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static atomic_int g_state, g_watchers, g_dev;
static atomic_llong g_bytes, g_free;

void gpucr_room_watching(int delta) { atomic_fetch_add(&g_watchers, delta); }
bool gpucr_room_pending(void) { return atomic_load(&g_state) == ROOM_ASKED; }

void gpucr_room_json(struct jb *j)
{
    atomic_store(&g_state, ROOM_FORWARDED);
    jb_int(j, "bytes", atomic_load(&g_bytes));
    jb_int(j, "device", atomic_load(&g_dev));
    jb_int(j, "free", atomic_load(&g_free));
}

void gpucr_room_verdict(bool granted)
{
    pthread_mutex_lock(&g_mu);
    if (atomic_load(&g_state) == ROOM_FORWARDED) atomic_store(&g_state, granted ? ROOM_GRANTED : ROOM_REFUSED);
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
}

bool gpucr_room_ask(size_t bytes)
{
    if (!atomic_load(&g_watchers)) return false;
    CUdevice dev = 0;
    size_t free_b = 0, total = 0;
    if (gpucr_drv.cuCtxGetDevice) gpucr_drv.cuCtxGetDevice(&dev);
    if (gpucr_drv.cuMemGetInfo_v2) gpucr_drv.cuMemGetInfo_v2(&free_b, &total);
    pthread_mutex_lock(&g_one);
    atomic_store(&g_bytes, (long long)bytes);
    atomic_store(&g_dev, dev);
    atomic_store(&g_free, (long long)free_b);
    atomic_store(&g_state, ROOM_ASKED);
    gpucr_gate_wake_watch();
    int depth = gpucr_gate_step_out();
    int64_t deadline = gpucr_now_ns() + ROOM_WAIT_NS;
    pthread_mutex_lock(&g_mu);
    while (atomic_load(&g_state) < ROOM_GRANTED && gpucr_now_ns() < deadline) gpucr_cond_wait_step(&g_cv, &g_mu, deadline);
    bool granted = atomic_load(&g_state) == ROOM_GRANTED;
    atomic_store(&g_state, ROOM_NONE);
    pthread_mutex_unlock(&g_mu);
    gpucr_gate_step_in(depth);
    pthread_mutex_unlock(&g_one);
    gpucr_log("room for %zu bytes on device %d: %s", bytes, (int)dev, granted ? "made by the gpucr server, retrying" : "none");
    return granted;
}

void gpucr_room_reset_after_fork(void)
{
    g_one = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    g_mu = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    g_cv = (pthread_cond_t)PTHREAD_COND_INITIALIZER;
    atomic_store(&g_state, ROOM_NONE);
    atomic_store(&g_watchers, 0);
}
