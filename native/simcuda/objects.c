/*
 * Exportable physical memory and its lifetime across processes, as the driver keeps it.
 *
 * On the driver, memory made with the POSIX-fd handle type lives while anyone holds a handle of it
 * OR an exported fd of it (any dup, in any process, even one with no CUDA context): the exporter's
 * cuMemRelease does not free it, an import from such an fd still works, and the driver's checkpoint
 * of the exporter neither refuses nor copies it (measured on the H200: reference/fdkeep_probe.py).
 *
 * simcuda models that with an object per such allocation, outside any one process:
 *   <rundir>/obj/<id>.<physical device>   the memory itself (a sparse file of whole granules)
 *   <rundir>/obj/<id>.owner               the pid of the process that made it and charges it in its
 *                                         own <pid>.mem; gone once that process lets go of it
 * Who holds it is told by open file description (OFD) read locks on byte <id> of <rundir>/nvidiactl:
 * each process holding a handle locks it through one description of its own, and every export is a
 * new open of nvidiactl (as on the driver: fstat cannot tell two exports apart) holding a lock, which
 * dup and SCM_RIGHTS share and which goes away with the last fd of that description. So "the last
 * handle and the last fd are gone" is "no lock on the byte", which anyone can test (F_OFD_GETLK).
 * The object is freed by whoever sees that first: the process dropping its handle, or any reader of
 * the accounting (sim_obj_usage), so free memory is right whenever it is read. Memory whose maker let
 * go while fds elsewhere keep it counts on its GPU by itself, in no process's usage.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "simcuda.h"

/* Ids are lock offsets and exported fds' file offsets: below 2^42 so every filesystem takes the seek. */
#define OBJ_ID_BITS 42

static pthread_mutex_t obj_mu = PTHREAD_MUTEX_INITIALIZER;
static int hold_fd = -1; /* this process's description that holds its handles' locks */

static int obj_dir(void)
{
    char dir[PATH_MAX], path[PATH_MAX + 8];
    if (sim_rundir(dir, sizeof(dir)) != CUDA_SUCCESS)
        return -1;
    snprintf(path, sizeof(path), "%s/obj", dir);
    if (mkdir(path, 0700) != 0 && errno != EEXIST)
        return -1;
    return open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
}

static bool set_lock(int fd, uint64_t id, short type, bool probe)
{
    struct flock l = {.l_type = type, .l_whence = SEEK_SET, .l_start = (off_t)id, .l_len = 1};
    if (fcntl(fd, probe ? F_OFD_GETLK : F_OFD_SETLK, &l) != 0)
        return false;
    return !probe || l.l_type == F_UNLCK; /* probe: true when no other description holds it */
}

/* Whether nobody (no handle, no exported fd) holds object id; probe_fd holds no lock of it. */
static bool unheld(int probe_fd, uint64_t id)
{
    return set_lock(probe_fd, id, F_WRLCK, true);
}

/* How many handles this process holds of each object: locks of one description merge, so the byte
 * is locked at the first and unlocked at the last (a process may import what it exported). */
struct held {
    struct held *next;
    uint64_t id;
    unsigned count;
};
static struct held *helds;

static bool hold(uint64_t id, short type)
{
    pthread_mutex_lock(&obj_mu);
    struct held **l = &helds;
    while (*l && (*l)->id != id)
        l = &(*l)->next;
    struct held *h = *l;
    bool ok = true;
    if (type == F_UNLCK) {
        if (h && --h->count == 0) {
            *l = h->next;
            free(h);
            ok = set_lock(hold_fd, id, F_UNLCK, false);
        }
    } else if (h) {
        h->count++;
    } else {
        if (!helds && hold_fd >= 0) { /* holding nothing: the control file of the dir named now (sim_acct_open_ctl) */
            close(hold_fd);
            hold_fd = -1;
        }
        if (hold_fd < 0)
            hold_fd = sim_acct_open_ctl();
        h = hold_fd >= 0 ? calloc(1, sizeof(*h)) : NULL;
        ok = h && set_lock(hold_fd, id, F_RDLCK, false);
        if (ok) {
            *h = (struct held){.next = helds, .id = id, .count = 1};
            helds = h;
        } else {
            free(h);
        }
    }
    pthread_mutex_unlock(&obj_mu);
    return ok;
}

static void name_of(char *buf, size_t len, uint64_t id, const char *suffix)
{
    snprintf(buf, len, "%" PRIx64 ".%s", id, suffix);
}

static void obj_unlink(int dfd, uint64_t id, int phys)
{
    char name[48];
    snprintf(name, sizeof(name), "%" PRIx64 ".%d", id, phys);
    unlinkat(dfd, name, 0);
    name_of(name, sizeof(name), id, "owner");
    unlinkat(dfd, name, 0);
}

int sim_obj_create(int phys, size_t size, uint64_t *id)
{
    int dfd = obj_dir(), fd = -1;
    for (int tries = 0; dfd >= 0 && fd < 0 && tries < 8; tries++) {
        uint64_t k = 0;
        if (getrandom(&k, sizeof(k), 0) != (ssize_t)sizeof(k))
            break;
        k &= (1ull << OBJ_ID_BITS) - 1;
        /* Held before it exists, so a reader never takes it for one nobody holds. */
        if (!k || !hold(k, F_RDLCK))
            continue;
        char name[48];
        snprintf(name, sizeof(name), "%" PRIx64 ".%d", k, phys);
        fd = openat(dfd, name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
        if (fd >= 0 && ftruncate(fd, (off_t)size) != 0) {
            close(fd);
            unlinkat(dfd, name, 0);
            fd = -1;
        }
        if (fd >= 0) {
            char owner[48], pid[24];
            name_of(owner, sizeof(owner), k, "owner");
            int ofd = openat(dfd, owner, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
            int n = snprintf(pid, sizeof(pid), "%d\n", (int)getpid());
            bool ok = ofd >= 0 && write(ofd, pid, (size_t)n) == n;
            if (ofd >= 0)
                close(ofd);
            if (!ok) {
                close(fd);
                obj_unlink(dfd, k, phys);
                fd = -1;
            } else {
                *id = k;
            }
        }
        if (fd < 0)
            hold(k, F_UNLCK);
    }
    if (dfd >= 0)
        close(dfd);
    return fd;
}

int sim_obj_data(uint64_t id, int phys)
{
    char name[48];
    int dfd = obj_dir(), fd = -1;
    snprintf(name, sizeof(name), "%" PRIx64 ".%d", id, phys);
    if (dfd >= 0) {
        fd = openat(dfd, name, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
        close(dfd);
    }
    return fd;
}

int sim_obj_open(uint64_t id, int *phys)
{
    int dfd = obj_dir(), fd = -1;
    if (dfd < 0)
        return -1;
    for (int p = 0; p < SIM_MAX_DEVICES && fd < 0; p++) {
        char name[48];
        snprintf(name, sizeof(name), "%" PRIx64 ".%d", id, p);
        fd = openat(dfd, name, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
        *phys = p;
    }
    close(dfd);
    if (fd >= 0 && !hold(id, F_RDLCK)) {
        close(fd);
        fd = -1;
    }
    return fd;
}

void sim_obj_drop(uint64_t id, int phys, bool owner)
{
    hold(id, F_UNLCK);
    int dfd = obj_dir(), probe = sim_acct_open_ctl();
    if (dfd >= 0 && probe >= 0) {
        if (unheld(probe, id)) {
            obj_unlink(dfd, id, phys);
        } else if (owner) {
            /* Kept by fds elsewhere: it counts on its GPU by itself from now on (the caller uncharges). */
            char name[48];
            name_of(name, sizeof(name), id, "owner");
            unlinkat(dfd, name, 0);
        }
    }
    if (probe >= 0)
        close(probe);
    if (dfd >= 0)
        close(dfd);
}

int sim_obj_export(uint64_t id)
{
    int fd = sim_acct_open_ctl();
    if (fd >= 0 && (lseek(fd, (off_t)id, SEEK_SET) != (off_t)id || !set_lock(fd, id, F_RDLCK, false))) {
        close(fd);
        fd = -1;
    }
    return fd;
}

uint64_t sim_obj_of_fd(int fd)
{
    struct stat st, ctl;
    int probe = sim_acct_open_ctl();
    bool is_ctl = probe >= 0 && fstat(probe, &ctl) == 0 && fstat(fd, &st) == 0 && st.st_dev == ctl.st_dev &&
                  st.st_ino == ctl.st_ino;
    if (probe >= 0)
        close(probe);
    off_t where = is_ctl ? lseek(fd, 0, SEEK_CUR) : -1;
    return where > 0 && where < (off_t)(1ull << OBJ_ID_BITS) ? (uint64_t)where : 0;
}

static bool owner_live(int dfd, uint64_t id)
{
    char name[48], buf[24] = {0};
    name_of(name, sizeof(name), id, "owner");
    int fd = openat(dfd, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0)
        return false;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    long pid = n > 0 ? strtol(buf, NULL, 10) : 0;
    return pid > 0 && !(kill((pid_t)pid, 0) != 0 && errno == ESRCH);
}

void sim_obj_usage(const char *rundir, size_t sums[SIM_MAX_DEVICES])
{
    /* Readers need no cuInit (nvidia-smi does not either): the control file is named from rundir. */
    char path[PATH_MAX + 16];
    snprintf(path, sizeof(path), "%s/nvidiactl", rundir);
    int probe = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    snprintf(path, sizeof(path), "%s/obj", rundir);
    DIR *d = probe >= 0 ? opendir(path) : NULL;
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL) {
        uint64_t id;
        int phys;
        struct stat st;
        if (sscanf(e->d_name, "%" SCNx64 ".%d", &id, &phys) != 2 || phys < 0 || phys >= SIM_MAX_DEVICES)
            continue;
        if (unheld(probe, id)) {
            obj_unlink(dirfd(d), id, phys); /* the last handle and the last fd are gone */
            continue;
        }
        if (!owner_live(dirfd(d), id) && fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0)
            sums[phys] += (size_t)st.st_size;
    }
    if (probe >= 0)
        close(probe);
    if (d)
        closedir(d);
}
