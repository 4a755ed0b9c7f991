/*
 * corral-agent: the watch over a paused sandbox (`--owner-watch MODE KILL_GROUP [GROUP...]`, run by
 * the host, outside the sandbox's cgroups, from the sandbox's first freeze to its close).
 *
 * A running sandbox ends with its owner: its agent reads end of file on its pipe and exits (and
 * bubblewrap dies with it, PR_SET_PDEATHSIG).  A frozen one notices nothing: its agent does not run,
 * and its processes, memory, mounts and uids stayed until the next `corral gc`.  So the host starts
 * this process before it first freezes a sandbox and SIGKILLs it when it closes the sandbox; should
 * the owner (this process's parent) die first, this kills every process of KILL_GROUP and GROUP...
 * (the sandbox's kill tree and limit groups, below each), thaws them (a v1 freezer holds the
 * signal until then) and exits.
 *
 * MODE is the kill tree's (host/cgroups.py): "cgroup.kill", "freeze" (cgroup v2 without
 * cgroup.kill) or "freezer" (cgroup v1).  It takes a session of its own, and /dev/null for stdio.
 */
#include "agent.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

/* cgroup trees are shallow: the sandbox's group, its leaves (and gVisor's nothing more) */
#define WATCH_MAX_DEPTH 8
#define WATCH_ROUNDS 200 /* x 25 ms: 5 s, kill_group's deadline (host/cgroup_tree.py) */

static void write_control(const char *group, const char *file, const char *value) {
    char path[4096];
    if (snprintf(path, sizeof path, "%s/%s", group, file) >= (int)sizeof path) return;
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return;
    if (write(fd, value, strlen(value)) < 0) { /* gone already, or not of this mode: nothing to do */ }
    close(fd);
}

/* SIGKILL every process of `group` and below; how many there were */
static int kill_below(const char *group, int depth) {
    char path[4096];
    int found = 0;
    if (snprintf(path, sizeof path, "%s/cgroup.procs", group) < (int)sizeof path) {
        FILE *procs = fopen(path, "re");
        if (procs) {
            long pid;
            while (fscanf(procs, "%ld", &pid) == 1)
                if (pid > 1 && kill((pid_t)pid, SIGKILL) == 0) found++;
            fclose(procs);
        }
    }
    if (depth >= WATCH_MAX_DEPTH) return found;
    DIR *dir = opendir(group);
    if (!dir) return found;
    struct dirent *entry;
    while ((entry = readdir(dir)) != NULL) {
        if (entry->d_type != DT_DIR || strcmp(entry->d_name, ".") == 0 || strcmp(entry->d_name, "..") == 0) continue;
        if (snprintf(path, sizeof path, "%s/%s", group, entry->d_name) < (int)sizeof path) found += kill_below(path, depth + 1);
    }
    closedir(dir);
    return found;
}

static void wait_for_owner(pid_t owner) {
    int pidfd = (int)syscall(SYS_pidfd_open, owner, 0);
    if (pidfd >= 0 && getppid() == owner) { /* (checked after the open: the pid was still its) */
        struct pollfd ended = {pidfd, POLLIN, 0};
        while (poll(&ended, 1, -1) < 0 && errno == EINTR) {}
        return;
    }
    /* no pidfds (Linux < 5.3): the owner's end reparents this process */
    struct timespec tick = {0, 50 * 1000 * 1000};
    while (getppid() == owner) nanosleep(&tick, NULL);
}

int owner_watch_main(int argc, char **argv) {
    if (argc < 4) return 2;
    const char *mode = argv[2], *kill_group = argv[3];
    pid_t owner = getppid();
    setsid(); /* the owner's terminal's ^C must not end the watch before the owner */
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null >= 0) {
        for (int fd = 0; fd < 3; fd++) dup2(null, fd);
        if (null > 2) close(null);
    }
    wait_for_owner(owner);
    struct timespec tick = {0, 25 * 1000 * 1000};
    for (int round = 0; round < WATCH_ROUNDS; round++) {
        if (strcmp(mode, "cgroup.kill") == 0) write_control(kill_group, "cgroup.kill", "1");
        int found = 0;
        for (int i = 3; i < argc; i++) /* argv[3]: the kill tree */ found += kill_below(argv[i], 0);
        /* signals first, then the thaw: nothing of the sandbox runs again but to die */
        if (strcmp(mode, "freezer") == 0) write_control(kill_group, "freezer.state", "THAWED");
        else write_control(kill_group, "cgroup.freeze", "0");
        if (!found) return 0;
        nanosleep(&tick, NULL);
    }
    return 1;
}
