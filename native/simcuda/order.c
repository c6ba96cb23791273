/*
 * The stream-ordering model. simcuda runs every piece of work synchronously, so data is always
 * up to date; what it models here is what CUDA promises about *order*, which is what a
 * stream-ordered allocator must respect: work enqueued on a stream is ordered after the work
 * before it on that stream, after the events it waited on (cuStreamWaitEvent), and after work the
 * host saw complete (a synchronize) before enqueuing it. Each stream has a vector clock over every
 * stream's positions; an event records its stream's clock; a synchronize adds what it waited for
 * to the host's clock. Completion is pessimistic: work counts as complete only once a
 * synchronize (or a successful query) observed it, one schedule a real GPU may also show.
 *
 * simcudaStreamPosition / simcudaStreamOrdered let a test ask whether the next work on a stream
 * is ordered after a given position: how the suite proves that memory freed on one stream was
 * handed to another only once the free was ordered before it.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "simcuda.h"

struct ostream {
    const void *key;          /* the stream handle, or a thread's per-thread stream; NULL: forgotten */
    uint64_t seq;             /* position of its last piece of work */
    struct sim_clock clock;   /* what its next piece of work is ordered after */
};

static struct {
    pthread_mutex_t mu;
    struct ostream *slot[SIM_ORDER_MAX];
    int n;
    struct sim_clock host;    /* what the host has seen complete */
} ord = {.mu = PTHREAD_MUTEX_INITIALIZER};

static __thread char per_thread_key;   /* its address names the calling thread's per-thread stream */

static const void *key_of(CUstream s)
{
    if (s == NULL || s == CU_STREAM_LEGACY) return CU_STREAM_LEGACY;
    if (s == CU_STREAM_PER_THREAD) return &per_thread_key;
    return s;
}

static void merge(struct sim_clock *into, const struct sim_clock *from)
{
    for (int i = 0; i < SIM_ORDER_MAX; i++)
        if (from->c[i] > into->c[i]) into->c[i] = from->c[i];
}

/* The slot of stream s (made on first use); ord.mu held. When every id is taken, a forgotten
 * stream's id is reused with its history cleared (its old positions then read as not ordered:
 * conservative); failing that, slot 0 (the legacy stream) stands in, merging orders: also safe. */
static int slot_of(CUstream s)
{
    const void *key = key_of(s);
    for (int i = 0; i < ord.n; i++)
        if (ord.slot[i] && ord.slot[i]->key == key) return i;
    int id = -1;
    if (ord.n < SIM_ORDER_MAX) {
        id = ord.n++;
        ord.slot[id] = calloc(1, sizeof(struct ostream));
        if (!ord.slot[id]) return 0;
    } else {
        for (int i = 1; i < ord.n && id < 0; i++)
            if (!ord.slot[i]->key) id = i;
        if (id < 0) {   /* said once: from here on streams share the legacy stream's order, and checks pass that should not */
            static bool said;
            if (!said) fprintf(stderr, "simcuda: more than %d streams alive at once: their order is no longer told apart\n",
                               SIM_ORDER_MAX);
            said = true;
            return 0;
        }
        ord.host.c[id] = 0;
        for (int i = 0; i < ord.n; i++) ord.slot[i]->clock.c[id] = 0;
        memset(ord.slot[id], 0, sizeof(struct ostream));
    }
    ord.slot[id]->key = key;
    return id;
}

struct sim_pos sim_order_op(CUstream s)
{
    pthread_mutex_lock(&ord.mu);
    int id = slot_of(s);
    struct ostream *o = ord.slot[id];
    merge(&o->clock, &ord.host);
    struct sim_pos p = {id, ++o->seq};
    pthread_mutex_unlock(&ord.mu);
    return p;
}

void sim_order_record(struct sim_clock *ev, CUstream s)
{
    struct sim_pos p = sim_order_op(s);
    pthread_mutex_lock(&ord.mu);
    *ev = ord.slot[p.id]->clock;
    ev->c[p.id] = p.seq;
    pthread_mutex_unlock(&ord.mu);
}

void sim_order_wait(CUstream s, const struct sim_clock *ev)
{
    pthread_mutex_lock(&ord.mu);
    merge(&ord.slot[slot_of(s)]->clock, ev);
    pthread_mutex_unlock(&ord.mu);
}

void sim_order_wait_pos(CUstream s, struct sim_pos p)
{
    pthread_mutex_lock(&ord.mu);
    struct ostream *o = ord.slot[slot_of(s)];
    if (o->clock.c[p.id] < p.seq) o->clock.c[p.id] = p.seq;
    pthread_mutex_unlock(&ord.mu);
}

void sim_order_sync_stream(CUstream s)
{
    pthread_mutex_lock(&ord.mu);
    int id = slot_of(s);
    merge(&ord.host, &ord.slot[id]->clock);
    if (ord.host.c[id] < ord.slot[id]->seq) ord.host.c[id] = ord.slot[id]->seq;
    pthread_mutex_unlock(&ord.mu);
}

void sim_order_sync_clock(const struct sim_clock *ev)
{
    pthread_mutex_lock(&ord.mu);
    merge(&ord.host, ev);
    pthread_mutex_unlock(&ord.mu);
}

void sim_order_sync_all(void)
{
    pthread_mutex_lock(&ord.mu);
    for (int i = 0; i < ord.n; i++) {
        merge(&ord.host, &ord.slot[i]->clock);
        if (ord.host.c[i] < ord.slot[i]->seq) ord.host.c[i] = ord.slot[i]->seq;
    }
    pthread_mutex_unlock(&ord.mu);
}

bool sim_order_done(const struct sim_clock *ev)
{
    pthread_mutex_lock(&ord.mu);
    bool done = true;
    for (int i = 0; i < SIM_ORDER_MAX && done; i++) done = ord.host.c[i] >= ev->c[i];
    pthread_mutex_unlock(&ord.mu);
    return done;
}

int sim_order_relation(CUstream s, struct sim_pos p)
{
    pthread_mutex_lock(&ord.mu);
    int id = slot_of(s);
    const struct ostream *o = ord.slot[id];
    int rel = (id == p.id && o->seq >= p.seq ? SIM_ORDER_SAME_STREAM : 0) |
              (o->clock.c[p.id] >= p.seq ? SIM_ORDER_EVENTS : 0) | (ord.host.c[p.id] >= p.seq ? SIM_ORDER_COMPLETE : 0);
    pthread_mutex_unlock(&ord.mu);
    return rel;
}

bool sim_order_pos_done(struct sim_pos p)
{
    pthread_mutex_lock(&ord.mu);
    bool done = ord.host.c[p.id] >= p.seq;
    pthread_mutex_unlock(&ord.mu);
    return done;
}

void sim_order_forget(CUstream s)
{
    pthread_mutex_lock(&ord.mu);
    const void *key = key_of(s);
    for (int i = 1; i < ord.n; i++)
        if (ord.slot[i]->key == key) ord.slot[i]->key = NULL;
    pthread_mutex_unlock(&ord.mu);
}

SIMAPI CUresult simcudaStreamPosition(CUstream s, unsigned long long *id, unsigned long long *seq)
{
    if (!id || !seq) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_stream_check(s);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&ord.mu);
    int i = slot_of(s);
    *id = (unsigned long long)i;
    *seq = ord.slot[i]->seq;
    pthread_mutex_unlock(&ord.mu);
    return CUDA_SUCCESS;
}

SIMAPI int simcudaStreamOrdered(CUstream s, unsigned long long id, unsigned long long seq)
{
    if (sim_stream_check(s) != CUDA_SUCCESS || id >= SIM_ORDER_MAX) return -1;
    return sim_order_relation(s, (struct sim_pos){(int)id, seq}) != 0;
}
