/*
 * corral-agent: the in-sandbox side of every Corral tier.
 *
 * It runs inside the sandbox (already confined: namespaces, seccomp, no
 * capabilities), reads framed requests on fd 0 and writes framed replies on
 * fd 1.  It is written in C because it sits on the cold-start path: a Python
 * agent costs ~17 ms of interpreter start-up per sandbox, this one < 1 ms.
 *
 * The host treats everything this program says as untrusted input: a command
 * running in the sandbox can kill or impersonate it.  Limits, timeouts and
 * kills are enforced by the host (cgroups), never here.
 *
 * Frame: u8 type | u32 id | u32 length | payload   (little endian)
 *
 * This file: framing, the request dispatch, the launcher and the main loop;
 * exec.c runs commands (and the spare), files.c the file requests, relay.c and
 * relay_mux.c the egress relays (process/gVisor, microVM).
 */
#include "agent.h"

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
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "relay_mux.h"

struct exec execs[MAX_EXECS];

long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void write_all(int fd, const void *buf, size_t len) {
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0) {
            if (errno == EINTR) continue;
            _exit(3); /* host is gone: nothing left to serve */
        }
        p += n;
        len -= (size_t)n;
    }
}

/* header and payload in one write when they fit: over a virtio-serial port
 * (microVM) every write is its own transfer to the host */
static unsigned char frame_buf[9 + CHUNK];

static size_t put_header(unsigned char *out, uint8_t type, uint32_t id, uint32_t len) {
    out[0] = type;
    memcpy(out + 1, &id, 4);
    memcpy(out + 5, &len, 4);
    return 9;
}

void send_frame(uint8_t type, uint32_t id, const void *data, uint32_t len) {
    if (len <= CHUNK) {
        write_all(1, frame_buf, put_frame(frame_buf, type, id, data, len));
        return;
    }
    write_all(1, frame_buf, put_header(frame_buf, type, id, len));
    write_all(1, data, len);
}

size_t put_frame(unsigned char *out, uint8_t type, uint32_t id, const void *data, uint32_t len) {
    size_t n = put_header(out, type, id, len);
    if (len) memcpy(out + n, data, len);
    return n + (size_t)len;
}

void send_err(uint32_t id, int err, const char *what) {
    char buf[512];
    int32_t e = err;
    memcpy(buf, &e, 4);
    int n = snprintf(buf + 4, sizeof buf - 4, "%s: %s", what, strerror(err));
    send_frame(T_ERR, id, buf, 4 + (uint32_t)(n < 0 ? 0 : n));
}

int read_full(int fd, void *buf, size_t len) {
    char *p = buf;
    while (len > 0) {
        ssize_t n = read(fd, p, len);
        if (n == 0) return 0;
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 1;
}

/* Split a payload of NUL-terminated strings; returns count, fills out (max). */
int split_strings(char *p, size_t len, char **out, int max) {
    int n = 0;
    size_t i = 0;
    while (i < len && n < max) {
        out[n++] = p + i;
        size_t l = strnlen(p + i, len - i);
        if (i + l >= len) { p[len - 1] = 0; break; }
        i += l + 1;
    }
    return n;
}

struct exec *find_exec(uint32_t id) {
    for (int i = 0; i < MAX_EXECS; i++)
        if (execs[i].used && execs[i].id == id) return &execs[i];
    return NULL;
}

void close_fd(int *fd) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

static void handle_request(uint8_t type, uint32_t id, char *payload, uint32_t len) {
    struct exec *e;
    /* every path payload is NUL terminated by the host; enforce it */
    if (len > 0 && type >= T_FREAD && payload[len - 1] != 0 && type != T_FWRITE && type != T_FAPPEND
        && type != T_FPUT) {
        send_err(id, EINVAL, "request");
        return;
    }
    switch (type) {
    case T_EXEC: do_exec(id, payload, len, NULL); break;
    case T_EXEC_SPARE: do_exec_spare(id, payload, len); break;
    case T_EXEC_PTY:
        if (len > 4) {
            struct winsize ws = {0};
            uint16_t rc[2];
            memcpy(rc, payload, 4);
            ws.ws_row = rc[0];
            ws.ws_col = rc[1];
            do_exec(id, payload + 4, len - 4, &ws);
        } else send_err(id, EINVAL, "exec");
        break;
    case T_RESIZE:
        if ((e = find_exec(id)) && len == 4 && e->fd_out >= 0) {
            struct winsize ws = {0};
            uint16_t rc[2];
            memcpy(rc, payload, 4);
            ws.ws_row = rc[0];
            ws.ws_col = rc[1];
            ioctl(e->fd_out, TIOCSWINSZ, &ws);
        }
        break;
    case T_GO:
        if ((e = find_exec(id)) && e->fd_sync >= 0) {
            char go = 1;
            if (write(e->fd_sync, &go, 1) < 0) {}
            close_fd(&e->fd_sync);
        }
        break;
    case T_STDIN:
        if ((e = find_exec(id)) && len > 0) take_stdin(e, payload, len);
        break;
    case T_STDIN_EOF:
        if ((e = find_exec(id))) { e->eof_pending = 1; flush_stdin(e); }
        break;
    case T_SIGNAL:
        if (!find_exec(id) && len == 4) {  /* ended: a kill still ends what it left in its group */
            int32_t sig;
            memcpy(&sig, payload, 4);
            if (sig == SIGKILL) command_group_kill_ended(id);
        }
        if ((e = find_exec(id)) && len == 4) {
            int32_t sig;
            memcpy(&sig, payload, 4);
            if (!e->exited) {
                kill(-e->pid, sig);
                kill(e->pid, sig);
            }
            /* what left its process group too, and also once the command's own process has
             * exited: its daemons (a kernel's cells' setsid children) are still its group's, and
             * on gVisor, where no host cgroup leaf holds them, they outlived every kernel restart
             * (a group's number is never reused, unlike a pid) */
            if (sig == SIGKILL) command_group_kill(e->group);
            /* said once both kills are done: this agent shares the sandbox's CPU quota, and with
             * a command keeping it spent the signal came seconds after the host sent it (a
             * throttled task waits for the next period at each return from a system call); the
             * host counts an interrupted cell's grace from here */
            send_frame(T_SIGNALED, id, &sig, 4);
        }
        break;
    case T_FREAD:
        if (len) {
            /* PATH \0 [LIMIT \0]: the most bytes the host takes (none given: no limit) */
            size_t plen = strlen(payload);
            unsigned long long limit = plen + 1 < len ? strtoull(payload + plen + 1, NULL, 10) : ~0ULL;
            do_fread(id, payload, limit);
        } else send_err(id, EINVAL, "read");
        break;
    case T_FWRITE: do_fwrite(id, payload, len, 0); break;
    case T_FAPPEND: do_fwrite(id, payload, len, 1); break;
    case T_FPUT: do_fput(id, payload, len); break;
    case T_FLIST: if (len) do_flist(id, payload); else send_err(id, EINVAL, "list"); break;
    case T_FSTAT: if (len) do_fstat(id, payload); else send_err(id, EINVAL, "stat"); break;
    case T_FREMOVE: do_fremove(id, payload, len); break;
    case T_FMKDIR: do_fmkdir(id, payload, len); break;
    case T_GUEST: agent_ids(1); do_guest(id, payload, len); agent_ids(0); break; /* as the guest's root */
    default: send_err(id, ENOSYS, "unknown request"); break;
    }
}


/* A file request in a child that has become the default user (users.c: where set*fsid is
 * missing); its answer is the child's frames, and the agent waits for it (as it would have for
 * the request itself), so no other frame comes between them. */
static void handle_as_the_user(uint8_t type, uint32_t id, char *payload, uint32_t len) {
    pid_t pid = fork();
    if (pid < 0) {
        send_err(id, errno, "fork");
        return;
    }
    if (pid == 0) {
        if (drop_to_file_user() < 0) {
            send_err(id, errno, "become the sandbox's user");
            _exit(1);
        }
        handle_request(type, id, payload, len);
        _exit(0);
    }
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    if (!WIFEXITED(status)) send_err(id, EIO, "file request"); /* killed before it answered */
}

/*
 * Launcher mode, run by the host as root: `corral-agent --launch UID NETNS|- -- PROGRAM ARGS...`
 * enters a network namespace (optional), drops every privilege to UID, and
 * execs PROGRAM (bubblewrap).  A static binary, so the host can vfork+exec it
 * instead of forking its whole Python process to change uid.
 */
static int launch_main(int argc, char **argv) {
    if (argc < 6 || strcmp(argv[4], "--") != 0 || argv[5][0] != '/') {
        dprintf(2, "corral-agent: usage: --launch UID NETNS|- -- /PROGRAM [ARGS...]\n");
        return 125;
    }
    char *end;
    unsigned long uid = strtoul(argv[2], &end, 10);
    if (*end || uid == 0 || uid >= 0xFFFFFFFFul) {
        dprintf(2, "corral-agent: refusing uid %s\n", argv[2]);
        return 125;
    }
    if (strcmp(argv[3], "-") != 0) {
        int fd = open(argv[3], O_RDONLY | O_CLOEXEC);
        if (fd < 0 || setns(fd, CLONE_NEWNET) < 0) {
            dprintf(2, "corral-agent: cannot enter network namespace %s: %s\n", argv[3], strerror(errno));
            return 125;
        }
        close(fd);
    }
    if (setgroups(0, NULL) < 0 || setresgid((gid_t)uid, (gid_t)uid, (gid_t)uid) < 0 ||
        setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) < 0 || getuid() != (uid_t)uid || geteuid() != (uid_t)uid) {
        dprintf(2, "corral-agent: cannot drop to uid %lu: %s\n", uid, strerror(errno));
        return 125;
    }
    execv(argv[5], &argv[5]);
    dprintf(2, "corral-agent: cannot execute %s: %s\n", argv[5], strerror(errno));
    return 125;
}

/* The egress relay (process and gVisor tiers), a child of pid 1 under a uid of its own that no
 * command runs as: it ran as the default user, whose commands could stop or kill it (the
 * sandbox's egress then timed out or ended for good) and then listen on its port themselves, in
 * the path of root's later requests.  Pid 1 keeps the listening sockets (the port is never free
 * for another to take) and starts a relay again when one ends, at most once a second. */
#define RELAY_UID 65533
#define RELAY_RESTART_MS 1000
static struct {
    int listeners[2];
    const char *path;
    pid_t pid;
    long long started_ms, restart_at_ms;
} relay = {{-1, -1}, NULL, -1, 0, -1};

static void start_relay(void) {
    relay.restart_at_ms = -1;
    pid_t pid = fork();
    if (pid < 0) {
        relay.restart_at_ms = now_ms() + RELAY_RESTART_MS;
        return;
    }
    if (pid == 0) {
        /* nothing of pid 1's but the listeners: not its protocol pipes and stderr (nor given to
         * the relay's uid), and a relay started again later held the write end of a command's
         * stdin, which then never saw its end.  Nothing at all on 0-2 (it prints nothing): what
         * a process holds, gVisor's /proc lets another uid open */
        int low = relay.listeners[0], high = relay.listeners[1];
        if (high >= 0 && high < low) { low = high; high = relay.listeners[0]; }
        int from = 0;
        for (int keep = 0; keep < 2; keep++) {
            int fd = keep == 0 ? low : high;
            if (fd < from) continue;
            if (fd > from) close_range((unsigned)from, (unsigned)fd - 1, 0);
            from = fd + 1;
        }
        close_range((unsigned)from, INT_MAX, 0); /* not ~0U: gVisor refuses it (EINVAL) */
        if (default_uid >= 0 && become_user(RELAY_UID) < 0) _exit(2);
        prctl(PR_SET_DUMPABLE, 0);
        relay_main(relay.listeners, relay.path);
        _exit(2); /* (it serves for ever) never on into pid 1's loop */
    }
    relay.pid = pid;
    relay.started_ms = now_ms();
}

/* 1 if `pid` was the relay (started again now or later: relay_restart_due) */
static int relay_exited(pid_t pid) {
    if (pid != relay.pid || pid < 0) return 0;
    relay.pid = -1;
    long long again = relay.started_ms + RELAY_RESTART_MS;
    if (now_ms() >= again) start_relay();
    else relay.restart_at_ms = again;
    return 1;
}

/* ms until a relay is due to start again (-1: none is), starting it if it is due now */
static int relay_restart_due(void) {
    if (relay.restart_at_ms < 0) return -1;
    long long left = relay.restart_at_ms - now_ms();
    if (left > 0) return (int)left;
    start_relay();
    return relay.restart_at_ms < 0 ? -1 : RELAY_RESTART_MS;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--launch") == 0) return launch_main(argc, argv);
    if (argc == 3 && strcmp(argv[1], "--userns") == 0) return userns_main(argv[2]);
    if ((argc == 3 || argc == 4) && strcmp(argv[1], "--mountns") == 0)
        return mountns_main(argv[2], argc == 4 ? argv[3] : NULL);
    if (argc > 1 && strcmp(argv[1], "--vmm") == 0) return vmm_main(argc, argv);
    if (argc > 1 && strcmp(argv[1], "--owner-watch") == 0) return owner_watch_main(argc, argv);
    /* the microVM guest's egress relay, started by its pid 1 (relay_mux.c) */
    if (argc == 3 && strcmp(argv[1], "--relay-mux") == 0) return relay_mux_main(atoi(argv[2]));
    prctl(PR_SET_DUMPABLE, 0);
    signal(SIGPIPE, SIG_IGN);
    /* Never stopped or ended by a terminal: the microVM's agent leads a session (not pid 1, whose
     * namespace shields it), and a terminal the sandbox linked at a path the owner read became its
     * controlling one -- the sandbox's ^C then ended the agent and the sandbox.  Files are opened
     * O_NOCTTY too; commands start with every signal at its default (exec.c). */
    static const int terminal_signals[] = {SIGHUP, SIGINT, SIGQUIT, SIGTSTP, SIGTTIN, SIGTTOU};
    for (size_t i = 0; i < sizeof terminal_signals / sizeof *terminal_signals; i++) signal(terminal_signals[i], SIG_IGN);
    if (argc == 3 && strcmp(argv[1], "--connect") == 0) return connect_main(atoi(argv[2]));
    if (argc > 1 && strcmp(argv[1], "--spare") == 0) {
        spares_enabled = 1;
        argv[1] = argv[0];
        argv++;
        argc--;
    }
    /* --hold (the process tier): bwrap may clone this process before the host
     * has moved bwrap into the sandbox's limit cgroups, and a child inherits
     * the cgroups of the moment it is forked.  So say READY, fork nothing, and
     * wait for the host's GO (sent once this process sits in every limit
     * group); only then start the relay and the spare. */
    int hold = 0;
    if (argc > 1 && strcmp(argv[1], "--hold") == 0) {
        hold = 1;
        argv[1] = argv[0];
        argv++;
        argc--;
    }
    /* --user UID (process and gVisor tiers, whose agent is root of the sandbox's user namespace):
     * commands and file requests run as UID unless a command names its own user */
    if (argc > 2 && strcmp(argv[1], "--user") == 0) {
        char *end;
        long uid = strtol(argv[2], &end, 10);
        if (*end || set_default_user(uid) < 0) return 2;
        argv[2] = argv[0];
        argv += 2;
        argc -= 2;
    }
    /* --command-groups DIR (gVisor): see command_groups.c */
    if (argc > 2 && strcmp(argv[1], "--command-groups") == 0) {
        set_command_groups(argv[2]); /* (none mounted: each command's group kill is what is left) */
        argv[2] = argv[0];
        argv += 2;
        argc -= 2;
    }
    if (hold) {
        send_frame(T_READY, 0, "corral-agent 2", 14);
        capbset_read(); /* while the host checks the sandbox's cgroups: off the create's path */
        unsigned char hdr[9];
        if (read_full(0, hdr, 9) <= 0 || hdr[0] != T_GO) return 0; /* no GO: never run anything */
        uint32_t len;
        memcpy(&len, hdr + 5, 4);
        if (len != 0) return 2;
    }
    if (argc == 4 && strcmp(argv[1], "--relay") == 0) {
        /* the relay is a child of pid 1; the agent's own protocol is unchanged.  Its port is
         * bound here, before pid 1 reads any request: a command (the sandbox's first included)
         * always finds it listening.  Bound in the child, a command run meanwhile was refused
         * (1 in 30 first commands on a loaded host). */
        int port = atoi(argv[2]);
        if (port <= 0 || port > 65535) return 2;
        relay.listeners[0] = loopback_listener(AF_INET, port);
        relay.listeners[1] = loopback_listener(AF_INET6, port);
        if (relay.listeners[0] < 0) return 2;
        relay.path = argv[3];
        start_relay();
    }
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sfd < 0) return 2;
    static struct pollfd pfds[2 + MAX_EXECS * 3];
    static struct { struct exec *e; int which; } owners[2 + MAX_EXECS * 3];
    if (argc == 3 && strcmp(argv[1], "--wait-fd") == 0) {
        /* started ahead of time (the microVM guest starts it before its snapshot):
         * say "waiting" on the socket FD, then block until a byte says go.  The
         * protocol on stdin/stdout only begins after that.  The pages it will
         * write are written now, so a restored VM takes no page faults for them. */
        memset(frame_buf, 0, sizeof frame_buf);
        memset(execs, 0, sizeof execs);
        memset(pfds, 0, sizeof pfds);
        memset(owners, 0, sizeof owners);
        int fd = atoi(argv[2]);
        char go = 'w';
        if (fd < 3 || write(fd, &go, 1) != 1) return 2;
        ssize_t n;
        do n = read(fd, &go, 1); while (n < 0 && errno == EINTR);
        if (n != 1) return 2;
        close(fd);
        /* "u": commands and file requests as the sandbox user (uid 1000) unless a command names
         * its own; "g": as the agent (guest root), as a sandbox created with user="root" asks */
        if (go == 'u' && set_default_user(1000) < 0) return 2;
    }
    if (!hold) {
        send_frame(T_READY, 0, "corral-agent 2", 14);
        capbset_read(); /* once: each command then drops only what its bounding set holds */
    }
    fork_spare();

    char *payload = NULL;
    for (;;) {
        int n = 0;
        pfds[n++] = (struct pollfd){.fd = 0, .events = POLLIN};
        pfds[n++] = (struct pollfd){.fd = sfd, .events = POLLIN};
        int timeout = relay_restart_due();
        long long now = now_ms();
        for (int i = 0; i < MAX_EXECS; i++) {
            struct exec *e = &execs[i];
            if (!e->used) continue;
            if (e->exited) {
                long long left = e->exit_ms + GRACE_MS - now;
                if ((e->fd_out < 0 && e->fd_err < 0) || left <= 0) { finish_exec(e); continue; }
                if (timeout < 0 || left < timeout) timeout = (int)left;
            }
            if (e->fd_out >= 0) { owners[n].e = e; owners[n].which = 1; pfds[n++] = (struct pollfd){.fd = e->fd_out, .events = POLLIN}; }
            if (e->fd_err >= 0) { owners[n].e = e; owners[n].which = 2; pfds[n++] = (struct pollfd){.fd = e->fd_err, .events = POLLIN}; }
            if (e->fd_in >= 0 && e->inlen > 0) { owners[n].e = e; owners[n].which = 0; pfds[n++] = (struct pollfd){.fd = e->fd_in, .events = POLLOUT}; }
        }
        if (poll(pfds, (nfds_t)n, timeout) < 0) {
            if (errno == EINTR) continue;
            return 2;
        }
        for (int i = 2; i < n; i++) {
            if (!pfds[i].revents) continue;
            struct exec *e = owners[i].e;
            if (!e->used) continue;
            if (owners[i].which == 1) pump_output(e, &e->fd_out, T_STDOUT);
            else if (owners[i].which == 2) pump_output(e, &e->fd_err, T_STDERR);
            else flush_stdin(e);
        }
        if (pfds[1].revents) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) > 0) {}
            int st;
            pid_t pid;
            while ((pid = waitpid(-1, &st, WNOHANG)) > 0)
                if (!relay_exited(pid)) child_exited(pid, st);
        }
        if (pfds[0].revents) {
            unsigned char hdr[9];
            int r = read_full(0, hdr, 9);
            if (r <= 0) return 0; /* host closed the channel: the sandbox ends */
            uint32_t id, len;
            memcpy(&id, hdr + 1, 4);
            memcpy(&len, hdr + 5, 4);
            if (len > MAX_FRAME) return 2;
            payload = realloc(payload, len + 1);
            if (!payload) return 2;
            if (len && read_full(0, payload, len) <= 0) return 0;
            payload[len] = 0;
            if (hdr[0] & T_AS_AGENT) {
                /* a file request of the host's own (the microVM's cgroup leaves, its network
                 * files): with the agent's ids, not the default user's */
                agent_ids(1);
                handle_request(hdr[0] & ~T_AS_AGENT, id, payload, len);
                agent_ids(0);
            } else if (((hdr[0] >= T_FREAD && hdr[0] <= T_FSTAT) || hdr[0] == T_FPUT) && file_requests_in_a_child()) {
                handle_as_the_user(hdr[0], id, payload, len);
            } else handle_request(hdr[0], id, payload, len);
        }
    }
}
