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
#include <sys/random.h>
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
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
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
    int oflags = O_WRONLY | O_CREAT | O_CLOEXEC | O_NONBLOCK | O_NOCTTY | (append ? O_APPEND : O_TRUNC);
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

/*
 * T_FPUT: ``sandbox.files.write``, whole or not at all.  The data goes to a temporary file the
 * agent makes beside the target (``.NAME.corral-RANDOM``, O_EXCL), which is renamed over the
 * target by the request that brings the last of it; a request that fails (a full disk, a fifo
 * at the path) removes it, and so does the host's PUT_ABORT when it gives a write up.  Two
 * writes of one path each have their own temporary file: the last rename wins, whole.  (Before,
 * the first chunk truncated the target and the rest were appended: a write that failed for a
 * full disk left a part of the new data in place of the old file, and two writes at once
 * interleaved.)
 *
 * Payload: u32 mode | u32 flags | TARGET \0 | TEMP \0 | data.  TEMP is empty in a write's
 * first request; a first request with PUT_MORE answers "TARGET \0 TEMP \0" (TARGET resolved:
 * a link at the path is followed, and the file it names is what is replaced or made), and
 * the host's later requests of the write carry both.
 *
 * What is replaced keeps its mode, and its owner where the writer may give it (root; or the
 * same user); a file the write makes gets ``mode`` (less the umask) and goes to the default user
 * (give_new_file), as before.  As before only a regular file the writer may write is replaced:
 * a directory is EISDIR, a fifo, socket or device EINVAL (never opened for more than a
 * non-blocking look).  A dangling link at the path is followed: its target is made, as
 * open(O_CREAT) makes it (link_target).
 */
#define PUT_PARENTS 1u /* make the missing parent directories */
#define PUT_MORE 2u    /* more data follows: keep the temporary file, answer its name */
#define PUT_ABORT 4u   /* the host gives the write up: remove the temporary file */

/* 0 with *exists = 0 if nothing (or a link) is at TARGET, 0 with *exists = 1 and its stat if it
 * is a regular file the writer may write; -1 (errno) otherwise */
static int check_target(const char *target, struct stat *st, int *exists) {
    *exists = 0;
    if (lstat(target, st) < 0) return errno == ENOENT ? 0 : -1;
    if (S_ISLNK(st->st_mode)) return 0;
    if (S_ISDIR(st->st_mode)) { errno = EISDIR; return -1; }
    if (!S_ISREG(st->st_mode)) { errno = EINVAL; return -1; }
    /* the writer's permission to write it, as when it was written in place; O_NONBLOCK and
     * O_NOFOLLOW: a fifo swapped in meanwhile holds nothing; ETXTBSY (a running program) comes
     * after the permission check, and a replaced program runs on from its old file */
    int fd = open(target, O_WRONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY);
    if (fd < 0 && errno != ETXTBSY) { if (errno == ENXIO || errno == ELOOP) errno = EINVAL; return -1; }
    if (fd >= 0) {
        int r = fstat(fd, st);
        close(fd);
        if (r < 0) return -1;
        if (!S_ISREG(st->st_mode)) { errno = EINVAL; return -1; }
    }
    *exists = 1;
    return 0;
}

/* a new temporary file beside TARGET, its path in *tmp (malloc'd) */
static int make_temp(const char *target, uint32_t mode, char **tmp) {
    const char *slash = strrchr(target, '/');
    int dlen = slash ? (int)(slash - target + 1) : 0;
    const char *base = slash ? slash + 1 : target;
    size_t cap = strlen(target) + 64;
    *tmp = malloc(cap);
    if (!*tmp) { errno = ENOMEM; return -1; }
    for (int tries = 0; tries < 16; tries++) {
        uint64_t r;
        if (getrandom(&r, sizeof r, 0) != sizeof r) r = ((uint64_t)getpid() << 32) ^ (uint64_t)now_ms() ^ (uint64_t)tries;
        /* the name's length within NAME_MAX: at most 100 bytes of the target's */
        snprintf(*tmp, cap, "%.*s.%.100s.corral-%012llx", dlen, target, base, (unsigned long long)(r & 0xffffffffffffULL));
        int fd = open(*tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY, mode & 07777);
        if (fd >= 0 || errno != EEXIST) {
            if (fd < 0) { int err = errno; free(*tmp); *tmp = NULL; errno = err; }
            return fd;
        }
    }
    free(*tmp);
    *tmp = NULL;
    errno = EEXIST;
    return -1;
}

static int write_whole(int fd, const char *data, size_t len) {
    while (len > 0) {
        ssize_t n = write(fd, data, len);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return -1;
        data += n;
        len -= (size_t)n;
    }
    return 0;
}

/* the temporary file (open as FD) becomes TARGET; FD is closed either way */
static int commit(int fd, const char *tmp, const char *target) {
    struct stat st;
    int exists;
    if (check_target(target, &st, &exists) < 0) { int err = errno; close(fd); errno = err; return -1; }
    if (exists) {
        if (fchown(fd, st.st_uid, st.st_gid) < 0) {} /* only root (or the same user) may: else it is the writer's */
        if (fchmod(fd, st.st_mode & 07777) < 0) { int err = errno; close(fd); errno = err; return -1; }
    } else give_new_file(fd, NULL);
    if (close(fd) < 0) return -1; /* a network file system's late ENOSPC */
    return rename(tmp, target);
}

/* TEMP as the host sent it back: a temporary file of ours beside TARGET, nothing else */
static int our_temp(const char *target, const char *temp) {
    const char *ts = strrchr(target, '/'), *ps = strrchr(temp, '/');
    size_t dlen = ts ? (size_t)(ts - target + 1) : 0;
    if ((ps ? (size_t)(ps - temp + 1) : 0) != dlen || strncmp(target, temp, dlen) != 0) return 0;
    return temp[dlen] == '.' && strstr(temp + dlen, ".corral-") != NULL;
}

/* The file a write through the link at `path` lands in, as open(O_CREAT) would find it: the
 * end of its chain of links, which need not exist (a dangling link's target is created, as
 * `echo x > link` does); NULL (errno set) if no write could land (a missing directory, a loop). */
static char *link_target(const char *path) {
    char cur[4096], text[4096];
    if (strlen(path) >= sizeof cur) { errno = ENAMETOOLONG; return NULL; }
    strcpy(cur, path);
    for (int hops = 0; hops < 40; hops++) {
        struct stat st;
        if (lstat(cur, &st) < 0) {
            if (errno != ENOENT) return NULL;
            char *slash = strrchr(cur, '/');
            const char *base = slash ? slash + 1 : cur;
            char dir[4096];
            if (!slash) strcpy(dir, ".");
            else if (slash == cur) strcpy(dir, "/");
            else { memcpy(dir, cur, (size_t)(slash - cur)); dir[slash - cur] = 0; }
            if (!*base) { errno = EISDIR; return NULL; }
            char *real = realpath(dir, NULL);
            if (!real) return NULL;
            char *out = malloc(strlen(real) + strlen(base) + 2);
            if (out) sprintf(out, "%s/%s", strcmp(real, "/") ? real : "", base);
            else errno = ENOMEM;
            free(real);
            return out;
        }
        if (!S_ISLNK(st.st_mode)) return realpath(cur, NULL);
        ssize_t n = readlink(cur, text, sizeof text - 1);
        if (n < 0) return NULL;
        text[n] = 0;
        if (text[0] == '/') {
            strcpy(cur, text);
        } else {
            char *slash = strrchr(cur, '/');
            size_t keep = slash ? (size_t)(slash - cur) + 1 : 0;
            if (keep + (size_t)n >= sizeof cur) { errno = ENAMETOOLONG; return NULL; }
            memcpy(cur + keep, text, (size_t)n + 1);
        }
    }
    errno = ELOOP;
    return NULL;
}

void do_fput(uint32_t id, char *payload, uint32_t len) {
    if (len < 8) { send_err(id, EINVAL, "write"); return; }
    uint32_t mode, flags;
    memcpy(&mode, payload, 4);
    memcpy(&flags, payload + 4, 4);
    char *path = payload + 8, *end = payload + len;
    char *z = memchr(path, 0, (size_t)(end - path));
    char *temp = z ? z + 1 : NULL;
    char *z2 = temp ? memchr(temp, 0, (size_t)(end - temp)) : NULL;
    if (!z2 || !*path) { send_err(id, EINVAL, "write"); return; }
    char *data = z2 + 1;
    size_t dlen = (size_t)(end - data);
    if (*temp && !our_temp(path, temp)) { send_err(id, EINVAL, path); return; }
    if (flags & PUT_ABORT) {
        if (*temp) unlink(temp);
        send_frame(T_OK, id, NULL, 0);
        return;
    }
    char *resolved = NULL, *made = NULL;
    const char *target = path, *tmp = temp;
    int fd;
    if (!*temp) { /* the write's first request */
        if ((flags & PUT_PARENTS) && mkdir_parents(path, 0755) < 0) { send_err(id, errno, path); return; }
        struct stat st;
        int exists;
        if (lstat(path, &st) == 0 && S_ISLNK(st.st_mode)) {
            if ((resolved = link_target(path)) == NULL) { send_err(id, errno, path); return; }
            target = resolved;
        }
        if (check_target(target, &st, &exists) < 0 || (fd = make_temp(target, mode, &made)) < 0) {
            send_err(id, errno, path);
            free(resolved);
            return;
        }
        tmp = made;
    } else {
        fd = open(temp, O_WRONLY | O_APPEND | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
        struct stat st;
        if (fd >= 0 && (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode))) { close(fd); fd = -1; errno = EINVAL; }
        if (fd < 0) {
            int err = errno == ENOENT ? ESTALE : errno; /* (given up meanwhile) */
            unlink(temp);
            send_err(id, err, path);
            return;
        }
    }
    int r = write_whole(fd, data, dlen);
    if (r == 0 && (flags & PUT_MORE)) {
        if ((r = close(fd)) == 0) {
            size_t tl = strlen(target) + 1, ml = strlen(tmp) + 1;
            char *answer = malloc(tl + ml);
            if (answer) {
                memcpy(answer, target, tl);
                memcpy(answer + tl, tmp, ml);
                send_frame(T_OK, id, answer, (uint32_t)(tl + ml));
                free(answer);
            } else { r = -1; errno = ENOMEM; }
        }
    } else if (r == 0) {
        if ((r = commit(fd, tmp, target)) == 0) send_frame(T_OK, id, NULL, 0);
    } else {
        int err = errno;
        close(fd);
        errno = err;
    }
    if (r < 0) {
        int err = errno;
        unlink(tmp);
        send_err(id, err, path);
    }
    free(resolved);
    free(made);
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
