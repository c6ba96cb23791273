/*
 * Tests for simcuda, the libcuda.so.1 TEST DOUBLE. Plain C, real processes: the binary runs
 * the tests as the parent and re-executes itself in child roles (a memory holder, a checkpoint
 * target, an importer of shared memory) that it drives over a pipe, one command per line.
 *
 * Run through tests/run.sh, which builds the library and sets nothing else up: this program
 * makes its own runtime dir and device size, so it never sees other simcuda processes.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../simcuda_api.h"

#define MiB (1ull << 20)
#define GRAN (2 * MiB)
#define TOTAL_MEM (1024 * MiB) /* the simulated device every process here shares */
#define CTX_BYTES (64 * MiB)

/* ---- reporting ---- */

static const char *role = "parent";

static const char *errname(CUresult rc)
{
    const char *s = NULL;
    cuGetErrorName(rc, &s);
    return s ? s : "?";
}

__attribute__((format(printf, 4, 5), noreturn)) static void fail_at(const char *file, int line, const char *what,
                                                                     const char *fmt, ...)
{
    fprintf(stderr, "FAIL [%s] %s:%d: %s: ", role, file, line, what);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(1);
}

#define CHECK(cond, ...)                                                                       \
    do {                                                                                       \
        if (!(cond))                                                                           \
            fail_at(__FILE__, __LINE__, #cond, __VA_ARGS__);                                   \
    } while (0)

#define EXPECT_RC(call, want)                                                                  \
    do {                                                                                       \
        CUresult r_ = (call), w_ = (want);                                                     \
        if (r_ != w_)                                                                          \
            fail_at(__FILE__, __LINE__, #call, "returned %d %s, expected %d %s", r_, errname(r_), w_, \
                    errname(w_));                                                              \
    } while (0)

#define CU(call) EXPECT_RC(call, CUDA_SUCCESS)

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void sleep_ms(unsigned ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

static uint32_t pattern(size_t i, uint32_t seed) { return (uint32_t)(i * 2654435761u) ^ seed; }

static CUcontext init_primary(void)
{
    CUcontext ctx;
    CU(cuInit(0));
    CU(cuDevicePrimaryCtxRetain(&ctx, 0));
    CU(cuCtxSetCurrent(ctx));
    return ctx;
}

static const CUmemAllocationProp vmm_prop = {
    .type = CU_MEM_ALLOCATION_TYPE_PINNED, .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
static const CUmemAllocationProp vmm_prop_fd = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                                .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                                .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};

static CUresult set_access(CUdeviceptr va, size_t size, int flags)
{
    CUmemAccessDesc d = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}, .flags = flags};
    return cuMemSetAccess(va, size, &d, 1);
}

static CUfunction builtin(const char *name)
{
    static CUmodule mod;
    if (!mod)
        CU(cuModuleLoadData(&mod, "simcuda-builtin"));
    CUfunction f;
    CU(cuModuleGetFunction(&f, mod, name));
    return f;
}

static CUresult launch(CUfunction f, void **params, CUstream s)
{
    return cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, params, NULL);
}

/* ---- driving child processes ---- */

static const char *self_exe;

struct child {
    pid_t pid;
    FILE *to, *from;
};

/* Starts this binary in role `name`; env_set is an optional "NAME=value" for the child. */
static struct child spawn(const char *name, const char *arg1, const char *arg2, const char *env_set)
{
    int down[2], up[2];
    CHECK(pipe2(down, O_CLOEXEC) == 0 && pipe2(up, O_CLOEXEC) == 0, "pipe: %s", strerror(errno));
    fflush(NULL);
    pid_t pid = fork();
    CHECK(pid >= 0, "fork: %s", strerror(errno));
    if (pid == 0) {
        dup2(down[0], 0);
        dup2(up[1], 1);
        if (env_set)
            putenv((char *)env_set);
        execl(self_exe, self_exe, name, arg1, arg2, (char *)NULL);
        _exit(127);
    }
    close(down[0]);
    close(up[1]);
    struct child c = {.pid = pid, .to = fdopen(down[1], "w"), .from = fdopen(up[0], "r")};
    return c;
}

static void child_recv(struct child *c, char *buf, size_t len)
{
    CHECK(fgets(buf, (int)len, c->from) != NULL, "child %d hung up (crashed or failed)", c->pid);
    buf[strcspn(buf, "\n")] = '\0';
}

/* Sends a command and returns the reply line in buf. */
static void child_ask(struct child *c, char *buf, size_t len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vfprintf(c->to, fmt, ap);
    va_end(ap);
    fputc('\n', c->to);
    fflush(c->to);
    child_recv(c, buf, len);
}

static void child_ok(struct child *c, const char *cmd)
{
    char buf[256];
    child_ask(c, buf, sizeof(buf), "%s", cmd);
    CHECK(strcmp(buf, "OK") == 0, "child %d answered '%s' to %s", c->pid, buf, cmd);
}

static void child_finish(struct child *c)
{
    fprintf(c->to, "EXIT\n");
    fclose(c->to);
    fclose(c->from);
    int status;
    CHECK(waitpid(c->pid, &status, 0) == c->pid, "waitpid");
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child %d ended with status 0x%x", c->pid, status);
}

static void child_kill(struct child *c)
{
    kill(c->pid, SIGKILL);
    fclose(c->to);
    fclose(c->from);
    waitpid(c->pid, NULL, 0);
}

static size_t proc_used(pid_t pid)
{
    size_t used = 0;
    CU(simcudaProcessMemUsed(pid, &used));
    return used;
}

static size_t device_used(void)
{
    size_t used = 0, total = 0;
    CU(simcudaDeviceMemUsed(0, &used, &total));
    CHECK(total == TOTAL_MEM, "total %zu", total);
    return used;
}

static size_t free_mem(void)
{
    size_t free = 0, total = 0;
    CU(cuMemGetInfo_v2(&free, &total));
    CHECK(total == TOTAL_MEM, "total %zu", total);
    return free;
}

static CUprocessState state_of(pid_t pid)
{
    CUprocessState s = -1;
    CU(cuCheckpointProcessGetState(pid, &s));
    return s;
}

/* ================= child roles ================= */

static char line[256];

static bool next_command(void)
{
    if (!fgets(line, sizeof(line), stdin))
        return false;
    line[strcspn(line, "\n")] = '\0';
    return strcmp(line, "EXIT") != 0;
}

/* holder <bytes>: holds one allocation until FREE; shows up in everyone's accounting. */
static int role_holder(size_t bytes)
{
    init_primary();
    CUdeviceptr p = 0;
    if (bytes) {
        CU(cuMemAlloc_v2(&p, bytes));
        CU(cuMemsetD8_v2(p, 0x5a, 4096)); /* touch a little: the rest stays sparse */
    }
    printf("READY\n");
    while (next_command()) {
        if (strcmp(line, "FREE") == 0 && p) {
            CU(cuMemFree_v2(p));
            p = 0;
        }
        printf("OK\n");
    }
    return 0;
}

/* importer <fd> <expect>: imports a POSIX-fd allocation from its parent and writes to it. */
static int role_importer(int fd, uint32_t expect)
{
    init_primary();
    CUmemGenericAllocationHandle h;
    CU(cuMemImportFromShareableHandle(&h, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    close(fd);
    CUmemAllocationProp prop;
    CU(cuMemGetAllocationPropertiesFromHandle(&prop, h));
    CHECK(prop.requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR && prop.location.id == 0, "prop");
    CUdeviceptr va;
    CU(cuMemAddressReserve(&va, GRAN, 0, 0, 0));
    CU(cuMemMap(va, GRAN, 0, h, 0));
    CU(set_access(va, GRAN, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
    uint32_t got;
    CU(cuMemcpyDtoH_v2(&got, va, 4));
    CHECK(got == expect, "imported memory holds %#x, exporter wrote %#x", got, expect);
    uint32_t mine = 0x12345678;
    CU(cuMemcpyHtoD_v2(va, &mine, 4));
    printf("READY\n");
    while (next_command())
        printf("OK\n");
    CU(cuMemUnmap(va, GRAN));
    CU(cuMemRelease(h));
    CU(cuMemAddressFree(va, GRAN));
    return 0;
}

/* exporter <socket fd>: makes exportable memory, fills it, hands its exported fd to the parent over
 * the socket (SCM_RIGHTS), then unmaps and releases it and closes its own fd: only the parent's fd
 * keeps the memory alive. Then answers PING until EXIT. */
#define KEPT_BYTES (2 * GRAN)

/* Maps all of handle h (bytes long) at new addresses with protection prot. */
static CUdeviceptr map_handle(CUmemGenericAllocationHandle h, size_t bytes, int prot)
{
    CUdeviceptr va;
    CU(cuMemAddressReserve(&va, bytes, 0, 0, 0));
    CU(cuMemMap(va, bytes, 0, h, 0));
    CU(set_access(va, bytes, prot));
    return va;
}

static int role_exporter(int sock)
{
    init_primary();
    CUmemGenericAllocationHandle h;
    int fd;
    CU(cuMemCreate(&h, KEPT_BYTES, &vmm_prop_fd, 0));
    CUdeviceptr va = map_handle(h, KEPT_BYTES, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    CU(cuMemsetD32_v2(va, 0x5eed5eed, KEPT_BYTES / 4));
    CU(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    char one = 'f', ctl[CMSG_SPACE(sizeof(int))] = {0};
    struct iovec iov = {&one, 1};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl, .msg_controllen = sizeof(ctl)};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    *cm = (struct cmsghdr){.cmsg_len = CMSG_LEN(sizeof(int)), .cmsg_level = SOL_SOCKET, .cmsg_type = SCM_RIGHTS};
    memcpy(CMSG_DATA(cm), &fd, sizeof(int));
    CHECK(sendmsg(sock, &msg, 0) == 1, "sendmsg: %s", strerror(errno));
    close(sock);
    CU(cuMemUnmap(va, KEPT_BYTES));
    CU(cuMemRelease(h));
    CU(cuMemAddressFree(va, KEPT_BYTES));
    close(fd);
    printf("READY\n");
    while (next_command()) {
        CU(cuCtxSynchronize());
        printf("OK\n");
    }
    return 0;
}

/* ckpt-target: device memory of every kind, a thread that keeps calling the API, and a
 * VERIFY that checks every byte and protection after a restore. */
#define TGT_A_BYTES (8 * MiB)  /* cuMemAlloc */
#define TGT_B_BYTES (4 * MiB)  /* VMM, mapped: first granule RW, second READ */
#define TGT_C_BYTES (2 * MiB)  /* VMM, created and filled but not mapped anywhere */
#define TGT_USED (CTX_BYTES + TGT_A_BYTES + TGT_B_BYTES + TGT_C_BYTES)

static struct {
    CUcontext ctx;
    CUdeviceptr a, b;
    CUmemGenericAllocationHandle hb, hc;
    atomic_long count, fails, polls;
    atomic_bool stop, spinning;
    pthread_t blocker, spinner, poller;
    bool have_blocker, have_spinner, have_poller;
    unsigned spin_ms;
} tgt;

static void *blocker_main(void *arg)
{
    (void)arg;
    CU(cuCtxSetCurrent(tgt.ctx));
    while (!atomic_load(&tgt.stop)) {
        uint32_t x;
        if (cuMemcpyDtoH_v2(&x, tgt.a, 4) != CUDA_SUCCESS || x != pattern(0, 1) + 7)
            atomic_fetch_add(&tgt.fails, 1);
        atomic_fetch_add(&tgt.count, 1);
        sleep_ms(5);
    }
    return NULL;
}

/* Queries its stream without a pause, as a busy-wait on the GPU does: the lock does not hold it. */
static void *poller_main(void *arg)
{
    (void)arg;
    CU(cuCtxSetCurrent(tgt.ctx));
    while (!atomic_load(&tgt.stop)) {
        CU(cuStreamQuery(NULL));
        atomic_fetch_add(&tgt.polls, 1);
    }
    return NULL;
}

static void *spinner_main(void *arg)
{
    (void)arg;
    CU(cuCtxSetCurrent(tgt.ctx));
    CUfunction f = builtin("spin_ms");
    void *params[] = {&tgt.spin_ms};
    atomic_store(&tgt.spinning, true);
    CU(launch(f, params, NULL));
    return NULL;
}

static uint32_t *host_words(size_t bytes, uint32_t seed)
{
    uint32_t *w = malloc(bytes);
    CHECK(w != NULL, "malloc");
    for (size_t i = 0; i < bytes / 4; i++)
        w[i] = pattern(i, seed);
    return w;
}

static void target_setup(void)
{
    tgt.ctx = init_primary();
    /* A: plain allocation, written from the host, then changed by a kernel */
    CU(cuMemAlloc_v2(&tgt.a, TGT_A_BYTES));
    uint32_t *w = host_words(TGT_A_BYTES, 1);
    CU(cuMemcpyHtoD_v2(tgt.a, w, TGT_A_BYTES));
    free(w);
    unsigned long long n = TGT_A_BYTES / 4;
    unsigned seven = 7;
    void *params[] = {&tgt.a, &seven, &n};
    CU(launch(builtin("add_u32"), params, NULL));
    /* B: VMM, its second granule made read-only after it was written */
    CU(cuMemAddressReserve(&tgt.b, TGT_B_BYTES, 0, 0, 0));
    CU(cuMemCreate(&tgt.hb, TGT_B_BYTES, &vmm_prop_fd, 0));
    CU(cuMemMap(tgt.b, TGT_B_BYTES, 0, tgt.hb, 0));
    CU(set_access(tgt.b, TGT_B_BYTES, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
    w = host_words(TGT_B_BYTES, 2);
    CU(cuMemcpyHtoD_v2(tgt.b, w, TGT_B_BYTES));
    free(w);
    CU(set_access(tgt.b + GRAN, GRAN, CU_MEM_ACCESS_FLAGS_PROT_READ));
    /* C: written sparsely (its head and last word) through a temporary mapping, then left
     * unmapped: only the handle holds it */
    CUdeviceptr tmp;
    CU(cuMemCreate(&tgt.hc, TGT_C_BYTES, &vmm_prop, 0));
    CU(cuMemAddressReserve(&tmp, TGT_C_BYTES, 0, 0, 0));
    CU(cuMemMap(tmp, TGT_C_BYTES, 0, tgt.hc, 0));
    CU(set_access(tmp, TGT_C_BYTES, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
    CU(cuMemsetD32_v2(tmp, 0xC0FFEE00u, 4096 / 4));
    CU(cuMemsetD32_v2(tmp + TGT_C_BYTES - 4, 0xC0FFEE00u, 1));
    CU(cuMemUnmap(tmp, TGT_C_BYTES));
    CU(cuMemAddressFree(tmp, TGT_C_BYTES));
}

/* Returns NULL when everything is intact, else what is not. */
static const char *target_verify(void)
{
    static uint32_t got[TGT_A_BYTES / 4]; /* big enough for A and B */
    CUdeviceptr base;
    size_t size;
    if (cuMemGetAddressRange_v2(&base, &size, tgt.a + 100) != CUDA_SUCCESS || base != tgt.a || size != TGT_A_BYTES)
        return "A's address range";
    CU(cuMemcpyDtoH_v2(got, tgt.a, TGT_A_BYTES));
    uint64_t sum = 0;
    for (size_t i = 0; i < TGT_A_BYTES / 4; i++) {
        if (got[i] != pattern(i, 1) + 7)
            return "A's bytes";
        sum += got[i];
    }
    /* kernels still work on restored memory */
    CUdeviceptr out;
    CU(cuMemAlloc_v2(&out, 8));
    unsigned long long n = TGT_A_BYTES / 4;
    void *params[] = {&tgt.a, &n, &out};
    CU(launch(builtin("checksum_u32"), params, NULL));
    uint64_t ksum;
    CU(cuMemcpyDtoH_v2(&ksum, out, 8));
    CU(cuMemFree_v2(out));
    if (ksum != sum)
        return "checksum kernel over A";

    CU(cuMemcpyDtoH_v2(got, tgt.b, TGT_B_BYTES)); /* the read-only granule is still readable */
    for (size_t i = 0; i < TGT_B_BYTES / 4; i++)
        if (got[i] != pattern(i, 2))
            return "B's bytes";
    uint32_t v = 1;
    if (cuMemcpyHtoD_v2(tgt.b + GRAN, &v, 4) != CUDA_ERROR_INVALID_VALUE)
        return "B's second granule should still be read-only";
    if (cuMemcpyHtoD_v2(tgt.b + 4, &v, 4) != CUDA_SUCCESS)
        return "B's first granule should still be writable";

    CUmemGenericAllocationHandle h;
    if (cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)(tgt.b + GRAN)) != CUDA_SUCCESS || h != tgt.hb)
        return "B's handle";
    CU(cuMemRelease(h));

    CUdeviceptr tmp;
    CU(cuMemAddressReserve(&tmp, TGT_C_BYTES, 0, 0, 0));
    CU(cuMemMap(tmp, TGT_C_BYTES, 0, tgt.hc, 0));
    CU(set_access(tmp, TGT_C_BYTES, CU_MEM_ACCESS_FLAGS_PROT_READ));
    uint32_t head, middle, last;
    CU(cuMemcpyDtoH_v2(&head, tmp + 4092, 4));
    CU(cuMemcpyDtoH_v2(&middle, tmp + TGT_C_BYTES / 2, 4));
    CU(cuMemcpyDtoH_v2(&last, tmp + TGT_C_BYTES - 4, 4));
    CU(cuMemUnmap(tmp, TGT_C_BYTES));
    CU(cuMemAddressFree(tmp, TGT_C_BYTES));
    if (head != 0xC0FFEE00u || middle != 0 || last != 0xC0FFEE00u)
        return "C's bytes (the unmapped, sparsely written allocation)";
    return NULL;
}

static int role_target(void)
{
    target_setup();
    printf("READY %llx %llx\n", tgt.a, tgt.b);
    while (next_command()) {
        if (strcmp(line, "BLOCKER") == 0) {
            CHECK(pthread_create(&tgt.blocker, NULL, blocker_main, NULL) == 0, "thread");
            tgt.have_blocker = true;
            while (atomic_load(&tgt.count) == 0)
                sleep_ms(1);
            printf("OK\n");
        } else if (strcmp(line, "POLLER") == 0) {
            CHECK(pthread_create(&tgt.poller, NULL, poller_main, NULL) == 0, "thread");
            tgt.have_poller = true;
            while (atomic_load(&tgt.polls) == 0)
                sleep_ms(1);
            printf("OK\n");
        } else if (strcmp(line, "POLLS") == 0) {
            printf("%ld\n", atomic_load(&tgt.polls));   /* without calling CUDA, as COUNT */
        } else if (strcmp(line, "COUNT") == 0) {
            /* answered without calling CUDA: this thread must not block on the lock */
            printf("%ld %ld\n", atomic_load(&tgt.count), atomic_load(&tgt.fails));
        } else if (sscanf(line, "SPIN %u", &tgt.spin_ms) == 1) {
            CHECK(pthread_create(&tgt.spinner, NULL, spinner_main, NULL) == 0, "thread");
            tgt.have_spinner = true;
            while (!atomic_load(&tgt.spinning))
                sleep_ms(1);
            printf("OK\n");
        } else if (strcmp(line, "PING") == 0) {
            CU(cuCtxSynchronize());
            printf("OK\n");
        } else if (strcmp(line, "VERIFY") == 0) {
            const char *bad = target_verify();
            printf(bad ? "BAD %s\n" : "OK\n", bad);
        } else {
            printf("unknown command %s\n", line);
        }
    }
    atomic_store(&tgt.stop, true);
    if (tgt.have_blocker)
        pthread_join(tgt.blocker, NULL);
    if (tgt.have_spinner)
        pthread_join(tgt.spinner, NULL);
    if (tgt.have_poller)
        pthread_join(tgt.poller, NULL);
    return 0;
}

/* multidev (SIMCUDA_DEVICES=2): memory and accounting per device, and a process that
 * checkpoints itself (its control thread serves its own requests). */
static int role_multidev(void)
{
    CU(cuInit(0));
    int n;
    CU(cuDeviceGetCount(&n));
    CHECK(n == 2, "devices %d", n);
    CUuuid u0, u1;
    CU(cuDeviceGetUuid_v2(&u0, 0));
    CU(cuDeviceGetUuid_v2(&u1, 1));
    CHECK(memcmp(&u0, &u1, sizeof(u0)) != 0, "devices share a UUID");
    size_t used0, used1, total;
    CU(simcudaDeviceMemUsed(0, &used0, &total));
    CU(simcudaDeviceMemUsed(1, &used1, &total));
    CHECK(used1 == 0, "device 1 used %zu", used1);

    CUcontext ctx;
    CU(cuDevicePrimaryCtxRetain(&ctx, 1));
    CU(cuCtxSetCurrent(ctx));
    CUdevice d;
    CU(cuCtxGetDevice(&d));
    CHECK(d == 1, "context device %d", d);
    CUdeviceptr p;
    CU(cuMemAlloc_v2(&p, 4 * MiB));
    CU(cuMemsetD32_v2(p, 0x0d1ce, MiB));
    CUmemAllocationProp prop = vmm_prop;
    prop.location.id = 1;
    CUmemGenericAllocationHandle h;
    CU(cuMemCreate(&h, GRAN, &prop, 0));
    int ordinal = -1;
    CU(cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p));
    CHECK(ordinal == 1, "pointer on device %d", ordinal);
    size_t now0;
    CU(simcudaDeviceMemUsed(0, &now0, &total));
    CU(simcudaDeviceMemUsed(1, &used1, &total));
    CHECK(now0 == used0 && used1 == CTX_BYTES + 4 * MiB + GRAN, "per device: %zu, %zu", now0, used1);

    int self = getpid();
    CUprocessState st;
    CU(cuCheckpointProcessLock(self, NULL));
    CU(cuCheckpointProcessCheckpoint(self, NULL));
    CU(cuCheckpointProcessGetState(self, &st));
    CU(simcudaDeviceMemUsed(1, &used1, &total));
    CHECK(st == CU_PROCESS_STATE_CHECKPOINTED && used1 == 0, "self-checkpoint: state %d, used %zu", st, used1);
    CU(cuCheckpointProcessRestore(self, NULL));
    CU(cuCheckpointProcessUnlock(self, NULL));
    CU(simcudaDeviceMemUsed(1, &used1, &total));
    CHECK(used1 == CTX_BYTES + 4 * MiB + GRAN, "restored: %zu", used1);
    uint32_t v;
    CU(cuMemcpyDtoH_v2(&v, p + 4 * MiB - 4, 4));
    CHECK(v == 0x0d1ce, "device 1 memory after self-checkpoint: %#x", v);
    CU(cuMemRelease(h));
    CU(cuMemFree_v2(p));
    printf("READY\n");
    while (next_command())
        printf("OK\n");
    return 0;
}

static int child_main(int argc, char **argv)
{
    role = argv[1];
    alarm(60); /* a child must never outlive a broken test */
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (strcmp(role, "holder") == 0 && argc >= 3)
        return role_holder(strtoull(argv[2], NULL, 0));
    if (strcmp(role, "importer") == 0 && argc >= 4)
        return role_importer(atoi(argv[2]), (uint32_t)strtoul(argv[3], NULL, 0));
    if (strcmp(role, "target") == 0)
        return role_target();
    if (strcmp(role, "exporter") == 0 && argc >= 3)
        return role_exporter(atoi(argv[2]));
    if (strcmp(role, "multidev") == 0)
        return role_multidev();
    if (strcmp(role, "interposed") == 0) {
        /* run.sh preloads an interposer defining cuMemAlloc_v2: a direct call reaches it, but
         * cuGetProcAddress must still hand out simcuda's own function (cf. SIMAPI). */
        CUdeviceptr p;
        CHECK(cuMemAlloc_v2(&p, 1) == 4242, "the interposer is not active");
        void *pfn;
        CU(cuGetProcAddress("cuMemAlloc", &pfn, 12000, 0));
        Dl_info info;
        CHECK(dladdr(pfn, &info) && strstr(info.dli_fname, "libcuda.so.1"), "resolved into %s", info.dli_fname);
        CHECK(((CUresult(*)(CUdeviceptr *, size_t))pfn)(&p, 1) == CUDA_ERROR_NOT_INITIALIZED, "not simcuda's");
        printf("interposed: cuGetProcAddress bypasses an LD_PRELOAD interposer: ok\n");
        return 0;
    }
    fprintf(stderr, "unknown role %s\n", role);
    return 2;
}

/* ================= tests (parent) ================= */

static void test_before_init(void)
{
    int v = 0;
    CU(cuDriverGetVersion(&v));
    CHECK(v == 13000, "driver version %d", v);
    CHECK(simcudaIsSimulated() == 1, "simcudaIsSimulated");
    CUdeviceptr p;
    EXPECT_RC(cuMemAlloc_v2(&p, 1), CUDA_ERROR_NOT_INITIALIZED);
    CUcontext ctx;
    EXPECT_RC(cuCtxGetCurrent(&ctx), CUDA_ERROR_NOT_INITIALIZED);
    size_t used = 1, total = 0;
    CU(simcudaDeviceMemUsed(0, &used, &total)); /* like nvidia-smi: no cuInit needed */
    CHECK(used == 0 && total == TOTAL_MEM, "used %zu total %zu", used, total);
    EXPECT_RC(simcudaDeviceMemUsed(1, &used, &total), CUDA_ERROR_INVALID_DEVICE);
    EXPECT_RC(cuInit(1), CUDA_ERROR_INVALID_VALUE);
}

static void test_errors(void)
{
    static const CUresult codes[] = {0, 1, 2, 3, 100, 101, 200, 201, 304, 400, 401, 500, 600, 700, 712, 713, 800, 801, 909, 999};
    for (size_t i = 0; i < sizeof(codes) / sizeof(codes[0]); i++) {
        const char *name = NULL, *text = NULL;
        CU(cuGetErrorName(codes[i], &name));
        CU(cuGetErrorString(codes[i], &text));
        CHECK(name && strncmp(name, "CUDA_", 5) == 0 && text && *text, "code %d", codes[i]);
    }
    const char *s = "x";
    EXPECT_RC(cuGetErrorString(12345, &s), CUDA_ERROR_INVALID_VALUE);
    CHECK(s == NULL, "unknown code string");
    CU(cuGetErrorName(CUDA_ERROR_TIMEOUT, &s));
    CHECK(strcmp(s, "CUDA_ERROR_TIMEOUT") == 0, "%s", s);
}

static void test_device_and_contexts(void)
{
    CU(cuInit(0));
    int n = 0;
    CU(cuDeviceGetCount(&n));
    CHECK(n == 1, "device count %d", n);
    CUdevice dev;
    CU(cuDeviceGet(&dev, 0));
    EXPECT_RC(cuDeviceGet(&dev, 1), CUDA_ERROR_INVALID_DEVICE);
    char name[128], bus[32];
    CU(cuDeviceGetName(name, sizeof(name), 0));
    CHECK(strcmp(name, "simcuda simulated GPU (test double)") == 0, "%s", name);
    CU(cuDeviceGetPCIBusId(bus, sizeof(bus), 0));
    CHECK(strcmp(bus, "0000:10:00.0") == 0, "%s", bus);
    CUuuid u1, u2;
    CU(cuDeviceGetUuid(&u1, 0));
    CU(cuDeviceGetUuid_v2(&u2, 0));
    CHECK(memcmp(&u1, &u2, sizeof(u1)) == 0, "uuid not deterministic");
    int major, minor, ua, pitch, vmm, fd, unknown;
    CU(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0));
    CU(cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0));
    CU(cuDeviceGetAttribute(&ua, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 0));
    CU(cuDeviceGetAttribute(&pitch, CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT, 0));
    CU(cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0));
    CU(cuDeviceGetAttribute(&fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, 0));
    CU(cuDeviceGetAttribute(&unknown, 9999, 0));
    CHECK(major == 9 && minor == 0 && ua == 1 && pitch == 512 && vmm == 1 && fd == 1 && unknown == 0, "attributes");
    size_t total;
    CU(cuDeviceTotalMem_v2(&total, 0));
    CHECK(total == TOTAL_MEM, "total %zu", total);

    /* no current context: memory calls refuse */
    CUdeviceptr p;
    EXPECT_RC(cuMemAlloc_v2(&p, 1), CUDA_ERROR_INVALID_CONTEXT);
    size_t before = device_used();
    CUcontext primary, cur, c2, popped;
    unsigned flags;
    int active;
    CU(cuDevicePrimaryCtxGetState(0, &flags, &active));
    CHECK(!active, "primary active before retain");
    CU(cuDevicePrimaryCtxRetain(&primary, 0));
    CHECK(device_used() == before + CTX_BYTES, "a context costs SIMCUDA_CTX_BYTES");
    CU(cuCtxSetCurrent(primary));
    CU(cuCtxGetCurrent(&cur));
    CHECK(cur == primary, "current");
    CU(cuDevicePrimaryCtxGetState(0, &flags, &active));
    CHECK(active, "primary inactive after retain");

    /* a created context: pushed, charged, owns its allocations, freed with them */
    CU(cuCtxCreate_v2(&c2, 0, 0));
    CU(cuCtxGetCurrent(&cur));
    CHECK(cur == c2, "created context is current");
    CU(cuMemAlloc_v2(&p, 3 * MiB));
    CHECK(device_used() == before + 2 * CTX_BYTES + 4 * MiB, "used %zu", device_used());
    CU(cuCtxPopCurrent_v2(&popped));
    CHECK(popped == c2, "pop");
    CU(cuCtxGetCurrent(&cur));
    CHECK(cur == primary, "primary current again");
    CU(cuCtxPushCurrent_v2(c2));
    CU(cuCtxDestroy_v2(c2));
    CHECK(device_used() == before + CTX_BYTES, "destroy frees the context and its memory");
    CU(cuCtxGetCurrent(&cur));
    CHECK(cur == primary, "destroying the current context pops it");
    EXPECT_RC(cuCtxDestroy_v2(c2), CUDA_ERROR_INVALID_CONTEXT);
    CUdevice d = -1;
    CU(cuCtxGetDevice(&d));
    CHECK(d == 0, "ctx device");
    CU(cuCtxSynchronize());
}

static void test_memory_basics(void)
{
    const size_t n = 5 * MiB + 12; /* not a whole number of granules */
    size_t before = device_used();
    CUdeviceptr a, b;
    CU(cuMemAlloc_v2(&a, n));
    CU(cuMemAlloc_v2(&b, n));
    CHECK(a % GRAN == 0 && b % GRAN == 0, "granule-aligned device pointers");
    CHECK(device_used() == before + 2 * 6 * MiB, "allocations are charged in whole granules");
    EXPECT_RC(cuMemAlloc_v2(&a, 0), CUDA_ERROR_INVALID_VALUE);

    uint8_t *h = malloc(n), *back = malloc(n);
    for (size_t i = 0; i < n; i++)
        h[i] = (uint8_t)(i * 7 + 3);
    CU(cuMemcpyHtoD_v2(a, h, n));
    CU(cuMemcpyDtoD_v2(b, a, n));
    memset(back, 0, n);
    CU(cuMemcpyDtoH_v2(back, b, n));
    CHECK(memcmp(h, back, n) == 0, "HtoD/DtoD/DtoH round trip");
    /* the unified cuMemcpy and the async and per-thread forms */
    CUstream s;
    CU(cuStreamCreate(&s, 0));
    CU(cuMemsetD8Async(b, 0, n, s));
    CU(cuMemcpyAsync(b, a, n, s));
    CU(cuStreamSynchronize(s));
    CU(cuStreamQuery(s));
    memset(back, 0, n);
    CU(cuMemcpy((CUdeviceptr)(uintptr_t)back, b, n));
    CHECK(memcmp(h, back, n) == 0, "cuMemcpyAsync + cuMemcpy");
    CU(cuMemcpyHtoDAsync_v2_ptsz(a + 1, "xyz", 3, CU_STREAM_PER_THREAD));
    CU(cuMemcpyDtoDAsync_v2(b, a, 4, CU_STREAM_LEGACY));
    char four[4];
    CU(cuMemcpyDtoHAsync_v2(four, b, 4, s));
    CHECK(memcmp(four + 1, "xyz", 3) == 0 && (uint8_t)four[0] == h[0], "async copies");
    CU(cuMemcpyDtoH_v2_ptds(four, a + 1, 3));
    CHECK(memcmp(four, "xyz", 3) == 0, "ptds copy");

    /* memsets */
    CU(cuMemsetD32_v2(a, 0xdeadbeef, 4));
    CU(cuMemsetD16_v2(a + 16, 0xabcd, 2));
    CU(cuMemsetD8_v2(a + 20, 0x11, 4));
    CU(cuMemsetD32Async_ptsz(a + 24, 0x01020304, 2, NULL));
    uint32_t w[8];
    CU(cuMemcpyDtoH_v2(w, a, sizeof(w)));
    CHECK(w[0] == 0xdeadbeef && w[3] == 0xdeadbeef && w[4] == 0xabcdabcd && w[5] == 0x11111111 &&
              w[6] == 0x01020304 && w[7] == 0x01020304,
          "memset results");
    EXPECT_RC(cuMemsetD32_v2(a + 2, 0, 1), CUDA_ERROR_INVALID_VALUE); /* misaligned */

    /* validation: whole range must be live device memory */
    EXPECT_RC(cuMemcpyHtoD_v2(b + 6 * MiB - 2, h, 4), CUDA_ERROR_INVALID_VALUE); /* runs off the end */
    EXPECT_RC(cuMemsetD8_v2(0x1000, 0, 1), CUDA_ERROR_INVALID_VALUE);
    CUdeviceptr base;
    size_t size;
    CU(cuMemGetAddressRange_v2(&base, &size, a + 12345));
    CHECK(base == a && size == n, "address range");
    EXPECT_RC(cuMemGetAddressRange_v2(&base, &size, a + n + 1), CUDA_ERROR_NOT_FOUND);

    /* pointer attributes */
    unsigned type = 0, managed = 1;
    CUcontext ctx, cur;
    CUdeviceptr start;
    CU(cuCtxGetCurrent(&cur));
    CU(cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, a + 5));
    CU(cuPointerGetAttribute(&ctx, CU_POINTER_ATTRIBUTE_CONTEXT, a + 5));
    CU(cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, a + 5));
    CU(cuPointerGetAttribute(&size, CU_POINTER_ATTRIBUTE_RANGE_SIZE, a + 5));
    CU(cuPointerGetAttribute(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, a + 5));
    CHECK(type == CU_MEMORYTYPE_DEVICE && ctx == cur && start == a && size == n && managed == 0, "attributes");
    EXPECT_RC(cuPointerGetAttribute(&type, 7 /* BUFFER_ID */, a), CUDA_ERROR_NOT_SUPPORTED);
    EXPECT_RC(cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)h),
              CUDA_ERROR_INVALID_VALUE);

    /* legacy IPC: handles can be made, not opened */
    CUipcMemHandle ipc;
    CU(cuIpcGetMemHandle(&ipc, a));
    CUdeviceptr opened;
    EXPECT_RC(cuIpcOpenMemHandle_v2(&opened, ipc, 1), CUDA_ERROR_NOT_SUPPORTED);
    EXPECT_RC(cuIpcGetMemHandle(&ipc, a + 4), CUDA_ERROR_INVALID_VALUE);

    /* free; a freed pointer is no longer device memory */
    CU(cuMemFree_v2(a));
    CU(cuMemFree_v2(b));
    EXPECT_RC(cuMemFree_v2(a), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuMemcpyHtoD_v2(a, h, 4), CUDA_ERROR_INVALID_VALUE);
    CHECK(device_used() == before, "freed memory is uncharged");

    /* pitch, managed, pool */
    size_t p;
    CU(cuMemAllocPitch_v2(&a, &p, 1000, 3, 4));
    CHECK(p == 1024, "pitch %zu", p);
    CU(cuMemFree_v2(a));
    CU(cuMemAllocManaged(&a, 100, 1));
    CU(cuPointerGetAttribute(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, a));
    CHECK(managed == 1, "managed");
    CU(cuMemFree_v2(a));
    CU(cuMemAllocAsync(&a, 100, s));
    CU(cuMemsetD8Async(a, 1, 100, s));
    CU(cuMemFreeAsync_ptsz(a, NULL));
    CU(cuStreamDestroy_v2(s));
    EXPECT_RC(cuStreamSynchronize(s), CUDA_ERROR_INVALID_HANDLE);

    /* host memory: pinned host memory counts as device-accessible */
    void *hp;
    CU(cuMemAllocHost_v2(&hp, 4096));
    CU(cuMemsetD32_v2((CUdeviceptr)(uintptr_t)hp, 7, 4));
    CHECK(((uint32_t *)hp)[3] == 7, "memset into pinned host memory");
    CU(cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)hp));
    CHECK(type == CU_MEMORYTYPE_HOST, "host type");
    CU(cuMemFreeHost(hp));
    CU(cuMemHostAlloc(&hp, 100, 0x2));
    CU(cuMemFreeHost(hp));
    CU(cuMemHostRegister_v2(h, n, 0));
    EXPECT_RC(cuMemHostRegister_v2(h + 8, 8, 0), CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    CUdeviceptr hd;
    CU(cuMemHostGetDevicePointer_v2(&hd, h, 0));
    CHECK(hd == (CUdeviceptr)(uintptr_t)h, "host device pointer");
    /* the driver unregisters on a thread with no current context (the gpucr server's unpins do) */
    CU(cuCtxGetCurrent(&cur));
    CU(cuCtxSetCurrent(NULL));
    CU(cuMemHostUnregister(h));
    CU(cuCtxSetCurrent(cur));
    EXPECT_RC(cuMemHostUnregister(h), CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
    CU(cuMemHostRegister_v2(h, n, 0));   /* the same range registers again once unregistered */
    CU(cuMemHostUnregister(h));
    free(h);
    free(back);
}

static void test_vmm(void)
{
    size_t g = 0;
    CU(cuMemGetAllocationGranularity(&g, &vmm_prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CHECK(g == GRAN, "granularity %zu", g);
    CU(cuMemGetAllocationGranularity(&g, &vmm_prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    CHECK(g == GRAN, "granularity %zu", g);

    CU(cuCtxSynchronize());   /* what earlier tests freed in stream order is given back first */
    size_t before = device_used();
    CUdeviceptr va;
    CU(cuMemAddressReserve(&va, 3 * GRAN, 0, 0, 0));
    CHECK(device_used() == before, "a reservation costs no device memory");
    CUmemGenericAllocationHandle h1, h2;
    EXPECT_RC(cuMemCreate(&h1, GRAN + 1, &vmm_prop, 0), CUDA_ERROR_INVALID_VALUE);
    CU(cuMemCreate(&h1, 2 * GRAN, &vmm_prop, 0));
    CU(cuMemCreate(&h2, GRAN, &vmm_prop, 0));
    CHECK(h1 && h2 && h1 != h2, "handles");
    CHECK(device_used() == before + 3 * GRAN, "physical memory is charged at create");

    CU(cuMemMap(va, 2 * GRAN, 0, h1, 0));
    EXPECT_RC(cuMemMap(va + GRAN, GRAN, 0, h2, 0), CUDA_ERROR_INVALID_VALUE); /* already mapped */
    CU(cuMemMap(va + 2 * GRAN, GRAN, 0, h2, 0));
    uint32_t v = 42, r = 0;
    EXPECT_RC(cuMemcpyHtoD_v2(va, &v, 4), CUDA_ERROR_INVALID_VALUE); /* mapped but no access yet */
    CU(set_access(va, 3 * GRAN, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)); /* one call across two mappings */
    CU(cuMemcpyHtoD_v2(va + 2 * GRAN - 2, &v, 4));                    /* a copy across the boundary */
    CU(cuMemcpyDtoH_v2(&r, va + 2 * GRAN - 2, 4));
    CHECK(r == 42, "copy across mappings");
    unsigned long long acc = 0;
    CUmemLocation loc = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0};
    CU(cuMemGetAccess(&acc, &loc, va));
    CHECK(acc == CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "access flags");
    CU(set_access(va + 2 * GRAN, GRAN, CU_MEM_ACCESS_FLAGS_PROT_READ));
    EXPECT_RC(cuMemsetD8_v2(va + 2 * GRAN, 0, 1), CUDA_ERROR_INVALID_VALUE);
    CU(cuMemcpyDtoH_v2(&r, va + 2 * GRAN, 2));

    CUmemGenericAllocationHandle hr;
    CU(cuMemRetainAllocationHandle(&hr, (void *)(uintptr_t)(va + GRAN + 5)));
    CHECK(hr == h1, "retained handle");
    CU(cuMemRelease(hr));
    CUmemAllocationProp prop;
    CU(cuMemGetAllocationPropertiesFromHandle(&prop, h1));
    CHECK(prop.type == CU_MEM_ALLOCATION_TYPE_PINNED && prop.location.id == 0, "prop");
    int fd;
    EXPECT_RC(cuMemExportToShareableHandle(&fd, h1, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
              CUDA_ERROR_INVALID_VALUE); /* not created with the fd handle type */
    CUdeviceptr alloc;
    CU(cuMemAlloc_v2(&alloc, 16));
    EXPECT_RC(cuMemRetainAllocationHandle(&hr, (void *)(uintptr_t)alloc), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuMemUnmap(alloc, GRAN), CUDA_ERROR_INVALID_VALUE); /* cuMemAlloc memory is not the app's VMM */
    CU(cuMemFree_v2(alloc));

    /* release while mapped keeps the memory; the last unmap frees it */
    CU(cuMemRelease(h1));
    CU(cuMemcpyDtoH_v2(&r, va + 2 * GRAN - 2, 4));
    CHECK(r == 42, "memory survives release while mapped");
    EXPECT_RC(cuMemUnmap(va + GRAN, GRAN), CUDA_ERROR_INVALID_VALUE); /* only whole mappings */
    EXPECT_RC(cuMemAddressFree(va, 3 * GRAN), CUDA_ERROR_INVALID_VALUE); /* still mapped */
    CU(cuMemUnmap(va, 2 * GRAN));
    CHECK(device_used() == before + GRAN, "unmap after release frees physical memory");
    EXPECT_RC(cuMemcpyDtoH_v2(&r, va, 4), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuMemMap(va, 2 * GRAN, 0, h1, 0), CUDA_ERROR_INVALID_VALUE); /* released handle */

    /* same-address remap with new physical memory */
    CUmemGenericAllocationHandle h3;
    CU(cuMemCreate(&h3, 2 * GRAN, &vmm_prop, 0));
    CHECK(h3 != h1 && h3 != h2, "handles are never reused");
    CU(cuMemMap(va, 2 * GRAN, 0, h3, 0));
    CU(set_access(va, 2 * GRAN, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
    CU(cuMemcpyDtoH_v2(&r, va + 2 * GRAN - 2, 2));
    CHECK(r == 0, "fresh memory is zeroed");
    CU(cuMemcpyHtoD_v2(va, &v, 4));

    /* export as a POSIX fd and import in the same process: the same pages at a second VA */
    CUmemGenericAllocationHandle hx, hi;
    CU(cuMemCreate(&hx, GRAN, &vmm_prop_fd, 0));
    CU(cuMemExportToShareableHandle(&fd, hx, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    CU(cuMemImportFromShareableHandle(&hi, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    close(fd);
    EXPECT_RC(cuMemImportFromShareableHandle(&hi, (void *)(intptr_t)0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
              CUDA_ERROR_INVALID_VALUE); /* stdin is no simcuda memfd */
    CUdeviceptr v1, v2;
    CU(cuMemAddressReserve(&v1, GRAN, 0, 0, 0));
    CU(cuMemAddressReserve(&v2, GRAN, 0, 0, 0));
    CU(cuMemMap(v1, GRAN, 0, hx, 0));
    CU(cuMemMap(v2, GRAN, 0, hi, 0));
    CU(set_access(v1, GRAN, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
    CU(set_access(v2, GRAN, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
    CU(cuMemsetD32_v2(v1, 0x600dcafe, 1));
    CU(cuMemcpyDtoH_v2(&r, v2, 4));
    CHECK(r == 0x600dcafe, "imported memory shares the exporter's pages");
    CU(cuMemUnmap(v1, GRAN));
    CU(cuMemUnmap(v2, GRAN));
    CU(cuMemRelease(hx));
    CU(cuMemRelease(hi));
    CU(cuMemAddressFree(v1, GRAN));
    CU(cuMemAddressFree(v2, GRAN));

    /* memory an asynchronous copy may still use is not unmapped (CUDA leaves it undefined): once the
     * host has seen the copy done, it is */
    CUstream s;
    CU(cuStreamCreate(&s, 0));
    CU(cuMemcpyHtoDAsync_v2(va, &v, 4, s));                  /* into the first mapping */
    CU(cuMemcpyDtoHAsync_v2(&r, va + 2 * GRAN, 4, s));       /* out of the second (read-only now) */
    EXPECT_RC(cuMemUnmap(va, 2 * GRAN), CUDA_ERROR_ILLEGAL_STATE);
    EXPECT_RC(cuMemUnmap(va + 2 * GRAN, GRAN), CUDA_ERROR_ILLEGAL_STATE);
    CU(cuStreamSynchronize(s));
    CU(cuStreamDestroy_v2(s));
    /* a synchronous copy on the legacy stream is done when it returns, and so is the work before it there */
    CU(cuMemcpyHtoDAsync_v2(va, &v, 4, NULL));
    EXPECT_RC(cuMemUnmap(va, 2 * GRAN), CUDA_ERROR_ILLEGAL_STATE);
    CU(cuMemcpyDtoH_v2(&r, va + 2 * GRAN, 4));

    CU(cuMemUnmap(va, 2 * GRAN));
    CU(cuMemUnmap(va + 2 * GRAN, GRAN));
    CU(cuMemRelease(h2));
    CU(cuMemRelease(h3));
    CU(cuMemAddressFree(va, 3 * GRAN));
    CHECK(device_used() == before, "all VMM memory freed: %zu against %zu", device_used(), before);

    /* a requested address is honoured when free */
    CUdeviceptr again;
    CU(cuMemAddressReserve(&again, 3 * GRAN, 0, va, 0));
    CHECK(again == va, "reserve at a requested address");
    CUdeviceptr other;
    CU(cuMemAddressReserve(&other, GRAN, 0, va, 0));
    CHECK(other != va, "a taken address is only a hint");
    CU(cuMemAddressFree(other, GRAN));
    CU(cuMemAddressFree(again, 3 * GRAN));
}

static void test_procaddr(void)
{
    struct {
        const char *name;
        int version;
        unsigned flags;
        void *want;
    } ok[] = {
        {"cuMemAlloc", 13000, 0, (void *)cuMemAlloc_v2},
        {"cuMemAlloc", 3020, 0, (void *)cuMemAlloc_v2},
        {"cuMemcpyHtoDAsync", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, (void *)cuMemcpyHtoDAsync_v2_ptsz},
        {"cuMemcpyHtoDAsync", 12000, CU_GET_PROC_ADDRESS_LEGACY_STREAM, (void *)cuMemcpyHtoDAsync_v2},
        {"cuMemcpyHtoDAsync", 12000, 0, (void *)cuMemcpyHtoDAsync_v2},
        {"cuMemcpyHtoD", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, (void *)cuMemcpyHtoD_v2_ptds},
        {"cuMemcpyHtoD", 6050, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, (void *)cuMemcpyHtoD_v2}, /* ptds is 7.0+ */
        {"cuMemcpy", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, (void *)cuMemcpy_ptds},
        {"cuMemsetD32", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, (void *)cuMemsetD32_v2_ptds},
        {"cuMemsetD32Async", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, (void *)cuMemsetD32Async_ptsz},
        {"cuLaunchKernel", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, (void *)cuLaunchKernel_ptsz},
        {"cuLaunchKernel", 12000, 0, (void *)cuLaunchKernel},
        {"cuMemAllocAsync", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, (void *)cuMemAllocAsync_ptsz},
        {"cuMemFree", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, (void *)cuMemFree_v2}, /* no ptsz form */
        {"cuCtxCreate", 12000, 0, (void *)cuCtxCreate_v3},
        {"cuCtxCreate", 13000, 0, (void *)cuCtxCreate_v4},
        {"cuCtxSynchronize", 12080, 0, (void *)cuCtxSynchronize},
        {"cuCtxSynchronize", 13000, 0, (void *)cuCtxSynchronize_v2},
        {"cuCtxDestroy", 12000, 0, (void *)cuCtxDestroy_v2},
        {"cuGetProcAddress", 12000, 0, (void *)cuGetProcAddress_v2},
        {"cuGetProcAddress", 11030, 0, (void *)cuGetProcAddress},
        {"cuCheckpointProcessLock", 12080, 0, (void *)cuCheckpointProcessLock},
    };
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        void *pfn = NULL;
        CUdriverProcAddressQueryResult st = -1;
        CU(cuGetProcAddress_v2(ok[i].name, &pfn, ok[i].version, ok[i].flags, &st));
        CHECK(pfn == ok[i].want && st == CU_GET_PROC_ADDRESS_SUCCESS, "%s v%d flags %u resolved wrong", ok[i].name,
              ok[i].version, ok[i].flags);
    }
    struct {
        const char *name;
        int version;
        CUdriverProcAddressQueryResult status;
    } bad[] = {
        {"cuNoSuchFunction", 12000, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND},
        {"cuMemAlloc_v2", 12000, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND},  /* base names only */
        {"cuMemAlloc", 3000, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND},     /* the 32-bit v1 ABI: not simulated */
        {"cuMemAlloc", 1000, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT},
        {"cuMemAllocAsync", 11000, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        void *pfn = (void *)1;
        CUdriverProcAddressQueryResult st = -1;
        EXPECT_RC(cuGetProcAddress_v2(bad[i].name, &pfn, bad[i].version, 0, &st), CUDA_ERROR_NOT_FOUND);
        CHECK(pfn == NULL && st == bad[i].status, "%s v%d: status %d", bad[i].name, bad[i].version, st);
    }
    void *pfn;
    EXPECT_RC(cuGetProcAddress_v2("cuMemAlloc", &pfn, 13010, 0, NULL), CUDA_ERROR_INVALID_VALUE); /* newer than us */
    EXPECT_RC(cuGetProcAddress_v2("cuMemAlloc", &pfn, 12000, 4, NULL), CUDA_ERROR_INVALID_VALUE);
    CU(cuGetProcAddress("cuMemsetD8", &pfn, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM));
    CHECK(pfn == (void *)cuMemsetD8_v2_ptds, "v1 resolver");

    /* a resolved function works */
    CUdeviceptr p;
    CU(cuMemAlloc_v2(&p, 64));
    CU(((CUresult(*)(CUdeviceptr, unsigned, size_t))pfn)(p, 0x33, 64));
    unsigned char c;
    CU(cuMemcpyDtoH_v2(&c, p + 63, 1));
    CHECK(c == 0x33, "call through a resolved pointer");
    CU(cuMemFree_v2(p));
}

static atomic_int host_fn_calls;
static CUdeviceptr host_fn_target;

static void host_fn(void *arg)
{
    /* the API may be called from a host function (nested gate entry) */
    if (cuMemsetD32_v2(host_fn_target, *(unsigned *)arg, 1) == CUDA_SUCCESS)
        atomic_fetch_add(&host_fn_calls, 1);
}

static void *spin_thread(void *arg)
{
    CUcontext ctx = arg;
    CU(cuCtxSetCurrent(ctx));
    unsigned ms = 400;
    void *params[] = {&ms};
    CU(launch(builtin("spin_ms"), params, NULL));
    return NULL;
}

static void test_kernels(void)
{
    CUmodule mod;
    EXPECT_RC(cuModuleLoadData(&mod, "\x7f" "ELF not a simcuda image"), CUDA_ERROR_INVALID_IMAGE);
    CU(cuModuleLoadData(&mod, "simcuda-builtin v1"));
    CUfunction fill, add, sum, spin;
    EXPECT_RC(cuModuleGetFunction(&fill, mod, "no_such_kernel"), CUDA_ERROR_NOT_FOUND);
    CU(cuModuleGetFunction(&fill, mod, "fill_u32"));
    CU(cuModuleGetFunction(&add, mod, "add_u32"));
    CU(cuModuleGetFunction(&sum, mod, "checksum_u32"));
    CU(cuModuleGetFunction(&spin, mod, "spin_ms"));

    const unsigned long long n = 1000;
    CUdeviceptr p, out;
    CU(cuMemAlloc_v2(&out, 8));
    CU(cuMemAlloc_v2(&p, n * 4)); /* allocated last: nothing mapped behind it */
    unsigned v = 5, inc = 3;
    void *fill_params[] = {&p, &v, (void *)&n};
    void *add_params[] = {&p, &inc, (void *)&n};
    void *sum_params[] = {&p, (void *)&n, &out};
    CU(cuLaunchKernel(fill, 4, 1, 1, 256, 1, 1, 0, NULL, fill_params, NULL));
    CU(cuLaunchKernel_ptsz(add, 4, 1, 1, 256, 1, 1, 0, NULL, add_params, NULL));
    CU(launch(sum, sum_params, NULL));
    uint64_t total = 0;
    CU(cuMemcpyDtoH_v2(&total, out, 8));
    CHECK(total == n * 8, "checksum %llu", (unsigned long long)total);

    unsigned long long too_many = GRAN / 4 + 1; /* past the allocation's last granule */
    void *oob[] = {&p, &v, &too_many};
    EXPECT_RC(launch(fill, oob, NULL), CUDA_ERROR_ILLEGAL_ADDRESS);
    CUdeviceptr bogus = 0x10;
    void *bad_out[] = {&p, (void *)&n, &bogus};
    EXPECT_RC(launch(sum, bad_out, NULL), CUDA_ERROR_ILLEGAL_ADDRESS);
    EXPECT_RC(cuLaunchKernel(fill, 0, 1, 1, 1, 1, 1, 0, NULL, fill_params, NULL), CUDA_ERROR_INVALID_VALUE);

    /* events time a spin_ms kernel; host functions run in order */
    CUevent e0, e1;
    CU(cuEventCreate(&e0, 0));
    CU(cuEventCreate(&e1, 0));
    unsigned ms = 50;
    void *spin_params[] = {&ms};
    CU(cuEventRecord(e0, NULL));
    CU(launch(spin, spin_params, NULL));
    CU(cuEventRecord_ptsz(e1, NULL));
    CU(cuEventSynchronize(e1));
    float elapsed = 0;
    CU(cuEventElapsedTime(&elapsed, e0, e1));
    CHECK(elapsed >= 45 && elapsed < 1000, "spin_ms(50) took %.1f ms", elapsed);
    CU(cuEventDestroy_v2(e0));
    CU(cuEventDestroy_v2(e1));
    host_fn_target = p;
    unsigned marker = 77;
    CU(cuLaunchHostFunc(NULL, host_fn, &marker));
    CHECK(atomic_load(&host_fn_calls) == 1, "host function ran (and could call the API)");
    CU(cuMemcpyDtoH_v2(&v, p, 4));
    CHECK(v == 77, "host function's memset");

    /* a long kernel does not serialise other calls */
    CUcontext ctx;
    CU(cuCtxGetCurrent(&ctx));
    pthread_t th;
    CHECK(pthread_create(&th, NULL, spin_thread, ctx) == 0, "thread");
    sleep_ms(50);
    double t0 = now_ms();
    for (int i = 0; i < 200; i++)
        CU(cuMemcpyDtoH_v2(&v, p, 4));
    double t = now_ms() - t0;
    pthread_join(th, NULL);
    CHECK(t < 200, "200 copies took %.0f ms while a kernel ran", t);

    CU(cuModuleUnload(mod));
    EXPECT_RC(launch(fill, fill_params, NULL), CUDA_ERROR_INVALID_HANDLE);
    CU(cuMemFree_v2(p));
    CU(cuMemFree_v2(out));
}

static char dir[256];

static void test_accounting(void)
{
    size_t free0 = free_mem(), dev0 = device_used();
    const size_t hold = 256 * MiB;
    char arg[32], buf[64];
    snprintf(arg, sizeof(arg), "%zu", hold);
    struct child c = spawn("holder", arg, NULL, NULL);
    child_recv(&c, buf, sizeof(buf));
    CHECK(strcmp(buf, "READY") == 0, "%s", buf);
    CHECK(proc_used(c.pid) == hold + CTX_BYTES, "holder uses %zu", proc_used(c.pid));
    CHECK(device_used() == dev0 + hold + CTX_BYTES, "device used");
    size_t free1 = free_mem();
    CHECK(free1 == free0 - hold - CTX_BYTES, "free %zu -> %zu", free0, free1);

    /* allocation beyond what is free across processes fails; up to it succeeds */
    CUdeviceptr p;
    EXPECT_RC(cuMemAlloc_v2(&p, free1 + 1), CUDA_ERROR_OUT_OF_MEMORY);
    CUmemGenericAllocationHandle h;
    EXPECT_RC(cuMemCreate(&h, free1 + GRAN, &vmm_prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
    CU(cuMemAlloc_v2(&p, free1));
    CHECK(free_mem() == 0, "device full");
    CU(cuMemFree_v2(p));

    child_ok(&c, "FREE");
    CHECK(proc_used(c.pid) == CTX_BYTES, "after FREE the holder keeps its context");
    child_finish(&c);
    CHECK(free_mem() == free0, "the holder's exit gives everything back");

    /* a killed process leaves a stale file that readers ignore and remove */
    c = spawn("holder", arg, NULL, NULL);
    child_recv(&c, buf, sizeof(buf));
    char path[512];
    snprintf(path, sizeof(path), "%s/%d.mem", dir, c.pid);
    CHECK(access(path, F_OK) == 0, "%s published", path);
    child_kill(&c);
    CHECK(access(path, F_OK) == 0, "a killed process cannot remove its file");
    CHECK(device_used() == dev0, "a dead process's usage is ignored");
    CHECK(access(path, F_OK) != 0, "the stale file was removed by the reader");
    EXPECT_RC(cuCheckpointProcessGetState(c.pid, &(CUprocessState){0}), CUDA_ERROR_INVALID_VALUE);
}

static void test_shared_across_processes(void)
{
    CUmemGenericAllocationHandle h;
    CUdeviceptr va;
    CU(cuMemCreate(&h, GRAN, &vmm_prop_fd, 0));
    CU(cuMemAddressReserve(&va, GRAN, 0, 0, 0));
    CU(cuMemMap(va, GRAN, 0, h, 0));
    CU(set_access(va, GRAN, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
    CU(cuMemsetD32_v2(va, 0xfeedf00d, 1));
    int fd;
    CU(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    CHECK(fcntl(fd, F_SETFD, 0) == 0, "let the importer inherit the fd");
    char fdarg[16], buf[64];
    snprintf(fdarg, sizeof(fdarg), "%d", fd);
    struct child c = spawn("importer", fdarg, "0xfeedf00d", NULL);
    close(fd);
    child_recv(&c, buf, sizeof(buf));
    CHECK(strcmp(buf, "READY") == 0, "%s", buf);
    uint32_t r;
    CU(cuMemcpyDtoH_v2(&r, va, 4));
    CHECK(r == 0x12345678, "the importer's write is visible to the exporter (%#x)", r);
    CHECK(proc_used(c.pid) == CTX_BYTES, "imported memory is charged to the exporter only");
    child_finish(&c);
    CU(cuMemUnmap(va, GRAN));
    CU(cuMemRelease(h));
    CU(cuMemAddressFree(va, GRAN));
}

/* Maps handle h (bytes long) and reads its last word. */
static uint32_t read_last(CUmemGenericAllocationHandle h, size_t bytes)
{
    uint32_t r;
    CUdeviceptr va = map_handle(h, bytes, CU_MEM_ACCESS_FLAGS_PROT_READ);
    CU(cuMemcpyDtoH_v2(&r, va + bytes - 4, 4));
    CU(cuMemUnmap(va, bytes));
    CU(cuMemAddressFree(va, bytes));
    return r;
}

/* An exported fd keeps memory alive as the driver does: after the exporter's release, through any
 * dup, in any process (one with no CUDA too); it is freed when the last handle and the last fd are
 * gone, and accounting says so at once. An imported handle cannot be exported again. */
static void test_exported_lifetime(void)
{
    size_t dev0 = device_used(), free0 = free_mem(), mine0 = proc_used(getpid());
    CUmemGenericAllocationHandle h, hi;
    int fd, fd2;
    CU(cuMemCreate(&h, GRAN, &vmm_prop_fd, 0));
    CUdeviceptr va = map_handle(h, GRAN, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    CU(cuMemsetD32_v2(va, 0xa11ce, GRAN / 4));
    CU(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    CHECK(proc_used(getpid()) == mine0 + GRAN, "the maker is charged while it holds the handle");
    CU(cuMemUnmap(va, GRAN));
    CU(cuMemRelease(h));
    CU(cuMemAddressFree(va, GRAN));
    CHECK(proc_used(getpid()) == mine0, "released: no longer this process's (%zu)", proc_used(getpid()));
    CHECK(device_used() == dev0 + GRAN, "an open fd keeps the memory on the device (%zu)", device_used());
    CHECK(free_mem() == free0 - GRAN, "cuMemGetInfo counts it");

    /* a dup holds it as well as the original; importing after the release still works */
    fd2 = dup(fd);
    close(fd);
    CU(cuMemImportFromShareableHandle(&hi, (void *)(intptr_t)fd2, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    CHECK(read_last(hi, GRAN) == 0xa11ce, "imported after the exporter's release: the bytes are there");
    EXPECT_RC(cuMemExportToShareableHandle(&fd, hi, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
              CUDA_ERROR_INVALID_VALUE); /* an imported handle cannot be exported again */
    close(fd2);
    CHECK(device_used() == dev0 + GRAN, "the imported handle still holds it");
    CU(cuMemRelease(hi));
    CHECK(device_used() == dev0 && free_mem() == free0, "last handle and last fd gone: freed (%zu)", device_used());
    EXPECT_RC(cuMemImportFromShareableHandle(&hi, (void *)(intptr_t)fd2, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
              CUDA_ERROR_INVALID_VALUE);

    /* a process with no CUDA at all holds it; it is freed when that process goes */
    CU(cuMemCreate(&h, GRAN, &vmm_prop_fd, 0));
    CU(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    int go[2];
    CHECK(pipe(go) == 0, "pipe");
    pid_t keeper = fork();
    CHECK(keeper >= 0, "fork");
    if (keeper == 0) { /* holds the inherited fd until the pipe closes */
        char b;
        close(go[1]);
        while (read(go[0], &b, 1) > 0)
            ;
        _exit(0);
    }
    close(go[0]);
    close(fd);
    CU(cuMemRelease(h));
    CHECK(device_used() == dev0 + GRAN, "kept by another process's fd (%zu)", device_used());
    close(go[1]);
    CHECK(waitpid(keeper, NULL, 0) == keeper, "waitpid");
    CHECK(device_used() == dev0 && free_mem() == free0, "the keeper exited: freed (%zu)", device_used());

    /* a process that imports what it exported holds it twice: releasing one handle keeps it */
    CU(cuMemCreate(&h, GRAN, &vmm_prop_fd, 0));
    va = map_handle(h, GRAN, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    CU(cuMemsetD32_v2(va, 0xb0b, GRAN / 4));
    CU(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    CU(cuMemImportFromShareableHandle(&hi, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    close(fd);
    CU(cuMemUnmap(va, GRAN));
    CU(cuMemAddressFree(va, GRAN));
    CU(cuMemRelease(h));
    CHECK(device_used() == dev0 + GRAN, "the imported handle holds it (%zu)", device_used());
    CHECK(read_last(hi, GRAN) == 0xb0b, "and its bytes");
    CU(cuMemRelease(hi));
    CHECK(device_used() == dev0, "both handles gone: freed (%zu)", device_used());

    /* memory never exported goes at its release, as before */
    CU(cuMemCreate(&h, GRAN, &vmm_prop_fd, 0));
    CU(cuMemRelease(h));
    CHECK(device_used() == dev0, "unexported: freed at release");
}

/* The driver's checkpoint of a process whose exported memory only another process's fd keeps: that
 * memory stays on the device through the checkpoint, is neither refused nor copied, and its bytes
 * are there for the fd's holder afterwards. */
static void test_checkpoint_with_kept_memory(void)
{
    size_t dev0 = device_used();
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair");
    char arg[16], buf[64], one;
    snprintf(arg, sizeof(arg), "%d", sv[1]);
    struct child c = spawn("exporter", arg, NULL, NULL);
    close(sv[1]);
    char cbuf[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {&one, 1};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof(cbuf)};
    CHECK(recvmsg(sv[0], &msg, 0) == 1 && CMSG_FIRSTHDR(&msg), "no fd from the exporter");
    int fd;
    memcpy(&fd, CMSG_DATA(CMSG_FIRSTHDR(&msg)), sizeof(int));
    close(sv[0]);
    child_recv(&c, buf, sizeof(buf));
    CHECK(strcmp(buf, "READY") == 0, "%s", buf);
    CHECK(proc_used(c.pid) == CTX_BYTES, "released memory is not the exporter's (%zu)", proc_used(c.pid));
    CHECK(device_used() == dev0 + CTX_BYTES + KEPT_BYTES, "kept by our fd (%zu)", device_used());

    CU(cuCheckpointProcessLock(c.pid, NULL));
    CU(cuCheckpointProcessCheckpoint(c.pid, NULL));
    CHECK(proc_used(c.pid) == 0, "checkpointed exporter holds nothing");
    CHECK(device_used() == dev0 + KEPT_BYTES, "the kept memory stayed on the device (%zu)", device_used());
    CU(cuCheckpointProcessRestore(c.pid, NULL));
    CU(cuCheckpointProcessUnlock(c.pid, NULL));
    child_ok(&c, "PING");
    CHECK(device_used() == dev0 + CTX_BYTES + KEPT_BYTES, "restored: nothing added (%zu)", device_used());

    CUmemGenericAllocationHandle h;
    CU(cuMemImportFromShareableHandle(&h, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    close(fd);
    CHECK(read_last(h, KEPT_BYTES) == 0x5eed5eed, "the kept bytes are intact");
    CU(cuMemRelease(h));
    CHECK(device_used() == dev0 + CTX_BYTES, "last holder gone: freed (%zu)", device_used());
    child_finish(&c);
}

static struct child spawn_target(CUdeviceptr *a, CUdeviceptr *b, const char *env)
{
    struct child c = spawn("target", NULL, NULL, env);
    char buf[128];
    child_recv(&c, buf, sizeof(buf));
    CHECK(sscanf(buf, "READY %llx %llx", a, b) == 2, "target said '%s'", buf);
    return c;
}

static void counts(struct child *c, long *count, long *fails)
{
    char buf[64];
    child_ask(c, buf, sizeof(buf), "COUNT");
    CHECK(sscanf(buf, "%ld %ld", count, fails) == 2, "%s", buf);
}

/* Whether the target's mapping at va is backed by simcuda memory right now (a memfd, or an exportable
 * allocation's object). */
static bool mapped_to_memfd(pid_t pid, CUdeviceptr va)
{
    char path[64], l[512];
    snprintf(path, sizeof(path), "/proc/%d/maps", pid);
    FILE *f = fopen(path, "r");
    CHECK(f != NULL, "%s", path);
    bool found = false;
    while (fgets(l, sizeof(l), f)) {
        unsigned long lo, hi;
        if (sscanf(l, "%lx-%lx", &lo, &hi) == 2 && va >= lo && va < hi)
            found = strstr(l, "memfd:simcuda") != NULL || strstr(l, "/obj/") != NULL;
    }
    fclose(f);
    return found;
}

static void test_checkpoint_cycle(void)
{
    CUdeviceptr a, b;
    struct child c = spawn_target(&a, &b, NULL);
    CHECK(proc_used(c.pid) == TGT_USED, "target uses %zu", proc_used(c.pid));
    size_t dev_before = device_used(), free_before = free_mem();
    child_ok(&c, "BLOCKER");

    CHECK(state_of(c.pid) == CU_PROCESS_STATE_RUNNING, "running");
    int tid = 0;
    CU(cuCheckpointProcessGetRestoreThreadId(c.pid, &tid));
    char task[64];
    snprintf(task, sizeof(task), "/proc/%d/task/%d", c.pid, tid);
    CHECK(tid > 0 && tid != c.pid && access(task, F_OK) == 0, "restore thread %d", tid);

    /* wrong-state requests */
    EXPECT_RC(cuCheckpointProcessCheckpoint(c.pid, NULL), CUDA_ERROR_ILLEGAL_STATE);
    EXPECT_RC(cuCheckpointProcessRestore(c.pid, NULL), CUDA_ERROR_ILLEGAL_STATE);
    EXPECT_RC(cuCheckpointProcessUnlock(c.pid, NULL), CUDA_ERROR_ILLEGAL_STATE);
    CUcheckpointLockArgs bad_args = {.timeoutMs = 10, .reserved0 = 1};
    EXPECT_RC(cuCheckpointProcessLock(c.pid, &bad_args), CUDA_ERROR_INVALID_VALUE);

    /* lock: the app's thread blocks in its next call (it does not fail) */
    CUcheckpointLockArgs lock = {.timeoutMs = 5000};
    CU(cuCheckpointProcessLock(c.pid, &lock));
    CHECK(state_of(c.pid) == CU_PROCESS_STATE_LOCKED, "locked");
    EXPECT_RC(cuCheckpointProcessLock(c.pid, &lock), CUDA_ERROR_ILLEGAL_STATE);
    EXPECT_RC(cuCheckpointProcessRestore(c.pid, NULL), CUDA_ERROR_ILLEGAL_STATE);
    long c1, c2, fails;
    counts(&c, &c1, &fails);
    sleep_ms(150);
    counts(&c, &c2, &fails);
    CHECK(c1 == c2, "calls made progress while locked (%ld -> %ld)", c1, c2);

    /* checkpoint: the target holds no device memory any more */
    CUcheckpointCheckpointArgs cargs = {{0}};
    CU(cuCheckpointProcessCheckpoint(c.pid, &cargs));
    CHECK(state_of(c.pid) == CU_PROCESS_STATE_CHECKPOINTED, "checkpointed");
    CHECK(proc_used(c.pid) == 0, "checkpointed target uses %zu", proc_used(c.pid));
    CHECK(device_used() == dev_before - TGT_USED, "device used %zu", device_used());
    CHECK(free_mem() == free_before + TGT_USED, "free memory grew by the target's usage");
    CHECK(!mapped_to_memfd(c.pid, a) && !mapped_to_memfd(c.pid, b), "memory still backed while checkpointed");
    EXPECT_RC(cuCheckpointProcessCheckpoint(c.pid, NULL), CUDA_ERROR_ILLEGAL_STATE);
    EXPECT_RC(cuCheckpointProcessUnlock(c.pid, NULL), CUDA_ERROR_ILLEGAL_STATE);
    EXPECT_RC(cuCheckpointProcessLock(c.pid, NULL), CUDA_ERROR_ILLEGAL_STATE);

    /* restore: memory back at the same addresses, still locked */
    CUcheckpointRestoreArgs rargs = {0};
    CU(cuCheckpointProcessRestore(c.pid, &rargs));
    CHECK(state_of(c.pid) == CU_PROCESS_STATE_LOCKED, "restored = locked");
    CHECK(proc_used(c.pid) == TGT_USED, "restored target uses %zu", proc_used(c.pid));
    CHECK(mapped_to_memfd(c.pid, a) && mapped_to_memfd(c.pid, b), "memory re-mapped");
    counts(&c, &c2, &fails);
    CHECK(c1 == c2, "calls made progress before unlock");

    /* unlock: the blocked thread continues, and nothing failed */
    CU(cuCheckpointProcessUnlock(c.pid, NULL));
    CHECK(state_of(c.pid) == CU_PROCESS_STATE_RUNNING, "running again");
    sleep_ms(100);
    counts(&c, &c2, &fails);
    CHECK(c2 > c1 && fails == 0, "after unlock: %ld -> %ld calls, %ld failed", c1, c2, fails);
    child_ok(&c, "VERIFY");
    CHECK(free_mem() == free_before, "accounting back where it was");
    child_finish(&c);
}

static long polls(struct child *c)
{
    char buf[64];
    child_ask(c, buf, sizeof(buf), "POLLS");
    return atol(buf);
}

/* The child ended by SIGSEGV (what the driver does to a process whose checkpoint a query spoiled). */
static void expect_segv(struct child *c)
{
    int status;
    CHECK(waitpid(c->pid, &status, 0) == c->pid, "waitpid");
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV, "child %d ended with status 0x%x, not SIGSEGV", c->pid, status);
    fclose(c->to);
    fclose(c->from);
}

/* As on the driver: a stream query is not held by the lock, and one running during the checkpoint
 * fails it (304), the process goes FAILED and dies with SIGSEGV. */
static void test_query_during_checkpoint(void)
{
    CUdeviceptr a, b;
    struct child c = spawn_target(&a, &b, NULL);
    child_ok(&c, "POLLER");
    CUcheckpointLockArgs lock = {.timeoutMs = 5000};
    CU(cuCheckpointProcessLock(c.pid, &lock));
    long p1 = polls(&c);
    sleep_ms(50);
    CHECK(polls(&c) > p1, "the lock held a stream query (%ld polls)", p1);
    /* a poller descheduled for the whole checkpoint (a loaded machine) dies at its next query instead */
    CUresult rc = cuCheckpointProcessCheckpoint(c.pid, NULL);
    CHECK(rc == CUDA_ERROR_OPERATING_SYSTEM || rc == CUDA_SUCCESS, "checkpoint returned %d", rc);
    expect_segv(&c);
}

/* A synchronize called while the process is checkpointed kills it, as a query does. */
static void test_sync_while_checkpointed(void)
{
    CUdeviceptr a, b;
    struct child c = spawn_target(&a, &b, NULL);
    CUcheckpointLockArgs lock = {.timeoutMs = 5000};
    CU(cuCheckpointProcessLock(c.pid, &lock));
    CU(cuCheckpointProcessCheckpoint(c.pid, NULL));
    CHECK(state_of(c.pid) == CU_PROCESS_STATE_CHECKPOINTED, "checkpointed");
    fprintf(c.to, "PING\n");   /* its cuCtxSynchronize */
    fflush(c.to);
    expect_segv(&c);
}

static void test_lock_timeout(void)
{
    CUdeviceptr a, b;
    struct child c = spawn_target(&a, &b, NULL);
    child_ok(&c, "SPIN 1500");
    sleep_ms(100); /* the kernel is in flight */
    double t0 = now_ms();
    CUcheckpointLockArgs lock = {.timeoutMs = 300};
    EXPECT_RC(cuCheckpointProcessLock(c.pid, &lock), CUDA_ERROR_TIMEOUT);
    double t = now_ms() - t0;
    CHECK(t >= 280 && t < 1200, "lock gave up after %.0f ms", t);
    CHECK(state_of(c.pid) == CU_PROCESS_STATE_RUNNING, "a timed-out lock leaves the process running");
    child_ok(&c, "PING"); /* the gate is open again */
    lock.timeoutMs = 0;   /* for ever: returns once the kernel is done */
    CU(cuCheckpointProcessLock(c.pid, &lock));
    t = now_ms() - t0;
    CHECK(t >= 1300 && t < 3000, "lock waited for the kernel until %.0f ms", t);
    CU(cuCheckpointProcessUnlock(c.pid, NULL));
    child_ok(&c, "PING");
    child_finish(&c);
}

static void test_restore_oom_then_ok(bool inject_failure)
{
    CUdeviceptr a, b;
    struct child c = spawn_target(&a, &b, inject_failure ? "SIMCUDA_FAIL_RESTORE=1" : NULL);
    CU(cuCheckpointProcessLock(c.pid, NULL));
    CU(cuCheckpointProcessCheckpoint(c.pid, NULL));
    if (inject_failure) {
        EXPECT_RC(cuCheckpointProcessRestore(c.pid, NULL), CUDA_ERROR_UNKNOWN);
        CHECK(state_of(c.pid) == CU_PROCESS_STATE_CHECKPOINTED, "a failed restore stays checkpointed");
    } else {
        /* another process takes the memory the target needs back */
        size_t room = free_mem();
        char arg[32], buf[64];
        snprintf(arg, sizeof(arg), "%llu", (room - CTX_BYTES - 40 * MiB) / GRAN * GRAN);
        struct child hog = spawn("holder", arg, NULL, NULL);
        child_recv(&hog, buf, sizeof(buf));
        CHECK(strcmp(buf, "READY") == 0, "%s", buf);
        CHECK(free_mem() < TGT_USED, "free %zu", free_mem());
        EXPECT_RC(cuCheckpointProcessRestore(c.pid, NULL), CUDA_ERROR_OUT_OF_MEMORY);
        CHECK(state_of(c.pid) == CU_PROCESS_STATE_CHECKPOINTED, "out of memory: still checkpointed");
        CHECK(proc_used(c.pid) == 0, "nothing half-restored");
        child_ok(&hog, "FREE");
        child_finish(&hog);
    }
    CU(cuCheckpointProcessRestore(c.pid, NULL));
    CU(cuCheckpointProcessUnlock(c.pid, NULL));
    child_ok(&c, "VERIFY");
    child_finish(&c);
}

static void test_not_a_cuda_process(void)
{
    pid_t pid = fork();
    CHECK(pid >= 0, "fork");
    if (pid == 0) {
        pause();
        _exit(0);
    }
    CUprocessState s;
    EXPECT_RC(cuCheckpointProcessGetState(pid, &s), CUDA_ERROR_NOT_INITIALIZED);
    EXPECT_RC(cuCheckpointProcessLock(pid, NULL), CUDA_ERROR_NOT_INITIALIZED);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    EXPECT_RC(cuCheckpointProcessGetState(pid, &s), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuCheckpointProcessGetState(-5, &s), CUDA_ERROR_INVALID_VALUE);
}

static void test_multidev(void)
{
    char buf[64];
    struct child c = spawn("multidev", NULL, NULL, "SIMCUDA_DEVICES=2");
    child_recv(&c, buf, sizeof(buf));
    CHECK(strcmp(buf, "READY") == 0, "%s", buf);
    child_finish(&c);
}


/* ---- stream-ordered pools and the stream-ordering model ---- */

static uint64_t pool_attr(CUmemoryPool p, int attr)
{
    uint64_t v = 0;
    CU(cuMemPoolGetAttribute(p, attr, &v));
    return v;
}

static void test_pools(void)
{
    init_primary();
    CUdevice dev = 0;
    CUstream s1, s2;
    CU(cuStreamCreate(&s1, 0));
    CU(cuStreamCreate(&s2, 0));
    CUmemoryPool dflt, cur;
    CU(cuDeviceGetDefaultMemPool(&dflt, dev));
    CU(cuDeviceGetMemPool(&cur, dev));
    CHECK(dflt == cur, "the current pool starts as the default one");
    size_t base = proc_used(getpid());

    /* same stream: a freed block is reused at once */
    CUdeviceptr a, b, c;
    CU(cuMemAllocAsync(&a, 3 * MiB, s1));
    CHECK(pool_attr(dflt, CU_MEMPOOL_ATTR_USED_MEM_CURRENT) == 4 * MiB, "used counts the rounded block");
    CU(cuMemFreeAsync(a, s1));
    CHECK(pool_attr(dflt, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) == 4 * MiB, "a freed block stays reserved");
    CU(cuMemAllocAsync(&b, 3 * MiB, s1));
    CHECK(b == a, "same-stream reuse");
    /* another stream, no order and no internal dependencies allowed: a different block */
    CU(cuMemFreeAsync(b, s1));
    int off = 0, on = 1;
    CU(cuMemPoolSetAttribute(dflt, CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES, &off));
    unsigned long long id, seq;
    CU(simcudaStreamPosition(s1, &id, &seq));
    CHECK(simcudaStreamOrdered(s2, id, seq) == 0, "s2 is not ordered after s1's free yet");
    CU(cuMemAllocAsync(&c, 3 * MiB, s2));
    CHECK(c != a, "no cross-stream reuse without order");
    CU(cuMemFreeAsync(c, s2));
    /* an event orders the free before s2: reuse, and the model says so */
    CUevent ev;
    CU(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
    CU(cuEventRecord(ev, s1));
    EXPECT_RC(cuEventQuery(ev), CUDA_ERROR_NOT_READY);
    CU(cuStreamWaitEvent(s2, ev, 0));
    CHECK(simcudaStreamOrdered(s2, id, seq) == 1, "waiting on the event orders s2 after the free");
    CUdeviceptr d;
    CU(cuMemAllocAsync(&d, 3 * MiB, s2));
    CHECK(d == a || d == c, "reuse after an event");
    /* internal dependencies: the pool makes the stream wait */
    CUstream s3;
    CU(cuStreamCreate(&s3, 0));
    CU(cuMemFreeAsync(d, s2));
    CU(simcudaStreamPosition(s2, &id, &seq));
    CU(cuMemPoolSetAttribute(dflt, CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES, &on));
    CUdeviceptr e;
    CU(cuMemAllocAsync(&e, 3 * MiB, s3));
    CHECK(e == d, "reuse through an internal dependency");
    CHECK(simcudaStreamOrdered(s3, id, seq) == 1, "and the stream was made to wait for the free");
    CU(cuMemFreeAsync(e, s3));

    /* a synchronize gives back what is above the release threshold (0 by default) */
    CHECK(pool_attr(dflt, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) == 8 * MiB, "two blocks reserved");
    CU(cuStreamSynchronize(s1));
    /* the block last freed on s1 (if the pool took the other one for d) goes; those freed on s2/s3 wait */
    CHECK(pool_attr(dflt, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) == (d == c ? 4 : 8) * MiB,
          "only frees seen complete are released");
    CU(cuCtxSynchronize());
    EXPECT_RC(cuEventQuery(ev), CUDA_SUCCESS);
    CHECK(pool_attr(dflt, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) == 0, "released at the synchronize");
    CHECK(proc_used(getpid()) == base, "and given back to the device");
    CHECK(pool_attr(dflt, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) == 8 * MiB, "high watermark kept");
    uint64_t zero = 0, big = 64 * MiB;
    CU(cuMemPoolSetAttribute(dflt, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, &zero));
    CHECK(pool_attr(dflt, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH) == 0, "watermark reset to current");
    EXPECT_RC(cuMemPoolSetAttribute(dflt, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &zero), CUDA_ERROR_INVALID_VALUE);

    /* a threshold keeps memory; TrimTo releases it */
    CU(cuMemPoolSetAttribute(dflt, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &big));
    CU(cuMemAllocAsync(&a, 6 * MiB, s1));
    CU(cuMemFreeAsync(a, s1));
    CU(cuStreamSynchronize(s1));
    CHECK(pool_attr(dflt, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) == 6 * MiB, "kept under the threshold");
    CU(cuMemPoolTrimTo(dflt, 0));
    CHECK(pool_attr(dflt, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) == 0, "trimmed");
    CU(cuMemPoolSetAttribute(dflt, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &zero));

    /* explicit pools: props, current pool, access, IPC export only with a handle type */
    CUmemPoolProps props = {.allocType = CU_MEM_ALLOCATION_TYPE_PINNED, .location = {CU_MEM_LOCATION_TYPE_DEVICE, 0}};
    CUmemoryPool plain, ipc;
    CU(cuMemPoolCreate(&plain, &props));
    props.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CU(cuMemPoolCreate(&ipc, &props));
    props.location.id = 7;
    EXPECT_RC(cuMemPoolCreate(&cur, &props), CUDA_ERROR_INVALID_DEVICE);
    CU(cuDeviceSetMemPool(dev, plain));
    CU(cuMemAllocAsync(&a, MiB, s1));
    CHECK(pool_attr(plain, CU_MEMPOOL_ATTR_USED_MEM_CURRENT) == 2 * MiB, "cuMemAllocAsync uses the current pool");
    CU(cuMemAllocFromPoolAsync(&b, MiB, ipc, s1));
    int fd = -1;
    EXPECT_RC(cuMemPoolExportToShareableHandle(&fd, plain, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), CUDA_ERROR_INVALID_VALUE);
    CU(cuMemPoolExportToShareableHandle(&fd, ipc, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    CHECK(fd >= 0, "an fd");
    close(fd);
    CUmemPoolPtrExportData data;
    CU(cuMemPoolExportPointer(&data, b));
    EXPECT_RC(cuMemPoolExportPointer(&data, a), CUDA_ERROR_INVALID_VALUE);
    CUmemAccessDesc own_ro = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READ};
    EXPECT_RC(cuMemPoolSetAccess(plain, &own_ro, 1), CUDA_ERROR_INVALID_VALUE);
    int flags = 0;
    CUmemLocation loc = {CU_MEM_LOCATION_TYPE_DEVICE, 0};
    CU(cuMemPoolGetAccess(&flags, plain, &loc));
    CHECK(flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "its own device reads and writes");
    EXPECT_RC(cuMemPoolDestroy(dflt), CUDA_ERROR_INVALID_VALUE);
    CU(cuMemFreeAsync(a, s1));
    CU(cuMemFree_v2(b));   /* pool memory may be freed synchronously too */
    CU(cuMemPoolDestroy(plain));
    CU(cuMemPoolDestroy(ipc));
    CU(cuDeviceGetMemPool(&cur, dev));
    CHECK(cur == dflt, "destroying the current pool makes the default current again");
    CU(cuCtxSynchronize());
    CHECK(proc_used(getpid()) == base, "everything given back");
    uint64_t graph = 1;
    CU(cuDeviceGetGraphMemAttribute(dev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &graph));
    CHECK(graph == 0, "no graph memory on simcuda");
    CU(cuDeviceGraphMemTrim(dev));
    CU(cuEventDestroy_v2(ev));
    CU(cuStreamDestroy_v2(s1));
    CU(cuStreamDestroy_v2(s2));
    CU(cuStreamDestroy_v2(s3));
}

static void run(const char *name, void (*fn)(void))
{
    double t0 = now_ms();
    fn();
    printf("ok  %-28s %6.0f ms\n", name, now_ms() - t0);
    fflush(stdout);
}

static void test_restore_oom(void) { test_restore_oom_then_ok(false); }
static void test_restore_fault_injection(void) { test_restore_oom_then_ok(true); }

static void remove_dir(void)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d)))
        if (e->d_name[0] != '.')
            unlinkat(dirfd(d), e->d_name, 0);
    if (d)
        closedir(d);
    rmdir(dir);
}

int main(int argc, char **argv)
{
    self_exe = "/proc/self/exe";
    if (argc >= 2)
        return child_main(argc, argv);
    alarm(60);
    /* A private runtime dir and device for this run; children inherit them. */
    snprintf(dir, sizeof(dir), "%s/simcuda-test-XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    CHECK(mkdtemp(dir) != NULL, "mkdtemp: %s", strerror(errno));
    atexit(remove_dir);
    setenv("SIMCUDA_DIR", dir, 1);
    setenv("SIMCUDA_TOTAL_MEM", "1073741824", 1);
    setenv("SIMCUDA_CTX_BYTES", "67108864", 1);
    unsetenv("SIMCUDA_DEVICES");
    unsetenv("SIMCUDA_FAIL_RESTORE");

    double t0 = now_ms();
    run("before cuInit", test_before_init);
    run("error strings", test_errors);
    run("devices and contexts", test_device_and_contexts);
    run("memory basics", test_memory_basics);
    run("VMM", test_vmm);
    run("cuGetProcAddress", test_procaddr);
    run("kernels, events, streams", test_kernels);
    run("stream-ordered pools", test_pools);
    run("accounting across processes", test_accounting);
    run("fd sharing across processes", test_shared_across_processes);
    run("exported memory's lifetime", test_exported_lifetime);
    run("checkpoint with memory kept by an fd", test_checkpoint_with_kept_memory);
    run("not a CUDA process", test_not_a_cuda_process);
    run("checkpoint cycle", test_checkpoint_cycle);
    run("lock timeout", test_lock_timeout);
    run("a query during the checkpoint", test_query_during_checkpoint);
    run("a synchronize while checkpointed", test_sync_while_checkpointed);
    run("restore out of memory", test_restore_oom);
    run("restore fault injection", test_restore_fault_injection);
    run("two devices, self-checkpoint", test_multidev);
    printf("all simcuda tests passed in %.1f s\n", (now_ms() - t0) / 1e3);
    return 0;
}
