/* The private runtime dir the control sockets live in (the same rule as gpucr/paths.py's), made once when the
 * channel starts; the host-memory ledger (admit.c) lives there too. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "agent.h"

static char g_dir[256];
static bool g_up;

/* agent.h: the private runtime dir, once the channel is up (NULL before or without it). */
const char *gpucr_runtime_dir(void) { return g_up ? g_dir : NULL; }

void gpucr_runtime_dir_up(bool up) { g_up = up; }

/* The runtime dir rule: the same table as gpucr/paths.py RUNTIME_DIR_RULES (tests/test_security.py
 * holds the two to it). The first rule whose setting is present names the dir:
 *   GPUCR_RUNTIME_DIR   that dir                   not private: refused, the channel is off
 *   XDG_RUNTIME_DIR     $XDG_RUNTIME_DIR/gpucr     not private: refused, the channel is off
 *   (neither)           /tmp/gpucr-<uid>           not private (anyone may take that name first): the
 *                                                  first private /tmp/gpucr-<uid>.* dir, else a new one
 *                                                  made here with mkdtemp (the controller looks there too)
 * Private: a directory, not a link (lstat), of this user, mode 0700. */
static bool dir_private(const char *d)
{
    struct stat st;
    return lstat(d, &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == getuid() && !(st.st_mode & 0077);
}

static int fallback_dir(const char *taken)
{
    char prefix[64], best[256] = "";
    int plen = snprintf(prefix, sizeof prefix, "gpucr-%u.", (unsigned)getuid());
    DIR *d = opendir("/tmp");
    for (struct dirent *e; d && (e = readdir(d));) {
        char path[300];
        snprintf(path, sizeof path, "/tmp/%s", e->d_name);
        if (!strncmp(e->d_name, prefix, (size_t)plen) && strlen(path) < sizeof best && dir_private(path) &&
            (!best[0] || strcmp(path, best) < 0))
            snprintf(best, sizeof best, "%s", path);
    }
    if (d) closedir(d);
    if (best[0]) snprintf(g_dir, sizeof g_dir, "%s", best);
    else {
        snprintf(g_dir, sizeof g_dir, "/tmp/%sXXXXXX", prefix);
        if (!mkdtemp(g_dir)) {
            gpucr_warn("error: %s is not a private directory of this user and no private one can be made (%s): "
                       "the control channel is OFF, this process cannot be checkpointed", taken, strerror(errno));
            return -1;
        }
    }
    gpucr_warn("%s is not a private directory of this user (someone else may have made it): the control channel is "
               "in %s instead", taken, g_dir);
    return 0;
}

const char *gpucr_make_runtime_dir(void)
{
    const char *env = getenv("GPUCR_RUNTIME_DIR"), *xdg = getenv("XDG_RUNTIME_DIR");
    bool fallback = false;
    if (env && *env) snprintf(g_dir, sizeof g_dir, "%s", env);
    else if (xdg && *xdg) snprintf(g_dir, sizeof g_dir, "%s/gpucr", xdg);
    else { snprintf(g_dir, sizeof g_dir, "/tmp/gpucr-%u", (unsigned)getuid()); fallback = true; }
    mkdir(g_dir, 0700);
    if (dir_private(g_dir)) return g_dir;
    if (fallback) {
        char taken[sizeof g_dir];
        snprintf(taken, sizeof taken, "%s", g_dir);
        return fallback_dir(taken) ? NULL : g_dir;
    }
    gpucr_warn("error: runtime dir %s is not a private directory of this user (want a directory, not a link, owned "
               "by uid %u with mode 0700): the control channel is OFF, this process cannot be checkpointed",
               g_dir, (unsigned)getuid());
    return NULL;
}
