/* The microVM guest's egress relay (relay_mux.c): connections multiplexed over a virtio-serial port. */
#ifndef CORRAL_RELAY_MUX_H
#define CORRAL_RELAY_MUX_H
int relay_mux_main(int wait_fd);
/* relay.c: a non-blocking listener on the loopback address of family (AF_INET or AF_INET6) */
int loopback_listener(int family, int port);
#endif
