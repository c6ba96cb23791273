/* Host staging: where device data waits while the process is checkpointed. gpucr's data plane MAKES the
 * segments (memfds sealed against shrinking and growing, on hugetlbfs or shared memory, or files in a chosen
 * directory), faults them in, and keeps the host-memory budget (src/gpucr/dataplane/staging_make.py,
 * budget.py); the agent HOLDS their fds, so a parked process's data outlives any server, and places each
 * allocation in them, first fit. It plans what to ask for (staging_plan_json): the sizes rule lives here. */
#ifndef GPUCR_STAGING_H
#define GPUCR_STAGING_H
#include "agent.h"
#include "json.h"

#define STAGING_MAX_SEGS 200   /* all their fds go in one SCM_RIGHTS message (Linux takes 253) */

struct staging_info {
    size_t bytes;
    size_t memory_bytes;        /* of them, in host memory (hugetlbfs or shm; not file:DIR): the budget's */
    int segments;
    const char *kind;           /* of the newest segment: "hugetlbfs", "shm", "file" or "none" */
};

/* Hold these segment files (the plane made them): each checked (a regular file; a memfd sealed against
 * shrinking and growing, or an unlinked file when GPUCR_STAGING=file:DIR; of the kind asked for), then kept as
 * a dup. `replace`: the segments held so far are given back first (only while nothing is staged). entry_fd
 * (-1: none): the process's entry in the budget's ledger, with a shared flock on it that lasts while it is
 * held: the entry counts exactly while the process lives. 0, or -1 with err set (nothing held changed). */
int staging_hold(const int *fds, int n, bool replace, int entry_fd, char *err, size_t errlen);
/* The segments to ask the plane for so that every allocation `staged` picks (at_checkpoint: those a checkpoint
 * moves now; else those staged at the last one, to be read from an image) has a place, first fit, in that
 * order: {"add": [bytes...], "replace": bool, "need_bytes": N} under "staging_plan". Staging holding more than
 * twice what is needed, and more than a segment's target beyond it, is given back first (replace). */
void staging_plan_json(struct jb *j, bool at_checkpoint);
/* Hand out `size` bytes for this cycle (first fit); 0 with its segment and offset, -1 when no segment has room
 * (the caller refuses: the plane makes staging, the agent never does). */
int staging_take(size_t size, int *seg, size_t *off);
void staging_rewind(void);      /* the next cycle hands out from the start again */
void staging_drop(void);        /* give every segment back, and the ledger entry with them */
void staging_get_info(struct staging_info *out);
/* The segments' file descriptors (to hand to the controller), sizes and kinds; returns the count. */
int staging_segments(int *fds, size_t *sizes, const char **kinds, int max);
void staging_reset_after_fork(void);
#endif
