/* Time, logging, threads and settings. Logging goes to stderr, which the application owns: warnings only by default,
 * everything with GPUCR_LOG=1. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include "agent.h"

int64_t gpucr_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

void gpucr_cond_wait_step(pthread_cond_t *cv, pthread_mutex_t *mu, int64_t deadline_ns)
{
    int64_t left = deadline_ns - gpucr_now_ns();
    if (left <= 0) return;
    if (left > 10000000LL) left = 10000000LL;   /* wake at least every 10 ms: callers re-check without a signal too */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    int64_t abs_ns = (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec + left;
    ts.tv_sec = abs_ns / 1000000000LL;
    ts.tv_nsec = abs_ns % 1000000000LL;
    pthread_cond_timedwait(cv, mu, &ts);
}

bool gpucr_spawn_detached(void *(*fn)(void *), void *arg)
{
    sigset_t all, prev;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &prev);   /* the new thread inherits this mask */
    pthread_t th;
    bool ok = pthread_create(&th, NULL, fn, arg) == 0;
    if (ok) pthread_detach(th);
    pthread_sigmask(SIG_SETMASK, &prev, NULL);
    return ok;
}

long gpucr_env_long(const char *name, long dflt)
{
    const char *v = getenv(name);
    return v && *v ? atol(v) : dflt;
}

static void vlog(const char *fmt, va_list ap)
{
    char line[1024];
    int n = snprintf(line, sizeof line, "gpucr[%d]: ", (int)getpid());
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    fprintf(stderr, "%s\n", line);
}

void gpucr_log(const char *fmt, ...)
{
    static int enabled = -1;
    if (enabled < 0) {
        const char *v = getenv("GPUCR_LOG");
        enabled = v && *v && *v != '0';
    }
    if (!enabled) return;
    va_list ap;
    va_start(ap, fmt);
    vlog(fmt, ap);
    va_end(ap);
}

void gpucr_warn(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vlog(fmt, ap);
    va_end(ap);
}
