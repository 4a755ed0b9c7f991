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
 */
#define _GNU_SOURCE
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

#include "relay_mux.h"

enum {
    /* host -> agent */
    T_EXEC = 1, T_GO = 2, T_STDIN = 3, T_STDIN_EOF = 4, T_SIGNAL = 5,
    T_EXEC_PTY = 6, T_RESIZE = 7, T_EXEC_SPARE = 8,
    T_FREAD = 10, T_FWRITE = 11, T_FAPPEND = 12, T_FLIST = 13, T_FREMOVE = 14,
    T_FMKDIR = 15, T_FSTAT = 16,
    /* agent -> host */
    T_READY = 100, T_STARTED = 101, T_STDOUT = 102, T_STDERR = 103,
    T_EXIT = 104, T_DATA = 105, T_SPARE = 106, T_OK = 110, T_ERR = 111,
};

#define MAX_FRAME (64u << 20)
#define MAX_EXECS 64
#define CHUNK 65536
#define GRACE_MS 100

extern char **environ;

struct exec {
    int used;
    uint32_t id;
    pid_t pid;
    int fd_in, fd_out, fd_err, fd_sync;
    int exited, status, eof_pending;
    long long exit_ms;
    char *inbuf;
    size_t inlen;
};

static struct exec execs[MAX_EXECS];

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void write_all(int fd, const void *buf, size_t len) {
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

static void send_frame(uint8_t type, uint32_t id, const void *data, uint32_t len) {
    frame_buf[0] = type;
    memcpy(frame_buf + 1, &id, 4);
    memcpy(frame_buf + 5, &len, 4);
    if (len <= CHUNK) {
        if (len) memcpy(frame_buf + 9, data, len);
        write_all(1, frame_buf, 9 + (size_t)len);
        return;
    }
    write_all(1, frame_buf, 9);
    write_all(1, data, len);
}

static void send_err(uint32_t id, int err, const char *what) {
    char buf[512];
    int32_t e = err;
    memcpy(buf, &e, 4);
    int n = snprintf(buf + 4, sizeof buf - 4, "%s: %s", what, strerror(err));
    send_frame(T_ERR, id, buf, 4 + (uint32_t)(n < 0 ? 0 : n));
}

static int read_full(int fd, void *buf, size_t len) {
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
static int split_strings(char *p, size_t len, char **out, int max) {
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

static struct exec *find_exec(uint32_t id) {
    for (int i = 0; i < MAX_EXECS; i++)
        if (execs[i].used && execs[i].id == id) return &execs[i];
    return NULL;
}

static void close_fd(int *fd) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

/* An exec payload: cwd \0 argc \0 argv... \0 envc \0 env... \0, parsed in place.
 * Returns NULL when well formed, else what is wrong. */
struct command { const char *cwd; char **argv; char **envp; };

static const char *parse_command(char *payload, uint32_t len, char **parts, int max, struct command *c) {
    if (len == 0 || payload[len - 1] != 0) return "exec";
    int n = split_strings(payload, len, parts, max - 2);
    if (n < 3) return "exec";
    int argc = atoi(parts[1]);
    if (argc < 1 || 2 + argc >= n) return "exec argv";
    int envc = atoi(parts[2 + argc]);
    if (envc < 0 || 3 + argc + envc > n) return "exec env";
    c->cwd = parts[0];
    c->argv = &parts[2];
    c->envp = &parts[3 + argc];
    /* terminate argv and envp in place: the slot after each list is free */
    parts[2 + argc] = NULL;
    parts[3 + argc + envc] = NULL;
    return NULL;
}

/* The child's side of a command, with its stdio in place: wait until the host
 * has placed it in the command's cgroup (the go byte on sync_fd), then exec. */
static void __attribute__((noreturn)) become_command(int sync_fd, const struct command *c) {
    char go;
    if (read(sync_fd, &go, 1) != 1) _exit(126);
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

/* A new command's process: default signals, its own session, its stdio. */
static void child_stdio(int in, int out, int err, int terminal) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    signal(SIGPIPE, SIG_DFL);
    setsid();
    if (terminal) ioctl(in, TIOCSCTTY, 0);
    dup2(in, 0);
    dup2(out, 1);
    dup2(err, 2);
}

static struct exec *free_exec(void) {
    for (int i = 0; i < MAX_EXECS; i++)
        if (!execs[i].used) return &execs[i];
    return NULL;
}

static void do_exec(uint32_t id, char *payload, uint32_t len, struct winsize *ws) {
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
    e->fd_out = pout[0];
    e->fd_err = perr[0];
    e->fd_sync = psync[1];
    uint32_t p32 = (uint32_t)pid;
    send_frame(T_STARTED, id, &p32, 4);
}

/*
 * Spare (`--spare`, the process tier): a child forked ahead of time, with its
 * pipes made, that the host moves into the next command's cgroup while the
 * sandbox is idle.  Moving a task between cgroups can wait for an RCU grace
 * period (milliseconds) when none happened lately; a spare takes that wait off
 * the path of the next command, which the host then sends as T_EXEC_SPARE.
 * The host names the spare it has placed; if that one has died meanwhile, the
 * command is forked as usual (and placed as usual), and a spare is never
 * used before the host has placed it.
 */
static int spares_enabled;
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

static void fork_spare(void) {
    if (!spares_enabled || spare.pid > 0) return;
    int pin[2] = {-1, -1}, pout[2] = {-1, -1}, perr[2] = {-1, -1}, psync[2] = {-1, -1};
    int *all[] = {pin, pout, perr, psync};
    int ok = pipe2(pin, O_CLOEXEC) == 0 && pipe2(pout, O_CLOEXEC) == 0 && pipe2(perr, O_CLOEXEC) == 0 &&
             pipe2(psync, O_CLOEXEC) == 0;
    pid_t pid = ok ? fork() : -1;
    if (pid == 0) {
        child_stdio(pin[0], pout[1], perr[1], 0);
        dup2(psync[0], 3);
        /* it may wait a long time: hold nothing of the agent's (another command's
         * stdin pipe kept open here would never see its end of file) */
        close_range(4, ~0U, 0);
        prctl(PR_SET_NAME, "corral-spare");
        spare_main();
    }
    if (pid < 0) {
        for (int i = 0; i < 4; i++) { close_fd(&all[i][0]); close_fd(&all[i][1]); }
        return;
    }
    close(pin[0]); close(pout[1]); close(perr[1]); close(psync[0]);
    spare.pid = pid;
    spare.fd_in = pin[1];
    spare.fd_out = pout[0];
    spare.fd_err = perr[0];
    spare.fd_sync = psync[1];
    uint32_t p32 = (uint32_t)pid;
    send_frame(T_SPARE, 0, &p32, 4);
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
static void do_exec_spare(uint32_t id, char *payload, uint32_t len) {
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
    uint32_t l32 = len;
    if (write_some(spare.fd_sync, &l32, 4) < 0 || write_some(spare.fd_sync, payload, len) < 0) {
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
    e->fd_sync = spare.fd_sync;
    spare.pid = 0;
    spare.fd_in = spare.fd_out = spare.fd_err = spare.fd_sync = -1;
    uint32_t p32 = (uint32_t)e->pid;
    send_frame(T_STARTED, id, &p32, 4);
}

static void flush_stdin(struct exec *e) {
    while (e->fd_in >= 0 && e->inlen > 0) {
        ssize_t n = write(e->fd_in, e->inbuf, e->inlen);
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR) return;
            e->inlen = 0; /* reader went away: drop the rest */
            break;
        }
        memmove(e->inbuf, e->inbuf + n, e->inlen - (size_t)n);
        e->inlen -= (size_t)n;
    }
    if (e->inlen == 0 && e->eof_pending) close_fd(&e->fd_in);
}

static void finish_exec(struct exec *e) {
    int32_t st = e->status;
    send_frame(T_EXIT, e->id, &st, 4);
    close_fd(&e->fd_in);
    close_fd(&e->fd_out);
    close_fd(&e->fd_err);
    close_fd(&e->fd_sync);
    free(e->inbuf);
    memset(e, 0, sizeof *e);
    fork_spare(); /* between commands, off the next one's path */
}

static void do_fread(uint32_t id, const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) { send_err(id, errno, path); return; }
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        send_err(id, S_ISDIR(st.st_mode) ? EISDIR : EINVAL, path);
        return;
    }
    static char buf[1 << 20];
    for (;;) {
        ssize_t n = read(fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) { close(fd); send_err(id, errno, path); return; }
        if (n == 0) break;
        send_frame(T_DATA, id, buf, (uint32_t)n);
    }
    close(fd);
    send_frame(T_OK, id, NULL, 0);
}

static int mkdir_parents(char *path, mode_t mode) {
    for (char *p = path + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        int r = mkdir(path, mode);
        *p = '/';
        if (r < 0 && errno != EEXIST) return -1;
    }
    return 0;
}

static void do_fwrite(uint32_t id, char *payload, uint32_t len, int append) {
    if (len < 8) { send_err(id, EINVAL, "write"); return; }
    uint32_t mode, flags;
    memcpy(&mode, payload, 4);
    memcpy(&flags, payload + 4, 4);
    char *path = payload + 8;
    size_t plen = strnlen(path, len - 8);
    if (plen == len - 8) { send_err(id, EINVAL, "write"); return; }
    char *data = path + plen + 1;
    size_t dlen = len - 8 - plen - 1;
    if ((flags & 1) && mkdir_parents(path, 0755) < 0) { send_err(id, errno, path); return; }
    int oflags = O_WRONLY | O_CREAT | O_CLOEXEC | (append ? O_APPEND : O_TRUNC);
    int fd = open(path, oflags, mode & 07777);
    if (fd < 0) { send_err(id, errno, path); return; }
    while (dlen > 0) {
        ssize_t n = write(fd, data, dlen);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) { int err = errno; close(fd); send_err(id, err, path); return; }
        data += n;
        dlen -= (size_t)n;
    }
    if (close(fd) < 0) { send_err(id, errno, path); return; }
    send_frame(T_OK, id, NULL, 0);
}

static char type_char(mode_t m) {
    return S_ISREG(m) ? 'f' : S_ISDIR(m) ? 'd' : S_ISLNK(m) ? 'l' : 'o';
}

static void do_flist(uint32_t id, const char *path) {
    DIR *d = opendir(path);
    if (!d) { send_err(id, errno, path); return; }
    size_t cap = 65536, len = 0;
    char *out = malloc(cap);
    struct dirent *de;
    int count = 0;
    while (out && (de = readdir(d)) != NULL && count < 100000) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        struct stat st;
        if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0) continue;
        size_t nl = strlen(de->d_name);
        size_t need = 1 + 8 + 4 + 8 + nl + 1;
        if (len + need > cap) {
            cap = (cap + need) * 2;
            char *n = realloc(out, cap);
            if (!n) { free(out); out = NULL; break; }
            out = n;
        }
        out[len] = type_char(st.st_mode);
        uint64_t size = (uint64_t)st.st_size;
        uint32_t mode = st.st_mode & 07777;
        int64_t mtime = st.st_mtime;
        memcpy(out + len + 1, &size, 8);
        memcpy(out + len + 9, &mode, 4);
        memcpy(out + len + 13, &mtime, 8);
        memcpy(out + len + 21, de->d_name, nl + 1);
        len += need;
        count++;
    }
    closedir(d);
    if (!out) { send_err(id, ENOMEM, path); return; }
    send_frame(T_OK, id, out, (uint32_t)len);
    free(out);
}

static void do_fstat(uint32_t id, const char *path) {
    struct stat st;
    if (lstat(path, &st) < 0) { send_err(id, errno, path); return; }
    char out[21];
    out[0] = type_char(st.st_mode);
    uint64_t size = (uint64_t)st.st_size;
    uint32_t mode = st.st_mode & 07777;
    int64_t mtime = st.st_mtime;
    memcpy(out + 1, &size, 8);
    memcpy(out + 9, &mode, 4);
    memcpy(out + 13, &mtime, 8);
    send_frame(T_OK, id, out, sizeof out);
}

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb; (void)ftw;
    return (flag == FTW_DP ? rmdir(p) : unlink(p)) < 0 ? -1 : 0;
}

static void do_fremove(uint32_t id, char *payload, uint32_t len) {
    if (len < 5) { send_err(id, EINVAL, "remove"); return; }
    uint32_t recursive;
    memcpy(&recursive, payload, 4);
    const char *path = payload + 4;
    struct stat st;
    if (lstat(path, &st) < 0) { send_err(id, errno, path); return; }
    int r;
    if (S_ISDIR(st.st_mode))
        r = recursive ? nftw(path, rm_entry, 32, FTW_DEPTH | FTW_PHYS) : rmdir(path);
    else
        r = unlink(path);
    if (r < 0) { send_err(id, errno, path); return; }
    send_frame(T_OK, id, NULL, 0);
}

static void do_fmkdir(uint32_t id, char *payload, uint32_t len) {
    if (len < 5) { send_err(id, EINVAL, "mkdir"); return; }
    uint32_t mode;
    memcpy(&mode, payload, 4);
    char *path = payload + 4;
    size_t l = strlen(path);
    char *p = malloc(l + 2);
    if (!p) { send_err(id, ENOMEM, path); return; }
    memcpy(p, path, l);
    p[l] = '/';
    p[l + 1] = 0;
    int r = mkdir_parents(p, mode & 07777);
    free(p);
    if (r < 0) { send_err(id, errno, path); return; }
    send_frame(T_OK, id, NULL, 0);
}

static void handle_request(uint8_t type, uint32_t id, char *payload, uint32_t len) {
    struct exec *e;
    /* every path payload is NUL terminated by the host; enforce it */
    if (len > 0 && type >= T_FREAD && payload[len - 1] != 0 && type != T_FWRITE && type != T_FAPPEND) {
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
        if ((e = find_exec(id)) && e->fd_in >= 0 && len > 0) {
            char *n = realloc(e->inbuf, e->inlen + len);
            if (!n) break;
            e->inbuf = n;
            memcpy(e->inbuf + e->inlen, payload, len);
            e->inlen += len;
            flush_stdin(e);
        }
        break;
    case T_STDIN_EOF:
        if ((e = find_exec(id))) { e->eof_pending = 1; flush_stdin(e); }
        break;
    case T_SIGNAL:
        if ((e = find_exec(id)) && len == 4 && !e->exited) {
            int32_t sig;
            memcpy(&sig, payload, 4);
            kill(-e->pid, sig);
            kill(e->pid, sig);
        }
        break;
    case T_FREAD: if (len) do_fread(id, payload); else send_err(id, EINVAL, "read"); break;
    case T_FWRITE: do_fwrite(id, payload, len, 0); break;
    case T_FAPPEND: do_fwrite(id, payload, len, 1); break;
    case T_FLIST: if (len) do_flist(id, payload); else send_err(id, EINVAL, "list"); break;
    case T_FSTAT: if (len) do_fstat(id, payload); else send_err(id, EINVAL, "stat"); break;
    case T_FREMOVE: do_fremove(id, payload, len); break;
    case T_FMKDIR: do_fmkdir(id, payload, len); break;
    default: send_err(id, ENOSYS, "unknown request"); break;
    }
}


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

static int relay_listen(int family, int port) {
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

static void relay_main(int port, const char *path) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    /* never hold the agent's protocol pipes: only pid 1 speaks on them */
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null >= 0) { dup2(null, 0); dup2(null, 1); }
    int l[2] = {relay_listen(AF_INET, port), relay_listen(AF_INET6, port)};
    if (l[0] < 0) _exit(2);
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

static void pump_output(struct exec *e, int *fd, uint8_t type) {
    static char buf[CHUNK];
    ssize_t n = read(*fd, buf, sizeof buf);
    if (n > 0) send_frame(type, e->id, buf, (uint32_t)n);
    else if (n == 0 || (errno != EINTR && errno != EAGAIN)) close_fd(fd);
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

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--launch") == 0) return launch_main(argc, argv);
    /* the microVM guest's egress relay, started by its pid 1 (relay_mux.c) */
    if (argc == 3 && strcmp(argv[1], "--relay-mux") == 0) return relay_mux_main(atoi(argv[2]));
    prctl(PR_SET_DUMPABLE, 0);
    signal(SIGPIPE, SIG_IGN);
    if (argc > 1 && strcmp(argv[1], "--spare") == 0) {
        spares_enabled = 1;
        argv[1] = argv[0];
        argv++;
        argc--;
    }
    if (argc == 4 && strcmp(argv[1], "--relay") == 0) {
        /* the relay is a child of pid 1; the agent's own protocol is unchanged */
        int port = atoi(argv[2]);
        if (port <= 0 || port > 65535) return 2;
        pid_t pid = fork();
        if (pid < 0) return 2;
        if (pid == 0) relay_main(port, argv[3]);
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
    }
    send_frame(T_READY, 0, "corral-agent 1", 14);
    fork_spare();

    char *payload = NULL;
    for (;;) {
        int n = 0;
        pfds[n++] = (struct pollfd){.fd = 0, .events = POLLIN};
        pfds[n++] = (struct pollfd){.fd = sfd, .events = POLLIN};
        int timeout = -1;
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
            while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
                if (pid == spare.pid) drop_spare();
                for (int i = 0; i < MAX_EXECS; i++) {
                    if (execs[i].used && execs[i].pid == pid) {
                        execs[i].exited = 1;
                        execs[i].status = st;
                        execs[i].exit_ms = now_ms();
                    }
                }
            }
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
            handle_request(hdr[0], id, payload, len);
        }
    }
}
