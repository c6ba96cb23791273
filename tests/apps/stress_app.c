/* A many-threaded driver-API program for the thread-safety test (tests/test_threads.py), built with
 * ThreadSanitizer by scripts/tsan-build. While a controller checkpoints and restores it:
 *   - alloc threads allocate plain memory (small: native; 2 MiB and more: made VMM by the agent),
 *     fill it, read it back (a checkpoint may fall between the two) and free it;
 *   - a VMM thread creates, maps, queries, retains and releases its own VMM memory;
 *   - an IPC thread asks for a legacy IPC handle of VMM memory (refused, but it reads the registry);
 *   - status threads ask the agent's control channel for its status, as a monitor would;
 *   - stream-ordered threads allocate with cuMemAllocAsync on a stream of their own, fill, check and
 *     free on the next thread's stream, synchronise (the pool's release threshold then applies) and
 *     trim the pool now and then: the agent's pools under the same cycles.
 * One buffer per alloc thread is kept for the whole run. It prints READY; on "stop" it stops
 * the threads, checks every kept buffer and prints "OK <allocations>" or "BAD <why>". */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef void *CUcontext;
typedef struct { int type; int id; } CUmemLocation;
typedef struct {
    int type, requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    unsigned char allocFlags[8];
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;

CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, int);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemsetD8_v2(CUdeviceptr, unsigned char, size_t);
CUresult cuMemcpyDtoH_v2(void *, CUdeviceptr, size_t);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemAddressFree(CUdeviceptr, size_t);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemUnmap(CUdeviceptr, size_t);
CUresult cuMemSetAccess(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *, CUmemGenericAllocationHandle);
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *, void *);
CUresult cuIpcGetMemHandle(void *, CUdeviceptr);
typedef void *CUstream, *CUmemoryPool;
CUresult cuStreamCreate(CUstream *, unsigned);
CUresult cuStreamSynchronize(CUstream);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuMemsetD8Async(CUdeviceptr, unsigned char, size_t, CUstream);
CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *, int);
CUresult cuMemPoolTrimTo(CUmemoryPool, size_t);

#define MiB ((size_t)1 << 20)
#define ALLOC_THREADS 6
#define STATUS_THREADS 2
#define ASYNC_THREADS 3

static CUcontext g_ctx;
static atomic_bool g_stop;
static atomic_long g_allocs, g_statuses;
static char g_bad[256];
static pthread_mutex_t g_bad_mu = PTHREAD_MUTEX_INITIALIZER;
static CUdeviceptr g_kept[ALLOC_THREADS];
static CUstream g_streams[ASYNC_THREADS];

static void bad(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void bad(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&g_bad_mu);
    if (!g_bad[0]) vsnprintf(g_bad, sizeof g_bad, fmt, ap);
    pthread_mutex_unlock(&g_bad_mu);
    va_end(ap);
}

/* Whether the first and last 4 KiB of [p, p+n) hold byte v. */
static int holds(CUdeviceptr p, size_t n, unsigned char v)
{
    static __thread unsigned char buf[4096];
    size_t k = n < sizeof buf ? n : sizeof buf;
    for (int end = 0; end < 2; end++) {
        if (cuMemcpyDtoH_v2(buf, end ? p + n - k : p, k)) return 0;
        for (size_t i = 0; i < k; i++)
            if (buf[i] != v) return 0;
    }
    return 1;
}

static void *alloc_thread(void *arg)
{
    int id = (int)(long)arg;
    static const size_t sizes[] = {4096, 64 << 10, 2 * MiB, 3 * MiB};
    cuCtxSetCurrent(g_ctx);
    for (unsigned i = 0; !atomic_load(&g_stop); i++) {
        size_t n = sizes[(i + (unsigned)id) % 4];
        unsigned char tag = (unsigned char)(i * 7 + (unsigned)id);
        CUdeviceptr p = 0;
        CUresult rc = cuMemAlloc_v2(&p, n);
        if (rc) { bad("cuMemAlloc_v2(%zu): %d", n, rc); break; }
        if ((rc = cuMemsetD8_v2(p, tag, n))) bad("cuMemsetD8_v2: %d", rc);
        else if (!holds(p, n, tag)) bad("%zu bytes at 0x%llx lost their data", n, p);
        if ((rc = cuMemFree_v2(p))) bad("cuMemFree_v2 of %zu bytes at 0x%llx: %d", n, p, rc);
        atomic_fetch_add(&g_allocs, 1);
    }
    return NULL;
}

static void *vmm_thread(void *arg)
{
    (void)arg;
    cuCtxSetCurrent(g_ctx);
    CUmemAllocationProp prop = {.type = 1, .location = {1, 0}};
    CUmemAccessDesc acc = {{1, 0}, 3};
    while (!atomic_load(&g_stop)) {
        CUmemGenericAllocationHandle h = 0, again = 0;
        CUdeviceptr va = 0;
        if (cuMemCreate(&h, 2 * MiB, &prop, 0) || cuMemAddressReserve(&va, 2 * MiB, 0, 0, 0) ||
            cuMemMap(va, 2 * MiB, 0, h, 0) || cuMemSetAccess(va, 2 * MiB, &acc, 1) || cuMemsetD8_v2(va, 0x5a, 2 * MiB)) {
            bad("application VMM failed");
            break;
        }
        /* not gated: a checkpoint may hold the memory released meanwhile, so these may fail; they must not race */
        CUmemAllocationProp got;
        cuMemGetAllocationPropertiesFromHandle(&got, h);
        if (cuMemRetainAllocationHandle(&again, (void *)(uintptr_t)va) == 0) cuMemRelease(again);
        if (!holds(va, 2 * MiB, 0x5a)) bad("application VMM at 0x%llx lost its data", va);
        if (cuMemUnmap(va, 2 * MiB) || cuMemRelease(h) || cuMemAddressFree(va, 2 * MiB)) bad("application VMM release failed");
        atomic_fetch_add(&g_allocs, 1);
    }
    return NULL;
}

static void *async_thread(void *arg)
{
    int id = (int)(long)arg;
    static const size_t sizes[] = {512, 64 << 10, 1 * MiB, 3 * MiB};
    CUstream mine = g_streams[id], next = g_streams[(id + 1) % ASYNC_THREADS];
    CUmemoryPool pool = NULL;
    cuCtxSetCurrent(g_ctx);
    cuDeviceGetDefaultMemPool(&pool, 0);
    for (unsigned i = 0; !atomic_load(&g_stop); i++) {
        size_t n = sizes[(i + (unsigned)id) % 4];
        unsigned char tag = (unsigned char)(i * 5 + (unsigned)id);
        CUdeviceptr p = 0;
        CUresult rc = cuMemAllocAsync(&p, n, mine);
        if (rc) { bad("cuMemAllocAsync(%zu): %d", n, rc); break; }
        if ((rc = cuMemsetD8Async(p, tag, n, mine)) || (rc = cuStreamSynchronize(mine))) bad("memset on the stream: %d", rc);
        else if (!holds(p, n, tag)) bad("%zu stream-ordered bytes at 0x%llx lost their data", n, p);
        /* freed on the next thread's stream: whoever gets it next must be ordered after the free */
        if ((rc = cuMemFreeAsync(p, next))) bad("cuMemFreeAsync of %zu bytes at 0x%llx: %d", n, p, rc);
        if (i % 16 == 15 && (rc = cuStreamSynchronize(next))) bad("cuStreamSynchronize: %d", rc);
        if (i % 64 == 63 && (rc = cuMemPoolTrimTo(pool, 0))) bad("cuMemPoolTrimTo: %d", rc);
        atomic_fetch_add(&g_allocs, 1);
    }
    return NULL;
}

static void *ipc_thread(void *arg)
{
    (void)arg;
    cuCtxSetCurrent(g_ctx);
    char handle[64];
    while (!atomic_load(&g_stop)) {
        cuIpcGetMemHandle(handle, g_kept[0]);   /* VMM memory: refused, after a registry look-up */
        usleep(1000);
    }
    return NULL;
}

static void socket_path(char *out, size_t len)
{
    struct stat ns;
    unsigned long long pidns = stat("/proc/self/ns/pid", &ns) == 0 ? (unsigned long long)ns.st_ino : 0;
    const char *dir = getenv("GPUCR_RUNTIME_DIR");   /* the test sets it */
    snprintf(out, len, "%s/%d-%llu.sock", dir ? dir : ".", (int)getpid(), pidns);
}

static void *status_thread(void *arg)
{
    (void)arg;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    socket_path(sa.sun_path, sizeof sa.sun_path);
    char reply[1 << 16];
    while (!atomic_load(&g_stop)) {
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0 && write(fd, "status\n", 7) == 7) {
            size_t have = 0;
            ssize_t n;
            while (have < sizeof reply && (n = read(fd, reply + have, sizeof reply - have)) > 0) {
                have += (size_t)n;
                if (memchr(reply, '\n', have)) break;
            }
            if (have && !memcmp(reply, "{\"ok\":true", 10)) atomic_fetch_add(&g_statuses, 1);
        }
        if (fd >= 0) close(fd);
        usleep(2000);
    }
    return NULL;
}

int main(void)
{
    if (cuInit(0) || cuDevicePrimaryCtxRetain(&g_ctx, 0) || cuCtxSetCurrent(g_ctx)) { printf("BAD init\n"); return 1; }
    for (int i = 0; i < ALLOC_THREADS; i++)   /* made before the threads start: they read g_kept freely */
        if (cuMemAlloc_v2(&g_kept[i], 2 * MiB) || cuMemsetD8_v2(g_kept[i], (unsigned char)(0x40 + i), 2 * MiB)) {
            printf("BAD kept buffer %d\n", i);
            return 1;
        }
    for (int i = 0; i < ASYNC_THREADS; i++)
        if (cuStreamCreate(&g_streams[i], 1)) { printf("BAD stream\n"); return 1; }
    pthread_t th[ALLOC_THREADS + STATUS_THREADS + ASYNC_THREADS + 2];
    int n = 0;
    for (long i = 0; i < ASYNC_THREADS; i++) pthread_create(&th[n++], NULL, async_thread, (void *)i);
    for (long i = 0; i < ALLOC_THREADS; i++) pthread_create(&th[n++], NULL, alloc_thread, (void *)i);
    pthread_create(&th[n++], NULL, vmm_thread, NULL);
    pthread_create(&th[n++], NULL, ipc_thread, NULL);
    for (int i = 0; i < STATUS_THREADS; i++) pthread_create(&th[n++], NULL, status_thread, NULL);
    printf("READY\n");
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin)) return 1;
    atomic_store(&g_stop, 1);
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < ALLOC_THREADS; i++)
        if (!holds(g_kept[i], 2 * MiB, (unsigned char)(0x40 + i))) bad("kept buffer %d lost its data", i);
    if (atomic_load(&g_statuses) == 0) bad("no status answer");
    if (g_bad[0]) printf("BAD %s\n", g_bad);
    else printf("OK %ld %ld\n", atomic_load(&g_allocs), atomic_load(&g_statuses));
    fflush(stdout);
    return 0;
}
