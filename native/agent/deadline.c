/* Work with a deadline (deadline.h). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include "deadline.h"

void job_put(struct deadline_job *j)
{
    pthread_mutex_lock(&j->mu);
    bool last = --j->refs == 0;
    pthread_mutex_unlock(&j->mu);
    if (last) { pthread_mutex_destroy(&j->mu); pthread_cond_destroy(&j->cv); free(j->ctxs); free(j); }
}

static void *job_thread(void *arg)
{
    struct deadline_job *j = arg;
    int rc = j->fn(j);
    pthread_mutex_lock(&j->mu);
    j->rc = rc;
    j->done = true;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    job_put(j);
    return NULL;
}

struct deadline_job *job_new(int (*fn)(struct deadline_job *))
{
    struct deadline_job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    j->refs = 2;
    j->fn = fn;
    return j;
}

int job_run(struct deadline_job *j, int64_t deadline_ns)
{
    if (!gpucr_spawn_detached(job_thread, j, "gpucr-job")) {
        j->rc = -1;
        snprintf(j->err, sizeof j->err, "cannot start a thread");
        j->refs = 1;
        return 0;
    }
    pthread_mutex_lock(&j->mu);
    while (!j->done && gpucr_now_ns() < deadline_ns) gpucr_cond_wait_step(&j->cv, &j->mu, deadline_ns);
    bool done = j->done;
    pthread_mutex_unlock(&j->mu);
    return done ? 0 : -1;
}
