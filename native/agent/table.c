/* The wrappers of the entry table (entrypoints.def): the generated gated ones, the driver's resolvers
 * (cuGetProcAddress*), and a pointer to each entry's wrapper (hand-written ones in alloc.c, pool_alloc.c, context.c...)
 * handed out in place of the driver's function (gpucr_substitute; interpose.c for dlsym and the runtime's
 * resolvers). Above every file that defines a wrapper; entry.c, below them all, resolves the real ones. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "agent.h"

/* Prototypes of the hand-written wrappers, so the table can point at them. */
#define E(kind, sym, base, ver, pt, params, args) GPUCR_EXPORT CUresult sym params;
#include "entrypoints.def"
#undef E

/* The real call runs with the gate held open, entered by `enter`. */
#define WRAP_ENTERED(enter, sym, params, args)                         \
    GPUCR_EXPORT CUresult sym params                                   \
    {                                                                  \
        gpucr_init();                                                  \
        if (!REAL(sym)) return CUDA_ERROR_NOT_SUPPORTED;               \
        enter();                                                       \
        CUresult rc = REAL(sym) args;                                  \
        gpucr_gate_leave();                                            \
        return rc;                                                     \
    }
/* A gated call: at the closed gate it waits, and is demand (a parked swap app is brought back). */
#define WRAP_GATED(sym, params, args) WRAP_ENTERED(gpucr_gate_enter, sym, params, args)
/* A call that waits at the closed gate but is not demand (entrypoints.def, WAITS). */
#define WRAP_WAITS(sym, params, args) WRAP_ENTERED(gpucr_gate_enter_waiting, sym, params, args)
/* A query (entrypoints.def): answered "complete" without the driver once a checkpoint has settled, so a
 * poller neither meets the driver's checkpoint nor stops its thread (which may hold a lock, or Python's
 * GIL) while the process is parked; else like a gated call. */
#define WRAP_QUERY(sym, params, args)                                  \
    GPUCR_EXPORT CUresult sym params                                   \
    {                                                                  \
        gpucr_init();                                                  \
        if (!REAL(sym)) return CUDA_ERROR_NOT_SUPPORTED;               \
        if (gpucr_gate_query()) return CUDA_SUCCESS;                   \
        CUresult rc = REAL(sym) args;                                  \
        gpucr_gate_leave();                                            \
        return rc;                                                     \
    }
#define WRAP_CUSTOM(sym, params, args)
#define E(kind, sym, base, ver, pt, params, args) WRAP_##kind(sym, params, args)
#include "entrypoints.def"
#undef E

static void *const g_wrappers[ENTRY_COUNT] = {
#define E(kind, sym, base, ver, pt, params, args) [ENTRY_##sym] = (void *)sym,
#include "entrypoints.def"
#undef E
};

const struct gpucr_entry *gpucr_entry_by_symbol(const char *symbol)
{
    if (!symbol || symbol[0] != 'c' || symbol[1] != 'u') return NULL;
    for (int i = 0; i < ENTRY_COUNT; i++)
        if (strcmp(gpucr_entries[i].symbol, symbol) == 0) return &gpucr_entries[i];
    return NULL;
}

const struct gpucr_entry *gpucr_entry_by_real(void *real)
{
    if (!real) return NULL;
    for (int i = 0; i < ENTRY_COUNT; i++)
        if (gpucr_entries[i].real == real) return &gpucr_entries[i];
    return NULL;
}

bool gpucr_is_wrapper(void *p)
{
    for (int i = 0; i < ENTRY_COUNT; i++)
        if (g_wrappers[i] == p) return true;
    return false;
}

void *gpucr_wrapper_of(const struct gpucr_entry *e) { return g_wrappers[e - gpucr_entries]; }

/* For the table test: the agent's view of its own table, one "symbol base version per_thread kind" per line. */
GPUCR_EXPORT const char *gpucr_entry_table(void)
{
    static char *text;
    if (text) return text;
    size_t cap = 128 * ENTRY_COUNT, len = 0;
    char *buf = malloc(cap);
    if (!buf) return "";
    for (int i = 0; i < ENTRY_COUNT; i++) {
        const struct gpucr_entry *e = &gpucr_entries[i];
        len += (size_t)snprintf(buf + len, cap - len, "%s %s %d %d %s\n", e->symbol, e->base, e->version, e->per_thread,
                                e->kind == GATED ? "GATED" : e->kind == WAITS ? "WAITS" : e->kind == QUERY ? "QUERY" : "CUSTOM");
    }
    text = buf;
    return text;
}

/* ---- the driver's resolvers: the rule (interpose.c's head) applied to what they return ---- */
void *gpucr_substitute(void *p)
{
    if (!p || gpucr_is_wrapper(p)) return p;
    const struct gpucr_entry *e = gpucr_entry_by_real(p);
    return e ? gpucr_wrapper_of(e) : p;
}

void *gpucr_hand_out(const char *name, void *real)
{
    void *p = gpucr_substitute(real);
    return p != real ? p : gpucr_thunk_for(name, real);
}

GPUCR_EXPORT CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, cuuint64_t flags, int *status)
{
    gpucr_init();
    if (!REAL(cuGetProcAddress_v2)) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = REAL(cuGetProcAddress_v2)(sym, pfn, ver, flags, status);
    if (rc == CUDA_SUCCESS && pfn) *pfn = gpucr_hand_out(sym, *pfn);
    return rc;
}

GPUCR_EXPORT CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, cuuint64_t flags)
{
    gpucr_init();
    if (!REAL(cuGetProcAddress)) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = REAL(cuGetProcAddress)(sym, pfn, ver, flags);
    if (rc == CUDA_SUCCESS && pfn) *pfn = gpucr_hand_out(sym, *pfn);
    return rc;
}
