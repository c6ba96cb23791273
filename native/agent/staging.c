#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include "admit.h"
#include "registry.h"
#include "settings.h"
#include "staging.h"

#define HUGE_PAGE ((size_t)2 << 20)
#define TOUCH_THREADS 8
#define TOUCH_PER_THREAD ((size_t)64 << 20)   /* a smaller segment is touched by the caller alone */

/* Segments of at most GPUCR_STAGING_SEGMENT_MIB (2 GiB by default), which gpucr's data plane maps and pins a
 * segment at a time, pinning ahead while it copies. Below that, a segment is sized to the data it is made for. */
static size_t seg_target(void) { return (size_t)gpucr_setting_int(SET_STAGING_SEGMENT_MIB) << 20; }

enum kind { K_HUGETLB, K_SHM, K_FILE };
static const char *const KIND_NAME[] = {"hugetlbfs", "shm", "file"};

struct seg {
    int fd;
    void *base;
    size_t cap, used;
    enum kind kind;
};

static struct {
    pthread_mutex_t mu;         /* guards segs: status reads them while a checkpoint grows them */
    struct seg segs[STAGING_MAX_SEGS];
    int n;
} S = {.mu = PTHREAD_MUTEX_INITIALIZER};

static size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

/* KiB, as /proc/meminfo says */
static size_t meminfo(const char *key) { return host_meminfo_kib(key); }

struct touch { char *base; size_t len, page; };
static void *touch_range(void *arg)
{
    struct touch *t = arg;
    for (size_t off = 0; off < t->len; off += t->page) ((volatile char *)t->base)[off] = 0;
    return NULL;
}

/* Fault the pages in with several threads: one thread tops out well below the memory bandwidth.
 * A small segment is not worth a thread. */
static void touch_parallel(char *base, size_t len, size_t page)
{
    int n = TOUCH_THREADS;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    if (cpus > 0 && cpus < n) n = (int)cpus;
    if (len / TOUCH_PER_THREAD < (size_t)n) n = (int)(len / TOUCH_PER_THREAD);
    if (n <= 1) {
        struct touch t = {base, len, page};
        touch_range(&t);
        return;
    }
    size_t per = round_up(len / (size_t)n + 1, page);
    pthread_t th[TOUCH_THREADS];
    struct touch t[TOUCH_THREADS];
    int started = 0;
    sigset_t all, prev;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &prev);
    for (int i = 0; i < n; i++) {
        size_t off = (size_t)i * per;
        if (off >= len) break;
        t[i] = (struct touch){base + off, off + per > len ? len - off : per, page};
        if (pthread_create(&th[i], NULL, touch_range, &t[i]) == 0) {
            pthread_setname_np(th[i], "gpucr-touch");
            started++;
        }
        else touch_range(&t[i]);
        if (started != i + 1) break;
    }
    pthread_sigmask(SIG_SETMASK, &prev, NULL);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
}

static bool hugetlbfs_asked(void) { return !strcmp(gpucr_setting_str(SET_STAGING), "hugetlbfs"); }

/* The backend asked for with GPUCR_STAGING: auto (default), hugetlbfs, shm or file:DIR. */
static enum kind wanted_kind(size_t cap, const char **dir)
{
    const char *v = gpucr_setting_str(SET_STAGING);
    *dir = NULL;
    if (!strncmp(v, "file:", 5)) { *dir = v + 5; return K_FILE; }
    if (!strcmp(v, "shm")) return K_SHM;
    if (hugetlbfs_asked()) return K_HUGETLB;
    /* auto: hugepages when enough are free */
    return meminfo("HugePages_Free") * HUGE_PAGE >= cap ? K_HUGETLB : K_SHM;
}

/* A memfd of `cap` bytes whose size can no longer change: the gpucr server maps it, and a process that
 * shrank it under a copy would fault the server (it refuses a memfd not sealed so). */
static int sized_memfd(size_t cap, unsigned int flags)
{
    int fd = memfd_create("gpucr-staging", MFD_CLOEXEC | MFD_ALLOW_SEALING | flags);
    if (fd >= 0 && (ftruncate(fd, (off_t)cap) != 0 ||
                    fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

static int seg_create(struct seg *g, size_t cap, char *err, size_t errlen)
{
    const char *dir;
    char path[300] = "";
    enum kind k = wanted_kind(round_up(cap, HUGE_PAGE), &dir);
    int fd = -1;
    if (k == K_HUGETLB) {
        cap = round_up(cap, HUGE_PAGE);
        fd = sized_memfd(cap, MFD_HUGETLB);
        if (fd < 0) {
            if (hugetlbfs_asked()) {
                snprintf(err, errlen, "cannot get %zu MiB of hugepages for staging (%s); reserve them with "
                         "'echo N > /proc/sys/vm/nr_hugepages' or use GPUCR_STAGING=shm", cap >> 20, strerror(errno));
                return -1;
            }
            k = K_SHM;
        }
    }
    if (k == K_SHM) {
        fd = sized_memfd(cap, 0);
    } else if (k == K_FILE) {
        static int serial;
        snprintf(path, sizeof path, "%s/gpucr-staging-%d-%d", dir, (int)getpid(), ++serial);
        fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        /* unlinked at once: the space lives as long as the fd, so a killed process leaves nothing behind */
        if (fd >= 0) unlink(path);
        if (fd >= 0 && ftruncate(fd, (off_t)cap) != 0) { close(fd); fd = -1; }
    }
    if (fd < 0) {
        snprintf(err, errlen, "cannot create %zu MiB of %s staging: %s", cap >> 20, KIND_NAME[k], strerror(errno));
        return -1;
    }
    void *base = mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        snprintf(err, errlen, "cannot map %zu MiB of %s staging: %s", cap >> 20, KIND_NAME[k], strerror(errno));
        close(fd);
        return -1;
    }
    /* a fork child (a DataLoader worker) must not map the parent's staging: it would keep it alive */
    if (madvise(base, cap, MADV_DONTFORK)) gpucr_warn("madvise(MADV_DONTFORK) of staging: %s", strerror(errno));
    touch_parallel(base, cap, k == K_HUGETLB ? HUGE_PAGE : (size_t)sysconf(_SC_PAGESIZE));
    *g = (struct seg){.fd = fd, .base = base, .cap = cap, .kind = k};
    return 0;
}

/* Bytes of `sizes` that first fit, in this order, leaves without a place in the segments, and the
 * largest of them. */
static size_t shortfall_locked(const size_t *sizes, int n, size_t *largest)
{
    size_t used[STAGING_MAX_SEGS] = {0}, missing = 0;
    if (largest) *largest = 0;
    for (int k = 0; k < n; k++) {
        int i = 0;
        while (i < S.n && S.segs[i].cap - used[i] < sizes[k]) i++;
        if (i < S.n) used[i] += sizes[k];
        else {
            missing += sizes[k];
            if (largest && sizes[k] > *largest) *largest = sizes[k];
        }
    }
    return missing;
}

static size_t capacity_locked(void)
{
    size_t cap = 0;
    for (int i = 0; i < S.n; i++) cap += S.segs[i].cap;
    return cap;
}

/* The next segment to add: what is still without a place (the last segment allowed takes all of
 * it, the others at most a segment's target size), at least its largest allocation, and at least
 * what staging holds already, up to the target: a process that grows a little at a time gets a few
 * segments of doubling size, never more than about twice its data. */
static size_t next_seg_size_locked(size_t missing, size_t largest)
{
    size_t add = S.n >= STAGING_MAX_SEGS - 1 || missing < seg_target() ? missing : seg_target();
    size_t held = capacity_locked();
    if (held > seg_target()) held = seg_target();
    if (add < held) add = held;
    if (add < largest) add = largest;
    return round_up(add, HUGE_PAGE);
}

static void seg_free(struct seg *g)
{
    munmap(g->base, g->cap);
    close(g->fd);
}

/* Give staging back when it holds more than twice what is needed (the process's data shrank): all
 * of it, to be made again at the size needed, since a segment still in use may be the oversized
 * one. Called while nothing is staged (the process runs, or its data comes from an image next). */
static void release_if_oversized_locked(size_t need)
{
    if (capacity_locked() <= 2 * need) return;
    for (int i = 0; i < S.n; i++) seg_free(&S.segs[i]);
    S.n = 0;
    admit_record(0);
}

/* Bytes of staging in host memory (file:DIR staging is on a filesystem: not the budget's). */
static size_t memory_locked(void)
{
    size_t b = 0;
    for (int i = 0; i < S.n; i++) if (S.segs[i].kind != K_FILE) b += S.segs[i].cap;
    return b;
}

/* Admission, before anything is touched: whether the host can give `need` more bytes of staging of
 * the kind asked for, checked in this order: the user's budget and the memory cgroup (admit.c), the
 * free hugepages or the machine's available memory. On yes, the growth is reserved in the shared
 * ledger (admit_record settles it); on no, err has one line naming the limit and what to do. */
static bool room_for(size_t need, char *err, size_t errlen)
{
    const char *dir;
    enum kind k = wanted_kind(need, &dir);
    if (k == K_FILE) return true;   /* on a filesystem: neither the budget's nor host memory's */
    size_t avail = k == K_HUGETLB ? meminfo("HugePages_Free") * HUGE_PAGE : meminfo("MemAvailable") * 1024;
    if (k == K_HUGETLB && need > avail) {
        snprintf(err, errlen, "not enough free hugepages for staging: need %zu MiB, %zu MiB free; reserve them with "
                 "'echo %zu > /proc/sys/vm/nr_hugepages' (as root) or use GPUCR_STAGING=shm", need >> 20, avail >> 20,
                 meminfo("HugePages_Total") + (need - avail) / HUGE_PAGE);
        return false;
    }
    if (k == K_SHM && need > avail) {
        snprintf(err, errlen, "not enough host memory for staging: need %zu MiB more, %zu MiB available; free host "
                 "memory and retry " ADMIT_ON_DISK, need >> 20, avail >> 20);
        return false;
    }
    /* hugepages are not charged to the memory cgroup (its hugetlb controller holds them) */
    return admit_reserve(memory_locked(), need, k == K_SHM, err, errlen) == 0;
}

/* staging_fit; `shrink`: also give staging back first if it is oversized (release_if_oversized_locked). */
static int fit(const size_t *sizes, int n, bool shrink, char *err, size_t errlen)
{
    size_t need = 0;
    for (int k = 0; k < n; k++) need += sizes[k];
    pthread_mutex_lock(&S.mu);
    if (shrink) release_if_oversized_locked(need);
    size_t largest = 0, missing = shortfall_locked(sizes, n, &largest);
    int rc = 0;
    /* the whole shortfall is checked first: a refusal must come before anything is touched */
    bool reserved = false;
    if (missing) {
        size_t first = next_seg_size_locked(missing, largest), all = round_up(missing, HUGE_PAGE);
        if (!room_for(first > all ? first : all, err, errlen)) rc = -1;
        else reserved = true;
    }
    /* each new segment holds at least the largest allocation still without a place, so every round places one */
    while (rc == 0 && missing) {
        if (S.n == STAGING_MAX_SEGS) {
            snprintf(err, errlen, "staging has reached %d segments; restart the process to consolidate", STAGING_MAX_SEGS);
            rc = -1;
            break;
        }
        rc = seg_create(&S.segs[S.n], next_seg_size_locked(missing, largest), err, errlen);
        if (rc == 0) S.n++;
        missing = shortfall_locked(sizes, n, &largest);
    }
    if (reserved) admit_record(memory_locked());   /* what was made, in place of what was reserved */
    pthread_mutex_unlock(&S.mu);
    return rc;
}

int staging_fit(const size_t *sizes, int n, char *err, size_t errlen) { return fit(sizes, n, true, err, errlen); }


/* First fit, in the order staging_fit planned with. */
static void *take_locked(size_t size)
{
    for (int i = 0; i < S.n; i++) {
        struct seg *g = &S.segs[i];
        if (g->cap - g->used >= size) {
            g->used += size;
            return (char *)g->base + g->used - size;
        }
    }
    return NULL;
}

void *staging_take(size_t size)
{
    pthread_mutex_lock(&S.mu);
    void *p = take_locked(size);
    /* An allocation made between staging_fit and the gate closing has no place in a staging sized to
     * the data: make one now rather than refuse the checkpoint. */
    char err[256];
    if (!p && S.n < STAGING_MAX_SEGS) {
        if (seg_create(&S.segs[S.n], next_seg_size_locked(size, size), err, sizeof err) == 0) {
            S.n++;
            admit_record(memory_locked());
            p = take_locked(size);
        } else {
            gpucr_warn("%s", err);
        }
    }
    pthread_mutex_unlock(&S.mu);
    return p;
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
    for (int i = 0; i < S.n; i++) seg_free(&S.segs[i]);
    S.n = 0;
    admit_record(0);
    pthread_mutex_unlock(&S.mu);
}

int staging_locate(const void *p, int *seg, size_t *off)
{
    pthread_mutex_lock(&S.mu);
    int found = -1;
    for (int i = 0; i < S.n; i++) {
        const char *b = S.segs[i].base;
        if ((const char *)p >= b && (const char *)p < b + S.segs[i].cap) { *seg = i; *off = (size_t)((const char *)p - b); found = 0; break; }
    }
    pthread_mutex_unlock(&S.mu);
    return found;
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

/* The sizes of every allocation a checkpoint would move now, in registry order (as it moves them). */
size_t *staging_movable_sizes(int *n)
{
    reg_lock();
    int count = 0;
    for (struct phys *p = g_reg.all; p; p = p->next_all)
        if (reg_phys_movable(p) && !reg_phys_released(p)) count++;
    size_t *sizes = malloc(sizeof *sizes * (size_t)(count ? count : 1));
    int k = 0;
    for (struct phys *p = g_reg.all; p && sizes; p = p->next_all)
        if (reg_phys_movable(p) && !reg_phys_released(p)) sizes[k++] = p->size;
    reg_unlock();
    *n = k;
    return sizes;
}

void staging_reset_after_fork(void)
{
    /* the parent's staging is the parent's (not mapped here: MADV_DONTFORK): close our copies of its
     * fds, which would keep it alive, never unregister or unlink it */
    S.mu = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    for (int i = 0; i < S.n; i++) close(S.segs[i].fd);
    S.n = 0;
    admit_reset_after_fork();
}
