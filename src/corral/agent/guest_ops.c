/*
 * corral-agent: what the microVM host asks of a guest around a live snapshot (T_GUEST).
 *
 * QEMU refuses to save a VM while its 9p workspace is mounted, so the host
 * asks the agent to unmount it first ("detach") and to mount it again in the
 * original VM and in every VM restored from the snapshot ("attach").  A VM
 * restored from a live snapshot then gets a fresh identity ("identity"): its
 * RNG reseeded from host bytes, the wall clock, a hostname, a machine id and
 * a boot id ("resume": the same VM back from disk, reseeded and its clock set,
 * keeps its identity).  The guest's commands are frozen meanwhile ("freeze 1",
 * until "freeze 0"): their cgroup, which the agent is outside of.
 *
 * Payload: NUL-terminated strings, the operation first.
 */
#include "agent.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/random.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define SANDBOX_CGROUP "/sys/fs/cgroup/sandbox"
#define FREEZE_WAIT_MS 10000
#define BOOT_ID "/proc/sys/kernel/random/boot_id"
#define BOOT_ID_SOURCE "/dev/.corral-boot-id"

static int starts_under(const char *link, const char *dir) {
    size_t n = strlen(dir);
    return strncmp(link, dir, n) == 0 && (link[n] == 0 || link[n] == '/');
}

/* Which process holds something under `dir` (cwd, root, an open file): the
 * reason an unmount is refused, told to the host in the error. */
static void who_holds(const char *dir, char *out, size_t size) {
    out[0] = 0;
    DIR *proc = opendir("/proc");
    if (!proc) return;
    struct dirent *d;
    size_t used = 0;
    int found = 0;
    while ((d = readdir(proc)) && found < 8) {
        char *end;
        long pid = strtol(d->d_name, &end, 10);
        if (*end || pid <= 0 || pid == getpid()) continue;
        char path[64], link[4096], comm[64] = "?";
        const char *what = NULL;
        static const char *const names[] = {"cwd", "root"};
        for (int i = 0; i < 2 && !what; i++) {
            snprintf(path, sizeof path, "/proc/%ld/%s", pid, names[i]);
            ssize_t n = readlink(path, link, sizeof link - 1);
            if (n > 0) { link[n] = 0; if (starts_under(link, dir)) what = i == 0 ? "working directory" : "root"; }
        }
        if (!what) {
            snprintf(path, sizeof path, "/proc/%ld/fd", pid);
            DIR *fds = opendir(path);
            struct dirent *f;
            while (fds && (f = readdir(fds)) && !what) {
                char fdpath[340];
                snprintf(fdpath, sizeof fdpath, "%s/%s", path, f->d_name);
                ssize_t n = readlink(fdpath, link, sizeof link - 1);
                if (n > 0) { link[n] = 0; if (starts_under(link, dir)) what = "open file"; }
            }
            if (fds) closedir(fds);
        }
        if (!what) continue;
        snprintf(path, sizeof path, "/proc/%ld/comm", pid);
        int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY);
        if (fd >= 0) {
            ssize_t n = read(fd, comm, sizeof comm - 1);
            comm[n > 0 ? n : 0] = 0;
            if (n > 0 && comm[n - 1] == '\n') comm[n - 1] = 0;
            close(fd);
        }
        int w = snprintf(out + used, size - used, "%spid %ld (%s): %s", found ? "; " : "", pid, comm, what);
        if (w < 0 || (size_t)w >= size - used) break;
        used += (size_t)w;
        found++;
    }
    closedir(proc);
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

static int reseed(const char *hex) {
    struct {
        int entropy_count;
        int buf_size;
        unsigned char buf[256];
    } seed;
    size_t n = strlen(hex) / 2;
    if (n == 0 || n > sizeof seed.buf) { errno = EINVAL; return -1; }
    for (size_t i = 0; i < n; i++) {
        int hi = hexval(hex[2 * i]), lo = hexval(hex[2 * i + 1]);
        if (hi < 0 || lo < 0) { errno = EINVAL; return -1; }
        seed.buf[i] = (unsigned char)(hi << 4 | lo);
    }
    seed.entropy_count = (int)n * 8;
    seed.buf_size = (int)n;
    int fd = open("/dev/urandom", O_RDWR | O_CLOEXEC);
    if (fd < 0) return -1;
    /* mix the host's bytes in, then make the CRNG rekey now: every VM restored
     * from one snapshot starts with the same CRNG state */
    int r = ioctl(fd, RNDADDENTROPY, &seed) < 0 || ioctl(fd, RNDRESEEDCRNG) < 0 ? -1 : 0;
    int saved = errno;
    close(fd);
    memset(&seed, 0, sizeof seed);
    errno = saved;
    return r;
}

static int write_text(const char *path, const char *text, mode_t mode) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW | O_NOCTTY, mode);
    if (fd < 0) return -1;
    size_t len = strlen(text);
    int r = write(fd, text, len) == (ssize_t)len && write(fd, "\n", 1) == 1 ? 0 : -1;
    int saved = errno;
    close(fd);
    errno = saved;
    return r;
}

/* A fresh boot id: the kernel's is read-only and fixed at boot, so a file of
 * ours is bind-mounted over it (read-only), as lxcfs does for /proc files. */
static int new_boot_id(const char *boot_id) {
    umount2(BOOT_ID, MNT_DETACH); /* a restore of a restore: the previous one goes */
    unlink(BOOT_ID_SOURCE);
    if (write_text(BOOT_ID_SOURCE, boot_id, 0444) < 0) return -1;
    int r = mount(BOOT_ID_SOURCE, BOOT_ID, NULL, MS_BIND, NULL);
    if (r == 0) r = mount(NULL, BOOT_ID, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    int saved = errno;
    unlink(BOOT_ID_SOURCE); /* the mount keeps the file */
    errno = saved;
    return r;
}

/* Freeze (and wait until the kernel says frozen) or thaw the commands' cgroup; the agent is
 * outside it.  Done here, as root of the guest, whoever file requests run as. */
static int freeze(int frozen) {
    int fd = open(SANDBOX_CGROUP "/cgroup.freeze", O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    int r = write(fd, frozen ? "1" : "0", 1) == 1 ? 0 : -1;
    int saved = errno;
    close(fd);
    errno = saved;
    if (r < 0 || !frozen) return r;
    for (int waited = 0; waited < FREEZE_WAIT_MS; waited++) {
        char events[512];
        fd = open(SANDBOX_CGROUP "/cgroup.events", O_RDONLY | O_CLOEXEC);
        if (fd < 0) return -1;
        ssize_t n = read(fd, events, sizeof events - 1);
        close(fd);
        events[n > 0 ? n : 0] = 0;
        if (strstr(events, "frozen 1")) return 0;
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
    errno = ETIMEDOUT;
    return -1;
}

void do_guest(uint32_t id, char *payload, uint32_t len) {
    char *a[8] = {0};
    int n = split_strings(payload, len, a, 8);
    if (n < 1) { send_err(id, EINVAL, "guest"); return; }
    if (strcmp(a[0], "detach") == 0 && n == 2) {
        if (umount2(a[1], UMOUNT_NOFOLLOW) < 0 && errno != EINVAL) {
            int err = errno;
            char holders[1024], what[1200];
            if (err == EBUSY) who_holds(a[1], holders, sizeof holders);
            else holders[0] = 0;
            snprintf(what, sizeof what, "unmount %s (%s)", a[1], holders[0] ? holders : "no holder found");
            send_err(id, err, what);
            return;
        }
    } else if (strcmp(a[0], "freeze") == 0 && n == 2) {
        if (freeze(strcmp(a[1], "1") == 0) < 0) { send_err(id, errno, "freeze the commands"); return; }
    } else if (strcmp(a[0], "attach") == 0 && n == 5) {
        /* attach SOURCE TARGET FSTYPE OPTIONS, read-only if OPTIONS starts with "ro," */
        unsigned long flags = MS_NOSUID | MS_NODEV;
        const char *options = a[4];
        if (strncmp(options, "ro,", 3) == 0) { flags |= MS_RDONLY; options += 3; }
        if (mount(a[1], a[2], a[3], flags, options) < 0) { send_err(id, errno, a[2]); return; }
    } else if ((strcmp(a[0], "identity") == 0 && n == 6) || (strcmp(a[0], "resume") == 0 && n == 3)) {
        /* identity SEED_HEX TIME_NS HOSTNAME MACHINE_ID BOOT_ID: a new VM from a snapshot;
         * resume SEED_HEX TIME_NS: the same VM back from disk (its identity stays) */
        if (reseed(a[1]) < 0) { send_err(id, errno, "reseed the RNG"); return; }
        long long ns = atoll(a[2]);
        struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000LL), .tv_nsec = (long)(ns % 1000000000LL)};
        if (clock_settime(CLOCK_REALTIME, &ts) < 0) { send_err(id, errno, "set the clock"); return; }
        if (n == 3) { send_frame(T_OK, id, NULL, 0); return; }
        if (sethostname(a[3], strlen(a[3])) < 0) { send_err(id, errno, "sethostname"); return; }
        if (write_text("/etc/hostname", a[3], 0644) < 0) { send_err(id, errno, "/etc/hostname"); return; }
        if (write_text("/etc/machine-id", a[4], 0444) < 0) { send_err(id, errno, "/etc/machine-id"); return; }
        if (new_boot_id(a[5]) < 0) { send_err(id, errno, BOOT_ID); return; }
    } else {
        send_err(id, EINVAL, "guest: unknown operation");
        return;
    }
    send_frame(T_OK, id, NULL, 0);
}
