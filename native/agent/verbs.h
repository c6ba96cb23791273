/* The channel's requests (verbs.c): one connection's state, as channel.c carries it, and what it asks of verbs.c. */
#ifndef GPUCR_VERBS_H
#define GPUCR_VERBS_H
#include "json.h"
#include "staging.h"

/* fds a request may carry: one for a relink, a batch of new memory for adopt */
#define MAX_IN_FDS 64

/* One connection. A checkpoint asked for with lease=1 belongs to its connection until the
 * controller says "commit": if the connection ends first (the controller died), the agent rolls
 * the process back to running by itself. */
struct client {
    int fd;
    bool lease;                 /* this connection's checkpoint is not committed yet */
    int fds[STAGING_MAX_SEGS];  /* to send with the answer (SCM_RIGHTS) */
    int nfds;
    bool close_sent;            /* the fds sent are ours to close afterwards (a re-export) */
    int in[MAX_IN_FDS];         /* received with the request (SCM_RIGHTS) */
    int nin;
    bool acted;                 /* it asked for a change (handle_op) or watches (watch.c): never evicted as idle */
    bool watches;               /* a server's watch (watch.c): room requests wait for its next watch until it ends */
    int slot;                   /* its place in channel.c's slots while it holds it */
    unsigned long id;
};

/* Answer one request line (NUL-free, without its newline) into j; c's fds go with the answer. */
void verbs_handle(const char *req, struct jb *j, struct client *c);
/* The connection ended: a checkpoint or staging it held under a lease is undone. */
void verbs_connection_ended(const struct client *c);
void verbs_reset_after_fork(void);
#endif
