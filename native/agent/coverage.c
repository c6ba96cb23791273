/* Coverage: which bytes gpucr's data plane moves and which it leaves to the driver's checkpoint
 * (correct, but ~2 GB/s), each kind with its reason, so that nothing is ever silently slow; and what
 * no checkpoint can cover, refused before anything is touched (dp_preflight). One home for the rule:
 * `gpucr status`, a checkpoint's answer and the manifest all read this. */
#include <stdio.h>
#include "dataplane.h"
#include "pool.h"
#include "registry.h"

static void left_entry(struct jb *j, const char *kind, unsigned long long bytes, long count, const char *reason)
{
    if (!bytes && count <= 0) return;
    jb_sub(j, NULL);
    jb_str(j, "kind", kind);
    jb_int(j, "bytes", (long long)bytes);
    if (count >= 0) jb_int(j, "count", count);
    jb_str(j, "reason", reason);
    jb_end(j);
}

void coverage_json(struct jb *j, const struct pool_stats *ps)
{
    unsigned long long moved = 0, vmm_left = 0;
    long vmm_left_n = 0;
    for (struct phys *p = g_reg.all; p; p = p->next_all) {
        if (reg_phys_released(p) || reg_phys_movable(p)) moved += p->size;
        else if (p->kind != PHYS_IMPORTED) { vmm_left += p->size; vmm_left_n++; }
    }
    unsigned long long left = vmm_left + g_reg.native_bytes + g_reg.pool_bytes + ps->graph_bytes;
    jb_int(j, "bytes_left_to_driver", (long long)left);
    jb_sub(j, "coverage");
    jb_int(j, "bytes_moved_by_gpucr", (long long)moved);
    jb_int(j, "bytes_left_to_driver", (long long)left);
    jb_arr(j, "left_to_driver");
    left_entry(j, "small allocations", g_reg.native_bytes, g_reg.native_count,
               "plain allocations below GPUCR_MIN_VMM_BYTES (one VMM granule each would waste memory), or all of them "
               "with GPUCR_NATIVE_ALLOC=1");
    left_entry(j, "IPC pool", ps->ipc_pool_bytes, ps->ipc_pool_allocs,
               "stream-ordered memory from a pool created with handle types (IPC-capable): the driver must keep it exportable");
    left_entry(j, "other stream-ordered pool", ps->other_native_bytes, ps->other_native_allocs,
               "stream-ordered memory from a pool gpucr did not see created (imported), a host pool or one with usage flags");
    left_entry(j, "graph memory nodes", ps->graph_bytes, -1,
               "memory graphs allocate on launch (cuGraphAddMemAllocNode, cudaMallocAsync during stream capture): the graph "
               "owns its addresses; what no graph holds is trimmed (cuDeviceGraphMemTrim) before a checkpoint");
    left_entry(j, "VMM memory not readable whole", vmm_left, vmm_left_n,
               "the application's VMM memory with no single mapping over all of it with access set, or whose context ended");
    jb_arr_end(j);
    jb_str(j, "not_counted", "module globals and the context's own memory: the driver saves them in its own checkpoint "
                             "(level full); no CUDA call says how big they are");
    jb_sub(j, "stream_ordered");
    jb_int(j, "pools_served", ps->pools_served);
    jb_int(j, "pools_left_to_driver", ps->pools_native);
    jb_int(j, "used_bytes", (long long)ps->served_used);
    jb_int(j, "reserved_bytes", (long long)ps->served_reserved);
    jb_int(j, "allocations", (long long)ps->alloc_calls);
    jb_int(j, "cross_stream_waits", (long long)ps->cross_stream_waits);
    jb_int(j, "segments_released", (long long)ps->segments_released);
    jb_int(j, "captured_allocations", ps->captured_allocs);
    jb_int(j, "ipc_exports", ps->ipc_exports);
    jb_int(j, "ipc_imports", ps->ipc_imports);
    jb_end(j);
    jb_end(j);
}

void dp_preflight(char *why, size_t len)
{
    why[0] = 0;
    reg_lock();
    long shared = 0;
    for (struct phys *p = g_reg.all; p; p = p->next_all)
        if (p->share_unknown) shared++;   /* shared some other way than a POSIX fd the agent could keep */
    if (g_reg.lost)
        snprintf(why, len, "the agent could not record everything this process did (%ld times; first: %s), so a "
                 "checkpoint would miss it; restart the process", g_reg.lost, g_reg.lost_why);
    else if (g_reg.multicast_objects)
        snprintf(why, len, "the process uses multicast objects (cuMulticastCreate: %ld; NCCL's NVLS makes them), which no "
                 "CUDA checkpoint covers; run the job with NCCL_NVLS_ENABLE=0", g_reg.multicast_objects);
    else if (g_reg.fabric_shares)
        snprintf(why, len, "the process shares memory as fabric handles (%ld exports or imports), which gpucr cannot relink; "
                 "share it as POSIX file descriptors (NCCL: NCCL_CUMEM_ENABLE=1 on one host uses them)", g_reg.fabric_shares);
    else if (g_reg.managed_count)
        snprintf(why, len, "the process uses managed memory (cuMemAllocManaged / cudaMallocManaged: %ld allocations, %zu MiB), "
                 "which no CUDA checkpoint can save; allocate with cudaMalloc instead",
                 g_reg.managed_count, g_reg.managed_bytes >> 20);
    else if (g_reg.ipc_exports)
        snprintf(why, len, "the process exported memory with legacy CUDA IPC (cuIpcGetMemHandle, %ld exports), which the "
                 "driver's checkpoint cannot cover; share memory through VMM POSIX-fd handles instead", g_reg.ipc_exports);
    else if (shared)
        snprintf(why, len, "the process shares %ld VMM allocations with other processes through handles other than POSIX "
                 "file descriptors, which gpucr cannot relink", shared);
    reg_unlock();
    if (!why[0]) pool_refusal(why, len);
}
