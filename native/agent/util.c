/* Time, logging, threads and settings. Logging goes to stderr, which the application owns: warnings only by default,
 * everything with GPUCR_LOG=1. */
#define _GNU_SOURCE   /* pthread_setname_np */
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "agent.h"
#include "settings.h"

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

/* Set in every thread the agent starts itself: its calls through the gate are never the application's activity. */
static __thread bool t_agent_thread;

bool gpucr_agent_thread(void) { return t_agent_thread; }

struct start { void *(*fn)(void *); void *arg; };

static void *agent_thread_start(void *p)
{
    struct start st = *(struct start *)p;
    free(p);
    t_agent_thread = true;
    return st.fn(st.arg);
}

bool gpucr_spawn_detached(void *(*fn)(void *), void *arg, const char *name)
{
    struct start *st = malloc(sizeof *st);
    if (!st) return false;
    *st = (struct start){fn, arg};
    sigset_t all, prev;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &prev);   /* the new thread inherits this mask */
    pthread_t th;
    bool ok = pthread_create(&th, NULL, agent_thread_start, st) == 0;
    if (ok) {
        pthread_setname_np(th, name);   /* "gpucr-...": /proc/PID/task tells the agent's threads from the app's */
        pthread_detach(th);
    } else {
        free(st);
    }
    pthread_sigmask(SIG_SETMASK, &prev, NULL);
    return ok;
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
    if (!gpucr_setting_on(SET_LOG)) return;
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

/* ---- settings (settings.def) ---- */

enum setting_kind { SK_BOOL, SK_INT, SK_INT_OR_0, SK_ENUM, SK_STAGING, SK_BUDGET, SK_TEXT, SK_PATH };

static const struct setting_def {
    const char *name;
    enum setting_kind kind;
    const char *dflt;
    long long min, max;
    const char *accepted;
} SETTINGS[SET_COUNT] = {
#define S(id, name, kind, dflt, min, max, accepted, meaning) [SET_##id] = {name, SK_##kind, dflt, min, max, accepted},
#include "settings.def"
#undef S
};

static struct { const char *str; long long num; bool given; } g_set[SET_COUNT];   /* given: set and valid */
static pthread_once_t g_set_once = PTHREAD_ONCE_INIT;

/* A plain decimal number: no sign, no spaces, no suffix, no overflow. */
static bool parse_decimal(const char *v, long long *out)
{
    if (!isdigit((unsigned char)v[0])) return false;
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno || *end) return false;
    *out = x;
    return true;
}

bool gpucr_parse_budget(const char *v, unsigned long long *bytes, int *pct)
{
    *bytes = 0;
    *pct = 0;
    if (!v || !isdigit((unsigned char)v[0])) return false;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno) return false;
    if (end[0] == '%' && !end[1]) {
        if (x < 1 || x > 100) return false;
        *pct = (int)x;
        return true;
    }
    static const char units[] = "KMGT";
    const char *u = *end ? strchr(units, *end) : NULL;
    if (*end && (!u || end[1])) return false;
    int shift = u ? 10 * (int)(u - units + 1) : 0;
    if (x == 0 || (shift && x > (~0ULL >> shift))) return false;
    *bytes = x << shift;
    return true;
}

/* Whether v is one of the words of a "a|b|c" list. */
static bool one_of(const char *v, const char *words)
{
    size_t n = strlen(v);
    for (const char *w = words;; w++) {
        size_t len = strcspn(w, "|");
        if (len == n && !strncmp(w, v, n)) return true;
        w += len;
        if (!*w) return false;
    }
}

/* Whether v is a valid value of d; *num gets its number (integer and 0/1 kinds). */
static bool setting_valid(const struct setting_def *d, const char *v, long long *num)
{
    switch (d->kind) {
    case SK_BOOL:
        *num = v[0] - '0';
        return (v[0] == '0' || v[0] == '1') && !v[1];
    case SK_INT:
        return parse_decimal(v, num) && *num >= d->min && *num <= d->max;
    case SK_INT_OR_0:
        return parse_decimal(v, num) && (*num == 0 || (*num >= d->min && *num <= d->max));
    case SK_ENUM:
        return one_of(v, d->accepted);
    case SK_STAGING:
        return one_of(v, "auto|hugetlbfs|shm") || (!strncmp(v, "file:", 5) && v[5]);
    case SK_BUDGET: {
        unsigned long long b;
        int pct;
        return gpucr_parse_budget(v, &b, &pct);
    }
    case SK_TEXT:
        return strlen(v) <= (size_t)d->max;
    case SK_PATH:
        return true;
    }
    return false;
}

static void use_default(int i)
{
    g_set[i].str = SETTINGS[i].dflt;
    enum setting_kind k = SETTINGS[i].kind;
    g_set[i].num = k == SK_BOOL || k == SK_INT || k == SK_INT_OR_0 ? strtoll(SETTINGS[i].dflt, NULL, 10) : 0;
}

/* One line naming the setting, the value (cut if long), what is accepted and the default kept. */
static void warn_refused(const struct setting_def *d, const char *v)
{
    size_t len = strlen(v);
    char shown[128];
    if (len > 64) snprintf(shown, sizeof shown, "%.64s... (%zu bytes)", v, len);
    else snprintf(shown, sizeof shown, "%s", v);
    gpucr_warn("%s=%s is not valid (accepted: %s); using the default, %s", d->name, shown, d->accepted,
               d->dflt[0] ? d->dflt : "none");
}

static void load_settings(void)
{
    /* GPUCR_AGENT_DISABLE first: an idle agent keeps quiet about the rest */
    const char *off = getenv(SETTINGS[SET_AGENT_DISABLE].name);
    bool quiet = off && !strcmp(off, "1");
    for (int i = 0; i < SET_COUNT; i++) {
        const struct setting_def *d = &SETTINGS[i];
        const char *v = getenv(d->name);
        long long num = 0;
        use_default(i);
        if (!v || !*v) continue;   /* unset or empty: the default */
        if (!setting_valid(d, v, &num)) {
            if (!quiet || i == SET_AGENT_DISABLE) warn_refused(d, v);
            continue;
        }
        /* a copy: the application may change or free its environment later */
        char *copy = strdup(v);
        if (!copy) continue;
        g_set[i].str = copy;
        g_set[i].num = num;
        g_set[i].given = true;
    }
}

void gpucr_settings_load(void) { pthread_once(&g_set_once, load_settings); }

long long gpucr_setting_int(enum gpucr_setting id)
{
    gpucr_settings_load();
    return g_set[id].num;
}

bool gpucr_setting_on(enum gpucr_setting id) { return gpucr_setting_int(id) != 0; }

const char *gpucr_setting_str(enum gpucr_setting id)
{
    gpucr_settings_load();
    return g_set[id].str;
}

/* By name (agent.h): a setting of settings.def, checked; dflt when unset or refused. */
long gpucr_env_long(const char *name, long dflt)
{
    for (int i = 0; i < SET_COUNT; i++)
        if (!strcmp(SETTINGS[i].name, name)) {
            gpucr_settings_load();
            return g_set[i].given ? (long)g_set[i].num : dflt;
        }
    gpucr_warn("%s is not in the agent's settings table (settings.def): ignored", name);
    return dflt;
}

/* Checked when the library loads, so a bad value is reported as the process starts, not at its
 * first checkpoint. */
__attribute__((constructor)) static void settings_at_load(void) { gpucr_settings_load(); }
