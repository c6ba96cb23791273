/* A tool preloaded beside gpucr's agent, as compute-sanitizer's injection is: it wraps dlopen and finds
 * the real one with dlsym(RTLD_NEXT) the first time, from its constructor, under a guard that is not
 * re-entrant. A real tool spins or deadlocks when that guard is re-entered; this one says so and exits
 * 42. Whatever answers dlsym(RTLD_NEXT) must therefore not call dlopen (the agent did, and the program
 * recursed until it crashed; found while looking into compute-sanitizer's target spinning under the
 * agent on the H200, which this did not cure). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>

static void *(*real_dlopen)(const char *, int);
static volatile int resolving;

void *dlopen(const char *file, int flags)
{
    if (!real_dlopen) {
        if (resolving) {
            fprintf(stderr, "tool_hooks: dlopen re-entered while finding the real dlopen\n");
            _exit(42);
        }
        resolving = 1;
        real_dlopen = (void *(*)(const char *, int))dlsym(RTLD_NEXT, "dlopen");
        resolving = 0;
        if (!real_dlopen) {
            fprintf(stderr, "tool_hooks: no real dlopen\n");
            _exit(43);
        }
    }
    return real_dlopen(file, flags);
}

__attribute__((constructor)) static void tool_start(void)
{
    void *self = dlopen(NULL, RTLD_LAZY);
    if (!self) _exit(44);
}
