/* Copies through a small ring of pinned host buffers, CPU threads moving the data between the ring
 * and staging that stays unpinned. The ring is sized to the data, up to GPUCR_BOUNCE_MIB (default
 * 1024; 0 turns it off). The driver's checkpoint then handles only the ring's pinned memory instead
 * of every byte of staging, which it would otherwise unpin at checkpoint and pin again before its
 * restore returns. */
#ifndef GPUCR_BOUNCE_H
#define GPUCR_BOUNCE_H
#include "agent.h"

bool bounce_enabled(void);
/* Whether a ring is pinned and its threads run; without one, copies go to pageable staging directly. */
bool bounce_ready(void);
/* Why the last preparation failed, if it did (copied into out). */
bool bounce_problem(char *out, size_t len);
/* Pin a ring for allocations of these sizes (up to GPUCR_BOUNCE_MIB) and start the copy threads;
 * a ring big enough, and not more than twice what is needed, is kept. */
int bounce_prepare(CUcontext ctx, const size_t *sizes, int n, char *err, size_t errlen);
/* Queue one chunk: device -> ring -> host (out) or host -> ring -> device (in), on stream s. */
CUresult bounce_submit(CUcontext ctx, CUstream s, CUdeviceptr dev, void *host, size_t n, bool out);
/* Wait until every queued chunk is done; the first error since the last wait. */
CUresult bounce_wait(void);
size_t bounce_pinned_bytes(void);
void bounce_reset_after_fork(void);
/* A context ends (context.c): its slot events end with it. */
void bounce_forget_context(CUcontext ctx);
#endif
