/* Host staging: where device data waits while the process is checkpointed. Segments of shared
 * memory (2 MiB hugepages through hugetlbfs when the host has them free, else ordinary shared
 * memory, or a file in a chosen directory), sized to the data (up to GPUCR_STAGING_SEGMENT_MIB
 * each), touched by several threads and reused by every later cycle. They stay unpinned while the
 * copies go through the bounce ring (bounce.h); with the ring off, each is pinned once with
 * cuMemHostRegister. */
#ifndef GPUCR_STAGING_H
#define GPUCR_STAGING_H
#include "agent.h"

#define STAGING_MAX_SEGS 200   /* all their fds go in one SCM_RIGHTS message (Linux takes 253) */

struct staging_info {
    size_t bytes, pinned_bytes;
    size_t memory_bytes;        /* of them, in host memory (hugetlbfs or shm; not file:DIR): the budget's */
    int segments;
    const char *kind;           /* of the newest segment: "hugetlbfs", "shm", "file" or "none" */
    bool ahead;                 /* prepared in the background as allocations grow */
};

/* Make room for allocations of these sizes, placed first fit in this order (never moves what
 * exists). Staging that holds more than twice what is needed is given back first and made anew,
 * so call it only while nothing is staged. Needs a current context for pinning. 0, or -1 with err
 * set. */
int staging_fit(const size_t *sizes, int n, char *err, size_t errlen);
size_t *staging_movable_sizes(int *n, CUcontext *ctx);   /* malloc'd; the caller frees */
/* Hand out `size` bytes for this cycle (first fit), adding a segment if none has room (an allocation
 * made after staging_fit); NULL if that fails. */
void *staging_take(size_t size);
void staging_rewind(void);      /* the next cycle hands out from the start again */
void staging_drop(void);        /* give all host memory back */
int staging_count(void);
/* Unpin one segment (before the driver locks the process: an image's staging is dropped while the
 * driver holds the process, and pinned memory makes the driver's own checkpoint slower). */
void staging_unpin_segment(int i);
/* Pin the segment holding p again if it was unpinned, or wait for the pin-ahead thread that has it. */
void staging_pin_for(const void *p);
/* Start GPUCR_PIN_THREADS (default 4) threads that pin every unpinned segment again, lowest first,
 * while a restore copies the segments already pinned. Returns how many started. */
int staging_pin_ahead(CUcontext ctx);
void staging_get_info(struct staging_info *out);
/* Segment index and offset of a staging address; -1 if it is not in staging. */
int staging_locate(const void *p, int *seg, size_t *off);
/* The segments' file descriptors (to hand to the controller), sizes and kinds; returns the count. */
int staging_segments(int *fds, size_t *sizes, const char **kinds, int max);
/* Start the background preparer (GPUCR_STAGING_AHEAD=1): keeps capacity >= movable bytes. */
void staging_start_ahead(void);
void staging_reset_after_fork(void);
/* A context ends (context.c): segments pinned in it are unpinned while it still lives. */
void staging_forget_context(CUcontext ctx);
#endif
