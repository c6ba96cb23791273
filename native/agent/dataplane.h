#ifndef GPUCR_DATAPLANE_H
#define GPUCR_DATAPLANE_H
#include "agent.h"
#include "json.h"

struct phase_times {            /* milliseconds of the last checkpoint's phases in the process */
    double gate, sync, release;
    uint64_t bytes_out;         /* handed to the data plane */
};

/* The process's phase (dataplane.c's LEGAL table says which step leads from which to which). */
enum dp_phase {
    PH_RUNNING,    /* its memory on the GPU (after a restore, its gate may stay closed until "resume") */
    PH_QUIESCED,   /* gate closed, device still; nothing released (several processes' first phase) */
    PH_HANDED,     /* released to gpucr's data plane, which copies it; the agent's fds keep it on the GPU */
    PH_COPIED,     /* the plane's copy is in staging; the fds still keep the memory until the commit */
    PH_PARKED,     /* committed: the memory off the GPU, the data in staging */
    PH_ON_DISK,    /* committed, the data only in an image (staging given back) */
};

struct dp_status {
    enum dp_phase phase;
    long generation;            /* completed checkpoints */
    struct phase_times last;
};
/* What status says of a phase: checkpointed (the process's memory is not its own now), staged (in host memory). */
static inline bool dp_checkpointed(enum dp_phase ph) { return ph >= PH_HANDED; }
static inline bool dp_staged(enum dp_phase ph) { return ph == PH_COPIED || ph == PH_PARKED; }
const char *dp_phase_name(enum dp_phase ph);

/* Quiesce: gate closed, device still, nothing released (several processes go through each
 * phase together); abort undoes a quiesce or an uncommitted handover. */
int dp_quiesce(int timeout_ms, char *err, size_t errlen);
int dp_abort(char *err, size_t errlen);
/* The end of a restore, after adopt: every released allocation is back (else it stays checkpointed). */
int dp_restore(bool drop_staging, bool open_gate, char *err, size_t errlen);
void dp_get_status(struct dp_status *out);
/* Progress of the operation running now (or the last one): bytes moved and steps taken; a controller
 * reads them on a second connection and gives up only when they stop changing. */
void dp_get_progress(unsigned long long *bytes, unsigned long long *steps);
/* Coverage problems that make a checkpoint unsafe, as one line; empty when there are none. */
void dp_preflight(char *why, size_t len);
void dp_reset_after_fork(void);
/* Images: describe the staged data and hand out the staging segments' fds (on disk: the allocations an image holds,
 * in no segment); give staging up once the data is safe in an image. */
int dp_layout(struct jb *j, int *fds, int *nfds, int maxfds, char *err, size_t errlen);
int dp_drop_staged(char *err, size_t errlen);
/* Hold the staging the data plane made (staging.c's staging_hold), refused while staging holds the process's data. */
int dp_hold(const int *fds, int n, bool replace, int entry_fd, char *err, size_t errlen);
/* Shared memory (POSIX fds): list it; re-export after a restore; relink an importer; open the gate. */
void dp_shared_json(struct jb *j);
int dp_shared_fds(struct jb *j, int from, int *fds, int *nfds, int maxfds);
/* For a gpucr server: every device allocation the agent manages from the n-th on, with its mappings
 * and a dup of the agent's own fd of it (closed once sent); at most maxfds fds, the rest later. */
int dp_memory_fds(struct jb *j, int from, int *fds, int *nfds, int maxfds);
/* The GPUs the process uses, with its bytes on each (status's "devices"); the caller holds the registry lock. */
void dp_devices_json(struct jb *j);
/* whether a gpucr data plane can take p at a handover (dp_handable), or make it again at a restore (dp_makeable) */
struct phys;
bool dp_makeable(const struct phys *p);
bool dp_handable(const struct phys *p);
/* Memory shared with other processes, at a restore (relink.c): bind an import to its exporter's key, export it
 * again, relink each importer, or give it zeroed memory when its exporter is gone. */
int dp_bind(unsigned sid, unsigned long long key, long owner, unsigned long long owner_start, char *err, size_t errlen);
int dp_export(unsigned long long key, int *fd_out, struct jb *j, char *err, size_t errlen);
int dp_relink(unsigned long long key, int fd, char *err, size_t errlen);
int dp_orphan(unsigned long long key, size_t *bytes, char *err, size_t errlen);
int dp_resume(char *err, size_t errlen);
/* gpucr's data plane (docs/server.md): quiesce if need be and release every movable allocation, keeping the
 * agent's own fd of each so the memory stays on the GPU for the plane to copy; refused, nothing touched, when
 * any allocation cannot be handed over (to_image: given no place in staging, the plane writes it to an image
 * itself). dp_handed_done: the plane's copy is in staging. dp_commit: the fds let
 * go. dp_abort takes a handed process back, before commit. dp_adopt maps the plane's new memory. */
int dp_handover(int timeout_ms, bool to_image, char *err, size_t errlen);
int dp_handed_done(char *err, size_t errlen);
void dp_commit(void);
int dp_adopt(int from, const int *fds, int nfds, int *adopted, char *err, size_t errlen);
int dp_unadopt(int *undone, char *err, size_t errlen);
/* A two-way switch (docs/swap.md): the handed allocations numbered below `upto` whose copy landed in staging let go
 * before the commit (the agent's fd closed, the memory leaves the GPU once the plane lets go of its own). */
int dp_give_back(int upto, int *given, size_t *bytes, char *err, size_t errlen);
#endif
