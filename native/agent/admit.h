/* Admission of host staging: before staging grows, the growth must fit the user's host-memory
 * budget (GPUCR_HOST_BUDGET, shared by every process of this user under gpucr), and the memory
 * cgroup the process is charged to. A refusal comes before anything is touched, in one line naming
 * the limit, the need, what is available and what to do. */
#ifndef GPUCR_ADMIT_H
#define GPUCR_ADMIT_H
#include <stdbool.h>
#include <stddef.h>
#include "json.h"

/* The way past every host-memory limit, said by each refusal: staging in a file. An --image is
 * written from staging, so it does not avoid staging in memory by itself. */
#define ADMIT_ON_DISK "or stage on disk: 'gpucr run --staging file:DIR' (an --image alone is written from staging)"

/* The nearest memory cgroup limit over the process (v2: memory.max and memory.high up the tree;
 * v1: memory.limit_in_bytes). found false: no limit (or no cgroup could be read). */
struct cgroup_room {
    bool found;
    char path[256];             /* the cgroup directory whose limit binds */
    const char *file;           /* "memory.max", "memory.high" or "memory.limit_in_bytes" */
    unsigned long long limit, current;
};
void admit_cgroup_room(struct cgroup_room *out);

/* The budget in bytes (0: none), from GPUCR_HOST_BUDGET (a percentage is of MemTotal). */
unsigned long long admit_budget_bytes(void);

/* May this process add `need` bytes of host-memory staging to the `held` it has? Checks the budget
 * (all processes' staging together) and, when `charged` (shared memory, faulted in by this process),
 * the cgroup. On yes, `held + need` is recorded for the others to see until admit_record; on no,
 * err has the one line. */
int admit_reserve(size_t held, size_t need, bool charged, char *err, size_t errlen);
/* What this process's staging holds now (after it grew, shrank or was dropped). */
void admit_record(size_t held);
/* In a fork child: let go of the parent's ledger entry. */
void admit_reset_after_fork(void);
/* Status: host_budget_bytes, host_budget_used_bytes (every live process of this user under gpucr,
 * this one's `held` included) and the memory cgroup. */
void admit_status_json(struct jb *j, size_t held);
/* A /proc/meminfo value, in KiB (0 when absent). */
size_t host_meminfo_kib(const char *key);
#endif
