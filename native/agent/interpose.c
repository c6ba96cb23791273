/* Every way a library can reach a driver function: dlsym on libcuda and the runtime's resolvers
 * (cudaGetDriverEntryPoint*); the driver's own (cuGetProcAddress*) are entries of the table (table.c).
 * Rule: resolve first with the caller's own name, version and flags; only when that succeeded,
 * hand back the wrapper whose real function is exactly the pointer the resolver returned. A pointer
 * the table does not know is returned unchanged, so no caller ever gets a wrapper of another ABI. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <string.h>
#include "agent.h"

/* libc's own dlmopen and dlclose, never a preloaded tool's wrapper of them: a tool that wraps them
 * (compute-sanitizer's collection library does) finds the real one, inside its wrapper and under its own
 * lock, with dlsym(RTLD_NEXT), which is ours; reached through the PLT from here, the wrapper was entered
 * again and waited on itself for ever (tests/apps/tool_hooks.c). dlvsym is not wrapped by such tools:
 * the agent's real dlsym comes the same way (entry.c). */
static void *libc_fn(void **slot, const char *name, const char *old_version)
{
    void *p = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (!p) {
        p = dlvsym(RTLD_NEXT, name, "GLIBC_2.34");
        if (!p) p = dlvsym(RTLD_NEXT, name, old_version);
        __atomic_store_n(slot, p, __ATOMIC_RELEASE);
    }
    return p;
}

static void *libc_dlmopen(Lmid_t ns, const char *file, int flags)
{
    static void *fn;
    void *(*f)(Lmid_t, const char *, int) = (void *(*)(Lmid_t, const char *, int))libc_fn(&fn, "dlmopen", "GLIBC_2.3.4");
    return f ? f(ns, file, flags) : NULL;
}

static void libc_dlclose(void *h)
{
    static void *fn;
    int (*f)(void *) = (int (*)(void *))libc_fn(&fn, "dlclose", "GLIBC_2.2.5");
    if (f) f(h);
}

/* ---- dlsym ---- */
#ifndef GPUCR_NO_DLSYM   /* scripts/tsan-build: ThreadSanitizer resolves its own interceptors through
                          * dlsym(RTLD_NEXT) before it can run instrumented code or dlopen */

/* dlsym(RTLD_NEXT, ...) means "after the caller's object"; forwarded from here it would mean "after
 * libgpucr", so walk the link map from the caller's object ourselves. */
static void *dlsym_next_after(const void *caller, const char *name)
{
    Dl_info info;
    struct link_map *lm = NULL;
    if (!dladdr1(caller, &info, (void **)&lm, RTLD_DL_LINKMAP) || !lm) return gpucr_real_dlsym(RTLD_NEXT, name);
    /* A link_map is not a handle readied for lookup (an initial dependency has no search list of its
     * own): dlmopen NOLOAD in the base namespace hands out the loaded object as one. */
    for (struct link_map *l = lm->l_next; l; l = l->l_next) {
        void *h = libc_dlmopen(LM_ID_BASE, l->l_name && *l->l_name ? l->l_name : NULL, RTLD_LAZY | RTLD_NOLOAD);
        if (!h) continue;
        void *p = gpucr_real_dlsym(h, name);
        libc_dlclose(h);
        if (p) return p;
    }
    return NULL;
}

GPUCR_EXPORT void *dlsym(void *handle, const char *name)
{
    void *p = handle == RTLD_NEXT ? dlsym_next_after(__builtin_return_address(0), name) : gpucr_real_dlsym(handle, name);
    if (!p || name[0] != 'c' || name[1] != 'u') return p;
    /* The wrapper itself resolves its real function lazily, so nothing is initialised here: the
     * driver may call dlsym while it is being loaded. */
    const struct gpucr_entry *e = gpucr_entry_by_symbol(name);
    return e ? gpucr_wrapper_of(e) : gpucr_is_driver_handle(handle) ? gpucr_thunk_for(name, p) : p;
}

#endif

/* ---- the runtime's resolvers (dynamic libcudart; a static runtime comes through dlsym above) ---- */

struct find_ctx { const char *name; void *found; };

static int find_in_cudart(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    struct find_ctx *c = data;
    if (!info->dlpi_name || !strstr(info->dlpi_name, "libcudart")) return 0;
    void *h = libc_dlmopen(LM_ID_BASE, info->dlpi_name, RTLD_LAZY | RTLD_NOLOAD);
    if (!h) return 0;
    c->found = gpucr_real_dlsym(h, c->name);
    libc_dlclose(h);
    return c->found != NULL;
}

/* The runtime is often loaded RTLD_LOCAL (by PyTorch), out of RTLD_NEXT's reach: look for it. */
static void *cudart_sym(const char *name)
{
    void *p = gpucr_real_dlsym(RTLD_NEXT, name);
    if (p) return p;
    struct find_ctx c = {name, NULL};
    dl_iterate_phdr(find_in_cudart, &c);
    return c.found;
}

#define RUNTIME_RESOLVER(fn, params, args)                                     \
    GPUCR_EXPORT cudaError_t fn params                                         \
    {                                                                          \
        static cudaError_t(*real) params;                                      \
        gpucr_init();                                                          \
        if (!real) real = (cudaError_t(*) params)cudart_sym(#fn);              \
        if (!real) return 801; /* cudaErrorNotSupported */                     \
        cudaError_t rc = real args;                                            \
        if (rc == 0 && pfn) *pfn = gpucr_hand_out(sym, *pfn);                  \
        return rc;                                                             \
    }

RUNTIME_RESOLVER(cudaGetDriverEntryPoint, (const char *sym, void **pfn, unsigned long long flags, int *status),
                 (sym, pfn, flags, status))
RUNTIME_RESOLVER(cudaGetDriverEntryPoint_ptsz, (const char *sym, void **pfn, unsigned long long flags, int *status),
                 (sym, pfn, flags, status))
RUNTIME_RESOLVER(cudaGetDriverEntryPointByVersion,
                 (const char *sym, void **pfn, unsigned int ver, unsigned long long flags, int *status),
                 (sym, pfn, ver, flags, status))
RUNTIME_RESOLVER(cudaGetDriverEntryPointByVersion_ptsz,
                 (const char *sym, void **pfn, unsigned int ver, unsigned long long flags, int *status),
                 (sym, pfn, ver, flags, status))
