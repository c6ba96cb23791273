/* Room on demand (issue 27): an allocation the driver refuses for lack of GPU memory asks the gpucr server, through
 * the `watch` it keeps on this process (gate.c), to park other apps on the GPU; it is retried once if the server
 * made room. With no server watching (no swap service) the error goes back as before, at once.
 *
 * The asking thread steps out of the gate while it waits (its own app may be parked meanwhile) and takes only this
 * file's locks, never one a checkpoint takes. One request at a time per process. The wait (for room, then for its
 * app's resume if it was parked meanwhile) ends at the swap service's wait limit, with the out-of-memory error.
 *
 * An app that frees its cache and retries a failed allocation (PyTorch's caching allocator: measured, one retry,
 * then OutOfMemoryError; CuPy's memory pool: frees its blocks and retries, then collects garbage and retries once
 * more) gets its first failure as is, and room is asked on its retry of the same size from the same thread: an app
 * whose own cache suffices parks no one. Any other app asks at once, as it may not retry at all. */
#define _GNU_SOURCE
#include <link.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include "agent.h"
#include "json.h"
#include "registry.h"
#include "settings.h"

#define ROOM_WAIT_NS (60LL * 1000000000LL)   /* the server parks and answers within its own deadlines */

enum { ROOM_NONE, ROOM_ASKED, ROOM_FORWARDED, ROOM_GRANTED, ROOM_REFUSED };
static pthread_mutex_t g_one = PTHREAD_MUTEX_INITIALIZER;   /* one request at a time */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static atomic_int g_state, g_watchers, g_dev;
static atomic_bool g_watched;   /* a server has watched this process (an allocation before that may wait for it) */
static atomic_llong g_bytes, g_free;
static atomic_bool g_context;   /* the request is for a context (its size the server's to say), not bytes */
static char g_uuid[48];   /* the asking context's GPU, written before the request is published (g_state), under g_one */

/* A server watches from its first `watch` on a connection until that connection ends (verbs.c), between its watches
 * too: an allocation that fails while the server answers the last watch (makes room, resumes this app, ...) waits
 * for its next one, where it used to find no watch and fail without asking (CI saw 15 of 16 requests asked). When
 * the last server hangs up, a request waiting for it is refused at once, not at its deadline. */
void gpucr_room_watching(int delta)
{
    if (delta > 0 && !atomic_exchange(&g_watched, true)) {   /* a request waiting for the first watch: it is here */
        pthread_mutex_lock(&g_mu);
        pthread_cond_broadcast(&g_cv);
        pthread_mutex_unlock(&g_mu);
    }
    if (atomic_fetch_add(&g_watchers, delta) + delta > 0) return;
    pthread_mutex_lock(&g_mu);
    int s = atomic_load(&g_state);
    if (s == ROOM_ASKED || s == ROOM_FORWARDED) atomic_store(&g_state, ROOM_REFUSED);
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
}
bool gpucr_room_pending(void) { return atomic_load(&g_state) == ROOM_ASKED; }

void gpucr_room_json(struct jb *j)
{
    atomic_store(&g_state, ROOM_FORWARDED);
    jb_int(j, "bytes", atomic_load(&g_bytes));
    jb_int(j, "device", atomic_load(&g_dev));
    jb_str(j, "uuid", g_uuid);   /* the server's name for that GPU: an app that holds no memory yet has no other */
    jb_int(j, "free", atomic_load(&g_free));
    jb_bool(j, "context", atomic_load(&g_context));
}

void gpucr_room_verdict(bool granted)
{
    pthread_mutex_lock(&g_mu);
    if (atomic_load(&g_state) == ROOM_FORWARDED) atomic_store(&g_state, granted ? ROOM_GRANTED : ROOM_REFUSED);
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
}

static __thread size_t t_let_fail;   /* this thread's last allocation let fail for its allocator to retry (bytes) */
static atomic_bool g_retrying;        /* a retrying allocator's library was seen loaded (neither is ever unloaded) */

/* PyTorch's CUDA allocator (libc10_cuda) or CuPy's memory pool (the extension module cupy/cuda/memory). */
static int is_retrying_allocator(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size; (void)data;
    return info->dlpi_name && (strstr(info->dlpi_name, "libc10_cuda") || strstr(info->dlpi_name, "/cupy/cuda/memory."));
}

/* Whether this app retries a failed allocation after freeing its cache (looked at only on out-of-memory). */
static bool app_retries(void)
{
    const char *v = gpucr_setting_str(SET_SWAP_ASK_ON_RETRY);
    if (strcmp(v, "auto")) return !strcmp(v, "1");
    if (!atomic_load(&g_retrying) && dl_iterate_phdr(is_retrying_allocator, NULL)) atomic_store(&g_retrying, true);
    return atomic_load(&g_retrying);
}

void gpucr_room_allocated(void) { t_let_fail = 0; }

/* The milliseconds left of a wait limit that started at start_ns (0: no limit; at least 1 once it passed). */
static long long limit_left_ms(long long limit_ms, int64_t start_ns)
{
    if (limit_ms <= 0) return 0;
    long long left = limit_ms - (gpucr_now_ns() - start_ns) / 1000000LL;
    return left > 0 ? left : 1;
}

/* Under `gpucr run --swap`, an allocation in the app's first moments, before the server's first watch (its next
 * tick after the app's socket is up), waits up to GPUCR_SWAP_FIRST_WATCH_MS for it, where it used to fail with no
 * word in the server's log. 0 once a watch came, or where no swap service is to come. */
static long long first_watch_ms(void)
{
    return atomic_load(&g_watched) ? 0 : gpucr_setting_int(SET_SWAP_FIRST_WATCH_MS);
}

/* The request itself, one at a time: `bytes` more on device `dev` (`free_b` free there as this process saw it);
 * `context`: a context the driver could not make, whose size the server knows better (bytes 0). */
static bool ask(size_t bytes, CUdevice dev, size_t free_b, bool context, long long first_ms)
{
    long long limit = gpucr_gate_wait_limit_ms();
    int64_t start = gpucr_now_ns();
    pthread_mutex_lock(&g_one);
    unsigned char id[16];
    if (gpucr_drv.cuDeviceGetUuid && gpucr_drv.cuDeviceGetUuid(id, dev) == CUDA_SUCCESS) reg_uuid_text(id, g_uuid);
    else g_uuid[0] = 0;
    atomic_store(&g_bytes, (long long)bytes);
    atomic_store(&g_dev, dev);
    atomic_store(&g_free, (long long)free_b);
    atomic_store(&g_context, context);
    atomic_store(&g_state, ROOM_ASKED);
    if (!atomic_load(&g_watchers) && !first_ms) atomic_store(&g_state, ROOM_REFUSED);   /* its server hung up meanwhile */
    gpucr_gate_wake_watch();
    int depth = gpucr_gate_step_out();
    int64_t deadline = start + (limit > 0 && limit * 1000000LL < ROOM_WAIT_NS ? limit * 1000000LL : ROOM_WAIT_NS);
    int64_t first_deadline = start + first_ms * 1000000LL;   /* while no watch came: the first watch's wait */
    pthread_mutex_lock(&g_mu);
    for (;;) {
        int64_t until = atomic_load(&g_watched) || first_deadline > deadline ? deadline : first_deadline;
        if (atomic_load(&g_state) >= ROOM_GRANTED || gpucr_now_ns() >= until) break;
        gpucr_cond_wait_step(&g_cv, &g_mu, until);
    }
    bool granted = atomic_load(&g_state) == ROOM_GRANTED;
    atomic_store(&g_state, ROOM_NONE);
    pthread_mutex_unlock(&g_mu);
    pthread_mutex_unlock(&g_one);
    bool in = gpucr_gate_step_in(depth, limit_left_ms(limit, start));
    const char *what = context ? "a context" : "an allocation";
    if (!in || (!granted && limit > 0 && gpucr_now_ns() - start >= limit * 1000000LL))
        gpucr_warn("%s of %zu bytes waited past its --wait-limit of %lld ms (for room%s): out of memory",
                   what, bytes, limit, in ? "" : ", then for its app's resume");
    else gpucr_log("room for %s of %zu bytes on device %d: %s", what, bytes, (int)dev,
                   granted ? "made by the gpucr server, retrying" : "none");
    return granted && in;
}

bool gpucr_room_ask(size_t bytes)
{
    long long first_ms = first_watch_ms();
    if (!atomic_load(&g_watchers) && !first_ms) return false;
    if (t_let_fail != bytes && app_retries()) {
        t_let_fail = bytes;
        gpucr_log("room for %zu bytes: not asked yet, the app frees its cache and retries first", bytes);
        return false;
    }
    t_let_fail = 0;
    CUdevice dev = 0;
    size_t free_b = 0, total = 0;
    if (gpucr_drv.cuCtxGetDevice) gpucr_drv.cuCtxGetDevice(&dev);
    if (gpucr_drv.cuMemGetInfo_v2) gpucr_drv.cuMemGetInfo_v2(&free_b, &total);
    return ask(bytes, dev, free_b, false, first_ms);
}

bool gpucr_room_ask_context(CUdevice dev)
{
    long long first_ms = first_watch_ms();
    if (!atomic_load(&g_watchers) && !first_ms) return false;
    return ask(0, dev, 0, true, first_ms);   /* no context here to read free memory in: the server reads it */
}

void gpucr_room_reset_after_fork(void)
{
    g_one = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    g_mu = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    g_cv = (pthread_cond_t)PTHREAD_COND_INITIALIZER;
    atomic_store(&g_state, ROOM_NONE);
    atomic_store(&g_watchers, 0);
    atomic_store(&g_watched, true);   /* a fork child is no swap app of its own: no watch is to come for it */
}
