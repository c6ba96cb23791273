/* The control channel: one Unix socket per process, <runtime dir>/<pid>-<pid namespace inode>.sock,
 * in a directory only its user can enter. Requests are single lines "VERB key=value ...", at most
 * 4 KiB; each answer is one JSON line. Only the same user or root may connect (SO_PEERCRED).
 * docs/security.md says what each check stops. This file carries the bytes (the socket, its slots, the framing
 * with SCM_RIGHTS, the peer check) and the agent's start and fork; verbs.c answers each request. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include "dataplane.h"
#include "registry.h"
#include "report.h"
#include "verbs.h"
#include "json.h"

#define MAX_REQUEST 4096
#define MAX_CLIENTS 8
#define IDLE_TIMEOUT_S 30          /* a connection that never asked for a change (status, a monitor) */
#define EVICT_GRACE_MS 500         /* an idle connection younger than this is not evicted */
#define ACTED_TIMEOUT_S 3600       /* a controller's connection between its steps (driver lock, checkpoint) */

static char g_sock[300];
static ino_t g_sock_ino;           /* what we bound: at exit only that is removed */
static int g_listen = -1;
static pthread_mutex_t g_clients_mu = PTHREAD_MUTEX_INITIALIZER;

/* Only the process's own user or root; `why` says who was refused. Through a user namespace, a user
 * with no uid in it (host root seen from a container is one) appears as the overflow uid. */
static bool peer_allowed(int fd, char *why, size_t len)
{
    struct ucred cr;
    socklen_t clen = sizeof cr;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &clen) != 0) { snprintf(why, len, "permission denied"); return false; }
    if (cr.uid == getuid() || cr.uid == 0) return true;
    long overflow = 65534;
    FILE *f = fopen("/proc/sys/kernel/overflowuid", "re");
    if (f) { if (fscanf(f, "%ld", &overflow) != 1) overflow = 65534; fclose(f); }
    if ((long)cr.uid == overflow)
        snprintf(why, len, "permission denied: the peer has uid %u, the overflow uid: a user with no uid in this process's "
                 "user namespace (host root seen from inside a container is one) cannot control it; run gpucr inside "
                 "the process's namespaces, as its user or that namespace's root", (unsigned)cr.uid);
    else
        snprintf(why, len, "permission denied: only the process's own user or root may control it (peer uid %u)",
                 (unsigned)cr.uid);
    return false;
}

/* Send the answer; file descriptors, if any, ride along with its first byte. */
static void send_answer(struct client *c, struct jb *j)
{
    jb_close(j);
    size_t off = 0;
    if (c->nfds > 0) {
        char ctl[CMSG_SPACE(sizeof(int) * STAGING_MAX_SEGS)];
        memset(ctl, 0, sizeof ctl);
        struct iovec iov = {j->buf, j->len};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl,
                            .msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)c->nfds)};
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)c->nfds);
        memcpy(CMSG_DATA(cm), c->fds, sizeof(int) * (size_t)c->nfds);
        ssize_t n = sendmsg(c->fd, &mh, MSG_NOSIGNAL);
        if (c->close_sent)
            for (int i = 0; i < c->nfds; i++) close(c->fds[i]);
        c->close_sent = false;
        c->nfds = 0;
        if (n <= 0) return;
        off = (size_t)n;
    }
    while (off < j->len) {
        ssize_t n = send(c->fd, j->buf + off, j->len - off, MSG_NOSIGNAL);
        if (n <= 0) return;
        off += (size_t)n;
    }
}

/* ---- connections: at most MAX_CLIENTS at once. One that never asked for a change times out after
 * IDLE_TIMEOUT_S and is the first to go when a newcomer needs its slot, so idle connections (a hung
 * monitor, `gpucr status` left open) never keep out a controller that acts. ---- */
struct slot { unsigned long id; int fd; bool busy, acted; int64_t last_ns; };   /* id 0: free */
static struct slot g_slots[MAX_CLIENTS];
static unsigned long g_next_id;

/* Idle for a while (a newcomer gets EVICT_GRACE_MS to send its request), with no request waiting, and
 * never a controller's. */
static bool evictable(const struct slot *s, int64_t now)
{
    struct pollfd pf = {.fd = s->fd, .events = POLLIN};
    return !s->busy && !s->acted && now - s->last_ns >= EVICT_GRACE_MS * 1000000LL && poll(&pf, 1, 0) == 0;
}

/* A slot for c: a free one, else that of the oldest idle connection that never acted (shut down: its
 * thread sees the end and goes). False when every slot serves a request or a controller. */
static bool take_slot(struct client *c)
{
    pthread_mutex_lock(&g_clients_mu);
    int k = -1, idle = -1;
    int64_t now = gpucr_now_ns();
    for (int i = 0; i < MAX_CLIENTS; i++) {
        if (!g_slots[i].id) { k = i; break; }
        if (evictable(&g_slots[i], now) && (idle < 0 || g_slots[i].last_ns < g_slots[idle].last_ns)) idle = i;
    }
    if (k < 0 && idle >= 0) { shutdown(g_slots[idle].fd, SHUT_RDWR); k = idle; }
    if (k >= 0) {
        c->slot = k;
        c->id = ++g_next_id;
        g_slots[k] = (struct slot){c->id, c->fd, false, false, gpucr_now_ns()};
    }
    pthread_mutex_unlock(&g_clients_mu);
    return k >= 0;
}

/* Between requests (busy false) the connection is idle since now; once it acted it is a controller's. */
static void mark_slot(struct client *c, bool busy)
{
    pthread_mutex_lock(&g_clients_mu);
    struct slot *s = &g_slots[c->slot];
    if (s->id == c->id) { s->busy = busy; s->acted = c->acted || c->lease; s->last_ns = gpucr_now_ns(); }
    pthread_mutex_unlock(&g_clients_mu);
}

static void leave_slot(struct client *c)
{
    pthread_mutex_lock(&g_clients_mu);
    if (g_slots[c->slot].id == c->id) g_slots[c->slot].id = 0;   /* not if a newcomer took it */
    pthread_mutex_unlock(&g_clients_mu);
}

static void set_idle_timeout(int fd, int seconds)
{
    struct timeval tv = {seconds, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
}

static void *serve_client(void *arg)
{
    struct client *cp = arg, c = *cp;
    free(cp);
    struct jb j = {0};
    char *req = malloc(MAX_REQUEST + 1);
    size_t have = 0;
    if (!req) goto out;
    for (;;) {
        /* requests may carry file descriptors (relink, adopt): keep up to MAX_IN_FDS, close any others */
        char ctl[CMSG_SPACE(sizeof(int) * MAX_IN_FDS)];
        struct iovec iov = {req + have, MAX_REQUEST - have};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl, .msg_controllen = sizeof ctl};
        ssize_t n = recvmsg(c.fd, &mh, MSG_CMSG_CLOEXEC);
        if (n <= 0) break;
        for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
            if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
            int nfd = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            int *got = (int *)CMSG_DATA(cm);
            for (int i = 0; i < nfd; i++) {
                if (c.nin < MAX_IN_FDS) c.in[c.nin++] = got[i];
                else close(got[i]);
            }
        }
        have += (size_t)n;
        char *nl;
        bool acted = c.acted;
        mark_slot(&c, true);
        while ((nl = memchr(req, '\n', have))) {
            *nl = 0;
            size_t used = (size_t)(nl - req) + 1;
            if (memchr(req, 0, used - 1)) jb_error(&j, "malformed request: NUL byte");
            else verbs_handle(req, &j, &c);
            send_answer(&c, &j);
            for (int i = 0; i < c.nin; i++) close(c.in[i]);   /* a request's fds live as long as the request */
            c.nin = 0;
            memmove(req, req + used, have - used);
            have -= used;
        }
        mark_slot(&c, false);
        if (c.acted && !acted) set_idle_timeout(c.fd, ACTED_TIMEOUT_S);   /* a controller between its steps */
        if (have == MAX_REQUEST) {
            jb_error(&j, "request too long (at most 4096 bytes)");
            send_answer(&c, &j);
            /* read what the client still sends, briefly, so closing does not reset the answer away */
            shutdown(c.fd, SHUT_WR);
            set_idle_timeout(c.fd, 1);
            while (recv(c.fd, req, MAX_REQUEST, 0) > 0) {}
            break;
        }
    }
out:
    for (int i = 0; i < c.nin; i++) close(c.in[i]);
    leave_slot(&c);
    verbs_connection_ended(&c);
    jb_free(&j);
    free(req);
    close(c.fd);
    return NULL;
}

/* Answer a connection that is not served, and close it; what it already sent is read first (briefly),
 * so closing does not reset the answer away. */
static void refuse(int fd, const char *why)
{
    struct jb j = {0};
    struct client c = {.fd = fd};
    jb_error(&j, why);
    send_answer(&c, &j);
    jb_free(&j);
    shutdown(fd, SHUT_WR);
    char sink[512];
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    while (poll(&pf, 1, 200) > 0 && recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0) {}
    close(fd);
}

static void *accept_loop(void *arg)
{
    (void)arg;
    for (;;) {
        int fd = accept4(g_listen, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) { if (errno == EINTR || errno == ECONNABORTED) continue; break; }
        char why[400];
        if (!peer_allowed(fd, why, sizeof why)) { refuse(fd, why); continue; }   /* before it can take a slot */
        /* a client that says nothing, or stops mid-request, must not hold its slot for long */
        set_idle_timeout(fd, IDLE_TIMEOUT_S);
        struct client *c = calloc(1, sizeof *c);
        if (c) c->fd = fd;
        if (!c || !take_slot(c)) { free(c); refuse(fd, "busy: too many connections"); continue; }
        pthread_t th;
        if (pthread_create(&th, NULL, serve_client, c) != 0) {
            leave_slot(c);
            free(c);
            refuse(fd, "busy: too many connections");
            continue;
        }
        pthread_setname_np(th, "gpucr-client");
        pthread_detach(th);
    }
    return NULL;
}

static void remove_socket(void)
{
    struct stat st;
    /* only the socket we bound: after a crash another process may hold the name */
    if (g_sock[0] && g_listen >= 0 && lstat(g_sock, &st) == 0 && st.st_ino == g_sock_ino) unlink(g_sock);
}

/* Nothing listens there any more (its process died without removing it). */
static bool socket_stale(const char *path)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    bool stale = fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0 && errno == ECONNREFUSED;
    if (fd >= 0) close(fd);
    return stale;
}

/* Move the listening socket to its name, never over another's: a live agent of the same pid in another
 * run keeps its socket; a stale one (its process died) is replaced. */
static int publish(const char *tmp)
{
    for (int tries = 0; tries < 2; tries++) {
        int rc = renameat2(AT_FDCWD, tmp, AT_FDCWD, g_sock, RENAME_NOREPLACE);
        if (rc != 0 && (errno == ENOSYS || errno == EINVAL)) {   /* no renameat2 here: link is no-replace too */
            rc = link(tmp, g_sock);
            if (rc == 0) unlink(tmp);
        }
        if (rc == 0) return 0;
        if (errno != EEXIST || !socket_stale(g_sock)) break;
        unlink(g_sock);
    }
    return -1;
}

void gpucr_channel_start(void)
{
    const char *g_dir = gpucr_make_runtime_dir();
    if (!g_dir) return;
    struct stat ns;
    unsigned long long pidns = stat("/proc/self/ns/pid", &ns) == 0 ? (unsigned long long)ns.st_ino : 0;
    /* pids repeat across pid namespaces sharing a dir: the namespace is part of the name */
    snprintf(g_sock, sizeof g_sock, "%s/%d-%llu.sock", g_dir, (int)getpid(), pidns);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return;
    /* Bound under a temporary name and renamed once listening: a controller that sees the socket can
     * connect to it (between bind and listen it would be refused). */
    char tmp[sizeof g_sock + 32];
    snprintf(tmp, sizeof tmp, "%s/.%d-%llu.%llx.new", g_dir, (int)getpid(), pidns, (unsigned long long)gpucr_now_ns());
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(g_sock) >= sizeof sa.sun_path || strlen(tmp) >= sizeof sa.sun_path) {
        close(fd);
        gpucr_warn("runtime dir path too long: %s", g_dir);
        return;
    }
    strcpy(sa.sun_path, tmp);
    mode_t old = umask(0177);   /* the socket is born 0600 */
    int rc = bind(fd, (struct sockaddr *)&sa, sizeof sa);
    umask(old);
    if (rc != 0 || listen(fd, 8) != 0 || publish(tmp) != 0) {
        gpucr_warn("cannot listen on %s: %s", g_sock, errno == EEXIST ? "a live agent already listens there" : strerror(errno));
        if (rc == 0) unlink(tmp);
        close(fd);
        return;
    }
    struct stat st;
    g_sock_ino = lstat(g_sock, &st) == 0 ? st.st_ino : 0;
    g_listen = fd;
    gpucr_runtime_dir_up(true);
    gpucr_spawn_detached(accept_loop, NULL, "gpucr-channel");   /* it must not take signals meant for the application */
    gpucr_log("control channel at %s", g_sock);
}

/* ---- fork (agent.h says what may be done where) ---- */
static atomic_bool g_start_pending;   /* a fork child that has not used CUDA yet: no channel until it does */

static void before_fork(void) { reg_lock(); }
static void after_fork_parent(void) { reg_unlock(); }

static void after_fork_child(void)
{
    gpucr_gate_reset_after_fork();
    gpucr_thunks_reset_after_fork();
    gpucr_room_reset_after_fork();
    reg_reset_after_fork();
    dp_reset_after_fork();
    /* The parent's socket and connections are the parent's: close our copies (a copy would keep a
     * controller's connection open after the parent closed it), never unlink the socket. */
    if (g_listen >= 0) close(g_listen);
    g_listen = -1;
    g_sock[0] = 0;
    gpucr_runtime_dir_up(false);
    for (int i = 0; i < MAX_CLIENTS; i++)
        if (g_slots[i].id) close(g_slots[i].fd);
    memset(g_slots, 0, sizeof g_slots);
    verbs_reset_after_fork();
    g_clients_mu = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    atomic_store(&g_start_pending, true);
}

void gpucr_channel_first_use(void)
{
    if (!atomic_load_explicit(&g_start_pending, memory_order_relaxed)) return;
    if (!atomic_exchange(&g_start_pending, false)) return;   /* another thread of the child started it */
    gpucr_channel_start();
}

__attribute__((constructor)) static void agent_start(void)
{
    const char *off = getenv("GPUCR_AGENT_DISABLE");
    if (off && *off && *off != '0') return;
    report_read_group();
    share_raise_nofile();   /* the agent keeps an fd of every GPU allocation */
    gpucr_on_first_use(gpucr_channel_first_use);
    gpucr_channel_start();
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
    atexit(remove_socket);
}

__attribute__((destructor)) static void agent_stop(void) { remove_socket(); }
