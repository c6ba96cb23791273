#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>
#include "registry.h"
#include "settings.h"
#include "staging.h"

#define HUGE_PAGE ((size_t)2 << 20)
#define LEDGER_SUFFIX ".staging"   /* src/gpucr/dataplane/budget.py: <pid>-<pid ns>.staging in the runtime dir */

/* Segments of at most GPUCR_STAGING_SEGMENT_MIB (2 GiB by default), which gpucr's data plane maps and pins a
 * segment at a time, pinning ahead while it copies. Below that, a segment is sized to the data it is made for. */
static size_t seg_target(void) { return (size_t)gpucr_setting_int(SET_STAGING_SEGMENT_MIB) << 20; }

enum kind { K_HUGETLB, K_SHM, K_FILE };
static const char *const KIND_NAME[] = {"hugetlbfs", "shm", "file"};

struct seg {
    int fd;
    size_t cap, used;
    enum kind kind;
};

static struct {
    pthread_mutex_t mu;         /* guards segs: status reads them while a checkpoint places allocations */
    struct seg segs[STAGING_MAX_SEGS];
    int n;
    int entry;                  /* the ledger entry's fd, its shared flock held; -1: none */
} S = {.mu = PTHREAD_MUTEX_INITIALIZER, .entry = -1};

static size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

static void seterr(char *err, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void seterr(char *err, size_t len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, len, fmt, ap);
    va_end(ap);
}

/* ---- what is held ---- */

/* The kind of a segment file, and whether it may be held: the plane is another process, and a file that could
 * shrink under its mapping would fault it (a memfd must be sealed), or outlive a killed process (a file must be
 * unlinked). -1 with err set when not. */
static int checked_kind(int fd, int i, enum kind *kind, size_t *bytes, char *err, size_t errlen)
{
    struct stat st;
    struct statfs fs;
    if (fstat(fd, &st) != 0 || fstatfs(fd, &fs) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0) {
        seterr(err, errlen, "staging segment %d is not a regular file with data", i);
        return -1;
    }
    int seals = fcntl(fd, F_GET_SEALS);
    bool file_asked = !strncmp(gpucr_setting_str(SET_STAGING), "file:", 5);
    if (seals < 0) {   /* not a memfd: a file of a filesystem, asked for with GPUCR_STAGING=file:DIR */
        if (!file_asked || st.st_nlink != 0) {
            seterr(err, errlen, "staging segment %d is a file %s; this process stages in %s", i,
                   st.st_nlink ? "with a name (a killed process would leave it behind)" : "of a filesystem",
                   file_asked ? "unlinked files" : "memfds");
            return -1;
        }
        *kind = K_FILE;
    } else {
        int want = F_SEAL_SHRINK | F_SEAL_GROW;
        if ((seals & want) != want) {
            seterr(err, errlen, "staging segment %d is a memfd not sealed against shrinking and growing", i);
            return -1;
        }
        *kind = (unsigned long)fs.f_type == (unsigned long)HUGETLBFS_MAGIC ? K_HUGETLB : K_SHM;
        if (!strcmp(gpucr_setting_str(SET_STAGING), "hugetlbfs") && *kind != K_HUGETLB) {
            seterr(err, errlen, "staging segment %d is not on hugetlbfs, as GPUCR_STAGING=hugetlbfs asks", i);
            return -1;
        }
    }
    *bytes = (size_t)st.st_size;
    return 0;
}

static void entry_name(char *out, size_t len)
{
    struct stat ns;
    unsigned long long pidns = stat("/proc/self/ns/pid", &ns) == 0 ? (unsigned long long)ns.st_ino : 0;
    snprintf(out, len, "%d-%llu" LEDGER_SUFFIX, (int)getpid(), pidns);
}

/* The ledger entry let go, and removed when it is still the file we held: the plane counts what staging holds
 * only while an entry exists and is flocked. */
static void entry_let_go_locked(void)
{
    if (S.entry < 0) return;
    const char *dir = gpucr_runtime_dir();
    char name[64], path[600];
    struct stat mine, there;
    entry_name(name, sizeof name);
    if (dir && snprintf(path, sizeof path, "%s/%s", dir, name) < (int)sizeof path && fstat(S.entry, &mine) == 0 &&
        lstat(path, &there) == 0 && mine.st_dev == there.st_dev && mine.st_ino == there.st_ino)
        unlink(path);
    /* unlocked, not only closed: a fork child made meanwhile shares the open file, and with it the flock */
    flock(S.entry, LOCK_UN);
    close(S.entry);
    S.entry = -1;
}

static void segs_free_locked(void)
{
    for (int i = 0; i < S.n; i++) close(S.segs[i].fd);
    S.n = 0;
}

int staging_hold(const int *fds, int n, bool replace, int entry_fd, char *err, size_t errlen)
{
    struct seg got[STAGING_MAX_SEGS];
    int k = 0, rc = 0, entry = -1;
    pthread_mutex_lock(&S.mu);
    if ((replace ? 0 : S.n) + n > STAGING_MAX_SEGS) {
        seterr(err, errlen, "staging would pass %d segments; restart the process to consolidate", STAGING_MAX_SEGS);
        rc = -1;
    }
    for (; rc == 0 && k < n; k++) {
        got[k] = (struct seg){.fd = -1};
        if (checked_kind(fds[k], k, &got[k].kind, &got[k].cap, err, errlen) ||
            (got[k].fd = fcntl(fds[k], F_DUPFD_CLOEXEC, 3)) < 0) {
            if (got[k].fd < 0 && !err[0]) seterr(err, errlen, "cannot keep staging segment %d: %s", k, strerror(errno));
            rc = -1;
        }
    }
    if (rc == 0 && entry_fd >= 0) {
        /* a dup of the plane's open file, its shared flock with it: it lasts while we hold it */
        entry = fcntl(entry_fd, F_DUPFD_CLOEXEC, 3);
        struct stat st;
        if (entry < 0 || fstat(entry, &st) != 0 || !S_ISREG(st.st_mode) || flock(entry, LOCK_SH | LOCK_NB) != 0) {
            seterr(err, errlen, "cannot hold the budget's ledger entry: %s", entry < 0 ? strerror(errno) : "not a locked file");
            if (entry >= 0) close(entry);
            rc = -1;
        }
    }
    if (rc) {
        for (int i = 0; i < k; i++) if (got[i].fd >= 0) close(got[i].fd);
    } else {
        if (replace) segs_free_locked();
        memcpy(&S.segs[S.n], got, sizeof *got * (size_t)n);
        S.n += n;
        if (entry >= 0) {
            if (S.entry >= 0) { flock(S.entry, LOCK_UN); close(S.entry); }   /* the same entry: ours replaces it */
            S.entry = entry;
        }
    }
    pthread_mutex_unlock(&S.mu);
    return rc;
}

/* ---- the plan: what to ask the plane for ---- */

/* Bytes of `sizes` that first fit, in this order, leaves without a place in segments of capacity `caps`,
 * and the largest of them. */
static size_t shortfall(const size_t *caps, int ncaps, const size_t *sizes, int n, size_t *largest)
{
    size_t used[STAGING_MAX_SEGS] = {0}, missing = 0;
    *largest = 0;
    for (int k = 0; k < n; k++) {
        int i = 0;
        while (i < ncaps && caps[i] - used[i] < sizes[k]) i++;
        if (i < ncaps) used[i] += sizes[k];
        else {
            missing += sizes[k];
            if (sizes[k] > *largest) *largest = sizes[k];
        }
    }
    return missing;
}

/* The next segment to add: what is still without a place (the last segment allowed takes all of it, the others
 * at most a segment's target size), at least its largest allocation, and at least what staging holds already,
 * up to the target: a process that grows a little at a time gets a few segments of doubling size, never more
 * than about twice its data. */
static size_t next_seg_size(int nsegs, size_t held, size_t missing, size_t largest)
{
    size_t add = nsegs >= STAGING_MAX_SEGS - 1 || missing < seg_target() ? missing : seg_target();
    if (held > seg_target()) held = seg_target();
    if (add < held) add = held;
    if (add < largest) add = largest;
    return round_up(add, HUGE_PAGE);
}

/* The sizes, in registry order (as a checkpoint places them), of what a checkpoint moves now (at_checkpoint) or
 * what the last one staged (to be read back from an image); malloc'd, NULL when out of memory. */
static size_t *sizes_to_place(bool at_checkpoint, int *n)
{
    reg_lock();
    int count = 0;
    for (struct phys *p = g_reg.all; p; p = p->next_all)
        count += reg_phys_movable(p) && reg_phys_released(p) != at_checkpoint;
    size_t *sizes = malloc(sizeof *sizes * (size_t)(count ? count : 1));
    int k = 0;
    for (struct phys *p = g_reg.all; p && sizes; p = p->next_all)
        if (reg_phys_movable(p) && reg_phys_released(p) != at_checkpoint) sizes[k++] = p->size;
    reg_unlock();
    *n = k;
    return sizes;
}

void staging_plan_json(struct jb *j, bool at_checkpoint)
{
    int n = 0;
    size_t *sizes = sizes_to_place(at_checkpoint, &n), need = 0, held = 0, largest = 0;
    size_t caps[STAGING_MAX_SEGS];
    for (int k = 0; sizes && k < n; k++) need += sizes[k];
    pthread_mutex_lock(&S.mu);
    int ncaps = S.n;
    for (int i = 0; i < S.n; i++) held += caps[i] = S.segs[i].cap;
    pthread_mutex_unlock(&S.mu);
    /* the data shrank: all given back, made again at the size needed; only when more than a segment's target
     * is idle, so a segment of the target lent by the server's pool of staging made ahead (its segments are that
     * size: src/gpucr/dataplane/staging_pool.py) to an app with less data is kept, not given back each cycle */
    bool replace = held > 2 * need && held - need > seg_target();
    if (replace) ncaps = 0, held = 0;
    jb_sub(j, "staging_plan");
    jb_int(j, "need_bytes", (long long)need);
    jb_bool(j, "replace", replace && n > 0);
    jb_arr(j, "add");
    /* each new segment holds at least the largest allocation still without a place, so every round places one */
    for (size_t missing = sizes ? shortfall(caps, ncaps, sizes, n, &largest) : 0; missing && ncaps < STAGING_MAX_SEGS;
         missing = shortfall(caps, ncaps, sizes, n, &largest)) {
        caps[ncaps] = next_seg_size(ncaps, held, missing, largest);
        held += caps[ncaps];
        jb_int(j, NULL, (long long)caps[ncaps++]);
    }
    jb_arr_end(j);
    jb_end(j);
    free(sizes);
}

/* ---- placing ---- */

int staging_take(size_t size, int *seg, size_t *off)
{
    int found = -1;
    pthread_mutex_lock(&S.mu);
    for (int i = 0; i < S.n && found < 0; i++) {
        struct seg *g = &S.segs[i];
        if (g->cap - g->used >= size) {
            *seg = i;
            *off = g->used;
            g->used += size;
            found = 0;
        }
    }
    pthread_mutex_unlock(&S.mu);
    return found;
}

void staging_rewind(void)
{
    pthread_mutex_lock(&S.mu);
    for (int i = 0; i < S.n; i++) S.segs[i].used = 0;
    pthread_mutex_unlock(&S.mu);
}

void staging_drop(void)
{
    pthread_mutex_lock(&S.mu);
    segs_free_locked();
    entry_let_go_locked();
    pthread_mutex_unlock(&S.mu);
}

int staging_segments(int *fds, size_t *sizes, const char **kinds, int max)
{
    pthread_mutex_lock(&S.mu);
    int n = S.n < max ? S.n : max;
    for (int i = 0; i < n; i++) { fds[i] = S.segs[i].fd; sizes[i] = S.segs[i].cap; kinds[i] = KIND_NAME[S.segs[i].kind]; }
    pthread_mutex_unlock(&S.mu);
    return n;
}

void staging_get_info(struct staging_info *out)
{
    pthread_mutex_lock(&S.mu);
    *out = (struct staging_info){.segments = S.n, .kind = S.n ? KIND_NAME[S.segs[S.n - 1].kind] : "none"};
    for (int i = 0; i < S.n; i++) {
        out->bytes += S.segs[i].cap;
        if (S.segs[i].kind != K_FILE) out->memory_bytes += S.segs[i].cap;
    }
    pthread_mutex_unlock(&S.mu);
}

void staging_reset_after_fork(void)
{
    /* the parent's staging and ledger entry are the parent's: close our copies of their fds, which would keep
     * them alive (the entry's flock with it), never unlink anything */
    S.mu = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    for (int i = 0; i < S.n; i++) close(S.segs[i].fd);
    S.n = 0;
    if (S.entry >= 0) close(S.entry);
    S.entry = -1;
}
