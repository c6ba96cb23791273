/* cuInit and the process-wide configuration of the simulated driver. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "simcuda.h"

struct sim_config sim_cfg;

static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static bool init_tried;
static CUresult init_result;
static atomic_bool ready;

/* A size from the environment in bytes; a malformed value is reported and ignored rather than
 * silently read as 0, which would make every allocation fail for an unclear reason. */
static size_t env_size(const char *name, size_t dflt)
{
    const char *s = getenv(name);
    if (!s || !*s)
        return dflt;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || *end || s[0] == '-') {
        fprintf(stderr, "simcuda: ignoring %s=%s (not a byte count)\n", name, s);
        return dflt;
    }
    return (size_t)v;
}

void sim_config_load(struct sim_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    size_t n = env_size("SIMCUDA_DEVICES", 1);
    cfg->ndevices = n > SIM_MAX_DEVICES ? SIM_MAX_DEVICES : (int)n;
    cfg->total_mem = env_size("SIMCUDA_TOTAL_MEM", 16ull << 30);
    cfg->ctx_bytes = env_size("SIMCUDA_CTX_BYTES", 64ull << 20);
    const char *fail = getenv("SIMCUDA_FAIL_RESTORE");
    cfg->fail_restore = !fail ? CUDA_SUCCESS : !strcmp(fail, "1") ? CUDA_ERROR_UNKNOWN
                        : !strcmp(fail, "oom") ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
    const char *fail_lock = getenv("SIMCUDA_FAIL_LOCK");
    cfg->fail_lock = fail_lock && strcmp(fail_lock, "1") == 0;
    cfg->checkpoint_delay_ms = env_size("SIMCUDA_CHECKPOINT_DELAY_MS", 0);
    const char *call = getenv("SIMCUDA_FAIL_CALL");
    if (call && *call) {
        const char *colon = strchr(call, ':');
        size_t len = colon ? (size_t)(colon - call) : strlen(call);
        char *end = NULL;
        unsigned long nth = colon ? strtoul(colon + 1, &end, 10) : 1;
        if (len >= sizeof cfg->fail_call || (colon && (*end || nth == 0)))
            fprintf(stderr, "simcuda: ignoring SIMCUDA_FAIL_CALL=%s (want NAME or NAME:N, N from 1)\n", call);
        else {
            memcpy(cfg->fail_call, call, len);
            cfg->fail_nth = (unsigned)nth;
        }
    }
    cfg->pid = getpid();
}

bool sim_fault_injected(const char *entry)
{
    static atomic_uint calls;
    if (!sim_cfg.fail_nth || strcmp(entry, sim_cfg.fail_call) != 0)
        return false;
    return atomic_fetch_add(&calls, 1) + 1 == sim_cfg.fail_nth;
}

bool sim_is_ready(void)
{
    /* A forked child inherits the flag but not the control thread or the accounting file,
     * and a real driver is unusable after fork too: treat it as not initialised. */
    return atomic_load_explicit(&ready, memory_order_acquire) && getpid() == sim_cfg.pid;
}

static CUresult do_init(void)
{
    sim_config_load(&sim_cfg);
    if (sim_cfg.ndevices == 0)
        return CUDA_ERROR_NO_DEVICE;
    CUresult rc = sim_mem_init();
    if (rc == CUDA_SUCCESS)
        rc = sim_acct_init();
    if (rc == CUDA_SUCCESS)
        rc = sim_ctl_start();
    return rc;
}

SIMAPI CUresult cuInit(unsigned int flags)
{
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (sim_is_ready())
        SIM_GATED(CUDA_SUCCESS); /* like any call, cuInit blocks while the process is locked */

    pthread_mutex_lock(&init_lock);
    if (!init_tried) {
        init_tried = true;
        init_result = do_init();
        if (init_result == CUDA_SUCCESS)
            atomic_store_explicit(&ready, true, memory_order_release);
    } else if (init_result == CUDA_SUCCESS && getpid() != sim_cfg.pid) {
        init_result = CUDA_ERROR_NOT_INITIALIZED; /* forked child: see sim_is_ready */
    }
    CUresult rc = init_result; /* the first result sticks, as on the real driver */
    pthread_mutex_unlock(&init_lock);
    return rc;
}

SIMAPI CUresult cuDriverGetVersion(int *driverVersion)
{
    if (!driverVersion)
        return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = SIM_DRIVER_VERSION;
    return CUDA_SUCCESS;
}

SIMAPI int simcudaIsSimulated(void)
{
    return 1;
}
