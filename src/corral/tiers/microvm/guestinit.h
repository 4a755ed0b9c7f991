/* Shared by corral-guestinit's files (guestinit.c: phases and helpers; guest_root.c: the
 * image's root and the identity; guest_start.c: the agent and the egress relay). */
#ifndef CORRAL_GUESTINIT_H
#define CORRAL_GUESTINIT_H
#include <sys/types.h>

void say(const char *fmt, const char *arg);
void die(const char *what, const char *arg);
void mark(const char *what);
const char *get(const char *key);
const char *need(const char *key);
void mkdir_p(const char *path);
void do_mount(const char *src, const char *target, const char *type, unsigned long flags, const char *data);
void write_file(const char *path, const char *data);

int prepare_root(void);
void warm_page_cache(void);
void setup_root(void);

int start_agent(int port, pid_t *pid);
int start_relay(int net_port);
void start_egress(int relay);
void loopback_up(void);
void net_prepare(void);
void start_net(void);
#endif
