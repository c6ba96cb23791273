/* A tool preloaded beside gpucr's agent, as compute-sanitizer's injection is: it wraps dlopen, dlmopen
 * and dlclose, and finds each real one with dlsym(RTLD_NEXT) the first time it is called, from its
 * constructor on, under one guard that is not re-entrant. A real tool spins or deadlocks when that guard
 * is re-entered (compute-sanitizer's collection library waited on itself for ever inside its dlclose,
 * under the agent, on the H200 and here); this one says which and exits 42. Whatever answers
 * dlsym(RTLD_NEXT) must therefore reach none of these through the tool: the agent's dlsym once called
 * dlopen, then dlclose, through the PLT. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>

static volatile int resolving;

static void *real(const char *name)
{
    if (resolving) {
        fprintf(stderr, "tool_hooks: %s re-entered the tool while it found a real function\n", name);
        _exit(42);
    }
    resolving = 1;
    void *p = dlsym(RTLD_NEXT, name);
    resolving = 0;
    if (!p) {
        fprintf(stderr, "tool_hooks: no real %s\n", name);
        _exit(43);
    }
    return p;
}

void *dlopen(const char *file, int flags)
{
    static void *(*fn)(const char *, int);
    if (!fn) fn = (void *(*)(const char *, int))real("dlopen");
    return fn(file, flags);
}

void *dlmopen(Lmid_t ns, const char *file, int flags)
{
    static void *(*fn)(Lmid_t, const char *, int);
    if (!fn) fn = (void *(*)(Lmid_t, const char *, int))real("dlmopen");
    return fn(ns, file, flags);
}

int dlclose(void *h)
{
    static int (*fn)(void *);
    if (!fn) fn = (int (*)(void *))real("dlclose");
    return fn(h);
}

__attribute__((constructor)) static void tool_start(void)
{
    void *self = dlopen(NULL, RTLD_LAZY);
    if (!self) _exit(44);
    void *again = dlmopen(LM_ID_BASE, NULL, RTLD_LAZY);
    if (!again) _exit(45);
    if (dlclose(again) != 0 || dlclose(self) != 0) _exit(46);
}
