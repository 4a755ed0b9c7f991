/* corral-agent: the file requests (read, write, list, stat, remove, mkdir). */
#include "agent.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>

/* ``limit``: the most the host takes.  A larger file is refused before any of it is read, and
 * one that grows past it while read stops there: a sparse 100 GB file kept the agent reading
 * (and the host receiving and dropping) long after the host had given up on the answer. */
void do_fread(uint32_t id, const char *path, unsigned long long limit) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) { send_err(id, errno, path); return; }
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        send_err(id, S_ISDIR(st.st_mode) ? EISDIR : EINVAL, path);
        return;
    }
    if ((unsigned long long)st.st_size > limit) { close(fd); send_err(id, EFBIG, path); return; }
    static char buf[1 << 20];
    unsigned long long sent = 0;
    for (;;) {
        ssize_t n = read(fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) { close(fd); send_err(id, errno, path); return; }
        if (n == 0) break;
        if ((sent += (unsigned long long)n) > limit) { close(fd); send_err(id, EFBIG, path); return; }
        send_frame(T_DATA, id, buf, (uint32_t)n);
    }
    close(fd);
    send_frame(T_OK, id, NULL, 0);
}

static int mkdir_parents(char *path, mode_t mode) {
    for (char *p = path + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        int r = mkdir(path, mode);
        if (r == 0) give_new_file(-1, path);
        *p = '/';
        if (r < 0 && errno != EEXIST) return -1;
    }
    return 0;
}

void do_fwrite(uint32_t id, char *payload, uint32_t len, int append) {
    if (len < 8) { send_err(id, EINVAL, "write"); return; }
    uint32_t mode, flags;
    memcpy(&mode, payload, 4);
    memcpy(&flags, payload + 4, 4);
    char *path = payload + 8;
    size_t plen = strnlen(path, len - 8);
    if (plen == len - 8) { send_err(id, EINVAL, "write"); return; }
    char *data = path + plen + 1;
    size_t dlen = len - 8 - plen - 1;
    if ((flags & 1) && mkdir_parents(path, 0755) < 0) { send_err(id, errno, path); return; }
    /* O_NONBLOCK: a fifo the sandbox put at the path would otherwise hold this open (and with it
     * every request of the sandbox) until something in the sandbox read it, perhaps never */
    int oflags = O_WRONLY | O_CREAT | O_CLOEXEC | O_NONBLOCK | (append ? O_APPEND : O_TRUNC);
    /* O_EXCL first: a file made here is given to the default user (give_new_file) */
    int fd = open(path, oflags | O_EXCL, mode & 07777);
    if (fd >= 0) give_new_file(fd, NULL);
    else if (errno == EEXIST) fd = open(path, oflags, mode & 07777);
    if (fd < 0) { send_err(id, errno == ENXIO ? EINVAL : errno, path); return; }
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) { /* a fifo, socket or device: not a file to write */
        close(fd);
        send_err(id, EINVAL, path);
        return;
    }
    while (dlen > 0) {
        ssize_t n = write(fd, data, dlen);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) { int err = errno; close(fd); send_err(id, err, path); return; }
        data += n;
        dlen -= (size_t)n;
    }
    if (close(fd) < 0) { send_err(id, errno, path); return; }
    send_frame(T_OK, id, NULL, 0);
}

static char type_char(mode_t m) {
    return S_ISREG(m) ? 'f' : S_ISDIR(m) ? 'd' : S_ISLNK(m) ? 'l' : 'o';
}

void do_flist(uint32_t id, const char *path) {
    DIR *d = opendir(path);
    if (!d) { send_err(id, errno, path); return; }
    size_t cap = 65536, len = 0;
    char *out = malloc(cap);
    struct dirent *de;
    int count = 0, more = 0;
    while (out && (de = readdir(d)) != NULL) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        if (count == MAX_LIST) { more = 1; break; } /* refused whole, never cut short in silence */
        struct stat st;
        if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0) continue;
        size_t nl = strlen(de->d_name);
        size_t need = 1 + 8 + 4 + 8 + nl + 1;
        if (len + need > cap) {
            cap = (cap + need) * 2;
            char *n = realloc(out, cap);
            if (!n) { free(out); out = NULL; break; }
            out = n;
        }
        out[len] = type_char(st.st_mode);
        uint64_t size = (uint64_t)st.st_size;
        uint32_t mode = st.st_mode & 07777;
        int64_t mtime = st.st_mtime;
        memcpy(out + len + 1, &size, 8);
        memcpy(out + len + 9, &mode, 4);
        memcpy(out + len + 13, &mtime, 8);
        memcpy(out + len + 21, de->d_name, nl + 1);
        len += need;
        count++;
    }
    closedir(d);
    if (more) { free(out); send_err(id, E2BIG, path); return; }
    if (!out) { send_err(id, ENOMEM, path); return; }
    send_frame(T_OK, id, out, (uint32_t)len);
    free(out);
}

void do_fstat(uint32_t id, const char *path) {
    struct stat st;
    if (lstat(path, &st) < 0) { send_err(id, errno, path); return; }
    char out[21];
    out[0] = type_char(st.st_mode);
    uint64_t size = (uint64_t)st.st_size;
    uint32_t mode = st.st_mode & 07777;
    int64_t mtime = st.st_mtime;
    memcpy(out + 1, &size, 8);
    memcpy(out + 9, &mode, 4);
    memcpy(out + 13, &mtime, 8);
    send_frame(T_OK, id, out, sizeof out);
}

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb; (void)ftw;
    return (flag == FTW_DP ? rmdir(p) : unlink(p)) < 0 ? -1 : 0;
}

void do_fremove(uint32_t id, char *payload, uint32_t len) {
    if (len < 5) { send_err(id, EINVAL, "remove"); return; }
    uint32_t recursive;
    memcpy(&recursive, payload, 4);
    const char *path = payload + 4;
    struct stat st;
    if (lstat(path, &st) < 0) { send_err(id, errno, path); return; }
    int r;
    if (S_ISDIR(st.st_mode))
        r = recursive ? nftw(path, rm_entry, 32, FTW_DEPTH | FTW_PHYS) : rmdir(path);
    else
        r = unlink(path);
    if (r < 0) { send_err(id, errno, path); return; }
    send_frame(T_OK, id, NULL, 0);
}

void do_fmkdir(uint32_t id, char *payload, uint32_t len) {
    if (len < 5) { send_err(id, EINVAL, "mkdir"); return; }
    uint32_t mode;
    memcpy(&mode, payload, 4);
    char *path = payload + 4;
    size_t l = strlen(path);
    char *p = malloc(l + 2);
    if (!p) { send_err(id, ENOMEM, path); return; }
    memcpy(p, path, l);
    p[l] = '/';
    p[l + 1] = 0;
    int r = mkdir_parents(p, mode & 07777);
    free(p);
    if (r < 0) { send_err(id, errno, path); return; }
    send_frame(T_OK, id, NULL, 0);
}
