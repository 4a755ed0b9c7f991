/*
 * corral-agent: who commands run as.
 *
 * In the process tier the agent is root of the sandbox's own user namespace
 * (its 65,536 host ids mapped to 0-65535 inside), holding only the
 * capabilities bwrap left it (--cap-add: root's set, see tiers/process).  Each
 * command becomes its user just before exec:
 *
 *   uid 0  keeps that set (in the sandbox's user namespace only: no host
 *          capability; seccomp and no_new_privs as for everyone);
 *   uid N  drops every capability (effective, permitted, inheritable, ambient
 *          and the bounding set) and all supplementary groups.
 *
 * The agent's own file requests run with the default user's file-system ids
 * (setfsuid/setfsgid): a file the files API writes belongs to that user, and
 * the kernel drops the file capabilities from the agent's effective set while
 * its fsuid is not 0.  gVisor has no setfsuid: there the agent stays root and
 * gives what file requests create to the default user (give_new_file).
 *
 * `--userns UID` (run by the host as root): drop to UID, make a user namespace
 * (owned by UID), say so on stdout and wait for end of file on stdin.  The
 * host writes its uid and gid maps meanwhile (only root can map a range) and
 * keeps a file descriptor of it: bwrap joins it (--userns), the sandbox's
 * idmapped image layers are made with it.
 */
#include "agent.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/seccomp.h>
#include <linux/filter.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/fsuid.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/syscall.h>
#include <unistd.h>

/* -1: the agent's own user (no --user given) */
long default_uid = -1;

static int capset_all(uint32_t lo, uint32_t hi) {
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2] = {{lo, lo, 0}, {hi, hi, 0}};
    return (int)syscall(SYS_capset, &hdr, data);
}

/* where set*fsid is missing (gVisor): the default user, to give what file requests create */
static long owner_of_new = -1;

int set_default_user(long uid) {
    if (uid < 0 || uid > 65535) return -1;
    default_uid = uid;
    /* file requests as that user: its ids on new files, its permissions */
    setfsgid((gid_t)uid);
    setfsuid((uid_t)uid);
    if ((long)setfsuid((uid_t)-1) == uid) return 0;
    /* a kernel without set*fsid (gVisor's: ENOSYS): the agent keeps all its ids 0 (an
     * effective uid of the user's would let the user's commands open the agent's
     * descriptors there) and hands what file requests create to the user instead */
    owner_of_new = uid;
    return 0;
}

void give_new_file(int fd, const char *path) {
    if (owner_of_new < 0) return;
    int r = fd >= 0 ? fchown(fd, (uid_t)owner_of_new, (gid_t)owner_of_new)
                    : lchown(path, (uid_t)owner_of_new, (gid_t)owner_of_new);
    (void)r; /* the file exists either way; its owner is cosmetic to the request */
}

/* Where set*fsid is missing (gVisor) the agent's file requests would act as root: through a
 * link the default user planted (/tmp/out -> /etc), the files API wrote /etc/passwd and
 * /usr/bin/ls of a sandbox whose user may not.  There each one runs in a child of the agent
 * that has become the default user (agent.c): 1 when that is needed. */
int file_requests_in_a_child(void) {
    return owner_of_new > 0;
}

/* In that child: the default user's effective ids, which the file system checks (gVisor has no
 * fsuid), and no capability; nothing handed over afterwards (what it creates is its own).  Its
 * real and saved uid stay 0: with all three the user's, the user's commands could signal it (a
 * kill is allowed when the sender's uid is the target's real or saved one) -- a SIGSTOP held the
 * agent, which waits for this child, and every later call of the sandbox failed -- and open its
 * descriptors (the agent's protocol) through /proc. */
int drop_to_file_user(void) {
    uid_t uid = (uid_t)owner_of_new;
    owner_of_new = -1;
    if (setgroups(0, NULL) < 0 || setresgid(uid, uid, uid) < 0 || setresuid(0, uid, 0) < 0) return -1;
    if (capset_all(0, 0) < 0) return -1; /* the kernel clears the effective set; permitted too, here */
    prctl(PR_SET_DUMPABLE, 0);
    return getuid() == 0 && geteuid() == uid ? 0 : -1;
}

/* on (1): the agent's own ids for one file request of the host's (setfsuid 0 gives the file
 * capabilities back; nothing is handed to the default user); off (0): the default user's again */
void agent_ids(int on) {
    static long saved_owner = -1;
    if (default_uid <= 0) return;
    if (on) {
        saved_owner = owner_of_new;
        owner_of_new = -1;
        setfsgid(0);
        setfsuid(0);
    } else {
        setfsgid((gid_t)default_uid);
        setfsuid((uid_t)default_uid);
        owner_of_new = saved_owner;
    }
}

/* The command's stdio as its own: the agent made its pipes and terminal, and where the agent's
 * file-system uid is not the user's (gVisor: root) a pipe or terminal of root's could not be
 * opened again by the command (/dev/stdin, /proc/self/fd/N, /dev/tty). */
static void give_stdio(uid_t uid) {
    for (int fd = 0; fd <= 2; fd++) {
        struct stat st;
        if (fstat(fd, &st) < 0 || st.st_uid == uid) continue;
        int pty_slave = S_ISCHR(st.st_mode) && major(st.st_rdev) >= 136 && major(st.st_rdev) <= 143;
        if (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode) || pty_slave)
            if (fchown(fd, uid, (gid_t)-1) < 0) {} /* best effort: the command runs either way */
    }
}

/* The agent's bounding set, read once (capbset_read) before it forks commands: it never
 * changes (nothing drops the agent's own), and its commands inherit it.  A capability not in
 * it needs no drop. */
static uint64_t bset;
static int bset_known;

void capbset_read(void) {
    uint64_t held = 0;
    for (int cap = 0; cap <= 63; cap++) {
        int r = prctl(PR_CAPBSET_READ, cap, 0, 0, 0);
        if (r < 0) {
            if (errno == EINVAL) break; /* past the kernel's last capability */
            return; /* unknown: become_user drops every one */
        }
        if (r) held |= 1ull << cap;
    }
    bset = held;
    bset_known = 1;
}

int become_user(uid_t uid) {
    if (uid != 0) give_stdio(uid);
    if (setgroups(0, NULL) < 0) return -1;
    if (uid == 0) {
        if (setresgid(0, 0, 0) < 0 || setresuid(0, 0, 0) < 0) return -1;
        /* the file-system ids back to 0 give the file capabilities back (setresuid does not) */
        setfsgid(0);
        setfsuid(0);
        return 0;
    }
    /* the bounding set first (it needs CAP_SETPCAP, gone with the uid change): only the
     * capabilities it holds (read once by the agent, see capbset_read), each one a system call
     * on a command's path; every one when it was not read */
    for (int cap = 0; cap <= 63; cap++) {
        if (bset_known && !(bset >> cap & 1)) continue;
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0 || errno == EPERM) continue;
        if (errno == EINVAL) break; /* past the kernel's last capability (they are numbered 0..last) */
        return -1;
    }
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    if (setresgid(uid, uid, uid) < 0 || setresuid(uid, uid, uid) < 0) return -1;
    if (getuid() != uid || geteuid() != uid) { errno = EPERM; return -1; }
    /* permitted and effective went with the uid; inheritable stays unless cleared */
    return capset_all(0, 0);
}

int userns_main(const char *uid_text) {
    char *end;
    unsigned long uid = strtoul(uid_text, &end, 10);
    if (*end || uid == 0 || uid >= 0xFFFFFFFFul) {
        dprintf(2, "corral-agent: refusing uid %s\n", uid_text);
        return 125;
    }
    if (setgroups(0, NULL) < 0 || setresgid((gid_t)uid, (gid_t)uid, (gid_t)uid) < 0 ||
        setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) < 0 || getuid() != (uid_t)uid) {
        dprintf(2, "corral-agent: cannot drop to uid %lu: %s\n", uid, strerror(errno));
        return 125;
    }
    if (unshare(CLONE_NEWUSER) < 0) {
        dprintf(2, "corral-agent: cannot make a user namespace: %s\n", strerror(errno));
        return 125;
    }
    char made = 'u';
    if (write(1, &made, 1) != 1) return 125;
    char buf[64];
    while (read(0, buf, sizeof buf) > 0) {}
    return 0;
}

/*
 * `--vmm USERNS_FD CAPS GROUPS [OPTIONS] -- /PROGRAM ARGS...` (run by the host as root; the
 * microVM tier's QEMU): keep only the supplementary groups GROUPS ("-" for none; e.g. /dev/kvm's),
 * enter the sandbox's user namespace USERNS_FD, become its uid and gid 0 (the range's base on the
 * host), take a network namespace of its own (empty), cut the bounding set to the capability
 * mask CAPS (hex), set no_new_privs and exec PROGRAM, which then holds exactly CAPS — over files
 * and ids of the sandbox's own range only.  OPTIONS: --die-with-parent (PROGRAM is killed when
 * the process that started this one ends: a template boot's QEMU); --seccomp PATH (load the BPF
 * program in PATH, the sandboxes' filter, read while still host root, on top of QEMU's own).
 */
static struct sock_filter seccomp_program[4096];
static struct sock_fprog seccomp_prog;

static int read_seccomp(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, seccomp_program, sizeof seccomp_program);
    close(fd);
    if (n <= 0 || n % (ssize_t)sizeof seccomp_program[0] != 0 || n == (ssize_t)sizeof seccomp_program) {
        errno = EINVAL;
        return -1;
    }
    seccomp_prog.len = (unsigned short)(n / (ssize_t)sizeof seccomp_program[0]);
    seccomp_prog.filter = seccomp_program;
    return 0;
}

int vmm_main(int argc, char **argv) {
    pid_t parent = getppid();
    int die_with_parent = 0, i = 5;
    const char *seccomp = NULL;
    for (; i < argc && strcmp(argv[i], "--") != 0; i++) {
        if (strcmp(argv[i], "--die-with-parent") == 0) {
            die_with_parent = 1;
        } else if (strcmp(argv[i], "--seccomp") == 0 && i + 1 < argc) {
            seccomp = argv[++i];
        } else {
            i = argc;
        }
    }
    if (argc < 7 || i + 1 >= argc || argv[i + 1][0] != '/') {
        dprintf(2, "corral-agent: usage: --vmm USERNS_FD CAPS GROUPS [--die-with-parent] [--seccomp PATH] -- "
                   "/PROGRAM [ARGS...]\n");
        return 125;
    }
    char **program = &argv[i + 1];
    if (seccomp != NULL && read_seccomp(seccomp) < 0) {
        dprintf(2, "corral-agent: cannot read the seccomp filter %s: %s\n", seccomp, strerror(errno));
        return 125;
    }
    int fd = atoi(argv[2]);
    unsigned long long keep = strtoull(argv[3], NULL, 16);
    gid_t groups[8];
    size_t ngroups = 0;
    for (char *g = strcmp(argv[4], "-") ? argv[4] : NULL, *next; g && *g && ngroups < 8; g = next) {
        groups[ngroups++] = (gid_t)strtoul(g, &next, 10);
        if (*next == ',') next++;
    }
    /* the groups first: inside, an unmapped group can no longer be added (it still grants access) */
    if (setgroups(ngroups, groups) < 0 || setns(fd, CLONE_NEWUSER) < 0 || setresgid(0, 0, 0) < 0 ||
        setresuid(0, 0, 0) < 0) {
        dprintf(2, "corral-agent: cannot enter the sandbox's user namespace: %s\n", strerror(errno));
        return 125;
    }
    close(fd);
    /* the change of uid cleared any parent-death signal set before: set it again (a template
     * boot's QEMU is in no sandbox's cgroup, so no janitor would find it), and go if the
     * parent is gone already */
    if (die_with_parent && (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0 || getppid() != parent)) return 125;
    /* a network namespace of its own, empty (its loopback down): QEMU is handed every socket
     * and tap it uses as a descriptor, and one a guest took over must not reach what the host's
     * namespace reaches (its loopback services, the metadata address, the LAN).  Owned by the
     * sandbox's user namespace; it goes with QEMU, its only process */
    if (unshare(CLONE_NEWNET) < 0) {
        dprintf(2, "corral-agent: cannot give QEMU a network namespace of its own: %s\n", strerror(errno));
        return 125;
    }
    for (int cap = 0; cap <= 63; cap++)
        if (!(keep >> cap & 1) && prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno != EINVAL) {
            dprintf(2, "corral-agent: cannot drop capability %d: %s\n", cap, strerror(errno));
            return 125;
        }
    /* exec as root of the namespace gives the bounding set: exactly CAPS, nothing to gain later */
    if (capset_all((uint32_t)keep, (uint32_t)(keep >> 32)) < 0 || prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) {
        dprintf(2, "corral-agent: cannot limit capabilities: %s\n", strerror(errno));
        return 125;
    }
    /* last, so that nothing above needs what it refuses (unshare, setns) */
    if (seccomp != NULL && prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &seccomp_prog, 0, 0) < 0) {
        dprintf(2, "corral-agent: cannot load the seccomp filter: %s\n", strerror(errno));
        return 125;
    }
    execv(program[0], program);
    dprintf(2, "corral-agent: cannot execute %s: %s\n", program[0], strerror(errno));
    return 125;
}
