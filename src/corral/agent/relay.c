/* corral-agent: the egress relay of the process and gVisor tiers. */
#include "agent.h"
#include "relay_mux.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>

/*
 * Egress relay (started as `corral-agent --relay PORT SOCKET`): the sandbox has
 * no network interface, only loopback, so programs reach the host's egress
 * proxy through this relay, which accepts on 127.0.0.1:PORT and [::1]:PORT and
 * forwards each connection to the proxy's Unix socket bound into the sandbox.
 * It enforces nothing: the proxy outside decides every destination.  One
 * process, one poll loop, non-blocking splice through a pipe per direction:
 * no fork or thread per connection (that cost ~1 ms a request under load) and
 * bytes never enter user space.
 */
#define RELAY_MAX 512
#define RELAY_PIPE (1 << 20)

struct half { int from, to, rd, wr; size_t queued; int eof, done; };
struct relay_conn { int used; struct half h[2]; };
static struct relay_conn conns[RELAY_MAX];

static void relay_close(struct relay_conn *c) {
    close(c->h[0].from);
    close(c->h[0].to);
    for (int i = 0; i < 2; i++) { close(c->h[i].rd); close(c->h[i].wr); }
    c->used = 0;
}

/* Move what the pipe holds to the destination; -1 on a dead connection. */
static int half_flush(struct half *h) {
    while (h->queued > 0) {
        ssize_t m = splice(h->rd, NULL, h->to, NULL, h->queued, SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
        if (m < 0) return (errno == EAGAIN || errno == EINTR) ? 0 : -1;
        h->queued -= (size_t)m;
    }
    if (h->eof && !h->done) { shutdown(h->to, SHUT_WR); h->done = 1; }
    return 0;
}

static int half_fill(struct half *h) {
    ssize_t n = splice(h->from, NULL, h->wr, NULL, RELAY_PIPE, SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
    if (n == 0) h->eof = 1;
    else if (n > 0) h->queued += (size_t)n;
    else if (errno != EAGAIN && errno != EINTR) return -1;
    return half_flush(h);
}

static void relay_accept(int listener, const char *path) {
    int client = accept4(listener, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (client < 0) return;
    struct relay_conn *c = NULL;
    for (int i = 0; i < RELAY_MAX && !c; i++) if (!conns[i].used) c = &conns[i];
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    int up = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int p0[2] = {-1, -1}, p1[2] = {-1, -1};
    if (!c || up < 0 || strlen(path) >= sizeof addr.sun_path) goto fail;
    strcpy(addr.sun_path, path);
    if (connect(up, (struct sockaddr *)&addr, sizeof addr) < 0) goto fail;
    fcntl(up, F_SETFL, O_NONBLOCK);
    if (pipe2(p0, O_CLOEXEC | O_NONBLOCK) < 0 || pipe2(p1, O_CLOEXEC | O_NONBLOCK) < 0) goto fail;
    fcntl(p0[1], F_SETPIPE_SZ, RELAY_PIPE);
    fcntl(p1[1], F_SETPIPE_SZ, RELAY_PIPE);
    c->used = 1;
    c->h[0] = (struct half){.from = client, .to = up, .rd = p0[0], .wr = p0[1]};
    c->h[1] = (struct half){.from = up, .to = client, .rd = p1[0], .wr = p1[1]};
    return;
fail:
    close(client);
    if (up >= 0) close(up);
    for (int i = 0; i < 2; i++) { if (p0[i] >= 0) close(p0[i]); if (p1[i] >= 0) close(p1[i]); }
}

/* A non-blocking listener on the loopback address of ``family`` (shared with relay_mux.c). */
int loopback_listener(int family, int port) {
    int fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return -1;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    int rc;
    if (family == AF_INET) {
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        rc = bind(fd, (struct sockaddr *)&a, sizeof a);
    } else {
        setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
        struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_port = htons((uint16_t)port)};
        a.sin6_addr = in6addr_loopback;
        rc = bind(fd, (struct sockaddr *)&a, sizeof a);
    }
    if (rc < 0 || listen(fd, 256) < 0) { close(fd); return -1; }
    return fd;
}

void relay_main(const int listeners[2], const char *path) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    /* (started holding nothing of pid 1's but its listeners: agent.c, start_relay) */
    const int l[2] = {listeners[0], listeners[1]};
    static struct pollfd pfds[2 + 2 * RELAY_MAX];
    static struct half *owner[2 + 2 * RELAY_MAX];
    static struct relay_conn *owner_conn[2 + 2 * RELAY_MAX];
    for (;;) {
        int n = 0;
        for (int i = 0; i < 2; i++) pfds[n++] = (struct pollfd){.fd = l[i], .events = POLLIN};
        for (int i = 0; i < RELAY_MAX; i++) {
            if (!conns[i].used) continue;
            for (int k = 0; k < 2; k++) {
                struct half *h = &conns[i].h[k];
                if (h->done) continue;
                owner[n] = h;
                owner_conn[n] = &conns[i];
                pfds[n++] = h->queued ? (struct pollfd){.fd = h->to, .events = POLLOUT}
                                      : (struct pollfd){.fd = h->from, .events = POLLIN};
            }
        }
        if (poll(pfds, (nfds_t)n, -1) < 0) continue;
        for (int i = 2; i < n; i++) {
            if (!pfds[i].revents) continue;
            struct half *h = owner[i];
            struct relay_conn *c = owner_conn[i];
            if (!c->used) continue;
            int rc = h->queued ? half_flush(h) : half_fill(h);
            if (rc < 0 || (c->h[0].done && c->h[1].done)) relay_close(c);
        }
        for (int i = 0; i < 2; i++)
            if (l[i] >= 0 && (pfds[i].revents & POLLIN)) relay_accept(l[i], path);
    }
}

/*
 * Port connector (run as a command: `/.corral/agent --connect PORT`): the
 * in-sandbox end of a forward for tiers whose loopback is not the host
 * kernel's (gVisor's netstack).  It connects to 127.0.0.1:PORT (then
 * [::1]:PORT) and copies stdin to the connection and the connection to
 * stdout; the end of stdin half-closes the connection, the end of the
 * connection ends the command.  The host carries its stdin and stdout over
 * the agent channel.  Exit 111 when nothing listens.
 */
int connect_main(int port) {
    struct sockaddr_in a4 = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    struct sockaddr_in6 a6 = {.sin6_family = AF_INET6, .sin6_port = htons((uint16_t)port),
                              .sin6_addr = IN6ADDR_LOOPBACK_INIT};
    int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0 || connect(s, (struct sockaddr *)&a4, sizeof a4) < 0) {
        if (s >= 0) close(s);
        s = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (s < 0 || connect(s, (struct sockaddr *)&a6, sizeof a6) < 0) return 111;
    }
    static char buf[65536];
    int up = 1, down = 1; /* stdin -> socket, socket -> stdout */
    while (up || down) {
        struct pollfd p[2] = {{.fd = up ? 0 : -1, .events = POLLIN}, {.fd = down ? s : -1, .events = POLLIN}};
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR) continue;
            return 1;
        }
        if (up && p[0].revents) {
            ssize_t n = read(0, buf, sizeof buf);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) {
                up = 0;
                shutdown(s, SHUT_WR);
            } else {
                write_all(s, buf, (size_t)n);
            }
        }
        if (down && p[1].revents) {
            ssize_t n = read(s, buf, sizeof buf);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) {
                /* the server is done sending: end here (the host learns of the end of stdout only
                 * from the exit), so a server's half-close ends the whole connection */
                down = 0;
                up = 0;
            } else {
                write_all(1, buf, (size_t)n);
            }
        }
    }
    return 0;
}
