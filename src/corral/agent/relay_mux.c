/*
 * Multiplexing egress relay: `corral-agent --relay-mux WAITFD`, the microVM
 * guest's side of network="allow".
 *
 * A VM has no network device and no vsock here, so the host's egress proxy
 * cannot be bound in as a Unix socket (as the process and gVisor tiers do).
 * Instead the guest has a second virtio-serial port, "corral-net", and this
 * relay carries every proxy connection over it: it accepts on 127.0.0.1:PORT
 * and [::1]:PORT and multiplexes each connection onto the port; on the host a
 * bridge opens one connection to the proxy's Unix socket per guest connection.
 * It enforces nothing: the proxy decides every destination, and the host
 * treats everything arriving on the port as untrusted.
 *
 * Frames, both directions: u8 type | u32 connection | u32 length | payload
 * (little endian, as the agent's).  OPEN (guest only), DATA, EOF (no more data
 * this way: half close), CLOSE (connection gone), CREDIT (u32: bytes the
 * receiver has passed on).  Flow control is per connection and credit based:
 * a side sends at most a window of DATA the other side has not credited, so a
 * client that stops reading a big download holds up only its own connection,
 * and neither side buffers more than its window per connection.  The
 * port itself is always read.  Connection numbers are never reused (a 32-bit
 * counter), so a late frame for a closed connection is simply dropped.
 *
 * Started by guestinit before the template snapshot with the port on fd 0: it
 * says "w" on WAITFD and blocks.  In `allow` mode pid 1 writes the TCP port to
 * listen on after the restore and waits for "l" (listening) before it lets the
 * agent start; otherwise it never writes, and the relay stays
 * blocked (a restored VM runs none of its code: under TCG that would be fresh
 * translation on every sandbox's start).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "relay_mux.h"

enum { M_HELLO = 1, M_OPEN = 2, M_DATA = 3, M_EOF = 4, M_CLOSE = 5, M_CREDIT = 6 };

#define HDR 9
#define MUX_CHUNK 65536            /* largest DATA payload (the host enforces it too) */
/* Windows per connection, each must match the host's (egress_bridge.py).  Under
 * TCG a credit's round trip is milliseconds, so a download needs a large window
 * (100 MB through curl: 27 MB/s with 256 KiB, 41 MB/s with 1 MiB); it is guest
 * memory, and only a client that does not read makes the relay hold it.  The
 * host buffers what the guest sends: that window stays small. */
#define DOWN_WINDOW (1024 * 1024)  /* host -> guest: what we may have to buffer */
#define UP_WINDOW (256 * 1024)     /* guest -> host: what the host may have to buffer */
#define CREDIT_STEP (DOWN_WINDOW / 4) /* credit in batches, not per read */
#define MUX_MAX 256                /* connections at once (the host caps them too) */
#define PORT_WRITE (32 * 1024)     /* virtio_console takes at most 32 KiB per write */
#define OUTQ_HIGH (256 * 1024)     /* stop reading clients above this much queued for the port */
/* above this, stop reading the port too (its frames make CREDIT and CLOSE frames):
 * the host always drains the port, so this only bounds the queue */
#define OUTQ_PORT_HIGH (512 * 1024)
#define INBUF_SIZE (2 * (HDR + MUX_CHUNK))
/* worst case: OUTQ_PORT_HIGH, then one read of the port that is all 9-byte
 * frames, each answered by a 13-byte frame */
#define OUTQ_SIZE (OUTQ_PORT_HIGH + INBUF_SIZE / HDR * (HDR + 4) + HDR + MUX_CHUNK)

struct mconn {
    int fd;                 /* the client's TCP socket, -1 if the slot is free */
    uint32_t id;
    uint32_t window;        /* bytes we may still send the host */
    uint32_t consumed;      /* passed to the client, not yet credited */
    char *buf;              /* from the host, not yet written to the client */
    size_t off, len;
    int sent_eof;           /* the client shut its side: EOF sent */
    int got_eof;            /* the host's side is done: shut the client's after buf */
};

static struct mconn mc[MUX_MAX];
static unsigned char outq[OUTQ_SIZE], inbuf[INBUF_SIZE];
static size_t outq_len, in_len;
static uint32_t next_id = 1;

static int queue_frame(uint8_t type, uint32_t id, const void *data, uint32_t len) {
    if (outq_len + HDR + len > sizeof outq) return -1; /* cannot happen with a draining host */
    unsigned char *p = outq + outq_len;
    p[0] = type;
    memcpy(p + 1, &id, 4);
    memcpy(p + 5, &len, 4);
    if (len) memcpy(p + HDR, data, len);
    outq_len += HDR + len;
    return 0;
}

/* Write what the port takes now; -1 if the host is gone. */
static int flush_port(int port) {
    size_t done = 0;
    while (done < outq_len) {
        size_t n = outq_len - done < PORT_WRITE ? outq_len - done : PORT_WRITE;
        ssize_t w = write(port, outq + done, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) break;
            return -1;
        }
        done += (size_t)w;
    }
    memmove(outq, outq + done, outq_len - done);
    outq_len -= done;
    return 0;
}

static void drop(struct mconn *c, int tell_host) {
    if (tell_host) queue_frame(M_CLOSE, c->id, NULL, 0);
    close(c->fd);
    free(c->buf);
    memset(c, 0, sizeof *c);
    c->fd = -1;
}

static struct mconn *find(uint32_t id) {
    for (int i = 0; i < MUX_MAX; i++)
        if (mc[i].fd >= 0 && mc[i].id == id) return &mc[i];
    return NULL;
}

static void maybe_finish(struct mconn *c) {
    /* both halves done and nothing left for the client: both sides forget it */
    if (c->sent_eof && c->got_eof && c->len == 0) drop(c, 0);
}

/* Pass buffered host data to the client; credits what it took. */
static void flush_client(struct mconn *c) {
    while (c->len > 0) {
        ssize_t w = write(c->fd, c->buf + c->off, c->len);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) break;
            drop(c, 1);
            return;
        }
        c->off += (size_t)w;
        c->len -= (size_t)w;
        c->consumed += (uint32_t)w;
    }
    if (c->len == 0) c->off = 0;
    /* after the host's EOF, the rest is credited once passed on: a window all credited back
     * tells the host we hold nothing of it, so it may close a connection whose proxy side
     * has closed without cutting a slow client short (egress_bridge.py, LINGER) */
    if (c->consumed >= CREDIT_STEP || (c->got_eof && c->len == 0 && c->consumed > 0)) {
        queue_frame(M_CREDIT, c->id, &c->consumed, 4);
        c->consumed = 0;
    }
    if (c->len == 0 && c->got_eof) {
        shutdown(c->fd, SHUT_WR);
        maybe_finish(c);
    }
}

static void host_frame(uint8_t type, uint32_t id, const unsigned char *data, uint32_t len) {
    struct mconn *c = find(id);
    if (!c) return; /* closed meanwhile: late frames are expected */
    switch (type) {
    case M_DATA:
        if (c->got_eof || c->len + len > DOWN_WINDOW) { drop(c, 1); return; } /* the host broke the window */
        if (c->len == 0) {
            /* the usual case: the client keeps up, and nothing is copied */
            ssize_t w;
            do w = write(c->fd, data, len); while (w < 0 && errno == EINTR);
            if (w < 0 && errno != EAGAIN) { drop(c, 1); return; }
            if (w > 0) {
                data += w;
                len -= (uint32_t)w;
                c->consumed += (uint32_t)w;
            }
            if (len == 0) { flush_client(c); break; } /* credits */
        }
        if (!c->buf && !(c->buf = malloc(DOWN_WINDOW))) { drop(c, 1); return; }
        if (c->off + c->len + len > DOWN_WINDOW) {
            memmove(c->buf, c->buf + c->off, c->len);
            c->off = 0;
        }
        memcpy(c->buf + c->off + c->len, data, len);
        c->len += len;
        flush_client(c);
        break;
    case M_EOF:
        c->got_eof = 1;
        flush_client(c);
        break;
    case M_CLOSE:
        drop(c, 0);
        break;
    case M_CREDIT:
        if (len == 4) {
            uint32_t n;
            memcpy(&n, data, 4);
            c->window = n > UP_WINDOW - c->window ? UP_WINDOW : c->window + n;
        }
        break;
    default:
        break;
    }
}

/* Read the port and act on every whole frame; -1 if the host is gone.
 * virtio_console returns at most one 4 KiB buffer per read, so read on until
 * the port is empty (bounded, so clients get their turn): one poll() per 4 KiB
 * cost a third of the guest's time in a bulk download under TCG. */
static int read_port(int port) {
    for (int round = 0; round < 64 && outq_len < OUTQ_PORT_HIGH; round++) {
        ssize_t n = read(port, inbuf + in_len, sizeof inbuf - in_len);
        if (n == 0) return -1;
        if (n < 0) return (errno == EAGAIN || errno == EINTR) ? 0 : -1;
        in_len += (size_t)n;
        size_t at = 0;
        while (in_len - at >= HDR) {
            uint32_t id, len;
            memcpy(&id, inbuf + at + 1, 4);
            memcpy(&len, inbuf + at + 5, 4);
            if (len > MUX_CHUNK) return -1; /* not our protocol */
            if (in_len - at < HDR + len) break;
            host_frame(inbuf[at], id, inbuf + at + HDR, len);
            at += HDR + len;
        }
        memmove(inbuf, inbuf + at, in_len - at);
        in_len -= at;
    }
    return 0;
}

/* Client data goes straight into the port's queue as one DATA frame. */
static void read_client(struct mconn *c) {
    uint32_t room = c->window < MUX_CHUNK ? c->window : MUX_CHUNK;
    unsigned char *p = outq + outq_len;
    ssize_t n = read(c->fd, p + HDR, room);
    if (n < 0) {
        if (errno != EAGAIN && errno != EINTR) drop(c, 1);
        return;
    }
    if (n == 0) {
        c->sent_eof = 1;
        queue_frame(M_EOF, c->id, NULL, 0);
        maybe_finish(c);
        return;
    }
    uint32_t len = (uint32_t)n;
    p[0] = M_DATA;
    memcpy(p + 1, &c->id, 4);
    memcpy(p + 5, &len, 4);
    outq_len += HDR + len;
    c->window -= len;
}

static void accept_client(int listener) {
    int fd = accept4(listener, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;
    for (int i = 0; i < MUX_MAX; i++) {
        if (mc[i].fd >= 0) continue;
        mc[i] = (struct mconn){.fd = fd, .id = next_id++, .window = UP_WINDOW};
        if (next_id == 0) next_id = 1; /* 0 is the relay's own */
        queue_frame(M_OPEN, mc[i].id, NULL, 0);
        return;
    }
    close(fd); /* full: the client sees its connection closed */
}

int relay_mux_main(int wait_fd) {
    int port = 0; /* the virtio-serial port is stdin */
    signal(SIGPIPE, SIG_IGN);
    prctl(PR_SET_DUMPABLE, 0);
    /* every page the loop writes, written now: before the snapshot (no page
     * faults, which are fresh code, in a restored VM) */
    memset(outq, 0, sizeof outq);
    memset(inbuf, 0, sizeof inbuf);
    memset(mc, 0, sizeof mc);
    for (int i = 0; i < MUX_MAX; i++) mc[i].fd = -1;
    static struct pollfd pfds[3 + MUX_MAX];
    static struct mconn *owner[3 + MUX_MAX];
    memset(pfds, 0, sizeof pfds);
    memset(owner, 0, sizeof owner);

    /* opened now (path lookups in a restored VM are fresh code under TCG): the
     * relay joins the sandbox's cgroup once told to listen, so what it buffers
     * counts against the sandbox's memory limit and it against its pids */
    int cgroup_fd = open("/sys/fs/cgroup/sandbox/relay/cgroup.procs", O_WRONLY | O_CLOEXEC);
    char msg[16] = {0};
    if (write(wait_fd, "w", 1) != 1) return 2;
    ssize_t got;
    do got = read(wait_fd, msg, sizeof msg - 1); while (got < 0 && errno == EINTR);
    if (got <= 0) return 0; /* pid 1 let go of us: no egress in this VM */
    if (cgroup_fd >= 0) {
        if (write(cgroup_fd, "0", 1) < 0) {} /* best effort: egress works either way */
        close(cgroup_fd);
    }
    int tcp_port = atoi(msg);
    int l[2] = {-1, -1};
    if (tcp_port > 0 && tcp_port <= 65535) {
        l[0] = loopback_listener(AF_INET, tcp_port);
        l[1] = loopback_listener(AF_INET6, tcp_port);
    }
    /* pid 1 lets the agent (and so any command) start only once we listen */
    if (write(wait_fd, l[0] >= 0 ? "l" : "e", 1) != 1 || l[0] < 0) return 2;
    close(wait_fd);
    /* blocking: virtio_console holds a write until the host side is connected,
     * which after a restore may be a moment after pid 1 said go */
    static const char hello[HDR] = {M_HELLO};
    if (write(port, hello, HDR) != HDR) return 2;
    if (fcntl(port, F_SETFL, O_NONBLOCK) < 0) return 2;

    for (;;) {
        int n = 0;
        short port_ev = (short)((outq_len < OUTQ_PORT_HIGH ? POLLIN : 0) | (outq_len ? POLLOUT : 0));
        pfds[n++] = (struct pollfd){.fd = port, .events = port_ev};
        int reading = outq_len < OUTQ_HIGH;
        for (int i = 0; i < 2; i++) pfds[n++] = (struct pollfd){.fd = reading ? l[i] : -1, .events = POLLIN};
        for (int i = 0; i < MUX_MAX; i++) {
            struct mconn *c = &mc[i];
            if (c->fd < 0) continue;
            short ev = 0;
            if (reading && !c->sent_eof && c->window > 0) ev |= POLLIN;
            if (c->len > 0) ev |= POLLOUT;
            if (!ev) continue;
            owner[n] = c;
            pfds[n++] = (struct pollfd){.fd = c->fd, .events = ev};
        }
        if (poll(pfds, (nfds_t)n, -1) < 0) {
            if (errno == EINTR) continue;
            return 2;
        }
        if ((port_ev & POLLIN) && (pfds[0].revents & (POLLIN | POLLHUP | POLLERR))) {
            /* POLLHUP: the host closed the port, i.e. the sandbox is going away */
            if (read_port(port) < 0) return 0;
        }
        for (int i = 3; i < n; i++) {
            struct mconn *c = owner[i];
            short re = pfds[i].revents;
            if (!re || c->fd != pfds[i].fd) continue; /* dropped meanwhile */
            /* an error or hang-up with data pending: the write fails and drops it (else
             * poll would report the fd again at once, for ever) */
            if ((re & (POLLOUT | POLLERR | POLLHUP)) && c->len > 0) flush_client(c);
            if (c->fd == pfds[i].fd && (re & (POLLIN | POLLHUP | POLLERR)) && outq_len < OUTQ_HIGH
                && !c->sent_eof && c->window > 0)
                read_client(c);
        }
        for (int i = 1; i < 3; i++)
            if (pfds[i].fd >= 0 && (pfds[i].revents & POLLIN)) accept_client(pfds[i].fd);
        if (outq_len && flush_port(port) < 0) return 0;
    }
}
