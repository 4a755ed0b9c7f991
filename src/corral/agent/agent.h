/* Shared by the agent's files: the protocol, the command table, framing helpers. */
#ifndef CORRAL_AGENT_H
#define CORRAL_AGENT_H
#define _GNU_SOURCE
#include <limits.h>
#include <stdint.h>
#include <stddef.h>
#include <sys/ioctl.h>
#include <sys/types.h>

enum {
    /* host -> agent */
    T_EXEC = 1, T_GO = 2, T_STDIN = 3, T_STDIN_EOF = 4, T_SIGNAL = 5,
    T_EXEC_PTY = 6, T_RESIZE = 7, T_EXEC_SPARE = 8,
    T_FREAD = 10, T_FWRITE = 11, T_FAPPEND = 12, T_FLIST = 13, T_FREMOVE = 14,
    T_FMKDIR = 15, T_FSTAT = 16, T_GUEST = 17,
    /* sandbox.files.write: a whole file, replaced at once (files.c, do_fput) */
    T_FPUT = 18,
    /* on a file request: run it with the agent's own ids (agent_ids) */
    T_AS_AGENT = 0x80,
    /* agent -> host */
    T_READY = 100, T_STARTED = 101, T_STDOUT = 102, T_STDERR = 103,
    T_EXIT = 104, T_DATA = 105, T_SPARE = 106, T_STDIN_ACK = 107, T_OK = 110, T_ERR = 111,
    /* a T_SIGNAL was delivered (payload: the signal); agents that send it say version 2 in T_READY */
    T_SIGNALED = 108,
};

#define MAX_FRAME (64u << 20)
#define MAX_EXECS 64
#define CHUNK 65536
#define GRACE_MS 100
/* entries a directory listing holds at most (MAX_LIST_ENTRIES in tiers/base.py): more is E2BIG */
#define MAX_LIST 100000
/* stdin bytes of one command the host may have sent and the agent not yet acknowledged
 * (T_STDIN_ACK: written to the command, or dropped): what the agent holds for a command that
 * reads slowly, in the sandbox's memory.  Unbounded, a client streaming 400 MiB to a command of a
 * 256 MiB sandbox got the agent OOM-killed, and the sandbox with it. */
#define STDIN_WINDOW (1u << 20)

extern char **environ;

struct exec {
    int used;
    uint32_t id;
    pid_t pid;
    int fd_in, fd_out, fd_err, fd_sync;
    int exited, status, eof_pending;
    int pty; /* its stdin is a terminal's master: end of file is the terminal's EOF character */
    long long exit_ms;
    char *inbuf;
    size_t inoff, inlen; /* the bytes still to write are inbuf[inoff .. inoff + inlen) */
    /* bytes of stdout / stderr still forwarded to the host; -1: all of it (see pump_output) */
    long long room_out, room_err;
    uint32_t group; /* its cgroup inside gVisor (command_groups.c); 0: none */
};

extern struct exec execs[MAX_EXECS];

/* agent.c: framing and small helpers */
long long now_ms(void);
void write_all(int fd, const void *buf, size_t len);
void send_frame(uint8_t type, uint32_t id, const void *data, uint32_t len);
/* a whole frame into out (9 + len bytes), for several frames in one write; returns its size */
size_t put_frame(unsigned char *out, uint8_t type, uint32_t id, const void *data, uint32_t len);
void send_err(uint32_t id, int err, const char *what);
int read_full(int fd, void *buf, size_t len);
int split_strings(char *p, size_t len, char **out, int max);
struct exec *find_exec(uint32_t id);
void close_fd(int *fd);

/* users.c: who commands run as (the agent itself may be root of the sandbox's user namespace) */
extern long default_uid;
int set_default_user(long uid);
void give_new_file(int fd, const char *path);
int become_user(uid_t uid);
void capbset_read(void);
int userns_main(const char *uid_text);
int vmm_main(int argc, char **argv);
void agent_ids(int on);
int file_requests_in_a_child(void);
int drop_to_file_user(void);

/* mountns.c: a sandbox's own mount namespace (`--mountns FD [UID]`) */
int mountns_main(const char *fd_text, const char *userns_uid);

/* owner_watch.c: a frozen sandbox killed if its owner dies (`--owner-watch MODE GROUP...`) */
int owner_watch_main(int argc, char **argv);

/* command_groups.c: a cgroup per command inside gVisor */
int set_command_groups(const char *dir);
uint32_t command_group_join(pid_t pid);
void command_group_kill(uint32_t group);
void command_group_done(uint32_t id, uint32_t group);
void command_group_kill_ended(uint32_t id);

/* exec.c: commands and the spare */
extern int spares_enabled;
void do_exec(uint32_t id, char *payload, uint32_t len, struct winsize *ws);
void do_exec_spare(uint32_t id, char *payload, uint32_t len);
void fork_spare(void);
void child_exited(pid_t pid, int status);
void flush_stdin(struct exec *e);
void take_stdin(struct exec *e, const char *data, size_t len);
void finish_exec(struct exec *e);
void pump_output(struct exec *e, int *fd, uint8_t type);

/* files.c: the file requests */
void do_fread(uint32_t id, const char *path, unsigned long long limit);
void do_fwrite(uint32_t id, char *payload, uint32_t len, int append);
void do_fput(uint32_t id, char *payload, uint32_t len);
void do_flist(uint32_t id, const char *path);
void do_fstat(uint32_t id, const char *path);
void do_fremove(uint32_t id, char *payload, uint32_t len);
void do_fmkdir(uint32_t id, char *payload, uint32_t len);

/* guest_ops.c: the microVM guest around a live snapshot (unmount, mount, fresh identity) */
void do_guest(uint32_t id, char *payload, uint32_t len);

/* relay.c: the egress relay of the process and gVisor tiers (`--relay PORT SOCKET`) */
/* the relay on LISTENERS (IPv4, IPv6 or -1; bound by pid 1 before it runs anything) */
void relay_main(const int listeners[2], const char *path);
/* relay.c: the in-sandbox end of a port forward (`--connect PORT`, run as a command) */
int connect_main(int port);
#endif
