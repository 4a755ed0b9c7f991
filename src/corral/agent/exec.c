/* corral-agent: running commands (pipes or a terminal, the cgroup hand-shake, the spare). */
#include "agent.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <pty.h>
#include <termios.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>

/* An exec payload: user \0 cwd \0 argc \0 argv... \0 envc \0 env... \0 [limit \0], parsed in
 * place; user is "" (the agent's default, see --user) or a uid inside the sandbox; limit, when
 * given, is the bytes per stream the host keeps and has no other use for (see pump_output).
 * Returns NULL when well formed, else what is wrong. */
struct command { long uid; const char *cwd; char **argv; char **envp; long long limit; };

static const char *parse_command(char *payload, uint32_t len, char **parts, int max, struct command *c) {
    if (len == 0 || payload[len - 1] != 0) return "exec";
    int n = split_strings(payload, len, parts, max - 2);
    if (n < 4) return "exec";
    c->uid = default_uid;
    if (parts[0][0]) {
        char *end;
        c->uid = strtol(parts[0], &end, 10);
        if (*end || c->uid < 0 || c->uid > 65535) return "exec user";
    }
    int argc = atoi(parts[2]);
    if (argc < 1 || 3 + argc >= n) return "exec argv";
    int envc = atoi(parts[3 + argc]);
    if (envc < 0 || 4 + argc + envc > n) return "exec env";
    c->limit = -1;
    if (n > 4 + argc + envc) {
        char *end;
        c->limit = strtoll(parts[4 + argc + envc], &end, 10);
        if (*end || end == parts[4 + argc + envc] || c->limit < 0) return "exec limit";
    }
    c->cwd = parts[1];
    c->argv = &parts[3];
    c->envp = &parts[4 + argc];
    /* terminate argv and envp in place: the slot after each list is free */
    parts[3 + argc] = NULL;
    parts[4 + argc + envc] = NULL;
    return NULL;
}

/* The child's side of a command, with its stdio in place: wait until the host
 * has placed it in the command's cgroup (the go byte on sync_fd), become its
 * user, then exec. */
static void __attribute__((noreturn)) become_command(int sync_fd, const struct command *c) {
    char go;
    if (read(sync_fd, &go, 1) != 1) _exit(126);
    /* a command starts with its stdio and nothing else: a spare's sync pipe is its fd 3 (dup2
     * drops close-on-exec), and what the agent itself was handed without close-on-exec (the
     * sandbox's user namespace, from bwrap) reached a first command not run by a spare */
    close_range(3, INT_MAX, 0); /* (gVisor refuses ~0U: EINVAL) */
    if (c->uid >= 0 && become_user((uid_t)c->uid) < 0) {
        dprintf(2, "corral: cannot run as uid %ld: %s\n", c->uid, strerror(errno));
        _exit(126);
    }
    if (chdir(c->cwd) < 0) {
        dprintf(2, "corral: cannot enter working directory %s: %s\n", c->cwd, strerror(errno));
        _exit(126);
    }
    environ = c->envp;
    execvp(c->argv[0], c->argv);
    int err = errno;
    dprintf(2, "corral: cannot execute %s: %s\n", c->argv[0], strerror(err));
    _exit(err == ENOENT ? 127 : 126);
}

/* A new command's process: default signals, its own session, its stdio.  Every
 * disposition is reset, not only the agent's own SIGPIPE: an ignored signal is
 * inherited across exec, so a host that started Corral with SIGINT ignored (a
 * background job of a script, nohup) would otherwise hand that to every
 * command -- and Python does not install its KeyboardInterrupt handler then. */
static void child_stdio(int in, int out, int err, int terminal) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    /* the raw system call: glibc's signal()/sigaction() refuse the two real-time signals it
     * keeps for itself (32, 33), which an ignoring parent hands down all the same */
    struct { void *handler; unsigned long flags; void *restorer; uint64_t mask; } dfl = {SIG_DFL, 0, NULL, 0};
    for (int sig = 1; sig <= 64; sig++) syscall(SYS_rt_sigaction, sig, &dfl, NULL, sizeof dfl.mask); /* KILL/STOP: EINVAL */
    setsid();
    /* open files: the usual 1024 (select() stays safe), up to 524288 on request -- not
     * whatever the owner's limit was (the hard limit cannot be raised from here) */
    struct rlimit files;
    if (getrlimit(RLIMIT_NOFILE, &files) == 0) {
        if (files.rlim_max > 524288) files.rlim_max = 524288;
        files.rlim_cur = files.rlim_max < 1024 ? files.rlim_max : 1024;
        setrlimit(RLIMIT_NOFILE, &files);
    }
    if (terminal) ioctl(in, TIOCSCTTY, 0);
    dup2(in, 0);
    dup2(out, 1);
    dup2(err, 2);
}

/* What pump_output forwards of each stream: one byte past the limit tells the host it was cut. */
static long long room_of(const struct command *c) {
    return c->limit < 0 ? -1 : c->limit + 1;
}

static struct exec *free_exec(void) {
    for (int i = 0; i < MAX_EXECS; i++)
        if (!execs[i].used) return &execs[i];
    return NULL;
}

void do_exec(uint32_t id, char *payload, uint32_t len, struct winsize *ws) {
    static char *parts[8192];
    struct command cmd;
    const char *bad = parse_command(payload, len, parts, 8192, &cmd);
    if (bad) { send_err(id, EINVAL, bad); return; }
    struct exec *e = free_exec();
    if (!e) { send_err(id, EAGAIN, "too many concurrent commands"); return; }

    int pin[2] = {-1, -1}, pout[2] = {-1, -1}, perr[2] = {-1, -1}, psync[2] = {-1, -1};
    int ok;
    if (ws) {
        /* a terminal: the master is both the command's input and its output */
        ok = openpty(&pout[0], &pin[0], NULL, NULL, ws) == 0;
        if (ok) {
            fcntl(pout[0], F_SETFD, FD_CLOEXEC);
            fcntl(pin[0], F_SETFD, FD_CLOEXEC);
            pin[1] = fcntl(pout[0], F_DUPFD_CLOEXEC, 3);
            pout[1] = fcntl(pin[0], F_DUPFD_CLOEXEC, 3);
            perr[1] = fcntl(pin[0], F_DUPFD_CLOEXEC, 3);
            ok = pin[1] >= 0 && pout[1] >= 0 && perr[1] >= 0;
        }
    } else {
        ok = pipe2(pin, O_CLOEXEC) == 0 && pipe2(pout, O_CLOEXEC) == 0 && pipe2(perr, O_CLOEXEC) == 0;
    }
    if (ok) ok = pipe2(psync, O_CLOEXEC) == 0;
    if (!ok) {
        int err = errno;
        int *all[] = {pin, pout, perr, psync};
        for (int i = 0; i < 4; i++) { close_fd(&all[i][0]); close_fd(&all[i][1]); }
        send_err(id, err, ws ? "openpty" : "pipe");
        return;
    }

    pid_t pid = fork();
    if (pid < 0) {
        int err = errno;
        int *all[] = {pin, pout, perr, psync};
        for (int i = 0; i < 4; i++) { close_fd(&all[i][0]); close_fd(&all[i][1]); }
        send_err(id, err, "fork");
        return;
    }
    if (pid == 0) {
        child_stdio(pin[0], pout[1], perr[1], ws != NULL);
        become_command(psync[0], &cmd);
    }
    close(pin[0]); close(pout[1]); close(perr[1]); close(psync[0]);
    if (ws) perr[0] = -1; /* a terminal has one output stream */
    fcntl(pin[1], F_SETFL, O_NONBLOCK);
    memset(e, 0, sizeof *e);
    e->used = 1;
    e->id = id;
    e->pid = pid;
    e->fd_in = pin[1];
    e->pty = ws != NULL;
    e->fd_out = pout[0];
    e->fd_err = perr[0];
    e->fd_sync = psync[1];
    e->room_out = e->room_err = room_of(&cmd);
    e->group = command_group_join(pid); /* before the go byte: it has run nothing yet */
    uint32_t p32 = (uint32_t)pid;
    send_frame(T_STARTED, id, &p32, 4);
}

/*
 * Spare (`--spare`, the process tier): a child forked ahead of time, with its
 * pipes made, that the host moves into the next command's cgroup while the
 * sandbox is idle.  Moving a task between cgroups can wait for an RCU grace
 * period (milliseconds) when none happened lately; a spare takes that wait off
 * the path of the next command, which the host then sends as T_EXEC_SPARE.
 * The host names the spare it has placed, and checked just before it sent the
 * command: the spare runs it at once, with no GO to wait for.  If that one has
 * died meanwhile, the command is forked as usual (and placed, and let go, as
 * usual), and a spare is never used before the host has placed it.  Once a
 * spare is taken the next one is forked at once, so the host places it while
 * the command runs: back-to-back commands each find a placed spare.
 */
int spares_enabled;
static struct { pid_t pid; int fd_in, fd_out, fd_err, fd_sync; } spare = {0, -1, -1, -1, -1};

static void __attribute__((noreturn)) spare_main(void) {
    /* fd 3 brings the command (u32 length, payload), then the go byte */
    static char *parts[8192];
    uint32_t len;
    if (read_full(3, &len, 4) <= 0 || len == 0 || len > MAX_FRAME) _exit(126);
    char *payload = malloc((size_t)len + 1);
    if (!payload || read_full(3, payload, len) <= 0) _exit(126);
    payload[len] = 0;
    struct command cmd;
    if (parse_command(payload, len, parts, 8192, &cmd)) _exit(126);
    become_command(3, &cmd);
}

/* Fork a new spare if there is none: its pid, or 0 (none made, or one is there already). */
static pid_t spawn_spare(void) {
    if (!spares_enabled || spare.pid > 0) return 0;
    int pin[2] = {-1, -1}, pout[2] = {-1, -1}, perr[2] = {-1, -1}, psync[2] = {-1, -1};
    int *all[] = {pin, pout, perr, psync};
    int ok = pipe2(pin, O_CLOEXEC) == 0 && pipe2(pout, O_CLOEXEC) == 0 && pipe2(perr, O_CLOEXEC) == 0 &&
             pipe2(psync, O_CLOEXEC) == 0;
    /* born with its name: the host places it as soon as it is announced (while a command
     * runs) and only moves a process named so; the agent takes its own name back at once */
    char own[16] = {0};
    prctl(PR_GET_NAME, own);
    prctl(PR_SET_NAME, "corral-spare");
    pid_t pid = ok ? fork() : -1;
    if (pid == 0) {
        child_stdio(pin[0], pout[1], perr[1], 0);
        dup2(psync[0], 3);
        /* it may wait a long time: hold nothing of the agent's (another command's
         * stdin pipe kept open here would never see its end of file) */
        close_range(4, INT_MAX, 0);
        spare_main();
    }
    prctl(PR_SET_NAME, own);
    if (pid < 0) {
        for (int i = 0; i < 4; i++) { close_fd(&all[i][0]); close_fd(&all[i][1]); }
        return 0;
    }
    close(pin[0]); close(pout[1]); close(perr[1]); close(psync[0]);
    spare.pid = pid;
    spare.fd_in = pin[1];
    spare.fd_out = pout[0];
    spare.fd_err = perr[0];
    spare.fd_sync = psync[1];
    return pid;
}

void fork_spare(void) {
    uint32_t p32 = (uint32_t)spawn_spare();
    if (p32) send_frame(T_SPARE, 0, &p32, 4);
}

static void drop_spare(void) {
    if (spare.pid > 0) kill(spare.pid, SIGKILL);
    spare.pid = 0;
    close_fd(&spare.fd_in); close_fd(&spare.fd_out); close_fd(&spare.fd_err); close_fd(&spare.fd_sync);
}

static int write_some(int fd, const void *buf, size_t len) {
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Payload: u32 pid of the spare the host placed, then an exec payload. */
void do_exec_spare(uint32_t id, char *payload, uint32_t len) {
    static char *parts[8192];
    struct command cmd;
    uint32_t placed;
    if (len < 4) { send_err(id, EINVAL, "exec"); return; }
    memcpy(&placed, payload, 4);
    payload += 4;
    len -= 4;
    struct exec *e = free_exec();
    /* only the spare the host names has been placed; any other is forked as usual */
    if (spare.pid <= 0 || (uint32_t)spare.pid != placed || !e) { do_exec(id, payload, len, NULL); return; }
    /* parse a copy only to refuse a malformed command here, as do_exec would */
    char *copy = malloc((size_t)len + 1);
    if (!copy) { send_err(id, ENOMEM, "exec"); return; }
    memcpy(copy, payload, len);
    copy[len] = 0;
    const char *bad = parse_command(copy, len, parts, 8192, &cmd);
    free(copy);
    if (bad) { send_err(id, EINVAL, bad); return; }
    /* the command and the go byte in one write: the host placed and checked this spare */
    uint32_t l32 = len;
    char *msg = malloc((size_t)len + 5);
    if (!msg) { send_err(id, ENOMEM, "exec"); return; }
    memcpy(msg, &l32, 4);
    memcpy(msg + 4, payload, len);
    msg[4 + len] = 1;
    int sent = write_some(spare.fd_sync, msg, (size_t)len + 5);
    free(msg);
    if (sent < 0) {
        drop_spare(); /* it died: fork this one as usual */
        do_exec(id, payload, len, NULL);
        return;
    }
    fcntl(spare.fd_in, F_SETFL, O_NONBLOCK);
    memset(e, 0, sizeof *e);
    e->used = 1;
    e->id = id;
    e->pid = spare.pid;
    e->fd_in = spare.fd_in;
    e->fd_out = spare.fd_out;
    e->fd_err = spare.fd_err;
    e->fd_sync = -1; /* let go already: a GO for it finds nothing to write */
    e->room_out = e->room_err = room_of(&cmd);
    close_fd(&spare.fd_sync);
    spare.pid = 0;
    spare.fd_in = spare.fd_out = spare.fd_err = -1;
    /* the next spare, placed by the host while this command runs; announced with the start in
     * one write: the host's reader wakes once for both, not twice while the command runs */
    uint32_t started = (uint32_t)e->pid, next = (uint32_t)spawn_spare();
    unsigned char out[2 * 13];
    size_t n = put_frame(out, T_STARTED, id, &started, 4);
    if (next) n += put_frame(out + n, T_SPARE, 0, &next, 4);
    write_all(1, out, n);
}

static void ack_stdin(struct exec *e, size_t done) {
    uint32_t n = (uint32_t)done;
    if (n) send_frame(T_STDIN_ACK, e->id, &n, 4);
}

/* Bytes the host sent for a command's stdin.  The host keeps at most STDIN_WINDOW of them
 * unacknowledged; more (or a command whose stdin is gone) are dropped, and acknowledged so. */
void take_stdin(struct exec *e, const char *data, size_t len) {
    if (e->fd_in < 0 || e->inlen + len > STDIN_WINDOW) {
        ack_stdin(e, len);
        return;
    }
    if (e->inoff) { /* at most a window moved per frame: no copy per partial write */
        memmove(e->inbuf, e->inbuf + e->inoff, e->inlen);
        e->inoff = 0;
    }
    char *n = realloc(e->inbuf, e->inlen + len);
    if (!n) {
        ack_stdin(e, len);
        return;
    }
    e->inbuf = n;
    memcpy(e->inbuf + e->inlen, data, len);
    e->inlen += len;
    flush_stdin(e);
}

void flush_stdin(struct exec *e) {
    size_t done = 0;
    while (e->fd_in >= 0 && e->inlen > 0) {
        ssize_t n = write(e->fd_in, e->inbuf + e->inoff, e->inlen);
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR) break;
            done += e->inlen; /* reader went away: drop the rest, and whatever comes after */
            e->inlen = 0;
            close_fd(&e->fd_in);
            break;
        }
        e->inoff += (size_t)n;
        e->inlen -= (size_t)n;
        done += (size_t)n;
    }
    if (e->inlen == 0) e->inoff = 0;
    ack_stdin(e, done);
    if (e->inlen == 0 && e->eof_pending) {
        if (e->pty && e->fd_in >= 0) {
            /* closing a terminal's input closes nothing (the master is also the output): a reader
             * gets end of file from the EOF character, as when a user types it (cat ran on to its
             * timeout); sent once, after what came before it */
            struct termios t;
            unsigned char c = tcgetattr(e->fd_in, &t) == 0 ? t.c_cc[VEOF] : 4;
            if (write(e->fd_in, &c, 1) == 1 || errno != EAGAIN) e->eof_pending = 0;
        } else {
            close_fd(&e->fd_in);
        }
    }
}

void finish_exec(struct exec *e) {
    int32_t st = e->status;
    send_frame(T_EXIT, e->id, &st, 4);
    close_fd(&e->fd_in);
    close_fd(&e->fd_out);
    close_fd(&e->fd_err);
    close_fd(&e->fd_sync);
    free(e->inbuf);
    command_group_done(e->id, e->group);
    memset(e, 0, sizeof *e);
    fork_spare(); /* between commands, off the next one's path */
}

/* The main loop reaped ``pid``: a command's end, or a spare that died. */
void child_exited(pid_t pid, int status) {
    if (pid == spare.pid) drop_spare();
    for (int i = 0; i < MAX_EXECS; i++) {
        if (execs[i].used && execs[i].pid == pid) {
            execs[i].exited = 1;
            execs[i].status = status;
            execs[i].exit_ms = now_ms();
        }
    }
}

/* A stream's output goes to the host, up to its room: past that (a host that only keeps
 * max_output and streams to nobody) it is read and dropped here, on the sandbox's CPU, not sent
 * to the host to be dropped there (a flooding `yes` cost the owner a fifth of a core). */
void pump_output(struct exec *e, int *fd, uint8_t type) {
    static char buf[CHUNK];
    ssize_t n = read(*fd, buf, sizeof buf);
    if (n > 0) {
        long long *room = type == T_STDERR ? &e->room_err : &e->room_out;
        uint32_t len = (uint32_t)n;
        if (*room >= 0) {
            if ((long long)len > *room) len = (uint32_t)*room;
            *room -= len;
        }
        if (len > 0) send_frame(type, e->id, buf, len);
    } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) close_fd(fd);
}
