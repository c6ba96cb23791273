/* Work with a deadline: cuCtxSynchronize has none, so it runs in a helper thread ("gpucr-job") that is left to
 * finish on its own if the deadline passes. */
#ifndef GPUCR_DEADLINE_H
#define GPUCR_DEADLINE_H
#include "agent.h"

struct deadline_job {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    bool done;
    int (*fn)(struct deadline_job *);
    int rc;
    char err[512];
    CUcontext *ctxs;            /* sync job: contexts to synchronise (malloc'd) */
    int nctx;
};

/* A job running fn, held twice (by its thread and by the caller, who lets go with job_put). */
struct deadline_job *job_new(int (*fn)(struct deadline_job *));
/* Run it; 0 when it finished in time (its own result in j->rc), -1 when the deadline passed. */
int job_run(struct deadline_job *j, int64_t deadline_ns);
void job_put(struct deadline_job *j);
#endif
