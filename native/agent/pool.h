/* Stream-ordered allocation served by the agent (pool.c): what the rest of the agent asks of it. */
#ifndef GPUCR_POOL_H
#define GPUCR_POOL_H
#include "agent.h"
#include "json.h"

/* cuMemFree of memory the agent's pools handed out: true (and *rc set) if it was theirs. */
bool pool_free_sync(CUdeviceptr p, CUresult *rc);
/* A context ends: its pools' memory goes with it (before the registry forgets the context). */
void pool_forget_ctx(CUcontext ctx);
/* The checkpoint's devices are synchronised and the gate is closed: give back every free block, and
 * let the driver trim its own pools and graph memory, so only memory in use is moved. */
void pool_trim_for_checkpoint(void);
/* Why the process cannot be checkpointed because of its pools (a pool shared with other processes),
 * written into why; false (why untouched) if nothing stands in the way. */
bool pool_refusal(char *why, size_t len);

/* What the pools hold, for `gpucr status` and the manifest. */
struct pool_stats {
    long pools_served, pools_native;            /* pools the agent serves / leaves to the driver */
    unsigned long long served_used, served_reserved;
    unsigned long long ipc_pool_bytes, other_native_bytes;   /* stream-ordered memory the driver keeps, by reason */
    long ipc_pool_allocs, other_native_allocs;
    long ipc_exports, ipc_imports;
    unsigned long long graph_bytes;             /* graph memory nodes (the driver's own), as last read */
    long captured_allocs;                       /* cuMemAllocAsync during stream capture: graph memory */
    unsigned long long alloc_calls, cross_stream_waits, segments_released;
};
/* running: the process runs, so the driver may be asked (graph memory); else the last value read. */
void pool_get_stats(struct pool_stats *st, bool running);
void pool_reset_after_fork(void);
/* The status answer's "coverage" and "bytes_left_to_driver" (coverage.c; registry locked). */
void coverage_json(struct jb *j, const struct pool_stats *ps);
#endif
