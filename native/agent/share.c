/* Memory shared with other processes through POSIX fds: what names it across processes.
 *
 * On the real driver every exported fd, of any allocation and in any process, is an open of
 * /dev/nvidiactl: fstat gives every one the same st_dev/st_ino (measured on the H200), so nothing
 * about the file names the memory. What does is the open file description: an export makes a new
 * one, and SCM_RIGHTS or dup hand the very same description to the importer. So the agent keeps a
 * duplicate of every fd it sees exported or imported (closed when the memory is freed, and at data
 * out, since an open fd keeps the memory on the GPU), and a controller that gathers these from the
 * processes of a checkpoint tells which importer holds which exporter's memory by comparing
 * descriptions (share_same_file). It then gives each importer the exporter's key, which names the
 * memory for the relink after a restore.
 *
 * Besides, the agent keeps one fd of its own of every device allocation it manages (own_fd), so a
 * gpucr server can be handed the memory: alloc.c makes it exportable, and since an imported handle
 * cannot be exported again (measured on the driver), the application's own export is answered with
 * a dup of this fd. An open fd keeps the memory on the GPU, so it is closed with the memory's last
 * handle, at a checkpoint's release and in a fork child (reg_phys_close_fds), and every fd is CLOEXEC.
 * Thousands of allocations (expandable segments) mean thousands of fds: once the process uses CUDA,
 * the soft RLIMIT_NOFILE is raised to the hard one. The agent leaves the last sixteenth of the table
 * (64 fds at least) to the application and the driver: past that an allocation works on without an
 * fd of the agent's, which is said once and counted (status: not exportable). */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#include "registry.h"

#define KCMP_FILE 0

bool share_same_file(int a, int b)
{
#ifdef SYS_kcmp
    long r = syscall(SYS_kcmp, (long)getpid(), (long)getpid(), KCMP_FILE, (long)a, (long)b);
    if (r >= 0) return r == 0;
#endif
    /* No kcmp (a seccomp profile may forbid it): the signal an fd's owner gets (F_SETSIG) is kept in
     * the open file description, so set it on one fd and read it back through the other. Nothing
     * is signalled: these fds never had O_ASYNC set. */
    int old_a = fcntl(a, F_GETSIG), old_b = fcntl(b, F_GETSIG);
    if (old_a < 0 || old_b < 0) return false;
    int mark = old_b == 37 ? 38 : 37;
    if (fcntl(a, F_SETSIG, mark) != 0) return false;
    bool same = fcntl(b, F_GETSIG) == mark;
    fcntl(a, F_SETSIG, old_a);
    return same;
}

uint64_t share_new_key(void)
{
    uint64_t k = 0;
    while (k == 0) {
        if (getrandom(&k, sizeof k, 0) != (ssize_t)sizeof k) k = (uint64_t)gpucr_now_ns() ^ ((uint64_t)getpid() << 40);
        k &= (1ULL << 62) - 1;   /* a positive JSON integer in every language */
    }
    return k;
}

static unsigned g_next_sid;

void share_keep_fd(struct phys *p, int fd)
{
    if (!p->share_sid) p->share_sid = ++g_next_sid;
    if (p->share_ndups >= SHARE_MAX_DUPS) {
        gpucr_warn("memory exported or imported more than %d times: only the first %d are told apart for a checkpoint",
                   SHARE_MAX_DUPS, SHARE_MAX_DUPS);
        return;
    }
    int d = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    if (d < 0) {
        gpucr_warn("cannot keep a duplicate of shared memory's fd: %s; a checkpoint of this process will be refused",
                   strerror(errno));
        p->share_unknown = true;
        return;
    }
    p->share_dups[p->share_ndups++] = d;
}

static bool is_our_dup(int fd)
{
    for (struct phys *p = g_reg.all; p; p = p->next_all) {
        if (p->own_fd == fd) return true;
        for (int i = 0; i < p->share_ndups; i++)
            if (p->share_dups[i] == fd) return true;
    }
    return false;
}

bool share_keeps_fd(const CUmemAllocationProp *prop)
{
    return prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE && (prop->requestedHandleTypes & 1 /* POSIX fd */);
}

/* Device memory is made exportable as a POSIX fd where its device can (so a gpucr server can be
 * handed it); true when the agent added the type the application did not ask for. */
bool share_make_exportable(CUmemAllocationProp *prop)
{
    enum { ATTR_POSIX_FD_SUPPORTED = 103 };   /* CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED */
    static _Atomic signed char supported[64];   /* per device: 0 unknown, 1 yes, -1 no */
    int dev = prop->location.id;
    if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || (prop->requestedHandleTypes & 1 /* POSIX fd */) ||
        dev < 0 || dev >= 64 || !gpucr_drv.cuDeviceGetAttribute)
        return false;
    if (!supported[dev]) {
        int v = 0;
        supported[dev] = gpucr_drv.cuDeviceGetAttribute(&v, ATTR_POSIX_FD_SUPPORTED, dev) == CUDA_SUCCESS && v ? 1 : -1;
    }
    if (supported[dev] < 0) return false;
    prop->requestedHandleTypes |= 1 /* POSIX fd */;
    return true;
}

void share_raise_nofile(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur >= rl.rlim_max) return;
    unsigned long long was = (unsigned long long)rl.rlim_cur;
    rl.rlim_cur = rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &rl) == 0)
        gpucr_log("raised the soft RLIMIT_NOFILE from %llu to its hard limit %llu: the agent keeps an fd of every "
                  "GPU allocation", was, (unsigned long long)rl.rlim_max);
}

/* Whether fd sits in the last part of the table the agent leaves to others (fds are handed out
 * lowest first, so a high number means the table is nearly full). */
static bool in_reserve(int fd)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return false;
    unsigned long long lim = (unsigned long long)rl.rlim_cur, reserve = lim / 16 < 64 ? 64 : lim / 16;
    return (unsigned long long)fd + reserve >= lim;
}

bool share_fds_left(int n)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return true;
    int lowest = fcntl(0, F_DUPFD_CLOEXEC, 0);   /* fds are handed out lowest first: the next one's number */
    if (lowest < 0) return false;
    close(lowest);
    unsigned long long lim = (unsigned long long)rl.rlim_cur, reserve = lim / 16 < 64 ? 64 : lim / 16;
    return (unsigned long long)lowest + (unsigned long long)n + reserve < lim;
}

int share_export_own(CUmemGenericAllocationHandle real)
{
    int fd = -1;
    CUresult rc = REAL(cuMemExportToShareableHandle)(&fd, real, 1 /* POSIX fd */, 0);
    bool full = rc == CUDA_SUCCESS ? in_reserve(fd) : errno == EMFILE;
    if (rc == CUDA_SUCCESS && !full) {
        /* close-on-exec whatever the driver gave: an exec'd child must not hold the GPU memory */
        fcntl(fd, F_SETFD, FD_CLOEXEC);
        return fd;
    }
    if (rc == CUDA_SUCCESS) close(fd);
    static atomic_bool said;
    if (!atomic_exchange(&said, true)) {
        struct rlimit rl = {0};
        getrlimit(RLIMIT_NOFILE, &rl);
        if (full)
            gpucr_warn("too few file descriptors left for GPU memory (RLIMIT_NOFILE soft %llu, hard %llu): allocations "
                       "go on working, but gpucr's data plane cannot reach those the agent holds no fd of, so a checkpoint "
                       "is refused (gpucr status counts them as not exportable); raise the hard limit (ulimit -Hn) "
                       "before starting the application", (unsigned long long)rl.rlim_cur, (unsigned long long)rl.rlim_max);
        else
            gpucr_cu_warn(rc, "exporting GPU memory as a POSIX fd (gpucr's data plane cannot reach it: a checkpoint is refused)");
    }
    return -1;
}

void share_adopt_own(struct phys *p, int fd, bool wanted)
{
    if (p->own_fd >= 0 && p->own_fd != fd) close(p->own_fd);   /* the same fd kept (a take-back) stays open */
    p->own_fd = fd;
    bool missing = wanted && fd < 0;
    if (missing != p->own_fd_missing) g_reg.unexportable += missing ? 1 : -1;
    p->own_fd_missing = missing;
}

int share_dup_own(const struct phys *p)
{
    return p->own_fd >= 0 ? fcntl(p->own_fd, F_DUPFD_CLOEXEC, 3) : -1;
}

int share_open_fds(const struct phys *p)
{
    if (!p->share_ndups) return p->share_open_at_release;
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    if (!d) return 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        int fd = atoi(e->d_name);
        if (fd == dirfd(d) || is_our_dup(fd)) continue;
        for (int i = 0; i < p->share_ndups; i++)
            if (share_same_file(fd, p->share_dups[i])) { n++; break; }
    }
    closedir(d);
    return n;
}

void share_release(struct phys *p)
{
    if (p->share_ndups) p->share_open_at_release = share_open_fds(p);
    reg_phys_close_fds(p);   /* the agent's own fd too: parked, it would keep the memory on the GPU */
}
