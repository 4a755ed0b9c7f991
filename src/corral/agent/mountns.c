/*
 * corral-agent: a sandbox's own mount namespace (`--mountns FD [UID]`, run by the host as root).
 *
 * Every mount a sandbox needs (its disk tmpfs, its overlay root, the idmapped
 * views of its image layers) is made here, in a mount namespace of this
 * process's own, never in the host's: the host's mount table stays the same
 * size however many sandboxes live, and bubblewrap, which copies the table it
 * starts from into each new sandbox, copies a short one.  Whatever was
 * mounted here vanishes with the last process in the namespace.
 *
 * At start: unshare(CLONE_NEWNS) and make every mount private (nothing the
 * host mounts later propagates in, nothing made here propagates out).  Then
 * it serves requests on FD, a SOCK_SEQPACKET socket, one per message:
 *
 *   'm' SOURCE \0 TARGET \0 FSTYPE \0 FLAGS \0 DATA     mount(2) ("" FSTYPE: none)
 *   'u' TARGET \0 FLAGS                                  umount2(2)
 *   'i' LOWER \0 VIEW          + fd: a user namespace    LOWER cloned, idmapped to it
 *                                                        (read-only, nosuid, nodev, noatime) at VIEW
 *   'x' UID \0 NETNS \0 PROGRAM \0 ARGS...  + fds         exec PROGRAM (bubblewrap) as UID
 *
 * 'M' is 'm' only if the request before it succeeded (else ECANCELED), so that the host can
 * send a chain at once (idmap a layer, mount the overlay on it, detach the view: one round trip).
 *
 * With UID it also forks, at once, the maker of the sandbox's user namespace (`--userns UID`,
 * users.c), which saves the host starting one of its own:
 *
 *   'n'                        wait until it made the namespace; answer: its pid (text)
 *   'N'                        the host has mapped it and holds it: the maker may exit (reaped
 *                              at the exec or the end; the one request with no answer)
 *
 * Each other request gets an answer: a 4-byte errno (0: done) and a message.  For 'x' the
 * fds received go to 3, 4, ... in order (NETNS "1": the first is a network
 * namespace to enter, and is not passed on); a successful exec closes FD (the
 * host reads end of file), a failed one answers.  End of file on FD ends this
 * process (its owner is gone, or is done with a namespace it never used).
 */
#include "agent.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define MNS_MAX_FDS 8
#define MNS_MAX_ARGS 1024

#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#ifndef SYS_move_mount
#define SYS_move_mount 429
#endif
#ifndef SYS_mount_setattr
#define SYS_mount_setattr 442
#endif

struct mns_attr {
    uint64_t attr_set, attr_clr, propagation, userns_fd;
};

/* the user namespace's maker: its pid, where it says it is done, where it waits for end of file */
static pid_t maker = 0;
static int maker_said = -1, maker_waits = -1;

static void start_maker(const char *uid, int sock) {
    int up[2], down[2];
    if (pipe2(up, O_CLOEXEC) < 0) return;
    if (pipe2(down, O_CLOEXEC) < 0) {
        close(up[0]);
        close(up[1]);
        return;
    }
    pid_t pid = fork();
    if (pid == 0) {
        /* no exec follows: close-on-exec closes nothing, so the ends that are not its own go by
         * hand (were the write end of ``down`` kept, its end of file would never come) */
        close(sock);
        close(up[0]);
        close(down[1]);
        if (dup2(down[0], 0) < 0 || dup2(up[1], 1) < 0) _exit(125);
        _exit(userns_main(uid));
    }
    close(up[1]);
    close(down[0]);
    if (pid < 0) {
        close(up[0]);
        close(down[1]);
        return;
    }
    maker = pid;
    maker_said = up[0];
    maker_waits = down[1];
}

static void end_maker(void) {
    if (maker_waits >= 0) close(maker_waits);
    if (maker_said >= 0) close(maker_said);
    maker_waits = maker_said = -1;
    if (maker > 0) waitpid(maker, NULL, 0);
    maker = 0;
}

/* errno and what failed, or 0 and ``text`` (may be NULL) */
static void answer(int sock, int err, const char *what, const char *text) {
    char buf[512];
    int32_t e = err;
    memcpy(buf, &e, 4);
    size_t n = 0;
    if (err) n = (size_t)snprintf(buf + 4, sizeof buf - 4, "%s: %s", what, strerror(err));
    else if (text) n = (size_t)snprintf(buf + 4, sizeof buf - 4, "%s", text);
    if (n > sizeof buf - 5) n = sizeof buf - 5;
    if (send(sock, buf, 4 + n, MSG_NOSIGNAL) < 0) _exit(1);
}

static int idmap_at(const char *lower, const char *view, int userns) {
    int tree = (int)syscall(SYS_open_tree, AT_FDCWD, lower, 1 /* OPEN_TREE_CLONE */ | O_CLOEXEC);
    if (tree < 0) return errno;
    /* no atime updates through it either (what reads the view other than overlayfs: a read-only
     * workspace is the view itself) */
    struct mns_attr attr = {0x100000 /* IDMAP */ | 0x1 /* RDONLY */ | 0x2 /* NOSUID */ | 0x4 /* NODEV */ |
                            0x10 /* NOATIME */, 0x70 /* _ATIME */, 0, (uint64_t)userns};
    int err = 0;
    if (syscall(SYS_mount_setattr, tree, "", 0x1000 /* AT_EMPTY_PATH */, &attr, sizeof attr) < 0 ||
        syscall(SYS_move_mount, tree, "", AT_FDCWD, view, 0x4 /* MOVE_MOUNT_F_EMPTY_PATH */) < 0)
        err = errno;
    close(tree);
    return err;
}

/* 'x': never returns on success */
static int exec_as(int sock, char **args, int nargs, int *fds, int nfds) {
    char *end;
    end_maker(); /* first: its descriptors must not be (or close) the ones placed below */
    if (nargs < 3 || args[2][0] != '/') return EINVAL;
    unsigned long uid = strtoul(args[0], &end, 10);
    if (*end || uid == 0 || uid >= 0xFFFFFFFFul) return EPERM;
    int first = 0;
    if (strcmp(args[1], "1") == 0) {
        if (nfds < 1 || setns(fds[0], CLONE_NEWNET) < 0) return nfds < 1 ? EINVAL : errno;
        first = 1;
    }
    /* the fds passed on, to 3, 4, ...: first out of the way (above every target), then in place */
    int high[MNS_MAX_FDS];
    for (int i = first; i < nfds; i++) {
        high[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 100);
        if (high[i] < 0) return errno;
    }
    for (int i = first; i < nfds; i++)
        if (dup2(high[i], 3 + i - first) < 0) return errno;
    if (setgroups(0, NULL) < 0 || setresgid((gid_t)uid, (gid_t)uid, (gid_t)uid) < 0 ||
        setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) < 0 || getuid() != (uid_t)uid || geteuid() != (uid_t)uid)
        return errno ? errno : EPERM;
    (void)sock; /* close-on-exec: its end of file tells the host the exec happened */
    execv(args[2], &args[2]);
    return errno;
}

int mountns_main(const char *fd_text, const char *userns_uid) {
    int sock = atoi(fd_text);
    /* above any fd 'x' places (3, 4, ...), closed by the exec */
    int moved = fcntl(sock, F_DUPFD_CLOEXEC, 200);
    if (moved < 0) return 125;
    close(sock);
    sock = moved;
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* cleared by the uid change before an exec */
    if (userns_uid) start_maker(userns_uid, sock);
    int start_err = 0;
    if (unshare(CLONE_NEWNS) < 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) start_err = errno;
    static char buf[1 << 18];
    int last_err = 0;
    char *args[MNS_MAX_ARGS + 1];
    for (;;) {
        int fds[MNS_MAX_FDS];
        int nfds = 0;
        char control[CMSG_SPACE(sizeof(int) * MNS_MAX_FDS)];
        struct iovec iov = {buf, sizeof buf - 1};
        struct msghdr msg = {0};
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control;
        msg.msg_controllen = sizeof control;
        ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
        if (n <= 0) { /* the owner is gone or done: the namespace goes with this process */
            end_maker();
            return 0;
        }
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
            if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
                int got = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
                for (int i = 0; i < got && nfds < MNS_MAX_FDS; i++) memcpy(&fds[nfds++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            }
        buf[n] = 0;
        /* the strings, and the terminator just written (an empty last one is kept) */
        int nargs = n > 1 ? split_strings(buf + 1, (size_t)n, args, MNS_MAX_ARGS) : 0;
        args[nargs] = NULL;
        int err = 0;
        const char *what = "request";
        char said[16];
        const char *text = NULL;
        if (start_err) {
            err = start_err;
            what = "cannot make a mount namespace";
        } else if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
            err = E2BIG;
        } else if (buf[0] == 'M' && last_err) {
            err = ECANCELED;
            what = "mount (after a failed request)";
        } else if ((buf[0] == 'm' || buf[0] == 'M') && nargs == 5) {
            what = "mount";
            if (mount(args[0], args[1], args[2][0] ? args[2] : NULL, strtoul(args[3], NULL, 10), args[4]) < 0)
                err = errno;
        } else if (buf[0] == 'u' && nargs == 2) {
            what = "umount";
            if (umount2(args[0], (int)strtol(args[1], NULL, 10)) < 0) err = errno;
        } else if (buf[0] == 'i' && nargs == 2 && nfds == 1) {
            what = "idmap";
            err = idmap_at(args[0], args[1], fds[0]);
        } else if (buf[0] == 'n' && nargs == 0) {
            char c = 0;
            what = "cannot make the sandbox's user namespace";
            if (maker_said < 0 || read(maker_said, &c, 1) != 1 || c != 'u') err = EPERM;
            else {
                snprintf(said, sizeof said, "%d", (int)maker);
                text = said;
            }
        } else if (buf[0] == 'N' && nargs == 0) {
            if (maker_waits >= 0) close(maker_waits); /* its end of file: it exits */
            maker_waits = -1;
            for (int i = 0; i < nfds; i++) close(fds[i]);
            continue;
        } else if (buf[0] == 'x') {
            what = "exec";
            err = exec_as(sock, args, nargs, fds, nfds);
        } else {
            err = EINVAL;
        }
        for (int i = 0; i < nfds; i++) close(fds[i]);
        last_err = err;
        answer(sock, err, what, text);
    }
}
