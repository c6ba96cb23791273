/* Host staging: where device data waits while the process is checkpointed. Segments of shared
 * memory (2 MiB hugepages through hugetlbfs when the host has them free, else ordinary shared
 * memory, or a file in a chosen directory), sized to the data (up to GPUCR_STAGING_SEGMENT_MIB
 * each), touched by several threads and reused by every later cycle. The agent makes them and
 * holds their fds (a parked process's data outlives a server); gpucr's data plane maps, pins and
 * fills them in its own process (src/gpucr/dataplane/). */
#ifndef GPUCR_STAGING_H
#define GPUCR_STAGING_H
#include "agent.h"

#define STAGING_MAX_SEGS 200   /* all their fds go in one SCM_RIGHTS message (Linux takes 253) */

struct staging_info {
    size_t bytes;
    size_t memory_bytes;        /* of them, in host memory (hugetlbfs or shm; not file:DIR): the budget's */
    int segments;
    const char *kind;           /* of the newest segment: "hugetlbfs", "shm", "file" or "none" */
};

/* Make room for allocations of these sizes, placed first fit in this order (never moves what
 * exists). Staging that holds more than twice what is needed is given back first and made anew,
 * so call it only while nothing is staged. 0, or -1 with err set. */
int staging_fit(const size_t *sizes, int n, char *err, size_t errlen);
size_t *staging_movable_sizes(int *n);   /* malloc'd; the caller frees */
/* Hand out `size` bytes for this cycle (first fit), adding a segment if none has room (an allocation
 * made after staging_fit); NULL if that fails. */
void *staging_take(size_t size);
void staging_rewind(void);      /* the next cycle hands out from the start again */
void staging_drop(void);        /* give all host memory back */
void staging_get_info(struct staging_info *out);
/* Segment index and offset of a staging address; -1 if it is not in staging. */
int staging_locate(const void *p, int *seg, size_t *off);
/* The segments' file descriptors (to hand to the controller), sizes and kinds; returns the count. */
int staging_segments(int *fds, size_t *sizes, const char **kinds, int max);
void staging_reset_after_fork(void);
#endif
