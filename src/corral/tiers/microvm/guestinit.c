/*
 * corral-guestinit: pid 1 of a Corral microVM guest.
 *
 * Two phases, split by the snapshot:
 *
 *  1. boot (runs once, in the template VM): mount /proc, /sys, /dev, load the
 *     virtio, 9p and EROFS modules from the initramfs, do everything that does
 *     not depend on the sandbox (cgroups, the /rw tmpfs, open files, start
 *     corral-agent waiting for "go"), mount the image's read-only disk under
 *     an overlay whose upper layer lives on /rw and switch root into it, open
 *     the virtio-serial port named "corral", say "corral-guest-ready" on it
 *     and wait for the sandbox's configuration.  The host snapshots the VM
 *     right here.  Under TCG every code path a restored VM runs is translated
 *     afresh (the translation cache is not in the snapshot), so the less
 *     phase 2 does, the faster every sandbox starts.
 *
 *  2. configure (runs in every VM restored from that snapshot): read the
 *     configuration frame (u32 length + NUL-separated key=value), reseed the
 *     kernel RNG with the host's fresh entropy (every restored VM starts from
 *     identical RNG state), set the clock and hostname, set the limits of the
 *     cgroup the sandbox's commands run in, size /rw, write the identity
 *     files, mount the workspace (virtio-9p: QEMU cannot save a VM with a 9p
 *     export mounted, so it cannot be in the template), with network="open"
 *     only configure eth0 (guest_start.c), and tell the agent to
 *     go (its stdin/stdout are the port).  When the agent exits the VM powers
 *     off.
 *
 * Nothing here is a security boundary: the guest kernel and the hypervisor are.
 */
#define _GNU_SOURCE
#include "guestinit.h"

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

#define READY_MARKER "corral-guest-ready\n"
#define MAX_CONFIG 65536

void say(const char *fmt, const char *arg) {
    /* the console (ttyS0) is a log file on the host: for debugging only */
    int fd = open("/dev/console", O_WRONLY | O_NOCTTY);
    if (fd >= 0) {
        dprintf(fd, "corral-guestinit: ");
        dprintf(fd, fmt, arg, strerror(errno));
        dprintf(fd, "\n");
        close(fd);
    }
}

static void power_off(void) {
    sync();
    reboot(RB_AUTOBOOT); /* with -no-reboot QEMU exits; microvm without ACPI cannot power off */
    for (;;) pause();
}

void die(const char *what, const char *arg) {
    say(what, arg);
    power_off();
}

/* Parameters for a module given on the kernel command line ("virtio_mmio.device=...",
 * which QEMU adds for each virtio-mmio device): modprobe would pass them, finit_module
 * does not read the command line itself. */
static void module_params(const char *module, char *out, size_t size) {
    static char cmdline[4096];
    out[0] = 0;
    int fd = open("/proc/cmdline", O_RDONLY);
    if (fd < 0) return;
    ssize_t n = read(fd, cmdline, sizeof cmdline - 1);
    close(fd);
    if (n <= 0) return;
    cmdline[n] = 0;
    size_t ml = strlen(module), used = 0;
    for (char *tok = strtok(cmdline, " \n"); tok; tok = strtok(NULL, " \n")) {
        if (strncmp(tok, module, ml) || tok[ml] != '.') continue;
        int w = snprintf(out + used, size - used, "%s%s", used ? " " : "", tok + ml + 1);
        if (w < 0 || (size_t)w >= size - used) break;
        used += (size_t)w;
    }
}

static void load_modules(void) {
    /* /modules/order lists the .ko files in dependency order */
    FILE *f = fopen("/modules/order", "r");
    if (!f) die("no module list: %s (%s)", "/modules/order");
    char line[256];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        if (!line[0]) continue;
        char path[300];
        snprintf(path, sizeof path, "/modules/%s", line);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) die("cannot open module %s (%s)", path);
        char name[256], params[2048];
        snprintf(name, sizeof name, "%s", line);
        name[strcspn(name, ".")] = 0;
        module_params(name, params, sizeof params);
        if (syscall(SYS_finit_module, fd, params, 0) < 0 && errno != EEXIST) die("cannot load module %s (%s)", path);
        close(fd);
    }
    fclose(f);
}

static int open_port(const char *want) {
    size_t wl = strlen(want);
    /* the port's device node appears once virtio_console has probed it */
    for (int attempt = 0; attempt < 2000; attempt++) {
        DIR *d = opendir("/sys/class/virtio-ports");
        if (d) {
            struct dirent *de;
            while ((de = readdir(d)) != NULL) {
                if (de->d_name[0] == '.') continue;
                char path[300], name[64] = {0};
                snprintf(path, sizeof path, "/sys/class/virtio-ports/%s/name", de->d_name);
                int fd = open(path, O_RDONLY);
                if (fd < 0) continue;
                ssize_t n = read(fd, name, sizeof name - 1);
                close(fd);
                if (n > 0 && strncmp(name, want, wl) == 0 && (name[wl] == '\n' || name[wl] == 0)) {
                    snprintf(path, sizeof path, "/dev/%s", de->d_name);
                    int port = open(path, O_RDWR | O_CLOEXEC);
                    if (port >= 0) { closedir(d); return port; }
                }
            }
            closedir(d);
        }
        usleep(5000);
    }
    die("no virtio-serial port named %s (%s)", want);
    return -1;
}

static void write_all(int fd, const void *buf, size_t len) {
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) die("port write failed (%s%s)", "");
        p += n;
        len -= (size_t)n;
    }
}

/* Read exactly len bytes.  The port is non-blocking while pid 1 waits for the configuration: it spins
 * (in the template until the snapshot, in a restored VM only until the
 * already-queued frame arrives), so a restored VM runs no wake-up path
 * (scheduler, wait queues: fresh code under TCG) before reading it.  A read
 * of 0 means the host side is not connected yet. */
static void read_exact(int fd, void *buf, size_t len) {
    char *p = buf;
    while (len > 0) {
        ssize_t n = read(fd, p, len);
        if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (n < 0) die("port read failed (%s%s)", "");
        if (n == 0) continue;
        p += n;
        len -= (size_t)n;
    }
}

/* Tracing a restore (configuration "trace=1", set by CORRAL_MICROVM_TRACE):
 * each step writes one byte ('A' + step) straight to the serial port's data
 * register, where QEMU's serial_write trace event timestamps it with the
 * host's clock (one I/O instruction: no tty code to distort the figures);
 * the steps' names go to the console after the agent started.  Monotonic
 * guest timestamps are kept too. */
static struct { const char *what; struct timespec at; } marks[48];
static int mark_count, tracing, serial_io;

void mark(const char *what) {
    if (mark_count < (int)(sizeof marks / sizeof *marks)) {
        marks[mark_count].what = what;
        clock_gettime(CLOCK_MONOTONIC, &marks[mark_count++].at);
        if (tracing && serial_io) {
            unsigned char c = (unsigned char)('A' + mark_count - 1);
            __asm__ volatile("outb %0, %1" : : "a"(c), "Nd"((unsigned short)0x3f8));
        }
    }
}

static void print_marks(void) {
    int fd = open("/dev/console", O_WRONLY | O_NOCTTY);
    if (fd < 0) return;
    for (int i = 1; i < mark_count; i++) {
        long long us = (marks[i].at.tv_sec - marks[0].at.tv_sec) * 1000000LL
                       + (marks[i].at.tv_nsec - marks[0].at.tv_nsec) / 1000;
        dprintf(fd, "corral-trace %8.3f ms %s\n", us / 1000.0, marks[i].what);
    }
    close(fd);
}

static char *config[512];
static int config_count;

const char *get(const char *key) {
    size_t kl = strlen(key);
    for (int i = 0; i < config_count; i++)
        if (!strncmp(config[i], key, kl) && config[i][kl] == '=') return config[i] + kl + 1;
    return NULL;
}

const char *need(const char *key) {
    const char *v = get(key);
    if (!v) die("configuration lacks %s (%s)", key);
    return v;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

/* Opened before the snapshot: a restored VM then runs no path lookup or
 * open code for them (fresh code under TCG) */
static int urandom_fd = -1, memory_max_fd = -1, pids_max_fd = -1;

static void reseed(const char *hex) {
    struct {
        int entropy_count;
        int buf_size;
        unsigned char buf[256];
    } seed;
    size_t n = strlen(hex) / 2;
    if (n == 0 || n > sizeof seed.buf) die("bad seed length (%s%s)", "");
    for (size_t i = 0; i < n; i++) {
        int hi = hexval(hex[2 * i]), lo = hexval(hex[2 * i + 1]);
        if (hi < 0 || lo < 0) die("bad seed (%s%s)", "");
        seed.buf[i] = (unsigned char)(hi << 4 | lo);
    }
    seed.entropy_count = (int)n * 8;
    seed.buf_size = (int)n;
    int fd = urandom_fd;
    /* mix the host's entropy in, then force the CRNG to rekey from the pool
     * now (otherwise it would keep the snapshot's key for up to a minute) */
    if (ioctl(fd, RNDADDENTROPY, &seed) < 0) die("RNDADDENTROPY failed (%s%s)", "");
    if (ioctl(fd, RNDRESEEDCRNG) < 0) die("RNDRESEEDCRNG failed (%s%s)", "");
    memset(&seed, 0, sizeof seed);
}

void mkdir_p(const char *path) {
    /* one call when the directory or its parent exists (the usual case) */
    if (mkdir(path, 0755) == 0 || errno == EEXIST) return;
    char buf[512];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        mkdir(buf, 0755);
        *p = '/';
    }
    mkdir(buf, 0755);
}

void do_mount(const char *src, const char *target, const char *type, unsigned long flags, const char *data) {
    mkdir_p(target);
    if (mount(src, target, type, flags, data) < 0) die("cannot mount %s (%s)", target);
}

void write_file(const char *path, const char *data) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0 || write(fd, data, strlen(data)) < 0) die("cannot write %s (%s)", path);
    close(fd);
}


/* Before the snapshot: everything that does not depend on the sandbox.  The
 * agent will live in cgroup "agent"; commands in leaves below "sandbox", which
 * gets the sandbox's memory and pids limits once they are known. */
static void early_setup(void) {
    do_mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "ptmxmode=0666");
    do_mount("shm", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
    /* favordynmods: moving a task between cgroups (each command is placed in its
     * own leaf) no longer waits for an RCU grace period */
    do_mount("cgroup2", "/sys/fs/cgroup", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, "favordynmods");
    write_file("/sys/fs/cgroup/cgroup.subtree_control", "+memory +pids");
    mkdir_p("/sys/fs/cgroup/agent");
    mkdir_p("/sys/fs/cgroup/sandbox");
    write_file("/sys/fs/cgroup/sandbox/cgroup.subtree_control", "+memory +pids");
    /* the guest has no swap; set anyway so no later change can let it swap */
    write_file("/sys/fs/cgroup/sandbox/memory.swap.max", "0");
    /* guest RAM is sized to the memory limit: with the default heuristic a big
     * allocation fails up front with ENOMEM (a bare MemoryError); always
     * overcommitting lets the memory cgroup's OOM killer end it, reported as OOM
     * like every other tier */
    write_file("/proc/sys/vm/overcommit_memory", "1");
    urandom_fd = open("/dev/urandom", O_RDWR | O_CLOEXEC);
    memory_max_fd = open("/sys/fs/cgroup/sandbox/memory.max", O_WRONLY | O_CLOEXEC);
    pids_max_fd = open("/sys/fs/cgroup/sandbox/pids.max", O_WRONLY | O_CLOEXEC);
    if (urandom_fd < 0 || memory_max_fd < 0 || pids_max_fd < 0) die("cannot open the RNG or cgroup files (%s%s)", "");
    /* the tmpfs for the overlays' upper and work directories, sized per
     * sandbox by a remount after the restore */
    do_mount("rw", "/rw", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755");
}

static void setup_cgroups(void) {
    const char *memory = need("memory"), *pids = need("pids");
    if (write(memory_max_fd, memory, strlen(memory)) < 0) die("cannot set memory.max (%s%s)", "");
    if (write(pids_max_fd, pids, strlen(pids)) < 0) die("cannot set pids.max (%s%s)", "");
}


static char config_buf[MAX_CONFIG + 1];

static void read_config(int port) {
    char *buf = config_buf;
    uint32_t len;
    read_exact(port, &len, 4);
    mark("length read");
    if (len == 0 || len > MAX_CONFIG) die("bad configuration length (%s%s)", "");
    read_exact(port, buf, len);
    buf[len] = 0;
    for (size_t i = 0; i < len && config_count < 512; i += strlen(buf + i) + 1)
        config[config_count++] = buf + i;
}

int main(void) {
    if (getpid() != 1) return 1;
    mount("proc", "/proc", "proc", 0, NULL);
    mount("sysfs", "/sys", "sysfs", 0, NULL);
    mount("dev", "/dev", "devtmpfs", 0, NULL);
    load_modules();
    early_setup();
    int port = open_port("corral");
    pid_t agent;
    int agent_go = start_agent(port, &agent);
    loopback_up();
    net_prepare();
    int relay = start_relay(open_port("corral-net"));
    /* after the agent and the relay started: their binary is in the initramfs,
     * which the switch hides (the relay keeps the initramfs as its root: it opened
     * its cgroup file already and touches no path afterwards) */
    int have_root = prepare_root();
    if (have_root) warm_page_cache();
    /* after the agent was cloned: it (and so every command) must not inherit it */
    serial_io = ioperm(0x3f8, 8, 1) == 0;
    /* write every page pid 1 will write after the restore (the configuration
     * buffer, the step marks, its stack) now: after the clone above they are
     * copy-on-write, and page faults are fresh code in a restored VM */
    memset(config_buf, 0, sizeof config_buf);
    memset(config, 0, sizeof config);
    memset(marks, 0, sizeof marks);
    volatile char stack[16384];
    memset((char *)stack, 0, sizeof stack);
    write_all(port, READY_MARKER, strlen(READY_MARKER)); /* blocks until the host connects */
    if (fcntl(port, F_SETFL, O_NONBLOCK) < 0) die("port O_NONBLOCK (%s%s)", "");

    /* ---- the template VM is snapshotted while waiting here ---- */
    read_config(port);
    /* the agent shares this open file: it expects a blocking port */
    if (fcntl(port, F_SETFL, 0) < 0) die("port blocking (%s%s)", "");

    tracing = get("trace") != NULL;
    mark("config read");
    reseed(need("seed"));
    mark("reseed");
    struct timeval tv;
    long long ns = atoll(need("time_ns"));
    tv.tv_sec = (time_t)(ns / 1000000000LL);
    tv.tv_usec = (suseconds_t)(ns % 1000000000LL / 1000);
    settimeofday(&tv, NULL);
    const char *hostname = need("hostname");
    sethostname(hostname, strlen(hostname));
    mark("clock+hostname");

    setup_cgroups();
    mark("cgroup limits");
    if (!have_root) die("no image disk (%s%s)", "");
    setup_root();

    start_net();
    start_egress(relay);

    /* the agent's default user: "u" (uid 1000) unless the sandbox was created with user="root" */
    const char *user = get("user");
    if (write(agent_go, user && strcmp(user, "root") == 0 ? "g" : "u", 1) != 1)
        die("cannot start the agent (%s%s)", "");
    close(agent_go);
    close(port);
    mark("agent told to go");
    if (tracing) print_marks();
    /* pid 1 reaps every orphan; the VM ends with the agent */
    for (;;) {
        int status;
        pid_t pid = wait(&status);
        if (pid == agent || (pid < 0 && errno == ECHILD)) power_off();
    }
}
