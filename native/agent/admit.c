#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>
#include "admit.h"
#include "agent.h"
#include "settings.h"

/* ---- the shared ledger: <runtime dir>/<pid>-<pid ns>.staging, the bytes a process's staging holds ----
 * Why a ledger and not the controller summing staging_bytes over the agents: staging grows without
 * any controller (GPUCR_STAGING_AHEAD), and two checkpoints started at once would each see room for
 * themselves. Admission reads and writes the ledger under one flock (of the runtime dir itself), so a
 * growth is admitted against what all others hold or have reserved. An entry counts while its
 * process lives: the process holds a shared flock on its entry for as long as the entry exists, so a
 * SIGKILLed process's entry is found stale by the first exclusive flock that succeeds, whatever the
 * pid namespace, and a reused pid cannot inherit it. */

#define MIB(x) ((unsigned long long)(x) >> 20)
#define ENTRY_SUFFIX ".staging"

/* The flock orders processes; within one, this mutex orders threads (and guards g_entry) the way
 * the sanitizers and readers can see. */
static pthread_mutex_t g_ledger_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_entry = -1;          /* this process's entry, shared flock held; -1: none */

#define LEDGER_WAIT_MS 5000       /* the lock is held for microseconds: longer means a holder is stuck */
#define LEDGER_BUSY (-2)

static void entry_name(char *out, size_t len)
{
    struct stat ns;
    unsigned long long pidns = stat("/proc/self/ns/pid", &ns) == 0 ? (unsigned long long)ns.st_ino : 0;
    snprintf(out, len, "%d-%llu" ENTRY_SUFFIX, (int)getpid(), pidns);
}

/* The pid /proc/locks gives for the flock on the file behind fd, or 0 when it names none. The pid is
 * of the process that took it: a lock is the open file's, so a fork child may share it. */
static int lock_holder(int fd)
{
    struct stat st;
    FILE *f = fstat(fd, &st) == 0 ? fopen("/proc/locks", "r") : NULL;
    if (!f) return 0;
    char line[256], want[64], file[64];
    snprintf(want, sizeof want, "%02x:%02x:%llu", major(st.st_dev), minor(st.st_dev), (unsigned long long)st.st_ino);
    int pid = 0, p;
    while (!pid && fgets(line, sizeof line, f))   /* "1: FLOCK  ADVISORY  WRITE PID MAJ:MIN:INODE 0 EOF" */
        if (sscanf(line, "%*d: FLOCK %*s %*s %d %63s", &p, file) == 2 && !strcmp(file, want)) pid = p;
    fclose(f);
    return pid;
}

/* flock(fd, LOCK_EX) for LEDGER_WAIT_MS at most: flock itself has no deadline. */
static bool flock_within(int fd)
{
    for (int waited = 0; flock(fd, LOCK_EX | LOCK_NB) != 0; waited += 2) {
        if (errno != EWOULDBLOCK && errno != EINTR) return false;
        if (waited >= LEDGER_WAIT_MS) return false;
        usleep(2000);
    }
    return true;
}

/* The runtime dir, opened (per use, so every user has a lock of its own) and flocked: admission is one
 * at a time across the user's processes. -1 without a control channel (no runtime dir): then only this
 * process's staging is known. LEDGER_BUSY when another process held it past the deadline (said in err). */
static int lock_ledger(char *err, size_t errlen)
{
    pthread_mutex_lock(&g_ledger_mu);
    const char *dir = gpucr_runtime_dir();   /* private (rundir.c) */
    int fd = dir ? open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC) : -1;
    if (fd >= 0 && !flock_within(fd)) {
        int holder = lock_holder(fd);
        char who[64] = "another process";
        if (holder > 0) snprintf(who, sizeof who, "process %d (or a child it forked)", holder);
        snprintf(err, errlen, "the host-memory ledger of %s is held by %s for more than %d s; retry, or end that "
                 "process if it is stopped", dir, who, LEDGER_WAIT_MS / 1000);
        close(fd);
        fd = LEDGER_BUSY;
    }
    return fd;
}

static void unlock_ledger(int fd)
{
    /* unlocked, not only closed: a fork child made meanwhile shares the open file, and with it a lock
     * that closing our fd alone would leave held for as long as the child lives */
    if (fd >= 0) { flock(fd, LOCK_UN); close(fd); }
    pthread_mutex_unlock(&g_ledger_mu);
}

static bool is_entry(const char *name)
{
    size_t n = strlen(name), k = strlen(ENTRY_SUFFIX);
    return n > k && !strcmp(name + n - k, ENTRY_SUFFIX) && name[0] != '.';
}

/* Bytes of the entries of live processes other than this one; stale entries are removed when `reap`
 * (only under the ledger's lock: an entry just made holds no flock yet). */
static unsigned long long others(int dirfd, bool reap)
{
    unsigned long long sum = 0;
    int dup_fd = dup(dirfd);
    DIR *d = dup_fd >= 0 ? fdopendir(dup_fd) : NULL;
    if (!d && dup_fd >= 0) close(dup_fd);
    char mine[64];
    entry_name(mine, sizeof mine);
    for (struct dirent *e; d && (e = readdir(d));) {
        if (!is_entry(e->d_name) || !strcmp(e->d_name, mine)) continue;
        int fd = openat(dirfd, e->d_name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
        if (fd < 0) continue;
        if (flock(fd, LOCK_EX | LOCK_NB) == 0) {
            if (reap) unlinkat(dirfd, e->d_name, 0);   /* no process holds it: its owner is gone */
        } else {
            char buf[32] = "";
            ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
            if (n > 0) sum += strtoull(buf, NULL, 10);
        }
        close(fd);
    }
    if (d) closedir(d);
    return sum;
}

static void write_entry_locked(int dirfd, size_t held)
{
    char name[64];
    entry_name(name, sizeof name);
    if (!held) {
        if (g_entry >= 0) { unlinkat(dirfd, name, 0); close(g_entry); g_entry = -1; }
        return;
    }
    if (g_entry < 0) {
        g_entry = openat(dirfd, name, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
        if (g_entry >= 0 && flock(g_entry, LOCK_SH) != 0) { close(g_entry); g_entry = -1; }
        if (g_entry < 0) { gpucr_warn("cannot record staging in the runtime dir: %s", strerror(errno)); return; }
    }
    char buf[32];
    int n = snprintf(buf, sizeof buf, "%zu\n", held);
    /* readers read under the same lock: never half of it */
    if (ftruncate(g_entry, 0) != 0 || pwrite(g_entry, buf, (size_t)n, 0) != n)
        gpucr_warn("cannot record staging in the runtime dir: %s", strerror(errno));
}

void admit_reset_after_fork(void)
{
    /* the entry is the parent's: the child must not keep its flock alive (nor remove it) */
    g_ledger_mu = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    if (g_entry >= 0) close(g_entry);
    g_entry = -1;
}

size_t host_meminfo_kib(const char *key)
{
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    size_t v = 0, klen = strlen(key);
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, key, klen) && line[klen] == ':') { v = strtoull(line + klen + 1, NULL, 10); break; }
    fclose(f);
    return v;
}

unsigned long long admit_budget_bytes(void)
{
    unsigned long long bytes = 0;
    int pct = 0;
    if (!gpucr_parse_budget(gpucr_setting_str(SET_HOST_BUDGET), &bytes, &pct)) return 0;
    return pct ? host_meminfo_kib("MemTotal") * 1024ULL / 100 * (unsigned long long)pct : bytes;
}

/* ---- the memory cgroup ---- */

/* GPUCR_TEST_CGROUP_ROOT: the test suite's stand-in for "/", to read fake /proc and /sys files. */
static const char *root(void) { return gpucr_setting_str(SET_TEST_CGROUP_ROOT); }

/* A cgroup file's number; false for "max", a missing file or anything else. */
static bool read_limit(const char *dir, const char *file, unsigned long long *v)
{
    char path[512], buf[64];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    FILE *f = fopen(path, "r");
    if (!f) return false;
    bool ok = fgets(buf, sizeof buf, f) != NULL;
    fclose(f);
    char *end;
    if (!ok || buf[0] < '0' || buf[0] > '9') return false;
    *v = strtoull(buf, &end, 10);
    return *end == '\n' || *end == 0;
}

/* The least room (limit - current) among the limits of dir and its ancestors up to top. */
static void walk_up(const char *top, const char *rel, const char *const *files, unsigned long long none_above,
                    const char *current_file, struct cgroup_room *out)
{
    char dir[512];
    snprintf(dir, sizeof dir, "%s%s", top, rel);
    size_t toplen = strlen(top);
    unsigned long long best = ~0ULL;
    for (;;) {
        size_t n = strlen(dir);
        while (n > toplen && dir[n - 1] == '/') dir[--n] = 0;   /* "top/" is top */
        unsigned long long cur = 0;
        for (int i = 0; files[i]; i++) {
            unsigned long long lim;
            if (!read_limit(dir, files[i], &lim) || lim >= none_above) continue;
            if (!read_limit(dir, current_file, &cur)) cur = 0;
            unsigned long long room = lim > cur ? lim - cur : 0;
            if (room < best) {
                best = room;
                *out = (struct cgroup_room){.found = true, .file = files[i], .limit = lim, .current = cur};
                snprintf(out->path, sizeof out->path, "%s", dir + strlen(root()));
            }
        }
        char *slash = strrchr(dir, '/');
        if (n <= toplen || !slash || (size_t)(slash - dir) < toplen) break;
        *slash = 0;
    }
}

void admit_cgroup_room(struct cgroup_room *out)
{
    *out = (struct cgroup_room){0};
    char path[512], line[512], v2[256] = "", v1[256] = "";
    bool has_v2 = false, has_v1 = false;
    snprintf(path, sizeof path, "%s/proc/self/cgroup", root());
    FILE *f = fopen(path, "r");
    if (!f) return;
    /* "0::/path" is v2; "N:a,memory,b:/path" is v1's memory controller */
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2) continue;
        *c1 = *c2 = 0;
        const char *ctrls = c1 + 1, *rel = c2 + 1;
        if (!strcmp(line, "0") && !*ctrls) { snprintf(v2, sizeof v2, "%s", rel); has_v2 = true; }
        for (const char *w = ctrls; *w;) {
            size_t len = strcspn(w, ",");
            if (len == 6 && !strncmp(w, "memory", 6)) { snprintf(v1, sizeof v1, "%s", rel); has_v1 = true; }
            w += len + (w[len] == ',');
        }
    }
    fclose(f);
    char top[512];
    if (has_v1) {   /* a v1 memory controller wins: then the v2 hierarchy holds no memory controller */
        static const char *const files[] = {"memory.limit_in_bytes", NULL};
        snprintf(top, sizeof top, "%s/sys/fs/cgroup/memory", root());
        walk_up(top, v1, files, 1ULL << 62, "memory.usage_in_bytes", out);   /* v1 says "none" with ~2^63 */
        return;
    }
    if (has_v2) {
        static const char *const files[] = {"memory.max", "memory.high", NULL};
        snprintf(top, sizeof top, "%s/sys/fs/cgroup", root());
        struct stat st;
        char unified[600];
        snprintf(unified, sizeof unified, "%s/unified", top);   /* hybrid hosts mount v2 there */
        if (stat(unified, &st) == 0 && S_ISDIR(st.st_mode)) snprintf(top, sizeof top, "%.500s", unified);
        walk_up(top, v2, files, ~0ULL, "memory.current", out);
    }
}

/* ---- admission ---- */

int admit_reserve(size_t held, size_t need, bool charged, char *err, size_t errlen)
{
    unsigned long long budget = admit_budget_bytes();
    int lk = lock_ledger(err, errlen);
    if (lk == LEDGER_BUSY) {
        unlock_ledger(lk);
        return -1;
    }
    unsigned long long others_bytes = lk >= 0 ? others(lk, true) : 0;
    int rc = 0;
    if (budget && others_bytes + held + need > budget) {
        unsigned long long used = others_bytes + held, avail = budget > used ? budget - used : 0;
        snprintf(err, errlen, "host-memory budget: staging needs %llu MiB more, %llu MiB left of %llu MiB (other "
                 "processes hold %llu MiB); raise GPUCR_HOST_BUDGET, free staging elsewhere (restore "
                 "--drop-staging) " ADMIT_ON_DISK, MIB(need), MIB(avail), MIB(budget),
                 MIB(others_bytes));
        rc = -1;
    }
    struct cgroup_room cg;
    if (charged) admit_cgroup_room(&cg);
    unsigned long long cg_avail = charged && cg.found && cg.limit > cg.current ? cg.limit - cg.current : 0;
    if (rc == 0 && charged && cg.found && need > cg_avail) {
        unsigned long long avail = cg_avail;
        snprintf(err, errlen, "memory cgroup %s: staging needs %llu MiB more, %llu MiB left (%s %llu MiB, current "
                 "%llu MiB; staging is charged to it); raise the limit, free memory in it " ADMIT_ON_DISK, cg.path,
                 MIB(need), MIB(avail), cg.file, MIB(cg.limit), MIB(cg.current));
        rc = -1;
    }
    if (rc == 0 && lk >= 0) write_entry_locked(lk, held + need);
    unlock_ledger(lk);
    return rc;
}

void admit_record(size_t held)
{
    char err[512];
    int lk = lock_ledger(err, sizeof err);
    if (lk >= 0) write_entry_locked(lk, held);
    if (lk == LEDGER_BUSY) gpucr_warn("staging holds %zu MiB, not recorded: %s", held >> 20, err);
    unlock_ledger(lk);
}

/* Without the ledger's lock: a status must answer whoever holds it (an entry read while it is
 * rewritten counts as 0 for that answer). */
static unsigned long long admit_used_bytes(void)
{
    const char *dir = gpucr_runtime_dir();
    int fd = dir ? open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC) : -1;
    unsigned long long sum = fd >= 0 ? others(fd, false) : 0;
    if (fd >= 0) close(fd);
    return sum;
}

void admit_status_json(struct jb *j, size_t held)
{
    jb_int(j, "host_budget_bytes", (long long)admit_budget_bytes());
    jb_int(j, "host_budget_used_bytes", (long long)(admit_used_bytes() + held));
    struct cgroup_room cg;
    admit_cgroup_room(&cg);
    if (!cg.found) return;
    jb_sub(j, "memory_cgroup");
    jb_str(j, "path", cg.path);
    jb_str(j, "limit_file", cg.file);
    jb_int(j, "limit_bytes", (long long)cg.limit);
    jb_int(j, "current_bytes", (long long)cg.current);
    jb_end(j);
}
