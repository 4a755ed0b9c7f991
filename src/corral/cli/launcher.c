/*
 * corral: the command-line launcher `make install` puts in the virtual environment.
 *
 * `corral run [--json] [--timeout S] [--] CMD...` with a `corral daemon` listening goes
 * straight to the daemon's socket (the wire of corral/cli/local_wire.py) and relays what it
 * answers: no Python start-up, which is most of a run's cost (~15 ms of ~23).  Every other
 * call, and a run with no daemon (or one that goes away before it said the command
 * started), execs the Python CLI with the same arguments, so results, messages and exit
 * codes are corral.cli's own; corral/cli/fast_run.py is the same logic in Python and the
 * two must agree (tests/test_cli_daemon.py runs every case through both).
 *
 * CORRAL_PYTHON is the interpreter of the virtual environment, fixed at build time.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#ifndef CORRAL_PYTHON
#error "build with -DCORRAL_PYTHON=\"/path/to/venv/bin/python\""
#endif

#define EXIT_SANDBOX_FAILED 125
#define EXIT_TIMEOUT 124
#define EXIT_OOM 137
#define MAX_REQUEST (1u << 20)
#define RESULT_HEAD 14 /* <i??d: exit code, timed out, OOM-killed, duration in ms */
#define DEFAULT_TIMEOUT 60.0 /* local_wire.DEFAULT_TIMEOUT */
#define ANSWER_GRACE 15.0    /* local_wire.ANSWER_GRACE */

static char **original_argv;

static void run_python(void) {
    int argc = 0;
    while (original_argv[argc]) argc++;
    char **argv = calloc((size_t)argc + 5, sizeof *argv);
    if (!argv) _exit(EXIT_SANDBOX_FAILED);
    argv[0] = CORRAL_PYTHON;
    /* -P: `-m` would put the working directory first on sys.path, and root runs `corral` in
     * project directories a sandbox writes back to (or a cloned repository fills): a
     * corral/__init__.py or an argparse.py there ran as host root before the CLI started */
    argv[1] = "-P";
    argv[2] = "-m";
    argv[3] = "corral.cli";
    for (int i = 1; i < argc; i++) argv[i + 3] = original_argv[i];
    execv(CORRAL_PYTHON, argv);
    fprintf(stderr, "corral: cannot run %s: %s\n", CORRAL_PYTHON, strerror(errno));
    _exit(EXIT_SANDBOX_FAILED);
}

static int write_all(int fd, const void *data, size_t n) {
    const char *p = data;
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int read_all(int fd, void *data, size_t n) {
    char *p = data;
    while (n) {
        ssize_t r = read(fd, p, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

static uint32_t le32(const unsigned char *b) {
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}

/* The daemon's socket, or -1 (no daemon, or a stale socket of a dead one). */
static int connect_daemon(void) {
    const char *state = getenv("CORRAL_STATE_DIR");
    if (!state || !*state) state = "/var/lib/corral";
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if ((size_t)snprintf(addr.sun_path, sizeof addr.sun_path, "%s/daemon.sock", state) >= sizeof addr.sun_path)
        return -1;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct ucred peer;
    socklen_t size = sizeof peer;
    /* a listener of another user (in a state directory they can change) is not the daemon:
     * the command and what it prints are not theirs; the Python CLI refuses such a directory */
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0 ||
        getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &size) < 0 || (peer.uid != 0 && peer.uid != geteuid())) {
        close(fd);
        return -1;
    }
    return fd;
}

static int send_request(int fd, char **cmd, const char *timeout) {
    size_t size = strlen(timeout);
    for (char **a = cmd; *a; a++) size += 1 + strlen(*a);
    if (size > MAX_REQUEST) return -1;
    char *body = malloc(size + 4);
    if (!body) return -1;
    body[0] = (char)(size & 0xff);
    body[1] = (char)(size >> 8 & 0xff);
    body[2] = (char)(size >> 16 & 0xff);
    body[3] = (char)(size >> 24 & 0xff);
    char *p = body + 4;
    p = stpcpy(p, timeout);
    for (char **a = cmd; *a; a++) {
        *p++ = '\0';
        size_t n = strlen(*a);
        memcpy(p, *a, n);
        p += n;
    }
    int rc = write_all(fd, body, size + 4);
    free(body);
    return rc;
}

/* The exit code of the daemon's run, or -1 to run the call in Python instead. */
/* seconds the client waits for each frame once the command started (local_wire.answer_deadline) */
static double answer_deadline(const char *timeout) {
    char *end = NULL;
    double seconds = *timeout ? strtod(timeout, &end) : DEFAULT_TIMEOUT;
    if (*timeout && (end == timeout || *end || !(seconds > 0 && seconds < 1e9))) seconds = DEFAULT_TIMEOUT;
    return seconds + ANSWER_GRACE;
}

static int relay(int fd, int as_json, double deadline) {
    int started = 0;
    for (;;) {
        unsigned char head[5];
        char *payload = NULL;
        uint32_t length = 0;
        errno = 0; /* (an end of the stream leaves it 0: only a timed-out read says EAGAIN) */
        int ok = read_all(fd, head, sizeof head) == 0;
        if (ok) {
            length = le32(head + 1);
            payload = malloc((size_t)length + 1);
            ok = payload && read_all(fd, payload, length) == 0;
        }
        if (!ok) {
            int timed_out = errno == EAGAIN || errno == EWOULDBLOCK;
            free(payload);
            if (started && timed_out) {
                fprintf(stderr, "corral: the local daemon said nothing for %g s while the command ran\n", deadline);
                return EXIT_SANDBOX_FAILED;
            }
            /* gone before the command started: run it in Python; after, never again (it may
             * have done what it does, silently or with --json) */
            if (!started) return -1;
            fprintf(stderr, "corral: the local daemon went away while the command ran\n");
            return EXIT_SANDBOX_FAILED;
        }
        payload[length] = '\0';
        int code = -2;
        switch (head[0]) {
        case 's': {
            started = 1; /* before it, a busy daemon's queue may be long: no deadline */
            struct timeval tv = {.tv_sec = (time_t)deadline, .tv_usec = (suseconds_t)((deadline - (double)(time_t)deadline) * 1e6)};
            setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
            break;
        }
        case 'o':
        case 'e':
            started = 1;
            if (!as_json) write_all(head[0] == 'o' ? 1 : 2, payload, length);
            break;
        case 'x':
            fprintf(stderr, "corral: %s\n", payload);
            code = EXIT_SANDBOX_FAILED;
            break;
        case 'r': {
            if (length < RESULT_HEAD) {
                code = EXIT_SANDBOX_FAILED;
                break;
            }
            int32_t exit_code = (int32_t)le32((unsigned char *)payload);
            int timed_out = payload[4] != 0, oom_killed = payload[5] != 0;
            double duration_ms;
            memcpy(&duration_ms, payload + 6, sizeof duration_ms); /* little-endian host */
            if (as_json) {
                write_all(1, payload + RESULT_HEAD, length - RESULT_HEAD);
                write_all(1, "\n", 1);
                code = 0;
            } else if (timed_out) {
                fprintf(stderr, "corral: command timed out after %.1f s\n", duration_ms / 1000);
                code = EXIT_TIMEOUT;
            } else if (oom_killed) {
                fprintf(stderr, "corral: command was killed: out of memory\n");
                code = EXIT_OOM;
            } else {
                code = exit_code & 0xff;
            }
            break;
        }
        }
        free(payload);
        if (code != -2) return code;
    }
}

int main(int argc, char **argv) {
    original_argv = argv;
    const char *url = getenv("CORRAL_URL"), *no_daemon = getenv("CORRAL_NO_DAEMON");
    if (argc < 3 || strcmp(argv[1], "run") != 0 || (url && *url) || (no_daemon && *no_daemon)) run_python();
    int i = 2, as_json = 0;
    const char *timeout = "";
    while (i < argc && argv[i][0] == '-' && strcmp(argv[i], "--") != 0) {
        if (strcmp(argv[i], "--json") == 0) {
            as_json = 1;
            i++;
        } else if (strcmp(argv[i], "--timeout") == 0 && i + 1 < argc) {
            timeout = argv[i + 1];
            i += 2;
        } else if (strncmp(argv[i], "--timeout=", 10) == 0) {
            timeout = argv[i] + 10;
            i++;
        } else {
            run_python(); /* any other option: the Python CLI knows it */
        }
    }
    if (i < argc && strcmp(argv[i], "--") == 0) i++;
    if (i >= argc) run_python();
    int fd = connect_daemon();
    if (fd < 0) run_python();
    if (send_request(fd, argv + i, timeout) < 0) {
        close(fd);
        run_python();
    }
    int code = relay(fd, as_json, answer_deadline(timeout));
    close(fd);
    if (code < 0) run_python();
    return code;
}
