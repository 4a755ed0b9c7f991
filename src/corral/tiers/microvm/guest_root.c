/* corral-guestinit: the image's root (prepared before the snapshot) and the sandbox's identity. */
#define _GNU_SOURCE
#include "guestinit.h"

#include <sys/wait.h>

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/random.h>
#include <net/if.h>
#include <dirent.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/io.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>


/* The identity files go straight into the root overlay's upper layer (a
 * tmpfs) before the overlay is mounted, so writing them later needs no copy-up
 * of /etc.  The upper /etc takes the lower one's owner, mode and times, so the
 * merged /etc looks as before.  Returns 0 if the lower /etc is not a plain
 * directory (then the files are written through the overlay). */
static int identity_in_upper(const char *lower, const char *upper) {
    char path[600];
    struct stat st;
    snprintf(path, sizeof path, "%s/etc", lower);
    if (lstat(path, &st) < 0 || !S_ISDIR(st.st_mode)) return 0;
    snprintf(path, sizeof path, "%s/etc", upper);
    if (mkdir(path, 0700) < 0 && errno != EEXIST) return 0;
    if (chown(path, st.st_uid, st.st_gid) < 0 || chmod(path, st.st_mode & 07777) < 0) return 0;
    snprintf(path, sizeof path, "%s/etc/hostname", upper);
    write_file(path, "");
    snprintf(path, sizeof path, "%s/etc/machine-id", upper);
    write_file(path, "");
    struct timespec times[2] = {st.st_atim, st.st_mtim};
    snprintf(path, sizeof path, "%s/etc", upper);
    utimensat(AT_FDCWD, path, times, 0);
    return 1;
}

/* Kept from the template: the identity files (opened through the overlay,
 * already in its upper layer) and a reconfiguration context for /rw, which
 * the root switch hides — a restored VM then runs no lookup or copy-up code
 * for them. */
static int hostname_fd = -1, machine_id_fd = -1, rw_fs_fd = -1;

/* Before the snapshot: the image's disk (/dev/vda, EROFS, read-only, shared
 * by every VM of the image) under an overlay whose upper layer is on /rw,
 * then the switch into it.  A block device, unlike a 9p export, does not
 * keep QEMU from saving the VM, so all of this is in the template and a
 * restored VM inherits it: its overlay's upper layer, being tmpfs in guest
 * RAM, is its own (copy-on-write from the template's).  Returns 0 without a
 * disk (the host's KVM probe boots without one). */
int prepare_root(void) {
    if (access("/dev/vda", F_OK) < 0) return 0;
    do_mount("/dev/vda", "/lower", "erofs", MS_RDONLY | MS_NOSUID | MS_NODEV, NULL);
    mkdir_p("/rw/u");
    mkdir_p("/rw/w");
    int identity = identity_in_upper("/lower", "/rw/u");
    do_mount("overlay", "/newroot", "overlay", 0, "lowerdir=/lower,upperdir=/rw/u,workdir=/rw/w");
    if (identity) {
        hostname_fd = open("/newroot/etc/hostname", O_WRONLY | O_CLOEXEC);
        machine_id_fd = open("/newroot/etc/machine-id", O_WRONLY | O_CLOEXEC);
        if (hostname_fd < 0 || machine_id_fd < 0) die("cannot open the identity files (%s%s)", "");
    }
    mkdir_p("/newroot/home/user");
    /* the sandbox user's home, as on the other tiers (copied up into the template's upper layer) */
    if (chown("/newroot/home/user", 1000, 1000) < 0) die("cannot chown /home/user (%s%s)", "");
    mkdir_p("/newroot/workspace");
    mkdir_p("/newroot/tmp");
    struct stat st;
    /* a chmod through the overlay copies the directory up: only if needed */
    if (stat("/newroot/tmp", &st) < 0 || (st.st_mode & 07777) != 01777) chmod("/newroot/tmp", 01777);
    static const char *const early[] = {"/proc", "/sys", "/dev"};
    for (size_t i = 0; i < sizeof early / sizeof *early; i++) {
        char target[64];
        snprintf(target, sizeof target, "/newroot%s", early[i]);
        mkdir_p(target);
        if (mount(early[i], target, NULL, MS_MOVE, NULL) < 0) die("cannot move %s (%s)", early[i]);
    }
    rw_fs_fd = fspick(AT_FDCWD, "/rw", FSPICK_CLOEXEC);
    if (rw_fs_fd < 0) die("fspick /rw (%s%s)", "");
    /* the agent shares pid 1's root and working directory (CLONE_FS): it moves too */
    if (chdir("/newroot") < 0) die("chdir /newroot (%s%s)", "");
    if (mount(".", "/", NULL, MS_MOVE, NULL) < 0) die("cannot move the new root (%s%s)", "");
    if (chroot(".") < 0 || chdir("/") < 0) die("chroot (%s%s)", "");
    return 1;
}

/* Before the snapshot, once the root is in place: run a shell, `true` and (where the image has
 * it) Python's start-up, as first commands would, so the loader, libc, the shell and Python's
 * start-up modules are in the template's page cache (4 MiB more in its memory image).  A restored
 * VM then reads none of them from its disk for its first command: under TCG each virtio-blk read
 * runs the guest's block and EROFS code fresh (a restored VM's first `true` went from ~19,000
 * translation blocks to ~16,500, and ~80 ms faster).  Python runs with -B: it writes no bytecode
 * into the template's upper layer.  Nothing of it is left running: pid 1 reaps it before it
 * says it is ready. */
void warm_page_cache(void) {
    pid_t pid = fork();
    if (pid == 0) {
        char *const argv[] = {"sh", "-c", "/usr/bin/true; /usr/bin/true; command -v python3 >/dev/null && python3 -I -B -c pass", NULL};
        char *const envp[] = {"PATH=/usr/bin:/bin", NULL};
        execve("/bin/sh", argv, envp);
        _exit(127);
    }
    if (pid > 0) waitpid(pid, NULL, 0);
}

static void write_identity(int fd, const char *path, const char *value) {
    char line[300];
    int n = snprintf(line, sizeof line, "%s\n", value);
    if (fd < 0) {
        write_file(path, line);
        return;
    }
    if (pwrite(fd, line, (size_t)n, 0) != n || ftruncate(fd, n) < 0) die("cannot write %s (%s)", path);
    close(fd);
}

/* After the restore: the sandbox's disk limit, identity and workspace. */
void setup_root(void) {
    /* /rw (uppers and workdirs) is in the template; only its size is the sandbox's */
    if (fsconfig(rw_fs_fd, FSCONFIG_SET_STRING, "size", need("disk"), 0) < 0
        || fsconfig(rw_fs_fd, FSCONFIG_CMD_RECONFIGURE, NULL, NULL, 0) < 0) die("cannot size /rw (%s%s)", "");
    close(rw_fs_fd);
    mark("tmpfs /rw");
    write_identity(hostname_fd, "/etc/hostname", need("hostname"));
    write_identity(machine_id_fd, "/etc/machine-id", need("machine_id"));
    mark("identity files");
    const char *ws_mode = need("workspace");
    do_mount("ws", "/workspace", "9p", MS_NOSUID | MS_NODEV | (strcmp(ws_mode, "ro") ? 0 : MS_RDONLY),
             "trans=virtio,version=9p2000.L,cache=none,msize=262144");
    mark("9p workspace");
}
