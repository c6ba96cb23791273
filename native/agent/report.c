/* What the agent reports to a controller beyond its state: the GPUs it uses, and its listings with fds over
 * SCM_RIGHTS (docs/server.md, "Handing the fds to a controller"): the memory it manages, for a gpucr data plane
 * to import, and the memory it shares with other processes. Each page is bounded (docs/security.md); the
 * registry lock is held while a page is written. */
#include "dataplane.h"
#include "registry.h"

/* Bytes of the plain allocations in `map` that are on device dev. */
static size_t native_on(const struct hmap *map, int dev)
{
    size_t n = 0;
    uint64_t key;
    void *val;
    for (size_t i = 0; (i = hmap_next(map, i, &key, &val)) < map->cap; i++)
        if (reg_native_dev(val) == dev) n += reg_native_size(val);
    return n;
}

/* The GPUs the process uses, as its contexts were made (the controller checks a restore's
 * --map against them); the caller holds the registry lock. */
void dp_devices_json(struct jb *j)
{
    jb_arr(j, "devices");
    for (int i = 0; i < g_reg.nctx; i++) {
        int k = 0, dev = g_reg.ctxs[i].dev;
        while (k < i && g_reg.ctxs[k].dev != dev) k++;
        if (k < i) continue;   /* a second context on the same device */
        const unsigned char *u = g_reg.ctxs[i].uuid;
        char uuid[48];
        reg_uuid_text(u, uuid);
        size_t bytes = 0, adopted = 0;
        for (struct phys *p = g_reg.all; p; p = p->next_all)
            if (p->kind != PHYS_IMPORTED && p->prop.location.id == dev) {
                bytes += p->size;
                if (p->adopted && !reg_phys_released(p)) adopted += p->size;
            }
        jb_sub(j, NULL);
        jb_int(j, "ordinal", dev);
        jb_str(j, "uuid", uuid);
        jb_int(j, "vmm_bytes", (long long)bytes);
        /* held now but made by the gpucr server: per-process counts leave it out, the controller adds it */
        jb_int(j, "adopted_bytes", (long long)adopted);
        jb_int(j, "driver_bytes", (long long)(native_on(&g_reg.native_by_va, dev) + native_on(&g_reg.pool_by_va, dev)));
        jb_end(j);
    }
    jb_arr_end(j);
}

/* ---- memory shared with other processes through POSIX fds (share.c says how it is named) ---- */

/* One page of a listing of the allocations `listed` picks (all when NULL), from the from-th of them on,
 * with at most maxfds fds: `entry` writes one allocation's fields and gives the fd to send with it (-1:
 * none); "total", "fd_index", the closing "next" (-1 after the last page) and the registry lock are the
 * pager's. "total" (how many the whole listing has) comes first: a controller bounds the listing by it. */
static void fd_page(struct jb *j, const char *key, int from, int *fds, int *nfds, int maxfds,
                    bool (*listed)(const struct phys *), int (*entry)(struct jb *, const struct phys *, int index))
{
    *nfds = 0;
    jb_bool(j, "ok", true);
    reg_lock();
    int total = 0;
    for (struct phys *p = g_reg.all; p; p = p->next_all) total += !listed || listed(p);
    jb_int(j, "total", total);
    jb_arr(j, key);
    int k = 0, next = -1;
    for (struct phys *p = g_reg.all; p; p = p->next_all) {
        if (listed && !listed(p)) continue;
        if (k++ < from) continue;
        if (*nfds >= maxfds) { next = k - 1; break; }
        jb_sub(j, NULL);
        int fd = entry(j, p, k - 1);
        jb_int(j, "fd_index", fd >= 0 ? *nfds : -1);
        jb_end(j);
        if (fd >= 0) fds[(*nfds)++] = fd;
    }
    reg_unlock();
    jb_arr_end(j);
    jb_int(j, "next", next);
}

static bool is_shared(const struct phys *p) { return p->share_sid != 0; }

/* a shared allocation, with the agent's own dup of its fd when it still has one (never ours to close) */
static int shared_entry(struct jb *j, const struct phys *p, int index)
{
    (void)index;
    jb_int(j, "sid", p->share_sid);
    jb_str(j, "role", p->kind == PHYS_IMPORTED ? "importer" : "exporter");
    jb_int(j, "key", (long long)p->share_key);
    if (p->kind == PHYS_IMPORTED) jb_int(j, "owner", p->share_owner_pid);
    jb_int(j, "bytes", (long long)p->size);
    return p->share_ndups ? p->share_dups[0] : -1;
}

/* The shared allocations from the n-th on, with the agent's fd of each that still has one (for a
 * controller to compare with other processes'; at most maxfds fds, the rest on a later call). */
int dp_shared_fds(struct jb *j, int from, int *fds, int *nfds, int maxfds)
{
    fd_page(j, "shared", from, fds, nfds, maxfds, is_shared, shared_entry);
    return 0;
}

static const char *kind_name(const struct phys *p)
{
    if (p->pool_seg) return "pool";
    return p->kind == PHYS_CONVERTED ? "converted" : p->kind == PHYS_APP_VMM ? "app_vmm" : "imported";
}

/* a managed allocation, with a dup of the agent's fd of it, sent and then closed: a free on another
 * thread meanwhile cannot make it another file */
static int memory_entry(struct jb *j, const struct phys *p, int index)
{
    int fd = share_dup_own(p);
    jb_int(j, "index", index);
    jb_str(j, "kind", kind_name(p));
    jb_int(j, "bytes", (long long)p->size);
    jb_int(j, "device", reg_ctx_device(p->ctx));   /* the GPU of the context it was made in */
    char uuid[48];
    reg_ctx_uuid(p->ctx, uuid);
    jb_str(j, "uuid", uuid);   /* the same GPU for a process that numbers them otherwise (a server) */
    jb_bool(j, "released", reg_phys_released(p));
    jb_str(j, "state", reg_alloc_state_name(p->state));   /* live | handed | parked */
    jb_bool(j, "not_exportable", p->own_fd_missing);
    jb_bool(j, "movable", reg_phys_movable(p));
    /* a server can take it at a handover (else it refuses), or, released, make it again at a restore */
    jb_bool(j, "handable", reg_phys_released(p) ? dp_makeable(p) : dp_handable(p));
    jb_int(j, "rdma", p->prop.allocFlags.gpuDirectRDMACapable);
    jb_int(j, "compression", p->prop.allocFlags.compressionType);
    jb_int(j, "usage", p->prop.allocFlags.usage);
    jb_arr(j, "maps");
    for (const struct mapping *m = p->maps; m; m = m->next) {
        jb_sub(j, NULL);
        jb_int(j, "va", (long long)m->va);
        jb_int(j, "bytes", (long long)m->size);
        jb_int(j, "offset", (long long)m->offset);
        jb_end(j);
    }
    jb_arr_end(j);
    return fd;
}

int dp_memory_fds(struct jb *j, int from, int *fds, int *nfds, int maxfds)
{
    fd_page(j, "memory", from, fds, nfds, maxfds, NULL, memory_entry);
    return 0;
}

void dp_shared_json(struct jb *j)
{
    jb_arr(j, "shared");
    reg_lock();
    for (struct phys *p = g_reg.all; p; p = p->next_all) {
        if (!p->share_sid) continue;
        jb_sub(j, NULL);
        jb_int(j, "sid", p->share_sid);
        jb_str(j, "role", p->kind == PHYS_IMPORTED ? "importer" : "exporter");
        jb_int(j, "key", (long long)p->share_key);
        if (p->kind == PHYS_IMPORTED) {
            jb_int(j, "owner", p->share_owner_pid);
            jb_int(j, "owner_start", (long long)p->share_owner_start);
        }
        jb_int(j, "bytes", (long long)p->size);
        jb_bool(j, "unlinked", reg_phys_released(p));
        jb_int(j, "open_fds", share_open_fds(p));
        jb_end(j);
    }
    reg_unlock();
    jb_arr_end(j);
}
