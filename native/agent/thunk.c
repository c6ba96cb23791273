/* Driver entry points outside the table: each handed out through a thunk that waits at the closed gate first.
 *
 * Why: cuCheckpointProcessLock blocks every driver call of the process but a few queries until the unlock. A
 * call the table does not wrap (cuStreamIsCapturing, cuFuncSetAttribute, a module load: cuBLAS makes some
 * before its launches) therefore blocked inside the driver while its app was parked at level full, never
 * reached the gate, was nobody's demand, and the app waited for ever (H100, torch's matmul after a park).
 * Through a thunk it waits at the gate instead, as demand, and goes on once the app is back.
 *
 * A thunk does not know the call's signature, so it cannot hold the gate across the call: it waits while the
 * gate is closed, then jumps to the driver with the caller's registers and stack untouched. A call that passes
 * just before the gate closes still meets the driver's lock, as it did before. At a park of level data the
 * process keeps its context and the driver takes no lock: such calls run on, and wake nobody.
 *
 * Handed out in place of a driver function only: a name of the driver's form (cu + capital) resolved in
 * the driver, and not one of the queries the driver answers while it holds the process (PASS below). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include "agent.h"

/* CUDA 13's cuda.h declares about 500 driver functions; with their versions and per-thread variants, and
 * every runtime in a process resolving them, the distinct real ones stay well under this. */
#define THUNKS 2048
#define SLOT_BYTES 16
#define STR_(x) #x
#define STR(x) STR_(x)

/* Answered by the driver while it holds a process locked or checkpointed (measured on the H200, driver 580;
 * entrypoints.def's table), or not a call into a context at all: handed out as they are. */
static const char *const PASS[] = {
    "cuInit", "cuDriverGetVersion", "cuGetErrorString", "cuGetErrorName", "cuGetExportTable",
    "cuDeviceGet", "cuDeviceGetCount", "cuDeviceGetName", "cuDeviceGetUuid", "cuDeviceGetUuid_v2", "cuDeviceGetLuid",
    "cuDeviceTotalMem", "cuDeviceTotalMem_v2", "cuDeviceGetAttribute", "cuDeviceGetProperties",
    "cuDeviceComputeCapability", "cuDeviceGetByPCIBusId", "cuDeviceGetPCIBusId", "cuDeviceCanAccessPeer",
    "cuDeviceGetP2PAttribute", "cuDevicePrimaryCtxGetState", "cuDeviceGetDefaultMemPool", "cuDeviceGetMemPool",
    "cuCtxGetCurrent", "cuCtxGetDevice", "cuCtxGetFlags", "cuCtxGetId", "cuCtxGetApiVersion",
    "cuMemGetInfo", "cuMemGetInfo_v2", "cuPointerGetAttribute", "cuPointerGetAttributes",
};

struct thunk { void *real; const char *name; };
static struct thunk g_thunks[THUNKS];
static atomic_int g_used;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

#if defined(__x86_64__)
/* THUNKS slots of SLOT_BYTES each: a slot puts its number in r11 and jumps to the common part, which keeps the
 * argument registers (rdi, rsi, rdx, rcx, r8, r9, rax for a variadic call's count, xmm0-7) around the wait and
 * jumps to the real function, so the stack the driver sees is the caller's own. */
__attribute__((visibility("hidden"))) void *gpucr_thunk_before(unsigned slot);
extern const char gpucr_thunk_slots[] __attribute__((visibility("hidden")));
__asm__(
    ".text\n"
    ".balign 16\n"
    "gpucr_thunk_common:\n"
    "  push %rax\n  push %rdi\n  push %rsi\n  push %rdx\n  push %rcx\n  push %r8\n  push %r9\n"
    "  sub $128, %rsp\n"   /* 7 pushes on a call's entry (rsp 8 mod 16) leave it 16-aligned for the call below */
    "  movdqu %xmm0, 0(%rsp)\n  movdqu %xmm1, 16(%rsp)\n  movdqu %xmm2, 32(%rsp)\n  movdqu %xmm3, 48(%rsp)\n"
    "  movdqu %xmm4, 64(%rsp)\n  movdqu %xmm5, 80(%rsp)\n  movdqu %xmm6, 96(%rsp)\n  movdqu %xmm7, 112(%rsp)\n"
    "  mov %r11d, %edi\n"
    "  call gpucr_thunk_before\n"
    "  mov %rax, %r11\n"
    "  movdqu 0(%rsp), %xmm0\n  movdqu 16(%rsp), %xmm1\n  movdqu 32(%rsp), %xmm2\n  movdqu 48(%rsp), %xmm3\n"
    "  movdqu 64(%rsp), %xmm4\n  movdqu 80(%rsp), %xmm5\n  movdqu 96(%rsp), %xmm6\n  movdqu 112(%rsp), %xmm7\n"
    "  add $128, %rsp\n"
    "  pop %r9\n  pop %r8\n  pop %rcx\n  pop %rdx\n  pop %rsi\n  pop %rdi\n  pop %rax\n"
    "  jmp *%r11\n"
    ".globl gpucr_thunk_slots\n"
    ".hidden gpucr_thunk_slots\n"
    ".balign 16\n"
    "gpucr_thunk_slots:\n"
    ".altmacro\n"
    ".macro gpucr_slot n\n"
    "  endbr64\n"
    "  movl $\\n, %r11d\n"
    "  jmp gpucr_thunk_common\n"
    "  .balign 16\n"
    ".endm\n"
    ".set gpucr_n, 0\n"
    ".rept " STR(THUNKS) "\n"
    "  gpucr_slot %gpucr_n\n"
    "  .set gpucr_n, gpucr_n + 1\n"
    ".endr\n"
    ".noaltmacro\n");

void *gpucr_thunk_before(unsigned slot)
{
    /* At the closed gate: wait for it to open, as demand (gate.c), then go on outside it. Not during a park of
     * level data (committed), whose context stays and whose driver takes no lock. */
    if (gpucr_gate_is_closed() && !gpucr_parked_at_data_level()) {
        gpucr_log("%s (outside the table) waits at the closed gate", g_thunks[slot].name);
        gpucr_gate_enter();
        gpucr_gate_leave();
    }
    return g_thunks[slot].real;
}
#endif

static bool passes(const char *name)
{
    for (size_t i = 0; i < sizeof PASS / sizeof PASS[0]; i++)
        if (strcmp(PASS[i], name) == 0) return true;
    return false;
}

/* Whether `handle` (a dlsym's) is a CUDA driver (the system's, or simcuda): it exports the driver's resolver and is
 * not the agent. Asked inside the application's dlsym, also before gpucr_init: only dlsym itself is called here, no
 * dlopen or dladdr (each takes the loader's lock, which another thread may hold while it waits for this one). */
bool gpucr_is_driver_handle(void *handle)
{
    if (handle == RTLD_DEFAULT || handle == RTLD_NEXT) return false;
    return gpucr_real_dlsym(handle, "cuGetProcAddress_v2") != NULL && gpucr_real_dlsym(handle, "gpucr_entry_table") == NULL;
}

/* A fork child: a thread of the parent that held the lock is not there to release it. */
void gpucr_thunks_reset_after_fork(void)
{
    pthread_mutex_init(&g_mu, NULL);
}

/* The driver's function `real`, of this name, as the application is to call it: through a thunk where the rule
 * above asks for one; as it is otherwise (and once all THUNKS are used, with a warning). The caller knows `real` is
 * the driver's (cuGetProcAddress, the runtime's resolvers, a dlsym of a driver's handle). */
void *gpucr_thunk_for(const char *name, void *real)
{
#if defined(__x86_64__)
    if (!real || !name || name[0] != 'c' || name[1] != 'u' || name[2] < 'A' || name[2] > 'Z' || passes(name))
        return real;
    pthread_mutex_lock(&g_mu);
    int n = atomic_load(&g_used), i = 0;
    while (i < n && g_thunks[i].real != real) i++;
    if (i == n && n < THUNKS) {
        g_thunks[n] = (struct thunk){real, strdup(name)};
        atomic_store(&g_used, n + 1);
    }
    pthread_mutex_unlock(&g_mu);
    if (i >= THUNKS) {
        static atomic_bool warned;
        if (!atomic_exchange(&warned, true))
            gpucr_warn("more than %d driver functions outside the table: %s and later ones are handed out unwrapped",
                       THUNKS, name);
        return real;
    }
    return (void *)(gpucr_thunk_slots + (size_t)i * SLOT_BYTES);
#else
    (void)name;
    return real;
#endif
}
