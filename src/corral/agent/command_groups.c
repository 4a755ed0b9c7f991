/* corral-agent: a cgroup per command inside gVisor (`--command-groups DIR`).
 *
 * On the process tier each command runs in a host cgroup leaf of its own, and a kill kills the
 * leaf: whatever the command started goes with it, also a child that left its session and
 * process group (`setsid`, a daemon's double fork).  gVisor's processes are not host processes,
 * so there the agent killed the command's session and process group only, and a `setsid` child
 * of a timed-out or killed command lived on until the sandbox was destroyed.
 *
 * gVisor has cgroups of its own (its `pids` hierarchy, mounted by runsc at DIR): each command
 * joins a new DIR/c<N> (N counts the agent's commands: a host's request ids may repeat) between
 * fork and exec (the agent writes its pid there before it lets the
 * command go), its descendants stay members whatever session they make, and a SIGKILL of the
 * command sends SIGKILL to every member too.  The directories are root's: uid 1000 can neither
 * leave its command's group nor make one (root commands can: root's own sandbox).  A group is
 * removed when its command ends, unless members are left (background children): those groups are
 * looked for at a command's start, at most once a second (a directory read per command cost
 * what the groups left made it).
 */
#include "agent.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *groups_dir; /* NULL: no command groups (every tier but gVisor) */

/* How many times a kill reads the group again: a member forking while it is read is listed on
 * the next pass, and a killed member forks no more, so the group empties in a few passes.
 * Not always: chains of processes that fork and exit at once can outrun the reads (a probe's 100
 * such chains left 1-3 alive after a timeout, 200 left 26; before the groups, 41-47 were left).
 * gVisor has no freezer and no cgroup.kill to stop them at once, and does not hold its pids.max
 * reliably (a fork charges the group of whichever hierarchy it meets first); stopping them one
 * by one, or killing their process groups too, did no better here.  What is left dies with the
 * sandbox, within its pids and memory limits. */
#define KILL_PASSES 64

int set_command_groups(const char *dir) {
    struct stat st;
    if (dir[0] != '/' || stat(dir, &st) < 0 || !S_ISDIR(st.st_mode)) return -1;
    groups_dir = dir;
    return 0;
}

static uint32_t groups_made;
static long long last_sweep_ms;

static int group_path(char *out, size_t n, uint32_t group, const char *file) {
    int len = snprintf(out, n, "%s/c%u%s%s", groups_dir, group, file ? "/" : "", file ? file : "");
    return len > 0 && (size_t)len < n ? 0 : -1;
}

static int group_in_use(uint32_t group) {
    for (int i = 0; i < MAX_EXECS; i++)
        if (execs[i].used && execs[i].group == group) return 1;
    return 0;
}

/* Remove the groups of ended commands whose members are gone too (rmdir refuses the others). */
static void sweep_groups(void) {
    DIR *d = opendir(groups_dir);
    if (!d) return;
    struct dirent *ent;
    while ((ent = readdir(d))) {
        if (ent->d_name[0] != 'c') continue;
        char *end;
        unsigned long group = strtoul(ent->d_name + 1, &end, 10);
        if (*end || end == ent->d_name + 1 || group_in_use((uint32_t)group)) continue; /* a running command's */
        unlinkat(dirfd(d), ent->d_name, AT_REMOVEDIR);
    }
    closedir(d);
}

/* The group the command ``pid`` joined: its number, or 0 (none: its group kill is what is left). */
uint32_t command_group_join(pid_t pid) {
    if (!groups_dir) return 0;
    long long now = now_ms();
    if (now - last_sweep_ms >= 1000) {
        last_sweep_ms = now;
        sweep_groups();
    }
    uint32_t group = ++groups_made ? groups_made : ++groups_made;
    char path[PATH_MAX];
    if (group_path(path, sizeof path, group, NULL) < 0) return 0;
    if (mkdir(path, 0755) < 0 && errno != EEXIST) return 0;
    if (group_path(path, sizeof path, group, "cgroup.procs") < 0) return 0;
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    int ok = dprintf(fd, "%d\n", (int)pid) > 0;
    close(fd);
    return ok ? group : 0;
}

/* Ended commands whose groups still had members (background children), by the host's request id:
 * a later kill of the command (an interpreter's restart of a kernel that died) kills them, as the
 * process tier's kill of the command's cgroup leaf does; before, the host's kill found no command
 * and a dead kernel's cells' `setsid` children outlived every restart.  Kept while the group is:
 * a slot is taken again once its group is gone (swept when its members ended), and the list grows
 * otherwise: each entry is a group with a live member (or, a root command's doing, a child group of
 * its own), up to ENDED_MOST (512 KiB).  A ring of 64 forgot the oldest: 64 commands each leaving a
 * background child pushed a dead kernel out, and its cells' children outlived the restart (helper 90). */
#define ENDED_MOST (1u << 16) /* past it, the oldest go (they still die with the sandbox) */
static struct ended_group { uint32_t id, group; } *ended;
static size_t ended_len, ended_cap, ended_next;

static int group_exists(uint32_t group) {
    char path[PATH_MAX];
    struct stat st;
    return group_path(path, sizeof path, group, NULL) == 0 && stat(path, &st) == 0;
}

static struct ended_group *ended_slot(void) {
    for (size_t i = 0; i < ended_len; i++)
        if (!ended[i].group || !group_exists(ended[i].group)) return &ended[i];
    if (ended_len == ended_cap && ended_cap < ENDED_MOST) {
        size_t cap = ended_cap ? ended_cap * 2 : 64;
        struct ended_group *grown = realloc(ended, cap * sizeof *grown);
        if (grown) {
            ended = grown;
            ended_cap = cap;
        }
    }
    if (ended_len < ended_cap) return &ended[ended_len++];
    return ended_len ? &ended[ended_next++ % ended_len] : NULL;
}

/* The command ``id`` of ``group`` ended: its group goes, unless members are left (see sweep_groups). */
void command_group_done(uint32_t id, uint32_t group) {
    char path[PATH_MAX];
    if (!groups_dir || !group || group_path(path, sizeof path, group, NULL) < 0) return;
    if (rmdir(path) < 0) { /* (members left: EBUSY on Linux; gVisor may say otherwise) */
        struct ended_group *slot = ended_slot();
        if (slot) {
            slot->id = id;
            slot->group = group;
        }
    }
}

void command_group_kill_ended(uint32_t id) {
    for (size_t i = 0; i < ended_len; i++)
        if (ended[i].group && ended[i].id == id) {
            command_group_kill(ended[i].group);
            ended[i].group = 0;
        }
}

void command_group_kill(uint32_t group) {
    if (!groups_dir || !group) return;
    char path[PATH_MAX];
    if (group_path(path, sizeof path, group, "cgroup.procs") < 0) return;
    static char now[65536], before[65536];
    before[0] = 0;
    for (int pass = 0; pass < KILL_PASSES; pass++) {
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) return;
        ssize_t n = read(fd, now, sizeof now - 1);
        close(fd);
        /* the members killed stay listed until reaped (by this loop's caller): the same list
         * twice is a group with nothing new in it */
        if (n <= 0) return;
        now[n] = 0;
        if (strcmp(now, before) == 0) return;
        for (char *p = now, *end; *p; p = end) {
            long pid = strtol(p, &end, 10);
            if (end == p) break;
            if (pid > 1) kill((pid_t)pid, SIGKILL); /* never pid 1: root may have moved the agent in */
            while (*end == '\n') end++;
        }
        memcpy(before, now, (size_t)n + 1);
    }
}
