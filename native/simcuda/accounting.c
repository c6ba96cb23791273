/*
 * Device-memory accounting across processes, so that several simulated CUDA processes share
 * one simulated device the way they share a real one: a process's usage (its physical
 * allocations, granule-rounded, plus SIMCUDA_CTX_BYTES per live context) is published in
 * <rundir>/<pid>.mem, and free memory is the device total minus what every live process
 * publishes. That is what makes "checkpoint gives the memory back" observable from outside,
 * and what lets a restore fail for lack of memory.
 *
 * Exported memory whose maker let it go while fds elsewhere keep it alive is in no process's file:
 * objects.c adds it (and frees what nobody holds) wherever usage is read.
 *
 * Usage is per physical device: a process's ordinal i is physical device i until a restore
 * with GPU pairs moves it onto another one (usage.phys), and what it charged moves along.
 *
 * File format: one line "<device> <bytes>" per physical device, and "-1 <bytes>" of host memory pinned
 * (simcudaProcessHostPinned: device -1 is no device to the readers of usage), replaced atomically (write a
 * temporary file, rename it). Files of dead processes are ignored and removed by whoever reads them.
 * Charging (the only path that can run out of memory) holds an flock on <rundir>/lock so two
 * processes cannot both take the last free bytes.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "simcuda.h"

static struct {
    pthread_mutex_t mu;
    size_t used[SIM_MAX_DEVICES]; /* this process, as published: by physical device */
    size_t host_pinned;           /* host memory pinned through this driver, as published */
    int phys[SIM_MAX_DEVICES];    /* ordinal -> physical device */
    char dir[PATH_MAX];
    char mem_path[PATH_MAX];
    int lock_fd;
    bool published; /* a .mem file exists and must be removed at exit */
} usage = {.mu = PTHREAD_MUTEX_INITIALIZER, .lock_fd = -1};

CUresult sim_rundir(char *buf, size_t len)
{
    const char *env = getenv("SIMCUDA_DIR");
    int n = env && *env ? snprintf(buf, len, "%s", env) : snprintf(buf, len, "/tmp/simcuda-%u", (unsigned)geteuid());
    if (n < 0 || (size_t)n >= len)
        return CUDA_ERROR_INVALID_VALUE;
    if (mkdir(buf, 0700) != 0 && errno != EEXIST) {
        fprintf(stderr, "simcuda: cannot create runtime dir %s: %s\n", buf, strerror(errno));
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    /* The dir holds control sockets and usage files other processes trust: refuse one that
     * someone else owns or can write to, and do not follow a symlink planted in /tmp. */
    struct stat st;
    if (lstat(buf, &st) != 0 || !S_ISDIR(st.st_mode)) {
        fprintf(stderr, "simcuda: runtime dir %s is not a directory\n", buf);
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    if (st.st_uid != geteuid() || (st.st_mode & 022)) {
        fprintf(stderr, "simcuda: refusing runtime dir %s (owner uid %u, mode %03o)\n", buf, (unsigned)st.st_uid,
                (unsigned)(st.st_mode & 0777));
        return CUDA_ERROR_NOT_PERMITTED;
    }
    return CUDA_SUCCESS;
}

CUresult sim_rundir_path(char *buf, size_t len, pid_t pid, const char *suffix)
{
    char dir[PATH_MAX];
    CUresult rc = sim_rundir(dir, sizeof(dir));
    if (rc != CUDA_SUCCESS)
        return rc;
    int n = snprintf(buf, len, "%s/%d%s", dir, (int)pid, suffix);
    return n < 0 || (size_t)n >= len ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

/* ---- reading what processes publish ---- */

static bool parse_pid(const char *name, pid_t *pid)
{
    char *end;
    long v = strtol(name, &end, 10);
    if (end == name || strcmp(end, ".mem") != 0 || v <= 0 || v > INT_MAX)
        return false;
    *pid = (pid_t)v;
    return true;
}

/* Adds the per-device bytes of one .mem file to sums[]; false if it cannot be read. */
static bool read_mem_file_host(int dirfd, const char *name, size_t sums[SIM_MAX_DEVICES], size_t *host)
{
    int fd = openat(dirfd, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0)
        return false;
    FILE *f = fdopen(fd, "r");
    if (!f) {
        close(fd);
        return false;
    }
    int dev;
    unsigned long long bytes;
    while (fscanf(f, "%d %llu", &dev, &bytes) == 2)
        if (dev >= 0 && dev < SIM_MAX_DEVICES)
            sums[dev] += bytes;
        else if (dev == -1 && host)
            *host = bytes;
    fclose(f);
    return true;
}

static bool read_mem_file(int dirfd, const char *name, size_t sums[SIM_MAX_DEVICES])
{
    return read_mem_file_host(dirfd, name, sums, NULL);
}

/* Calls fn(pid, its per-device bytes, arg) for every live process except skip that publishes in dir.
 * A file whose process is gone is removed (a pid reused in the instant between the check and the
 * unlink could lose its file until its next change; acceptable for a test double). */
static void each_process(const char *dir, pid_t skip, void (*fn)(pid_t, const size_t *, void *), void *arg)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        pid_t pid;
        size_t sums[SIM_MAX_DEVICES] = {0};
        if (!parse_pid(e->d_name, &pid) || pid == skip)
            continue;
        if (kill(pid, 0) != 0 && errno == ESRCH) {
            unlinkat(dirfd(d), e->d_name, 0);
            continue;
        }
        if (read_mem_file(dirfd(d), e->d_name, sums))
            fn(pid, sums, arg);
    }
    closedir(d);
}

static void add_usage(pid_t pid, const size_t *one, void *arg)
{
    (void)pid;
    size_t *sums = arg;
    for (int dev = 0; dev < SIM_MAX_DEVICES; dev++)
        sums[dev] += one[dev];
}

static void read_usage(const char *dir, pid_t skip, size_t sums[SIM_MAX_DEVICES])
{
    each_process(dir, skip, add_usage, sums);
    sim_obj_usage(dir, sums); /* memory that only others' exported fds keep alive */
}

/* ---- this process's usage ---- */

static void publish_locked(void)
{
    char tmp[PATH_MAX + 8];
    snprintf(tmp, sizeof(tmp), "%s.tmp", usage.mem_path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) {
        fprintf(stderr, "simcuda: cannot write %s: %s\n", tmp, strerror(errno));
        return;
    }
    char buf[(SIM_MAX_DEVICES + 1) * 32];
    size_t off = 0;
    for (int d = 0; d < sim_cfg.ndevices; d++)
        off += (size_t)snprintf(buf + off, sizeof(buf) - off, "%d %zu\n", d, usage.used[d]);
    off += (size_t)snprintf(buf + off, sizeof(buf) - off, "-1 %zu\n", usage.host_pinned);
    bool ok = write(fd, buf, off) == (ssize_t)off;
    ok = close(fd) == 0 && ok;
    if (!ok || rename(tmp, usage.mem_path) != 0) {
        fprintf(stderr, "simcuda: cannot publish %s: %s\n", usage.mem_path, strerror(errno));
        unlink(tmp);
        return;
    }
    usage.published = true;
}

static void acct_atexit(void)
{
    if (getpid() == sim_cfg.pid && usage.published)
        unlink(usage.mem_path);
}

/* Stand-ins for the driver's device files, opened as the real driver opens them: <rundir>/nvidiactl
 * once at cuInit (and anew for every export, see sim_vmm_export_fd), <rundir>/nvidia<N> for each
 * physical GPU the process charges memory to (as /dev/nvidia<N>), kept open for the process's life.
 * A controller finds the processes on a GPU by who holds its node open. */
static int node_fd[SIM_MAX_DEVICES] = {[0 ... SIM_MAX_DEVICES - 1] = -1};
static int ctl_fd = -1;

/* The control file of the dir SIMCUDA_DIR names now, the one obj_dir (objects.c) keeps the memory objects
 * in: a process that is pointed at another dir after cuInit (the test suite's own, a controller of each
 * test's dir, which imports that test's processes' memory) names objects and their holders in that dir.
 * Its accounting and control socket stay in the first. */
int sim_acct_open_ctl(void)
{
    char dir[PATH_MAX], path[PATH_MAX + 16];
    if (sim_rundir(dir, sizeof(dir)) != CUDA_SUCCESS)
        return -1;
    snprintf(path, sizeof(path), "%s/nvidiactl", dir);
    return open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
}

static void open_node_locked(int phys)
{
    if (node_fd[phys] >= 0)
        return;
    char path[PATH_MAX + 16];
    snprintf(path, sizeof(path), "%s/nvidia%d", usage.dir, phys);
    node_fd[phys] = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
}

SIMAPI CUresult simcudaDeviceNode(int phys, char *buf, size_t len)
{
    char dir[PATH_MAX];
    if (phys < 0 || phys >= SIM_MAX_DEVICES || !buf)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_rundir(dir, sizeof(dir));
    if (rc != CUDA_SUCCESS)
        return rc;
    return (size_t)snprintf(buf, len, "%s/nvidia%d", dir, phys) < len ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult sim_acct_init(void)
{
    CUresult rc = sim_rundir(usage.dir, sizeof(usage.dir));
    if (rc == CUDA_SUCCESS)
        rc = sim_rundir_path(usage.mem_path, sizeof(usage.mem_path), sim_cfg.pid, ".mem");
    if (rc != CUDA_SUCCESS)
        return rc;
    char lock_path[PATH_MAX + 8];
    snprintf(lock_path, sizeof(lock_path), "%s/lock", usage.dir);
    usage.lock_fd = open(lock_path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (usage.lock_fd < 0) {
        fprintf(stderr, "simcuda: cannot open %s: %s\n", lock_path, strerror(errno));
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    for (int d = 0; d < SIM_MAX_DEVICES; d++)
        usage.phys[d] = d;
    ctl_fd = sim_acct_open_ctl();   /* the driver's own control fd, as /dev/nvidiactl */
    atexit(acct_atexit);
    return CUDA_SUCCESS;
}

/* Charges bytes[d] on every device if every device has room; the common core of both
 * charge calls. Holds the dir flock so the check and the publication are one step for
 * every process. The map is a permutation, so no physical device is counted twice. */
static CUresult charge(const size_t bytes[SIM_MAX_DEVICES])
{
    pthread_mutex_lock(&usage.mu);
    while (flock(usage.lock_fd, LOCK_EX) != 0 && errno == EINTR)
        ;
    size_t others[SIM_MAX_DEVICES] = {0};
    read_usage(usage.dir, sim_cfg.pid, others);
    CUresult rc = CUDA_SUCCESS;
    for (int d = 0; d < sim_cfg.ndevices; d++) {
        int p = usage.phys[d];
        size_t taken = others[p] + usage.used[p];
        if (bytes[d] && (taken > sim_cfg.total_mem || bytes[d] > sim_cfg.total_mem - taken))
            rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (rc == CUDA_SUCCESS) {
        for (int d = 0; d < sim_cfg.ndevices; d++) {
            usage.used[usage.phys[d]] += bytes[d];
            if (bytes[d])
                open_node_locked(usage.phys[d]);
        }
        publish_locked();
    }
    flock(usage.lock_fd, LOCK_UN);
    pthread_mutex_unlock(&usage.mu);
    return rc;
}

CUresult sim_acct_charge(int dev, size_t bytes)
{
    size_t all[SIM_MAX_DEVICES] = {0};
    all[dev] = bytes;
    return bytes ? charge(all) : CUDA_SUCCESS;
}

CUresult sim_acct_charge_all(const size_t bytes[SIM_MAX_DEVICES])
{
    return charge(bytes);
}

void sim_acct_uncharge_all(const size_t bytes[SIM_MAX_DEVICES])
{
    pthread_mutex_lock(&usage.mu);
    for (int d = 0; d < sim_cfg.ndevices; d++) {
        size_t *used = &usage.used[usage.phys[d]];
        *used -= bytes[d] < *used ? bytes[d] : *used;
    }
    publish_locked();
    pthread_mutex_unlock(&usage.mu);
}

void sim_acct_uncharge(int dev, size_t bytes)
{
    size_t all[SIM_MAX_DEVICES] = {0};
    all[dev] = bytes;
    if (bytes)
        sim_acct_uncharge_all(all);
}

size_t sim_acct_free(int dev)
{
    pthread_mutex_lock(&usage.mu);
    size_t others[SIM_MAX_DEVICES] = {0};
    read_usage(usage.dir, sim_cfg.pid, others);
    int p = usage.phys[dev];
    size_t taken = others[p] + usage.used[p];
    pthread_mutex_unlock(&usage.mu);
    return taken >= sim_cfg.total_mem ? 0 : sim_cfg.total_mem - taken;
}

int sim_acct_physical(int dev)
{
    pthread_mutex_lock(&usage.mu);
    int p = usage.phys[dev];
    pthread_mutex_unlock(&usage.mu);
    return p;
}

int sim_acct_ordinal(int phys)
{
    int dev = -1;
    pthread_mutex_lock(&usage.mu);
    for (int d = 0; d < sim_cfg.ndevices && dev < 0; d++)
        if (usage.phys[d] == phys)
            dev = d;
    pthread_mutex_unlock(&usage.mu);
    return dev;
}

void sim_acct_devices(int phys[SIM_MAX_DEVICES])
{
    pthread_mutex_lock(&usage.mu);
    memcpy(phys, usage.phys, sizeof(usage.phys));
    pthread_mutex_unlock(&usage.mu);
}

void sim_acct_set_devices(const int phys[SIM_MAX_DEVICES])
{
    pthread_mutex_lock(&usage.mu);
    size_t used[SIM_MAX_DEVICES] = {0};
    for (int d = 0; d < sim_cfg.ndevices; d++)
        used[phys[d]] = usage.used[usage.phys[d]];
    memcpy(usage.used, used, sizeof(used));
    memcpy(usage.phys, phys, sizeof(usage.phys));
    publish_locked();
    pthread_mutex_unlock(&usage.mu);
}

/* ---- extensions: usage as nvidia-smi would show it, without cuInit or a context ---- */

SIMAPI CUresult simcudaDeviceMemUsed(int device, size_t *used, size_t *total)
{
    struct sim_config cfg;
    sim_config_load(&cfg);
    if (device < 0 || device >= cfg.ndevices)
        return CUDA_ERROR_INVALID_DEVICE;
    char dir[PATH_MAX];
    CUresult rc = sim_rundir(dir, sizeof(dir));
    if (rc != CUDA_SUCCESS)
        return rc;
    size_t sums[SIM_MAX_DEVICES] = {0};
    read_usage(dir, 0, sums);
    if (used)
        *used = sums[device];
    if (total)
        *total = cfg.total_mem;
    return CUDA_SUCCESS;
}

/* What process pid publishes, by physical device. A live process that publishes nothing holds
 * nothing (all zero). A pid with no process is CUDA_ERROR_INVALID_VALUE, as in the checkpoint API. */
static CUresult process_usage_host(int pid, size_t sums[SIM_MAX_DEVICES], size_t *host)
{
    if (pid <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return CUDA_ERROR_INVALID_VALUE;
    char dir[PATH_MAX], name[32];
    CUresult rc = sim_rundir(dir, sizeof(dir));
    if (rc != CUDA_SUCCESS)
        return rc;
    snprintf(name, sizeof(name), "%d.mem", pid);
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        read_mem_file_host(dfd, name, sums, host);
        close(dfd);
    }
    return CUDA_SUCCESS;
}

static CUresult process_usage(int pid, size_t sums[SIM_MAX_DEVICES])
{
    return process_usage_host(pid, sums, NULL);
}

SIMAPI CUresult simcudaProcessMemUsed(int pid, size_t *used)
{
    size_t sums[SIM_MAX_DEVICES] = {0};
    CUresult rc = used ? process_usage(pid, sums) : CUDA_ERROR_INVALID_VALUE;
    if (rc != CUDA_SUCCESS)
        return rc;
    *used = 0;
    for (int d = 0; d < SIM_MAX_DEVICES; d++)
        *used += sums[d];
    return CUDA_SUCCESS;
}

void sim_acct_host_pinned(long long delta)
{
    pthread_mutex_lock(&usage.mu);
    usage.host_pinned = delta < 0 && (size_t)-delta > usage.host_pinned ? 0 : usage.host_pinned + (size_t)delta;
    if (usage.mem_path[0])
        publish_locked();
    pthread_mutex_unlock(&usage.mu);
}

SIMAPI CUresult simcudaProcessHostPinned(int pid, size_t *bytes)
{
    size_t sums[SIM_MAX_DEVICES] = {0};
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    *bytes = 0;
    return process_usage_host(pid, sums, bytes);
}

/* One process's bytes on one physical device: what NVML's per-process list says on a real GPU. */
SIMAPI CUresult simcudaProcessDeviceMemUsed(int pid, int device, size_t *used)
{
    size_t sums[SIM_MAX_DEVICES] = {0};
    if (!used || device < 0 || device >= SIM_MAX_DEVICES)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = process_usage(pid, sums);
    if (rc == CUDA_SUCCESS)
        *used = sums[device];
    return rc;
}

struct on_device {
    int phys, *pids, room, found;
};

static void note_on_device(pid_t pid, const size_t *sums, void *arg)
{
    struct on_device *on = arg;
    if (sums[on->phys] == 0)
        return;
    if (on->found < on->room)
        on->pids[on->found] = pid;
    on->found++;
}

/* The processes that hold memory or a context on physical device `phys`: NVML's compute processes on a
 * real GPU. Up to *n pids go into pids; *n is set to how many there are. */
SIMAPI CUresult simcudaDeviceProcesses(int phys, int *pids, int *n)
{
    if (!n || *n < 0 || (*n > 0 && !pids) || phys < 0 || phys >= SIM_MAX_DEVICES)
        return CUDA_ERROR_INVALID_VALUE;
    char dir[PATH_MAX];
    CUresult rc = sim_rundir(dir, sizeof(dir));
    if (rc != CUDA_SUCCESS)
        return rc;
    struct on_device on = {.phys = phys, .pids = pids, .room = *n};
    each_process(dir, 0, note_on_device, &on);
    *n = on.found;
    return CUDA_SUCCESS;
}

/* Whether physical devices a and b are joined by NVLink (NVML's P2P status, NVLink index, on a real
 * machine). SIMCUDA_NVLINK lists the joined pairs, "0-1,2-3", or says "none"; unset, every pair of
 * devices is joined, as on the two-GPU H200 host. */
SIMAPI CUresult simcudaDevicesNvlinked(int a, int b, int *joined)
{
    struct sim_config cfg;
    sim_config_load(&cfg);
    if (!joined || a < 0 || b < 0 || a >= cfg.ndevices || b >= cfg.ndevices)
        return CUDA_ERROR_INVALID_VALUE;
    const char *links = getenv("SIMCUDA_NVLINK");
    *joined = 0;
    if (a == b)
        return CUDA_SUCCESS;
    if (!links || !*links) {
        *joined = 1;
        return CUDA_SUCCESS;
    }
    for (const char *p = links; *p;) {
        int x, y, used = 0;
        if (sscanf(p, "%d-%d%n", &x, &y, &used) == 2 && ((x == a && y == b) || (x == b && y == a)))
            *joined = 1;
        p += used ? used : 1;
        while (*p == ',' || *p == ' ')
            p++;
    }
    return CUDA_SUCCESS;
}
