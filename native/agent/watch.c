/* The swap service's watch (the `watch` verb): a server's request that waits, with no polling, for demand at the
 * closed gate, a room request, or the gate opened by someone else; then says which. Above the gate and room.c. */
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "agent.h"
#include "json.h"

/* What a watch waits for: demand at the closed gate, a room request, or the gate opened since the watch began (a
 * restore by someone else, or a park that failed). */
static bool opened_since(long opens) { return gpucr_gate_opens() != opens && !gpucr_gate_is_closed(); }

static bool watch_done(long opens, long long seen)
{
    long long demand = gpucr_gate_demand_ns();
    return (demand && demand != seen) || gpucr_room_pending() || opened_since(opens);
}

void gpucr_gate_watch(struct jb *j, const char *req, int client_fd)
{
    /* the verdict on the room request the last watch forwarded: room=1 made, room=2 none */
    if (strstr(req, " room=1")) gpucr_room_verdict(true);
    else if (strstr(req, " room=2")) gpucr_room_verdict(false);
    /* seen=NS: the server declined that demand (not its park, or its resume failed); wait for another, which the
     * gate notes again from now (a later demand of this closed period is not locked out by the first) */
    const char *seen_at = strstr(req, " seen=");
    long long seen = seen_at ? strtoll(seen_at + 6, NULL, 10) : 0;
    gpucr_gate_demand_declined(seen);
    int efd = gpucr_gate_demand_fd();
    if (efd < 0) { jb_error(j, "watch: no eventfd can be made"); return; }
    struct pollfd pf[2] = {{.fd = efd, .events = POLLIN}, {.fd = client_fd, .events = POLLIN}};
    long opens = gpucr_gate_opens();
    /* the conditions are looked at after the fd is published: what was raised before is seen here, what is raised
     * after writes the fd */
    while (!watch_done(opens, seen)) {
        if (poll(pf, 2, -1) < 0) continue;
        uint64_t n;
        if (pf[0].revents & POLLIN && read(efd, &n, sizeof n) < 0) { /* drained by another watch */ }
        if (pf[1].revents) break;   /* the server hung up, or sent something: this watch ends */
    }
    /* counted before the demand is read: a call between the two is taken as unseen (a wake too many, never one lost) */
    long long demands = gpucr_gate_demands_answered();
    long long demand = gpucr_gate_demand_ns();
    jb_bool(j, "ok", true);
    if (gpucr_room_pending()) { jb_str(j, "woke", "room"); gpucr_room_json(j); }
    else if (demand && demand != seen) jb_str(j, "woke", "demand");
    else jb_str(j, "woke", opened_since(opens) ? "opened" : "hung up");
    jb_int(j, "demand_ns", demand);
    jb_int(j, "demands", demands);
    jb_int(j, "now_ns", (long long)gpucr_now_ns());
}
