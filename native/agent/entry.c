/* The entry table's real driver functions, each resolved through the driver's own resolver, and the driver
 * functions the agent calls itself (gpucr_drv); errors named. The wrappers and the lookups that hand them out
 * are table.c's, above everything that defines a wrapper. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "agent.h"

struct gpucr_entry gpucr_entries[ENTRY_COUNT] = {
#define E(kind, sym, base, ver, pt, params, args) [ENTRY_##sym] = {#sym, #base, ver, pt, kind, NULL},
#include "entrypoints.def"
#undef E
};

struct gpucr_driver gpucr_drv;
static void *g_libcuda;
static void *g_real_dlsym;
static char g_libcuda_path[4096];
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
/* Set last by do_init: a thread that sees it set (acquire) sees the whole table and gpucr_drv, also
 * one that never called gpucr_init (the control channel's). */
static bool g_loaded;

void *gpucr_real_dlsym(void *handle, const char *name)
{
    /* not pthread_once: dlsym may be asked for while the process starts; any thread may resolve it,
     * they all find the same function */
    typedef void *(*dlsym_fn)(void *, const char *);
    dlsym_fn real = __atomic_load_n((dlsym_fn *)&g_real_dlsym, __ATOMIC_ACQUIRE);
    if (!real) {
        /* dlvsym is not interposed; ask for the default dlsym of either glibc era. */
        real = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
        if (!real) real = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
        __atomic_store_n((dlsym_fn *)&g_real_dlsym, real, __ATOMIC_RELEASE);
    }
    return real ? real(handle, name) : NULL;
}

const char *gpucr_libcuda_path(void) { return g_libcuda_path; }
bool gpucr_cuda_loaded(void) { return __atomic_load_n(&g_loaded, __ATOMIC_ACQUIRE); }

static void *drv_sym(const char *name)
{
    void *p = NULL;
    int status = 0;
    if (gpucr_drv.cuGetProcAddress_v2 &&
        gpucr_drv.cuGetProcAddress_v2(name, &p, 12000, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &status) == CUDA_SUCCESS && p)
        return p;
    /* the resolver wants base names; fall back to the exported symbol */
    return gpucr_real_dlsym(g_libcuda, name);
}

static void do_init(void)
{
    const char *path = getenv("GPUCR_LIBCUDA");
    if (!path || !*path) path = "libcuda.so.1";
    g_libcuda = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (!g_libcuda) {
        gpucr_warn("cannot load the CUDA driver (%s): %s", path, dlerror());
        return;
    }
    Dl_info info;
    void *any = gpucr_real_dlsym(g_libcuda, "cuInit");
    if (any && dladdr(any, &info) && info.dli_fname) strncpy(g_libcuda_path, info.dli_fname, sizeof g_libcuda_path - 1);
    else strncpy(g_libcuda_path, path, sizeof g_libcuda_path - 1);

    gpucr_drv.cuGetProcAddress_v2 = gpucr_real_dlsym(g_libcuda, "cuGetProcAddress_v2");
    for (int i = 0; i < ENTRY_COUNT; i++) {
        struct gpucr_entry *e = &gpucr_entries[i];
        void *p = NULL;
        int status = 0;
        cuuint64_t flags = e->per_thread ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : CU_GET_PROC_ADDRESS_LEGACY_STREAM;
        if (gpucr_drv.cuGetProcAddress_v2 &&
            gpucr_drv.cuGetProcAddress_v2(e->base, &p, e->version, flags, &status) == CUDA_SUCCESS && p)
            e->real = p;
        else
            e->real = gpucr_real_dlsym(g_libcuda, e->symbol);
    }
#define D(name) gpucr_drv.name = drv_sym(#name)
    D(cuCtxGetCurrent); D(cuCtxSetCurrent); D(cuCtxGetDevice); D(cuCtxSynchronize);
    D(cuMemAddressReserve); D(cuMemAddressFree); D(cuMemGetAllocationGranularity);
    D(cuStreamSynchronize);
    D(cuGetErrorString); D(cuGetErrorName); D(cuDeviceGetAttribute); D(cuDeviceGetUuid);
    D(cuPointerGetAttribute); D(cuDevicePrimaryCtxGetState); D(cuDevicePrimaryCtxRetain);
    D(cuEventCreate); D(cuEventRecord); D(cuDeviceGetCount);
    D(cuStreamWaitEvent); D(cuEventQuery); D(cuStreamIsCapturing); D(cuDeviceGetMemPool);
    D(cuDeviceGetDefaultMemPool); D(cuDeviceGraphMemTrim); D(cuDeviceGetGraphMemAttribute);
#undef D
    /* versioned names the resolver knows by their base name */
    gpucr_drv.cuMemGetInfo_v2 = drv_sym("cuMemGetInfo");
    gpucr_drv.cuDevicePrimaryCtxRelease_v2 = drv_sym("cuDevicePrimaryCtxRelease");
    gpucr_drv.simcudaIsSimulated = gpucr_real_dlsym(g_libcuda, "simcudaIsSimulated");
    __atomic_store_n(&g_loaded, true, __ATOMIC_RELEASE);
    gpucr_log("driver %s loaded, %d entry points resolved", g_libcuda_path, ENTRY_COUNT);
}

/* What a first use of CUDA starts besides (the channel of a fork child that had not used CUDA yet), set by the
 * channel when the agent loads: entry.c sits below it. */
static void (*g_first_use)(void);

void gpucr_on_first_use(void (*fn)(void)) { g_first_use = fn; }

void gpucr_init(void)
{
    pthread_once(&g_once, do_init);
    if (g_first_use) g_first_use();
}

const char *gpucr_cu_errstr(CUresult rc)
{
    static __thread char text[160];
    const char *name = NULL, *desc = NULL;
    if (!gpucr_cuda_loaded() || !gpucr_drv.cuGetErrorName || gpucr_drv.cuGetErrorName(rc, &name) != CUDA_SUCCESS) name = NULL;
    if (!gpucr_cuda_loaded() || !gpucr_drv.cuGetErrorString || gpucr_drv.cuGetErrorString(rc, &desc) != CUDA_SUCCESS) desc = NULL;
    if (name) snprintf(text, sizeof text, "%s (%s)", name, desc ? desc : "no description");
    else snprintf(text, sizeof text, "CUDA error %d (%s)", rc, desc ? desc : "unknown to the driver");
    return text;
}

void gpucr_cu_warn(CUresult rc, const char *what_fmt, ...)
{
    char what[300];
    va_list ap;
    va_start(ap, what_fmt);
    vsnprintf(what, sizeof what, what_fmt, ap);
    va_end(ap);
    gpucr_warn("%s failed: %s", what, gpucr_cu_errstr(rc));
}

void gpucr_use_ctx(CUcontext ctx)
{
    CUresult rc = gpucr_drv.cuCtxSetCurrent(ctx);
    /* deinitialised: the process is exiting and the driver tore down first (an application's frees at
     * exit came here on the H200, twice per run, with nothing left to do) */
    if (rc != CUDA_SUCCESS && rc != CUDA_ERROR_DEINITIALIZED)
        gpucr_cu_warn(rc, "cuCtxSetCurrent (context %p)", (void *)ctx);
}
