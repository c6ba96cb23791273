/* What the agent says of itself (report.c): hello and status; its listings are declared in dataplane.h. */
#ifndef GPUCR_REPORT_H
#define GPUCR_REPORT_H
#include <stdbool.h>
#include "json.h"

/* How the checkpoint held now was committed by its controller (on purpose). */
enum committed { COMMITTED_NONE, COMMITTED_DATA, COMMITTED_FULL };

/* The channel's own state, which status says (verbs.c keeps it). */
struct channel_state {
    bool busy;                  /* a checkpoint, restore or roll-back is running now */
    bool rolling_back;
    int committed;              /* enum committed */
    unsigned long requests_served;
};

/* Whether the process has loaded a CUDA driver, through the agent or on its own. */
bool report_cuda_present(void);
/* GPUCR_GROUP, read once at start: the application may change its environment later. */
void report_read_group(void);
void report_hello(struct jb *j);
/* st: the process's phase, read before the channel's state (cs), as a controller reads "busy" after it. */
struct dp_status;
void report_status(struct jb *j, const struct dp_status *st, const struct channel_state *cs);
#endif
