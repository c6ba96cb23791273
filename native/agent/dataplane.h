#ifndef GPUCR_DATAPLANE_H
#define GPUCR_DATAPLANE_H
#include "agent.h"
#include "json.h"

struct phase_times {            /* milliseconds of the last cycle's phases */
    double staging, gate, sync, copy_out, release, copy_in;
    double pin_wait;            /* part of copy_in spent waiting for staging to be pinned again */
    uint64_t bytes_out, bytes_in, bytes_zeroed;
};

enum agent_state { AGENT_RUNNING, AGENT_CHECKPOINTED };

struct dp_status {
    enum agent_state state;
    bool staged;
    bool quiesced, copied;      /* a checkpoint of several processes is between its phases */
    bool handed;                /* released, its data being copied by a gpucr server (dp_handover) */
    long generation;            /* completed checkpoints */
    struct phase_times last;
};

/* Close the gate, synchronise, copy every movable allocation out and release its physical memory.
 * On failure nothing is released, the gate is open again, and err says why. */
int dp_checkpoint(int timeout_ms, bool unpin, bool hold, char *err, size_t errlen);
/* The phases of dp_checkpoint one by one, for several processes going through each together:
 * quiesce (staging ready, gate closed, device still), checkpoint with hold (copied, nothing
 * released), release (memory given back: checkpointed); abort undoes a quiesce or a held copy. */
int dp_quiesce(int timeout_ms, char *err, size_t errlen);
int dp_release(char *err, size_t errlen);
int dp_abort(char *err, size_t errlen);
/* Re-create, re-map and copy back; then open the gate. On failure the process stays checkpointed. */
int dp_restore(int timeout_ms, bool drop_staging, bool wait_ready, bool open_gate, char *err, size_t errlen);
/* The controller says an allocation's data is in staging (restore from an image), or gives up. */
int dp_mark_ready(unsigned long long va, bool abort_all);
/* The image says this 64 MiB chunk of the allocation at va is all zero: set it on the device, copy nothing. */
int dp_mark_zero(unsigned long long va, unsigned long long offset);
void dp_get_status(struct dp_status *out);
/* Progress of the operation running now (or the last one): bytes moved and steps taken; a controller
 * reads them on a second connection and gives up only when they stop changing. */
void dp_get_progress(unsigned long long *bytes, unsigned long long *steps);
/* The controller read and verified another chunk of an image: the wait for its data is not idle. */
void dp_mark_progress(void);
/* The connection that asked for the running operation (-1: none); a long wait ends when it goes away. */
void dp_watch_requester(int fd);
/* Coverage problems that make a checkpoint unsafe, as one line; empty when there are none. */
void dp_preflight(char *why, size_t len);
void dp_reset_after_fork(void);
/* Images: describe the staged data and hand out the staging segments' fds; give staging up once
 * the data is safe in an image; re-create staging to be filled from an image before a restore. */
int dp_layout(struct jb *j, int *fds, int *nfds, int maxfds, char *err, size_t errlen);
int dp_drop_staged(char *err, size_t errlen);
int dp_stage(char *err, size_t errlen);
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
int dp_bind(unsigned sid, unsigned long long key, long owner, unsigned long long owner_start, char *err, size_t errlen);
int dp_export(unsigned long long key, int *fd_out, struct jb *j, char *err, size_t errlen);
int dp_relink(unsigned long long key, int fd, char *err, size_t errlen);
int dp_orphan(unsigned long long key, size_t *bytes, char *err, size_t errlen);
int dp_resume(char *err, size_t errlen);
/* The gpucr server's data plane (docs/server.md): quiesce if need be and release every movable allocation,
 * keeping the agent's own fd of each so the memory stays on the GPU for the server to copy; refused,
 * nothing touched, when any allocation cannot be handed over. dp_handed_done: the server's copy is in
 * staging, the fds let go. dp_abort takes a handed process back. dp_adopt maps the server's new memory. */
int dp_handover(int timeout_ms, bool unpin, char *err, size_t errlen);
int dp_handed_done(char *err, size_t errlen);
int dp_adopt(int from, const int *fds, int nfds, int *adopted, char *err, size_t errlen);
/* A context ends (context.c): drop the copy streams made in it. */
void dp_forget_context(CUcontext ctx);
#endif
