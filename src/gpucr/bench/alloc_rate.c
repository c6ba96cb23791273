/* The alloc/free microbenchmark's worker (gpucr.bench.alloc_rate builds and runs it): stream-ordered
 * alloc/free pairs per second, through whatever libcuda.so.1 the process loads (the driver's own pools,
 * or gpucr's agent in front of them when preloaded). C, not Python: a ctypes call costs about as much
 * as the allocation being measured.
 *
 *   alloc_rate THREADS STREAMS_PER_THREAD PAIRS_PER_THREAD WINDOW SIZES(comma-separated bytes)
 *
 * Each thread owns its streams and keeps WINDOW allocations live per stream: every step frees the oldest
 * on a stream and allocates the next size there, round-robin over its streams. The default pool keeps
 * what it reserves (release threshold UINT64_MAX, as PyTorch sets it), so the loop measures reuse, not
 * the device allocator. Prints one JSON line. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUstream, *CUcontext, *CUmemoryPool;

static CUresult (*cuInit)(unsigned);
static CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, int);
static CUresult (*cuCtxSetCurrent)(CUcontext);
static CUresult (*cuCtxSynchronize)(void);
static CUresult (*cuStreamCreate)(CUstream *, unsigned);
static CUresult (*cuMemAllocAsync)(CUdeviceptr *, size_t, CUstream);
static CUresult (*cuMemFreeAsync)(CUdeviceptr, CUstream);
static CUresult (*cuDeviceGetDefaultMemPool)(CUmemoryPool *, int);
static CUresult (*cuMemPoolSetAttribute)(CUmemoryPool, int, void *);

static CUcontext g_ctx;
static int g_streams, g_window, g_nsizes;
static long g_pairs;
static size_t g_sizes[64];
static pthread_barrier_t g_start;

#define DIE(...) do { fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); exit(1); } while (0)
#define CU(x) do { CUresult rc_ = (x); if (rc_) DIE("%s: CUDA error %d", #x, rc_); } while (0)

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void *worker(void *arg)
{
    long id = (long)arg;
    CU(cuCtxSetCurrent(g_ctx));
    CUstream *st = calloc((size_t)g_streams, sizeof *st);
    CUdeviceptr *live = calloc((size_t)(g_streams * g_window), sizeof *live);
    if (!st || !live) DIE("out of memory");
    for (int s = 0; s < g_streams; s++) CU(cuStreamCreate(&st[s], 1));
    long k = id;
    for (int s = 0; s < g_streams; s++)   /* fill the window first: the timed loop is steady state */
        for (int w = 0; w < g_window; w++) CU(cuMemAllocAsync(&live[s * g_window + w], g_sizes[k++ % g_nsizes], st[s]));
    pthread_barrier_wait(&g_start);
    for (long i = 0; i < g_pairs; i++) {
        int s = (int)(i % g_streams), w = (int)((i / g_streams) % g_window);
        CUdeviceptr *slot = &live[s * g_window + w];
        CU(cuMemFreeAsync(*slot, st[s]));
        CU(cuMemAllocAsync(slot, g_sizes[k++ % g_nsizes], st[s]));
    }
    pthread_barrier_wait(&g_start);
    for (int s = 0; s < g_streams; s++)
        for (int w = 0; w < g_window; w++) CU(cuMemFreeAsync(live[s * g_window + w], st[s]));
    free(live);
    free(st);
    return NULL;
}

#define SYM(name) do { *(void **)&name = dlsym(lib, #name); if (!name) DIE("libcuda has no %s", #name); } while (0)

int main(int argc, char **argv)
{
    if (argc != 6) DIE("usage: %s THREADS STREAMS_PER_THREAD PAIRS_PER_THREAD WINDOW SIZES", argv[0]);
    int threads = atoi(argv[1]);
    g_streams = atoi(argv[2]);
    g_pairs = atol(argv[3]);
    g_window = atoi(argv[4]);
    for (char *tok = strtok(argv[5], ","); tok && g_nsizes < 64; tok = strtok(NULL, ",")) g_sizes[g_nsizes++] = strtoull(tok, NULL, 0);
    if (threads < 1 || g_streams < 1 || g_pairs < 1 || g_window < 1 || !g_nsizes) DIE("bad arguments");
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) DIE("cannot load libcuda.so.1: %s", dlerror());
    /* the exported symbols, as a C program linked to the driver reaches them (dlsym: the agent's wrappers when preloaded) */
    SYM(cuInit); SYM(cuDevicePrimaryCtxRetain); SYM(cuCtxSetCurrent); SYM(cuCtxSynchronize); SYM(cuStreamCreate);
    SYM(cuMemAllocAsync); SYM(cuMemFreeAsync); SYM(cuDeviceGetDefaultMemPool); SYM(cuMemPoolSetAttribute);
    CU(cuInit(0));
    CU(cuDevicePrimaryCtxRetain(&g_ctx, 0));
    CU(cuCtxSetCurrent(g_ctx));
    CUmemoryPool pool;
    CU(cuDeviceGetDefaultMemPool(&pool, 0));
    uint64_t keep = UINT64_MAX;
    CU(cuMemPoolSetAttribute(pool, 4 /* CU_MEMPOOL_ATTR_RELEASE_THRESHOLD */, &keep));
    pthread_barrier_init(&g_start, NULL, (unsigned)threads + 1);
    pthread_t *t = calloc((size_t)threads, sizeof *t);
    for (long i = 0; i < threads; i++) pthread_create(&t[i], NULL, worker, (void *)i);
    pthread_barrier_wait(&g_start);
    double t0 = now();
    pthread_barrier_wait(&g_start);
    double secs = now() - t0;
    for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
    CU(cuCtxSynchronize());
    long pairs = g_pairs * threads;
    /* whether gpucr's agent served the calls: it is preloaded, so its entry table is visible */
    int agent = dlsym(RTLD_DEFAULT, "gpucr_entry_table") != NULL;
    printf("{\"threads\": %d, \"streams\": %d, \"window\": %d, \"pairs\": %ld, \"seconds\": %.6f, \"pairs_per_s\": %.1f, "
           "\"agent\": %s}\n", threads, threads * g_streams, g_window, pairs, secs, pairs / secs, agent ? "true" : "false");
    return 0;
}
