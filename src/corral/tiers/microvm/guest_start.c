/* corral-guestinit: the agent and the egress relay, started before the snapshot. */
#define _GNU_SOURCE
#include "guestinit.h"

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/random.h>
#include <arpa/inet.h>
#include <net/if.h>
#include <net/route.h>
#include <netinet/in.h>
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


/* Start the agent before the snapshot, so a restored VM neither forks nor
 * execs it (under TCG both are slow: fresh code, fresh page tables).  It
 * shares pid 1's root and working directory (CLONE_FS), so the root switch
 * after the restore moves it too; it waits on a socket for "go" before it
 * speaks on the port, which pid 1 reads the configuration from first.
 * Returns pid 1's end of that socket; *pid gets the agent's pid. */
/* Clone corral-agent (argv) in cgroup "agent" with ``port`` as its stdin (and
 * stdout when port_out), fd 3 a socket it says "w" on before it blocks on it.
 * Returns pid 1's end of that socket; *pid gets the child's pid. */
static int start_waiting(int port, int port_out, unsigned long clone_flags, char *const argv[],
                         char *const envp[], pid_t *pid, const char *what) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) die("socketpair (%s%s)", "");
    *pid = (pid_t)syscall(SYS_clone, clone_flags | SIGCHLD, 0, 0, 0, 0);
    if (*pid < 0) die("clone (%s%s)", "");
    if (*pid == 0) {
        write_file("/sys/fs/cgroup/agent/cgroup.procs", "0");
        setsid();
        /* above 3 first: pid 1 started without stdin/stdout/stderr, so the port
         * or the socket may itself be fd 0-3 */
        int p = fcntl(port, F_DUPFD_CLOEXEC, 10), w = fcntl(sv[1], F_DUPFD_CLOEXEC, 10);
        int null = open("/dev/null", O_RDWR | O_CLOEXEC);
        if (p < 0 || w < 0 || null < 0) _exit(127);
        dup2(p, 0);
        dup2(port_out ? p : null, 1);
        dup2(null, 2);
        dup2(w, 3);
        execve("/corral-agent", argv, envp);
        _exit(127);
    }
    close(sv[1]);
    char waiting;
    if (read(sv[0], &waiting, 1) != 1 || waiting != 'w') die("%s did not start (%s)", what);
    return sv[0];
}

int start_agent(int port, pid_t *pid) {
    char *argv[] = {"corral-agent", "--wait-fd", "3", NULL};
    char *envp[] = {"PATH=/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin", NULL};
    return start_waiting(port, 1, CLONE_FS, argv, envp, pid, "the agent");
}

/* The egress relay (network="allow"; corral-agent --relay-mux) is started
 * before the snapshot too, on its own virtio-serial port "corral-net", which
 * every VM has (one device set, one template).  It blocks until told the TCP
 * port to listen on; a VM without egress never tells it, so a restored VM runs
 * none of its code.  Returns pid 1's end of the socket it waits on. */
int start_relay(int net_port) {
    /* where it moves once told to listen: its buffers then count against the
     * sandbox's memory limit, as the relay inside a process-tier sandbox does */
    mkdir_p("/sys/fs/cgroup/sandbox/relay");
    /* beside the agent until told to listen (a VM without egress must not count
     * it in the sandbox's pids); its own root and cwd (no CLONE_FS) */
    char *argv[] = {"corral-agent", "--relay-mux", "3", NULL};
    char *envp[] = {NULL};
    pid_t pid;
    int relay = start_waiting(net_port, 0, 0, argv, envp, &pid, "the egress relay");
    close(net_port);
    return relay;
}

/* After the restore, with network="allow": the relay listens on the port
 * given before any command can run (the agent is told to go after this). */
void start_egress(int relay) {
    const char *port = get("egress");
    if (!port) return;
    char ack = 0;
    if (write(relay, port, strlen(port)) < 0 || read(relay, &ack, 1) != 1 || ack != 'l')
        die("the egress relay cannot listen on port %s (%s)", port);
    close(relay);
    mark("egress relay listening");
}

/* The guest's loopback comes up before the snapshot in every VM (the relay
 * listens on it; programs use it as on any host).  It is the only interface. */
void loopback_up(void) {
    struct ifreq ifr = {0};
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "lo");
    if (fd < 0 || ioctl(fd, SIOCGIFFLAGS, &ifr) < 0) die("loopback (%s%s)", "");
    ifr.ifr_flags |= IFF_UP;
    if (ioctl(fd, SIOCSIFFLAGS, &ifr) < 0) die("cannot bring up loopback (%s%s)", "");
    close(fd);
}

/* The virtio-net device every VM has (eth0).  Before the snapshot: no IPv6 on
 * it (network="open" is IPv4 only; the host drops IPv6), and a socket kept for
 * the configuration ioctls.  It stays down: without "open" its backend is a
 * black hole on the host anyway, and a restored VM runs none of this. */
static int net_fd = -1;

void net_prepare(void) {
    int fd = open("/proc/sys/net/ipv6/conf/eth0/disable_ipv6", O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (write(fd, "1", 1) != 1) say("cannot disable IPv6 on eth0 (%s%s)", "");
        close(fd);
    }
    net_fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
}

static void set_addr(unsigned long request, const char *what, struct in_addr addr) {
    struct ifreq ifr = {0};
    snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "eth0");
    struct sockaddr_in *sin = (struct sockaddr_in *)&ifr.ifr_addr;
    sin->sin_family = AF_INET;
    sin->sin_addr = addr;
    if (ioctl(net_fd, request, &ifr) < 0) die("eth0: cannot set the %s (%s)", what);
}

/* After the restore, with network="open" only (configuration net_addr, net_prefix,
 * net_gw): the sandbox's address on eth0, up, the default route through the
 * host's end of the veth.  /etc/resolv.conf is written by the host through the agent. */
void start_net(void) {
    const char *addr = get("net_addr");
    if (!addr) return;
    struct in_addr ip, gw, mask;
    int prefix = atoi(need("net_prefix"));
    if (inet_pton(AF_INET, addr, &ip) != 1 || inet_pton(AF_INET, need("net_gw"), &gw) != 1 || prefix < 1
        || prefix > 32 || net_fd < 0) die("bad network configuration %s (%s)", addr);
    mask.s_addr = htonl(0xffffffffu << (32 - prefix));
    set_addr(SIOCSIFADDR, "address", ip);
    set_addr(SIOCSIFNETMASK, "netmask", mask);
    struct ifreq ifr = {0};
    snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "eth0");
    if (ioctl(net_fd, SIOCGIFFLAGS, &ifr) < 0) die("eth0 (%s%s)", "");
    ifr.ifr_flags |= IFF_UP;
    if (ioctl(net_fd, SIOCSIFFLAGS, &ifr) < 0) die("cannot bring up eth0 (%s%s)", "");
    struct rtentry route = {0};
    struct sockaddr_in *dst = (struct sockaddr_in *)&route.rt_dst, *via = (struct sockaddr_in *)&route.rt_gateway,
                       *genmask = (struct sockaddr_in *)&route.rt_genmask;
    dst->sin_family = via->sin_family = genmask->sin_family = AF_INET;
    via->sin_addr = gw;
    route.rt_flags = RTF_UP | RTF_GATEWAY;
    route.rt_dev = "eth0";
    if (ioctl(net_fd, SIOCADDRT, &route) < 0) die("cannot add the default route (%s%s)", "");
    close(net_fd);
    mark("eth0 configured");
}
