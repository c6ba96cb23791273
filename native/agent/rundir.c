/* The private runtime dir the control sockets live in, by the rules of rules.h (gpucr's controller reads the
 * same), made once when the channel starts; the host-memory ledger (src/gpucr/dataplane/budget.py) lives there too. */
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
#include "rules.h"

static char g_dir[256];
static bool g_up;

/* agent.h: the private runtime dir, once the channel is up (NULL before or without it). */
const char *gpucr_runtime_dir(void) { return g_up ? g_dir : NULL; }

void gpucr_runtime_dir_up(bool up) { g_up = up; }

/* Private: a directory, not a link (lstat), of this user, mode 0700. */
static bool dir_private(const char *d)
{
    struct stat st;
    return lstat(d, &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == getuid() && !(st.st_mode & 0077);
}

/* The default dir `taken` is not private: the first private one beside it named after it (in name order),
 * else a new one made here (mkdtemp). */
static int fallback_dir(const char *taken)
{
    char prefix[64], best[256] = "";
    int plen = snprintf(prefix, sizeof prefix, GPUCR_RUNTIME_DIR_DEFAULT_NAME ".", (unsigned)getuid());
    DIR *d = opendir(GPUCR_RUNTIME_DIR_DEFAULT_PARENT);
    for (struct dirent *e; d && (e = readdir(d));) {
        char path[300];
        snprintf(path, sizeof path, GPUCR_RUNTIME_DIR_DEFAULT_PARENT "/%s", e->d_name);
        if (!strncmp(e->d_name, prefix, (size_t)plen) && strlen(path) < sizeof best && dir_private(path) &&
            (!best[0] || strcmp(path, best) < 0))
            snprintf(best, sizeof best, "%s", path);
    }
    if (d) closedir(d);
    if (best[0]) snprintf(g_dir, sizeof g_dir, "%s", best);
    else {
        snprintf(g_dir, sizeof g_dir, GPUCR_RUNTIME_DIR_DEFAULT_PARENT "/%sXXXXXX", prefix);
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

static const struct { const char *setting, *suffix; } RULES[] = {
#define RULE(setting, suffix) {setting, suffix},
    GPUCR_RUNTIME_DIRS(RULE)
#undef RULE
};

/* g_dir as the first rule whose setting is set names it; false: none is, g_dir is the default one. */
static bool name_by_rules(void)
{
    for (size_t i = 0; i < sizeof RULES / sizeof *RULES; i++) {
        const char *v = getenv(RULES[i].setting);
        if (v && *v) {
            snprintf(g_dir, sizeof g_dir, "%s%s", v, RULES[i].suffix);
            return true;
        }
    }
    snprintf(g_dir, sizeof g_dir, GPUCR_RUNTIME_DIR_DEFAULT_PARENT "/" GPUCR_RUNTIME_DIR_DEFAULT_NAME, (unsigned)getuid());
    return false;
}

const char *gpucr_make_runtime_dir(void)
{
    bool fallback = !name_by_rules();
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
