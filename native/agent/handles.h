/* One allocation's life cycle at a checkpoint (handles.c): released for gpucr's data plane, and back at its
 * addresses. The registry lock is not held by the caller; each takes it where it records. */
#ifndef GPUCR_HANDLES_H
#define GPUCR_HANDLES_H
#include "registry.h"

/* Release `refs` references of handle h of p; each failure logged (the memory may stay on the GPU). */
void handle_release(CUmemGenericAllocationHandle h, int refs, const struct phys *p);
/* Map handle h at every mapping of p, with the access each had; all or nothing. */
CUresult handle_map_all(const struct phys *p, CUmemGenericAllocationHandle h);
/* Memory handed over as a POSIX fd, imported and mapped at every mapping of p; all or nothing (*h: the new handle). */
CUresult handle_import_at(const struct phys *p, int fd, CUmemGenericAllocationHandle *h);
/* p's memory is back as handle h, with `own` the agent's fd of it (`adopted`: memory the gpucr server made). */
void handle_back_in_place(struct phys *p, CUmemGenericAllocationHandle h, int own, bool fd_wanted, bool adopted);
/* p's (imported) memory is back, as handle h: the application's handle count decides whether h is kept. */
void handle_linked(struct phys *p, CUmemGenericAllocationHandle h);
/* Give back p's physical memory for gpucr's data plane to copy; the agent's own fd keeps it on the GPU. */
CUresult handle_hand_over(struct phys *p);
/* Every released allocation mapped again from the agent's fd of it; -1 (err: the first) when some stay released. */
int handle_take_back_all(char *err, size_t errlen);
#endif
