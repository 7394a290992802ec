/* dsec-init: PID 1 of a dsec sandbox (docs/launcher.md, "PID 1").
 *
 * The launcher starts this program with clone3 in new pid, mount, ipc, uts
 * and net namespaces, inside the sandbox's cgroup2 directory (or posix_spawn:
 * agent/sandbox/spawn.py): PID 1 from its first instruction, it never held the
 * launcher's memory (no keys, no passwords, no agent state). argv is
 * "dsec-init", the environment is empty, fd 3 is the control socket
 * (SOCK_SEQPACKET, protocol in proto.h), nothing else is open.
 *
 * The launcher decides everything (mount plan, uid/gid, the seccomp program
 * compiled once per policy, sysctls, each step's argv/env/workdir); this
 * program carries it out, in a short straight line of syscalls:
 *
 *   JOIN    "0" written into each v1 cgroup `tasks` file passed -> HELLO
 *   CONFIG  sysctls (in the new net/pid namespaces), hostname, loopback up,
 *           the mount plan (every path inside the new root resolved with
 *           openat2 RESOLVE_IN_ROOT: a symlink in a rootfs never leads
 *           outside it), pivot_root                           -> READY
 *           then the capability bounding set emptied, once, for every step
 *   EXEC    clone (vfork); the child: default signals (the few PID 1 handles:
 *           every other one is default from PID 1's start), setsid, stdio,
 *           workdir, close every other fd, oom_score_adj, capabilities
 *           dropped (ambient, then setresgid/setresuid, capset for uid 0; the
 *           bounding set is PID 1's, already empty), no_new_privs, seccomp
 *           (unless PID 1 loaded it: SECCOMP_SHARED), execve (no STARTED message)
 *           every exit of a step's main process (its pid)     -> STEP_EXIT
 *   SIGNAL / TERMINATE   forwarded; signals sent to PID 1 go to every step
 *   CLOSE   SIGKILL to everything, reap                        -> CLOSED,
 *           then hold the namespaces until RELEASE (bounded) so the
 *           recorder can still read through /proc/1/root; exit 0.
 *
 * The control socket closing (the launcher died) kills the whole sandbox:
 * nothing runs unsupervised. PID 1 reaps every orphan, is not dumpable (the
 * workload, even as root without capabilities, cannot read its memory or
 * ptrace it), and has oom_score_adj -1000 while every step gets the
 * launcher's value (1000 by default): under memory pressure the workload is
 * the victim, and an OOM is reported as an OOM, never as "PID 1 died".
 * poll(2), never select(2): descriptors past 1023 are fine.
 *
 * Why this file is long: PID 1 is one small static program on purpose (one
 * exec, nothing to load into a sandbox, no interpreter); its parts (the
 * protocol reader, the mount-plan executor, the step launcher, the reaper)
 * share its little state, and splitting them into files would only add a
 * build step.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/openat2.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "proto.h"

#define CTL 3
#define MSG_MAX (2u << 20)
#define MAX_FDS 8
#define HOLD_MAX_MS 30000
#define MAX_STEPS 4096

/* ---- state ---------------------------------------------------------------- */
static unsigned char inbuf[MSG_MAX];
static unsigned char outbuf[65536];
static size_t outlen;
static int rootfd = -1;
static uid_t wl_uid = 65534;
static gid_t wl_gid = 65534;
static int hold_after_exit;
static long wl_oom_adj = 1000;
static struct sock_filter *sc_filter;
static unsigned short sc_len;
static int sc_shared;       /* SECCOMP_SHARED: load the filter into PID 1 once (after set-up) */
static int sc_loaded;       /* ... done: every step's child inherits it at its clone */
static int last_cap = 40;
static int nullfd = -1;
static struct { pid_t pid; uint64_t step; } steps[MAX_STEPS];
static int nsteps;
static uint64_t total_cpu_us, max_rss_kb;

/* ---- output ----------------------------------------------------------------- */
static void out_begin(uint32_t type)
{
    memcpy(outbuf, &type, 4);
    outlen = 4;
}

static void out_bytes(uint32_t tag, const void *data, size_t len)
{
    if (outlen + 8 + len > sizeof(outbuf))
        return;                     /* never: our messages are small; dropped rather than torn */
    uint32_t l = (uint32_t)len;
    memcpy(outbuf + outlen, &tag, 4);
    memcpy(outbuf + outlen + 4, &l, 4);
    memcpy(outbuf + outlen + 8, data, len);
    outlen += 8 + len;
}

static void out_str(uint32_t tag, const char *s) { out_bytes(tag, s, strlen(s)); }

static void out_u64(uint32_t tag, uint64_t v) { out_bytes(tag, &v, 8); }

static void out_send(void)
{
    while (send(CTL, outbuf, outlen, MSG_NOSIGNAL) < 0 && errno == EINTR)
        ;
}

static void fatal(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
static void fatal(const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    out_begin(DSEC_MSG_ERROR);
    out_str(DSEC_T_MSG, msg);
    out_send();
    _exit(125);
}

/* ---- input ------------------------------------------------------------------- */
struct item {
    uint32_t tag;
    uint32_t len;
    const unsigned char *data;
};

/* the next item of [*p, end): 1, 0 at the end, -1 when torn */
static int next_item(const unsigned char **p, const unsigned char *end, struct item *it)
{
    if (*p >= end)
        return 0;
    if (end - *p < 8)
        return -1;
    memcpy(&it->tag, *p, 4);
    memcpy(&it->len, *p + 4, 4);
    if ((size_t)(end - *p - 8) < it->len)
        return -1;
    it->data = *p + 8;
    *p += 8 + (size_t)it->len;
    return 1;
}

static uint64_t item_u64(const struct item *it)
{
    uint64_t v = 0;
    memcpy(&v, it->data, it->len < 8 ? it->len : 8);
    return v;
}

/* a NUL-terminated copy (never freed: config strings live as long as we do,
 * step strings are freed by the child's execve or by the parent after fork) */
static char *item_str(const struct item *it)
{
    char *s = malloc(it->len + 1);
    if (!s)
        fatal("out of memory");
    memcpy(s, it->data, it->len);
    s[it->len] = 0;
    return s;
}

/* one message (and the fds passed with it); 0 at EOF, -1 on error */
static ssize_t recv_msg(int *fds, int *nfds)
{
    char cbuf[CMSG_SPACE(sizeof(int) * MAX_FDS)];
    struct iovec iov = {inbuf, sizeof(inbuf)};
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof(cbuf);
    ssize_t n;
    do {
        n = recvmsg(CTL, &mh, MSG_CMSG_CLOEXEC);
    } while (n < 0 && errno == EINTR);
    *nfds = 0;
    if (n < 0)
        return -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        int *src = (int *)CMSG_DATA(c);
        for (int i = 0; i < k; i++) {
            if (*nfds < MAX_FDS)
                fds[(*nfds)++] = src[i];
            else
                close(src[i]);
        }
    }
    if (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))
        return -1;
    return n;
}

/* ---- small helpers ----------------------------------------------------------- */
static int write_file(const char *path, const char *value)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    size_t len = strlen(value);
    ssize_t n = write(fd, value, len);
    int e = errno;
    close(fd);
    errno = e;
    return n == (ssize_t)len ? 0 : -1;
}

static const char *fdpath(int fd, char *buf, size_t size)
{
    snprintf(buf, size, "/proc/self/fd/%d", fd);
    return buf;
}

/* a path inside the new root, resolved without ever leaving it (absolute
 * symlinks and ".." are confined to the root; /proc magic links refused) */
static int resolve_in_root(const char *path, int oflags)
{
    struct open_how how;
    memset(&how, 0, sizeof(how));
    how.flags = (uint64_t)(O_PATH | O_CLOEXEC | oflags);
    how.resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS;
    return (int)syscall(SYS_openat2, rootfd, path, &how, sizeof(how));
}

/* split "a/b/c" (leading slashes ignored) into its parent ("a/b" or "/") and name ("c") */
static int split(const char *path, char *parent, size_t psize, const char **name)
{
    while (*path == '/')
        path++;
    const char *slash = strrchr(path, '/');
    if (!*path)
        return -1;
    if (!slash) {
        snprintf(parent, psize, "/");
        *name = path;
    } else {
        size_t n = (size_t)(slash - path);
        if (n + 1 > psize)
            return -1;
        memcpy(parent, path, n);
        parent[n] = 0;
        *name = slash + 1;
    }
    return **name ? 0 : -1;
}

struct created { char **paths; int n; };
static struct created created;

static void note_created(const char *path)
{
    char **p = realloc(created.paths, sizeof(char *) * (size_t)(created.n + 1));
    if (!p)
        fatal("out of memory");
    created.paths = p;
    char *s = malloc(strlen(path) + 2);
    if (!s)
        fatal("out of memory");
    sprintf(s, "/%s", path + strspn(path, "/"));
    created.paths[created.n++] = s;
}

/* mkdir -p inside the root; returns 0 or -1 (errno) */
static int mkdir_in_root(const char *path, mode_t mode, int owner, int record)
{
    char partial[4096], parent[4096];
    const char *p = path;
    size_t len = 0;
    while (*p) {
        while (*p == '/')
            p++;
        if (!*p)
            break;
        const char *e = strchr(p, '/');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        if (len + n + 2 > sizeof(partial)) {
            errno = ENAMETOOLONG;
            return -1;
        }
        partial[len++] = '/';
        memcpy(partial + len, p, n);
        len += n;
        partial[len] = 0;
        p += n;
        int fd = resolve_in_root(partial, O_DIRECTORY);
        if (fd >= 0) {
            close(fd);
            continue;
        }
        if (errno != ENOENT)
            return -1;
        const char *name;
        if (split(partial, parent, sizeof(parent), &name) < 0) {
            errno = EINVAL;
            return -1;
        }
        int pfd = resolve_in_root(parent, O_DIRECTORY);
        if (pfd < 0)
            return -1;
        if (mkdirat(pfd, name, mode) < 0 && errno != EEXIST) {
            int e = errno;
            close(pfd);
            errno = e;
            return -1;
        }
        if (owner && fchownat(pfd, name, wl_uid, wl_gid, AT_SYMLINK_NOFOLLOW) < 0) {
            int e = errno;
            close(pfd);
            errno = e;
            return -1;
        }
        close(pfd);
        if (record)
            note_created(partial);
        /* a dangling symlink of that name: resolving again fails (ENOENT/ENOTDIR) */
        fd = resolve_in_root(partial, O_DIRECTORY);
        if (fd < 0)
            return -1;
        close(fd);
    }
    return 0;
}

/* ---- the mount plan ------------------------------------------------------------ */
struct op {
    uint64_t kind, flags, mode, dev;
    const char *src, *target, *fstype, *data, *value, *what;
    int src_in_root, target_host, if_exists, mkdir_mode_set, mkfile, record, owner, dir;
    uint64_t mkdir_mode;
};

static void parse_op(const unsigned char *p, const unsigned char *end, struct op *op)
{
    struct item it;
    int r;
    memset(op, 0, sizeof(*op));
    while ((r = next_item(&p, end, &it)) > 0) {
        switch (it.tag) {
        case DSEC_T_KIND: op->kind = item_u64(&it); break;
        case DSEC_T_FLAGS: op->flags = item_u64(&it); break;
        case DSEC_T_MODE: op->mode = item_u64(&it); break;
        case DSEC_T_DEV: op->dev = item_u64(&it); break;
        case DSEC_T_SRC: op->src = item_str(&it); break;
        case DSEC_T_TARGET: op->target = item_str(&it); break;
        case DSEC_T_FSTYPE: op->fstype = item_str(&it); break;
        case DSEC_T_DATA: op->data = item_str(&it); break;
        case DSEC_T_VALUE: op->value = item_str(&it); break;
        case DSEC_T_WHAT: op->what = item_str(&it); break;
        case DSEC_T_SRC_IN_ROOT: op->src_in_root = 1; break;
        case DSEC_T_TARGET_HOST: op->target_host = 1; break;
        case DSEC_T_IF_EXISTS: op->if_exists = 1; break;
        case DSEC_T_MKDIR: op->mkdir_mode_set = 1; op->mkdir_mode = item_u64(&it); break;
        case DSEC_T_MKFILE: op->mkfile = 1; break;
        case DSEC_T_RECORD: op->record = 1; break;
        case DSEC_T_OWNER: op->owner = 1; break;
        case DSEC_T_DIR: op->dir = 1; break;
        default: break;
        }
    }
    if (r < 0)
        fatal("torn mount-plan operation");
    if (!op->what)
        op->what = op->target ? op->target : "operation";
}

/* the target of an operation as an O_PATH fd (-2: skip, it does not exist) */
static int op_target(struct op *op)
{
    if (op->target_host)
        return open(op->target, O_PATH | O_CLOEXEC);
    if (rootfd < 0)
        fatal("%s: no root yet", op->what);
    int fd = resolve_in_root(op->target, 0);
    if (fd >= 0 || errno != ENOENT)
        return fd;
    if (op->if_exists)
        return -2;
    if (op->mkdir_mode_set) {
        if (mkdir_in_root(op->target, (mode_t)op->mkdir_mode, op->owner, op->record) < 0)
            fatal("%s: cannot create %s: %s", op->what, op->target, strerror(errno));
        return resolve_in_root(op->target, 0);
    }
    if (op->mkfile) {
        char parent[4096];
        const char *name;
        if (split(op->target, parent, sizeof(parent), &name) < 0)
            fatal("%s: bad path %s", op->what, op->target);
        if (mkdir_in_root(parent, 0755, 0, op->record) < 0)
            fatal("%s: cannot create %s: %s", op->what, parent, strerror(errno));
        int pfd = resolve_in_root(parent, O_DIRECTORY);
        if (pfd < 0)
            fatal("%s: %s: %s", op->what, parent, strerror(errno));
        int f = openat(pfd, name, O_CREAT | O_EXCL | O_WRONLY | O_NOFOLLOW | O_CLOEXEC, 0644);
        if (f < 0 && errno != EEXIST)
            fatal("%s: cannot create %s: %s", op->what, op->target, strerror(errno));
        if (f >= 0) {
            close(f);
            if (op->record)
                note_created(op->target);
        }
        close(pfd);
        return resolve_in_root(op->target, 0);
    }
    return -1;
}

static void do_mount(struct op *op)
{
    int tfd = op_target(op);
    if (tfd == -2)
        return;
    if (tfd < 0)
        fatal("%s: %s: %s", op->what, op->target, strerror(errno));
    struct stat st;
    if (fstat(tfd, &st) < 0)
        fatal("%s: %s", op->what, strerror(errno));
    if ((op->dir || op->mkdir_mode_set) && !S_ISDIR(st.st_mode))
        fatal("rootfs: %s exists and is not a directory", op->target);
    if (op->mkfile && !S_ISREG(st.st_mode))
        fatal("rootfs: %s exists and is not a regular file", op->target);
    char tbuf[64], sbuf[64];
    const char *src = op->src;
    int sfd = -1;
    if (op->src && op->src_in_root) {
        sfd = resolve_in_root(op->src, 0);
        if (sfd < 0)
            fatal("%s: %s: %s", op->what, op->src, strerror(errno));
        src = fdpath(sfd, sbuf, sizeof(sbuf));
    }
    const char *target = op->target_host ? op->target : fdpath(tfd, tbuf, sizeof(tbuf));
    if (mount(src, target, op->fstype, (unsigned long)op->flags, op->data) < 0)
        fatal("%s failed: %s", op->what, strerror(errno));
    if (sfd >= 0)
        close(sfd);
    close(tfd);
}

/* The root of the first directory mask's tmpfs (O_PATH): every later directory mask is a bind
 * mount of it, one empty read-only (superblock and mount) tmpfs for the sandbox instead of one per
 * masked directory. Each superblock costs a mount, and a registration under a kernel-wide lock
 * (its memcg-aware dentry and inode LRUs) that every memory cgroup's removal on the node walks:
 * with a few hundred sandboxes alive, a start's mounts waited on that lock
 * (docs/launch-figures.md). Closed before the pivot. */
static int mask_dir_fd = -1;

static void do_mask(struct op *op)
{
    int fd = resolve_in_root(op->target, 0);
    if (fd < 0) {
        if (errno == ENOENT)
            return;
        fatal("mask %s: %s", op->target, strerror(errno));
    }
    struct stat st;
    if (fstat(fd, &st) < 0)
        fatal("mask %s: %s", op->target, strerror(errno));
    char tbuf[64], sbuf[64];
    int r;
    if (S_ISDIR(st.st_mode) && mask_dir_fd >= 0) {
        /* a bind keeps the source mount's flags: read-only, nosuid, nodev, noexec */
        r = mount(fdpath(mask_dir_fd, sbuf, sizeof(sbuf)), fdpath(fd, tbuf, sizeof(tbuf)), NULL, MS_BIND, NULL);
    } else if (S_ISDIR(st.st_mode)) {
        r = mount("tmpfs", fdpath(fd, tbuf, sizeof(tbuf)), "tmpfs",
                  MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=0");
        if (r == 0 && (mask_dir_fd = resolve_in_root(op->target, O_DIRECTORY)) < 0)
            fatal("mask %s: reopening it: %s", op->target, strerror(errno));
    } else {
        int nfd = resolve_in_root("/dev/null", 0);
        if (nfd < 0)
            fatal("mask %s: /dev/null: %s", op->target, strerror(errno));
        r = mount(fdpath(nfd, sbuf, sizeof(sbuf)), fdpath(fd, tbuf, sizeof(tbuf)), NULL, MS_BIND, NULL);
        close(nfd);
    }
    if (r < 0)
        fatal("mask %s failed: %s", op->target, strerror(errno));
    close(fd);
}

static void at_parent(struct op *op, int *pfd, const char **name)
{
    char parent[4096];
    if (split(op->target, parent, sizeof(parent), name) < 0)
        fatal("%s: bad path %s", op->what, op->target);
    *pfd = resolve_in_root(parent, O_DIRECTORY);
    if (*pfd < 0)
        fatal("%s: %s: %s", op->what, parent, strerror(errno));
}

static void run_op(const unsigned char *p, const unsigned char *end)
{
    struct op op;
    parse_op(p, end, &op);
    int pfd;
    const char *name;
    switch (op.kind) {
    case DSEC_OP_MOUNT:
        do_mount(&op);
        break;
    case DSEC_OP_ROOT:
        rootfd = open(op.target, O_PATH | O_DIRECTORY | O_CLOEXEC);
        if (rootfd < 0)
            fatal("root %s: %s", op.target, strerror(errno));
        break;
    case DSEC_OP_MKDIR:
        if (mkdir_in_root(op.target, (mode_t)op.mode, op.owner, op.record) < 0)
            fatal("%s: cannot create %s: %s", op.what, op.target, strerror(errno));
        break;
    case DSEC_OP_MKNOD:
        at_parent(&op, &pfd, &name);
        if (mknodat(pfd, name, (mode_t)op.mode, (dev_t)op.dev) < 0)
            fatal("%s: %s", op.what, strerror(errno));
        close(pfd);
        break;
    case DSEC_OP_SYMLINK:
        at_parent(&op, &pfd, &name);
        if (symlinkat(op.value, pfd, name) < 0)
            fatal("%s: %s", op.what, strerror(errno));
        close(pfd);
        break;
    case DSEC_OP_MASK:
        do_mask(&op);
        break;
    case DSEC_OP_PIVOT:
        if (mask_dir_fd >= 0) {
            close(mask_dir_fd);
            mask_dir_fd = -1;
        }
        if (fchdir(rootfd) < 0 || syscall(SYS_pivot_root, ".", ".") < 0)
            fatal("pivot_root into %s failed: %s", op.target ? op.target : "the root", strerror(errno));
        if (umount2(".", MNT_DETACH) < 0)
            fatal("detaching the old root failed: %s", strerror(errno));
        if (chdir("/") < 0)
            fatal("chdir /: %s", strerror(errno));
        close(rootfd);
        rootfd = -1;
        break;
    default:
        fatal("unknown mount-plan operation %llu", (unsigned long long)op.kind);
    }
}

/* ---- set-up --------------------------------------------------------------------- */
static void loopback_up(void)
{
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        fatal("loopback: socket: %s", strerror(errno));
    struct ifreq ifr;
    memset(&ifr, 0, sizeof(ifr));
    strcpy(ifr.ifr_name, "lo");
    if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0)
        fatal("loopback: SIOCGIFFLAGS: %s", strerror(errno));
    ifr.ifr_flags |= IFF_UP;
    if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0)
        fatal("loopback: SIOCSIFFLAGS: %s", strerror(errno));
    close(s);
}

static void sysctl(const unsigned char *p, const unsigned char *end)
{
    struct item it;
    const char *path = NULL, *value = NULL;
    int if_exists = 0;
    while (next_item(&p, end, &it) > 0) {
        if (it.tag == DSEC_T_PATH)
            path = item_str(&it);
        else if (it.tag == DSEC_T_VALUE)
            value = item_str(&it);
        else if (it.tag == DSEC_T_IF_EXISTS)
            if_exists = 1;
    }
    if (!path || !value)
        fatal("torn sysctl");
    if (write_file(path, value) < 0 && !(if_exists && errno == ENOENT))
        fatal("sysctl %s = %s: %s", path, value, strerror(errno));
}

static void configure(size_t n)
{
    const unsigned char *p = inbuf + 4, *end = inbuf + n;
    struct item it;
    int r;
    const char *hostname = NULL;
    long self_oom = -1000;
    /* pass 1: scalars; pass 2: sysctls, then the mount plan in order */
    while ((r = next_item(&p, end, &it)) > 0) {
        switch (it.tag) {
        case DSEC_T_HOSTNAME: hostname = item_str(&it); break;
        case DSEC_T_UID: wl_uid = (uid_t)item_u64(&it); break;
        case DSEC_T_GID: wl_gid = (gid_t)item_u64(&it); break;
        case DSEC_T_HOLD: hold_after_exit = item_u64(&it) != 0; break;
        case DSEC_T_SECCOMP_SHARED: sc_shared = 1; break;
        case DSEC_T_OOM_ADJ: wl_oom_adj = (long)(int64_t)item_u64(&it); break;
        case DSEC_T_SELF_OOM_ADJ: self_oom = (long)(int64_t)item_u64(&it); break;
        case DSEC_T_SECCOMP:
            if (it.len % sizeof(struct sock_filter) || it.len / sizeof(struct sock_filter) > 65535)
                fatal("seccomp program of %u bytes is not a filter", it.len);
            sc_len = (unsigned short)(it.len / sizeof(struct sock_filter));
            sc_filter = malloc(it.len ? it.len : 1);
            if (!sc_filter)
                fatal("out of memory");
            memcpy(sc_filter, it.data, it.len);
            break;
        default: break;
        }
    }
    if (r < 0)
        fatal("torn CONFIG message");
    char num[32];
    snprintf(num, sizeof(num), "%ld", self_oom);
    /* lowering it needs CAP_SYS_RESOURCE, which some hosts' root lacks: then
     * init keeps the launcher's value; the steps' +1000 still makes them the
     * victims (init's few pages score next to nothing) */
    if (write_file("/proc/self/oom_score_adj", num) < 0 && errno != EACCES && errno != EPERM)
        fatal("oom_score_adj: %s", strerror(errno));
    FILE *f = fopen("/proc/sys/kernel/cap_last_cap", "re");
    if (f) {
        if (fscanf(f, "%d", &last_cap) != 1)
            last_cap = 40;
        fclose(f);
    }
    p = inbuf + 4;
    while (next_item(&p, end, &it) > 0)
        if (it.tag == DSEC_T_SYSCTL)
            sysctl(it.data, it.data + it.len);
    if (hostname && sethostname(hostname, strlen(hostname)) < 0)
        fatal("sethostname: %s", strerror(errno));
    loopback_up();
    umask(0);
    p = inbuf + 4;
    while (next_item(&p, end, &it) > 0)
        if (it.tag == DSEC_T_OP)
            run_op(it.data, it.data + it.len);
    umask(022);
    nullfd = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (nullfd < 0)
        fatal("/dev/null in the sandbox: %s", strerror(errno));
}

/* ---- steps ---------------------------------------------------------------------- */
struct exec_err {
    int err;
    char stage[16];
};

static void child_fail(int errfd, const char *stage, int err)
{
    struct exec_err e;
    memset(&e, 0, sizeof(e));
    e.err = err ? err : EIO;
    snprintf(e.stage, sizeof(e.stage), "%s", stage);
    ssize_t w = write(errfd, &e, sizeof(e));
    (void)w;
    _exit(127);
}

static int mkdirs(const char *path)
{
    char buf[4096];
    snprintf(buf, sizeof(buf), "%s", path);
    for (char *s = buf + 1; *s; s++) {
        if (*s != '/')
            continue;
        *s = 0;
        if (mkdir(buf, 0755) < 0 && errno != EEXIST)
            return -1;
        *s = '/';
    }
    if (mkdir(buf, 0755) < 0 && errno != EEXIST)
        return -1;
    return chown(buf, wl_uid, wl_gid);
}

/* execvp's search, done before seccomp is loaded (so it needs no extra calls after) */
static const char *find_command(const char *cmd, const char *pathvar, char *buf, size_t size, int *err)
{
    if (strchr(cmd, '/'))
        return cmd;
    const char *p = pathvar && *pathvar ? pathvar : "/usr/bin:/bin";
    int first = 0;
    while (1) {
        const char *e = strchr(p, ':');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        if (n == 0)
            snprintf(buf, size, "./%s", cmd);
        else
            snprintf(buf, size, "%.*s/%s", (int)n, p, cmd);
        struct stat st;
        if (stat(buf, &st) == 0 && S_ISREG(st.st_mode)) {
            if (access(buf, X_OK) == 0)
                return buf;
            if (!first)
                first = EACCES;
        }
        if (!e)
            break;
        p = e + 1;
    }
    *err = first ? first : ENOENT;
    return NULL;
}

/* the signals PID 1 handles (or ignores); every other one is at its default from main() on */
static const int handled[] = {SIGCHLD, SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGPIPE};
#define NHANDLED (sizeof(handled) / sizeof(handled[0]))

static void exec_workload(char **argv, char **envp, const char *workdir, const char *pathvar,
                          const int stdio[3], int errfd)
{
    sigset_t none;
    sigemptyset(&none);
    for (size_t i = 0; i < NHANDLED; i++)
        signal(handled[i], SIG_DFL);
    sigprocmask(SIG_SETMASK, &none, NULL);
    if (setsid() < 0)
        child_fail(errfd, "setup", errno);
    for (int i = 0; i < 3; i++)
        if (dup2(stdio[i], i) < 0)
            child_fail(errfd, "setup", errno);
    /* the error pipe above everything else, so closing "all but it" is two ranges */
    int high = fcntl(errfd, F_DUPFD_CLOEXEC, 1 << 16);
    if (high < 0)
        high = errfd;
    else
        errfd = high;
    if (chdir(workdir) < 0) {
        if (errno != ENOENT || mkdirs(workdir) < 0 || chdir(workdir) < 0)
            child_fail(errfd, "workdir", errno);
    }
    if (syscall(SYS_close_range, 3, (unsigned)errfd - 1, 0) < 0 ||
        syscall(SYS_close_range, (unsigned)errfd + 1, ~0U, 0) < 0)
        child_fail(errfd, "fds", errno);
    char num[32];
    snprintf(num, sizeof(num), "%ld", wl_oom_adj);
    if (write_file("/proc/self/oom_score_adj", num) < 0)
        child_fail(errfd, "oom_score_adj", errno);
    /* the bounding set is PID 1's, emptied once after CONFIG (drop_bounding_set) */
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    if (setgroups(0, NULL) < 0 || setresgid(wl_gid, wl_gid, wl_gid) < 0 || setresuid(wl_uid, wl_uid, wl_uid) < 0)
        child_fail(errfd, "privileges", errno);
    if (wl_uid == 0) {
        struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
        struct __user_cap_data_struct data[2];
        memset(data, 0, sizeof(data));
        if (syscall(SYS_capset, &hdr, data) < 0)
            child_fail(errfd, "privileges", errno);
    }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        child_fail(errfd, "privileges", errno);
    char buf[4096];
    int err = 0;
    const char *path = find_command(argv[0], pathvar, buf, sizeof(buf), &err);
    if (!path)
        child_fail(errfd, "exec", err);
    if (sc_filter && !sc_loaded) {
        /* the last step before execve: the filter must not have to allow our own
         * set-up calls, only execve itself (docs/launcher.md); a filter that allows
         * them is PID 1's already (SECCOMP_SHARED, load_shared_filter) */
        struct sock_fprog prog = {sc_len, sc_filter};
        if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) < 0)
            child_fail(errfd, "seccomp", errno);
    }
    execve(path, argv, envp);
    child_fail(errfd, "exec", errno);
}

static void send_step_exit(uint64_t step, pid_t pid, int has_status, int status, const struct rusage *ru,
                           int exec_errno, const char *stage)
{
    out_begin(DSEC_MSG_STEP_EXIT);
    out_u64(DSEC_T_STEP, step);
    out_u64(DSEC_T_PID, (uint64_t)pid);
    if (has_status)
        out_u64(DSEC_T_STATUS, (uint64_t)(int64_t)status);
    if (exec_errno) {
        out_u64(DSEC_T_EXEC_ERRNO, (uint64_t)exec_errno);
        out_str(DSEC_T_STAGE, stage);
        out_str(DSEC_T_MSG, strerror(exec_errno));
    }
    if (ru) {
        uint64_t us = (uint64_t)ru->ru_utime.tv_sec * 1000000 + (uint64_t)ru->ru_utime.tv_usec +
                      (uint64_t)ru->ru_stime.tv_sec * 1000000 + (uint64_t)ru->ru_stime.tv_usec;
        out_u64(DSEC_T_CPU_US, us);
        out_u64(DSEC_T_MAXRSS_KB, (uint64_t)ru->ru_maxrss);
    }
    out_send();
}

/* The step's process is cloned with CLONE_VM | CLONE_VFORK, as posix_spawn does: no copy of our
 * page tables, no copy-on-write faults, and its exec drops a reference to our memory instead of
 * tearing a copy down. We are suspended until it has exec'd or failed, which start_step waits for
 * anyway. The child runs on its own stack (below), allocates nothing and changes only what is its
 * own: its fd table, cwd, signal handlers and credentials are copies (no CLONE_FILES, CLONE_FS,
 * CLONE_SIGHAND), and its oom_score_adj is its own (the kernel exempts a vfork child from setting
 * it for every user of the shared memory). */
static char child_stack[128 << 10] __attribute__((aligned(64)));

struct child_args {
    char **argv, **envp;
    const char *workdir, *pathvar;
    const int *stdio;
    int errfd, errfd_other;
};

static int child_main(void *arg)
{
    const struct child_args *a = arg;
    close(a->errfd_other);
    exec_workload(a->argv, a->envp, a->workdir, a->pathvar, a->stdio, a->errfd);
    return 127;                     /* not reached: exec_workload execs or _exits */
}

static void start_step(size_t n, int *fds, int nfds)
{
    const unsigned char *p = inbuf + 4, *end = inbuf + n;
    struct item it;
    uint64_t step = 0;
    int nargs = 0, nenv = 0;
    const char *workdir = "/", *pathvar = NULL;
    while (next_item(&p, end, &it) > 0) {
        if (it.tag == DSEC_T_ARG)
            nargs++;
        else if (it.tag == DSEC_T_ENV)
            nenv++;
    }
    char **argv = calloc((size_t)nargs + 1, sizeof(char *));
    char **envp = calloc((size_t)nenv + 1, sizeof(char *));
    if (!argv || !envp)
        fatal("out of memory");
    int ia = 0, ie = 0;
    p = inbuf + 4;
    while (next_item(&p, end, &it) > 0) {
        switch (it.tag) {
        case DSEC_T_STEP: step = item_u64(&it); break;
        case DSEC_T_ARG: argv[ia++] = item_str(&it); break;
        case DSEC_T_ENV: envp[ie++] = item_str(&it); break;
        case DSEC_T_WORKDIR: workdir = item_str(&it); break;
        case DSEC_T_PATHVAR: pathvar = item_str(&it); break;
        default: break;
        }
    }
    int stdio[3];
    for (int i = 0; i < 3; i++)
        stdio[i] = i < nfds ? fds[i] : nullfd;
    int ep[2];
    pid_t pid = -1;
    int err = 0;
    char stage[16] = "setup";
    if (!nargs) {
        err = EINVAL;
    } else if (nsteps >= MAX_STEPS) {
        err = EAGAIN;
    } else if (pipe2(ep, O_CLOEXEC) < 0) {
        err = errno;
    } else {
        struct child_args ca = {argv, envp, workdir, pathvar, stdio, ep[1], ep[0]};
        pid = clone(child_main, child_stack + sizeof(child_stack), CLONE_VM | CLONE_VFORK | SIGCHLD, &ca);
        if (pid < 0)
            err = errno;
        close(ep[1]);
        if (pid > 0) {
            struct exec_err e;
            ssize_t r;
            do {
                r = read(ep[0], &e, sizeof(e));
            } while (r < 0 && errno == EINTR);
            if (r == (ssize_t)sizeof(e)) {
                err = e.err;
                memcpy(stage, e.stage, sizeof(stage));
                stage[sizeof(stage) - 1] = 0;
                struct rusage ru;
                while (wait4(pid, NULL, 0, &ru) < 0 && errno == EINTR)
                    ;
            }
        }
        close(ep[0]);
    }
    for (int i = 0; i < nfds; i++)
        close(fds[i]);
    for (int i = 0; i < ia; i++)
        free(argv[i]);
    for (int i = 0; i < ie; i++)
        free(envp[i]);
    free(argv);
    free(envp);
    if (err) {
        send_step_exit(step, pid > 0 ? pid : 0, 0, 0, NULL, err, stage);
        return;
    }
    steps[nsteps].pid = pid;
    steps[nsteps].step = step;
    nsteps++;
}

/* reap every child that has exited; 1 while children remain, 0 when none */
static int reap(int block)
{
    while (1) {
        int status;
        struct rusage ru;
        pid_t pid = wait4(-1, &status, block ? 0 : WNOHANG, &ru);
        if (pid < 0) {
            if (errno == EINTR)
                continue;
            return 0;           /* ECHILD */
        }
        if (pid == 0)
            return 1;
        uint64_t us = (uint64_t)ru.ru_utime.tv_sec * 1000000 + (uint64_t)ru.ru_utime.tv_usec +
                      (uint64_t)ru.ru_stime.tv_sec * 1000000 + (uint64_t)ru.ru_stime.tv_usec;
        total_cpu_us += us;
        if ((uint64_t)ru.ru_maxrss > max_rss_kb)
            max_rss_kb = (uint64_t)ru.ru_maxrss;
        for (int i = 0; i < nsteps; i++) {
            if (steps[i].pid != pid)
                continue;
            send_step_exit(steps[i].step, pid, 1, status, &ru, 0, NULL);
            steps[i] = steps[--nsteps];
            break;
        }
    }
}

static void signal_steps(int sig, uint64_t step, int group)
{
    for (int i = 0; i < nsteps; i++)
        if (step == 0 || steps[i].step == step)
            (void)(group ? killpg(steps[i].pid, sig) : kill(steps[i].pid, sig));
}

static void on_signal(int sig) { (void)sig; }

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Empty the capability bounding set of PID 1, once, after the set-up that needs it: every step
 * is cloned from PID 1 and inherits it (a bounding set only limits what an execve can gain: PID
 * 1 keeps its effective capabilities for the steps' set-up, setresuid and signals). Checked:
 * a step never starts with a capability in its bounding set. */
/* JOIN, the launcher's first message: move this process into the v1 cgroups whose
 * `tasks` files came with it (a hybrid host; the cgroup2 directory we were born in,
 * clone3(CLONE_INTO_CGROUP)). "0" moves the calling thread alone -- we have one --
 * and a single thread's move skips the kernel's global cgroup_threadgroup_rwsem,
 * whose writer (a cgroup.procs write) waits for an RCU grace period. Done before
 * HELLO: the sensors register the sandbox after it, so none of this is in its
 * record. */
static void join_cgroups(void)
{
    int fds[MAX_FDS], nfds;
    ssize_t n = recv_msg(fds, &nfds);
    if (n <= 0)
        _exit(125);                  /* the launcher went away */
    uint32_t type = 0;
    memcpy(&type, inbuf, n >= 4 ? 4 : 0);
    if (n < 4 || type != DSEC_MSG_JOIN)
        fatal("expected JOIN, got message type %u", type);
    const unsigned char *p = inbuf + 4, *end = inbuf + n;
    struct item it;
    int k = 0;
    while (next_item(&p, end, &it) > 0) {
        if (it.tag != DSEC_T_PATH)
            continue;
        if (k >= nfds)
            fatal("JOIN names more cgroups than it passed files");
        char name[64];
        size_t len = it.len < sizeof(name) - 1 ? it.len : sizeof(name) - 1;
        memcpy(name, it.data, len);
        name[len] = 0;
        ssize_t w;
        do {
            w = write(fds[k], "0", 1);
        } while (w < 0 && errno == EINTR);
        if (w != 1)
            fatal("cannot join its %s cgroup: %s", name, w < 0 ? strerror(errno) : "short write");
        close(fds[k++]);
    }
    if (k != nfds)
        fatal("JOIN passed %d cgroup files for %d names", nfds, k);
}

static void drop_bounding_set(void)
{
    for (int c = 0; c <= last_cap; c++)
        if (prctl(PR_CAPBSET_DROP, c, 0, 0, 0) < 0 && errno != EINVAL)
            fatal("capability bounding set: %s", strerror(errno));
    for (int c = 0; c <= last_cap; c++)
        if (prctl(PR_CAPBSET_READ, c, 0, 0, 0) == 1)
            fatal("capability bounding set: capability %d is still in it", c);
}

/* SECCOMP_SHARED: the launcher found that the sandbox's filter allows every call PID 1 and a
 * step's child make from here on (agent/sandbox/plan.py INIT_SYSCALLS): loaded into PID 1 once,
 * each step's child inherits it at its clone instead of loading it before its execve (a load is
 * ~0.1-0.2 ms: the kernel checks the program and precomputes its per-syscall cache). PID 1 has
 * CAP_SYS_ADMIN: no no_new_privs needed here (each step sets its own). */
static void load_shared_filter(void)
{
    if (!sc_filter || !sc_shared)
        return;
    struct sock_fprog prog = {sc_len, sc_filter};
    if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) < 0)
        fatal("seccomp (shared by the steps): %s", strerror(errno));
    sc_loaded = 1;
}

int main(void)
{
    prctl(PR_SET_NAME, "dsec-init", 0, 0, 0);
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    /* nothing but the control socket stays open; 0-2 are /dev/null */
    syscall(SYS_close_range, 4, ~0U, 0);
    int dn = open("/dev/null", O_RDWR);
    if (dn >= 0) {
        for (int i = 0; i < 3; i++)
            if (dn != i)
                dup2(dn, i);
        if (dn > 2)
            close(dn);
    }
    fcntl(CTL, F_SETFD, FD_CLOEXEC);
    int big = 4 << 20;
    setsockopt(CTL, SOL_SOCKET, SO_SNDBUFFORCE, &big, sizeof(big));
    setsockopt(CTL, SOL_SOCKET, SO_RCVBUFFORCE, &big, sizeof(big));
    join_cgroups();

    /* Every signal at its default action, once (what a step starts with: it then resets only
     * the ones below). Through the system call: libc's sigaction refuses the two signals it
     * reserves (32, 33), which posix_spawn leaves as the launcher had them (ignored, in an
     * agent), and a step inherited them ignored. A pid namespace's init gets only the signals
     * it has handlers for: a real (empty) handler for each, and all of them blocked and read
     * from a signalfd in the loop below; SIGPIPE ignored. */
    for (int s = 1; s <= 64; s++) {
        struct { void (*handler)(int); unsigned long flags; void (*restorer)(void); uint64_t mask; } dfl;
        memset(&dfl, 0, sizeof(dfl));
        dfl.handler = SIG_DFL;
        if (s != SIGKILL && s != SIGSTOP)
            syscall(SYS_rt_sigaction, s, &dfl, NULL, sizeof(dfl.mask));
    }
    sigset_t set;
    sigemptyset(&set);
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_signal;
    for (size_t i = 0; i < NHANDLED; i++) {
        if (handled[i] == SIGPIPE)
            continue;
        sigaction(handled[i], &sa, NULL);
        sigaddset(&set, handled[i]);
    }
    signal(SIGPIPE, SIG_IGN);
    sigprocmask(SIG_BLOCK, &set, NULL);
    int sfd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sfd < 0)
        fatal("signalfd: %s", strerror(errno));

    /* The launcher registers the sandbox with the sensors (and, on the fallback
     * path, moves us into its cgroups) only once this arrives, and configures us
     * after that: our own exec and the set-up above are never in the sandbox's
     * record, and the eBPF exemption it gives this pid is not undone by an exec
     * of ours that comes late (a loaded node). */
    out_begin(DSEC_MSG_HELLO);
    out_send();

    int fds[MAX_FDS], nfds;
    ssize_t n = recv_msg(fds, &nfds);
    if (n <= 0)
        _exit(125);                  /* the launcher went away before configuring us */
    uint32_t type = 0;
    memcpy(&type, inbuf, n >= 4 ? 4 : 0);
    if (n < 4 || type != DSEC_MSG_CONFIG)
        fatal("expected CONFIG, got message type %u", type);
    for (int i = 0; i < nfds; i++)
        close(fds[i]);
    configure((size_t)n);
    drop_bounding_set();
    load_shared_filter();           /* the last of the set-up: nothing of it runs under the filter */
    out_begin(DSEC_MSG_READY);
    for (int i = 0; i < created.n; i++)
        out_str(DSEC_T_CREATED, created.paths[i]);
    out_send();

    int closing = 0, owner_gone = 0;
    struct pollfd pf[2] = {{CTL, POLLIN, 0}, {sfd, POLLIN, 0}};
    while (!closing) {
        if (poll(pf, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            owner_gone = 1;
            break;
        }
        if (pf[1].revents & POLLIN) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
                if (si.ssi_signo == SIGCHLD)
                    reap(0);
                else
                    signal_steps((int)si.ssi_signo, 0, 0);   /* signals to PID 1 go to every step */
            }
        }
        if (!(pf[0].revents & (POLLIN | POLLHUP | POLLERR)))
            continue;
        n = recv_msg(fds, &nfds);
        if (n <= 0) {
            owner_gone = 1;         /* the launcher died: fail closed */
            break;
        }
        if (n < 4)
            continue;
        memcpy(&type, inbuf, 4);
        const unsigned char *p = inbuf + 4, *end = inbuf + n;
        struct item it;
        uint64_t sig = 0, step = 0, group = 0;
        switch (type) {
        case DSEC_MSG_EXEC:
            start_step((size_t)n, fds, nfds);
            nfds = 0;
            break;
        case DSEC_MSG_SIGNAL:
            while (next_item(&p, end, &it) > 0) {
                if (it.tag == DSEC_T_SIG)
                    sig = item_u64(&it);
                else if (it.tag == DSEC_T_STEP)
                    step = item_u64(&it);
                else if (it.tag == DSEC_T_GROUP)
                    group = item_u64(&it);
            }
            if (sig > 0 && sig < 65)
                signal_steps((int)sig, step, group != 0);
            break;
        case DSEC_MSG_TERMINATE:
            kill(-1, SIGTERM);
            break;
        case DSEC_MSG_CLOSE:
            closing = 1;
            break;
        default:
            break;                  /* GO, RELEASE early: nothing to do */
        }
        for (int i = 0; i < nfds; i++)
            close(fds[i]);
    }

    /* closing (or the launcher is gone): nothing may outlive the sandbox */
    kill(-1, SIGKILL);
    while (reap(1))
        ;
    for (int i = 0; i < nsteps; i++)
        send_step_exit(steps[i].step, steps[i].pid, 1, SIGKILL, NULL, 0, NULL);
    nsteps = 0;
    out_begin(DSEC_MSG_CLOSED);
    out_u64(DSEC_T_CPU_US, total_cpu_us);
    out_u64(DSEC_T_MAXRSS_KB, max_rss_kb);
    out_u64(DSEC_T_OWNER_GONE, (uint64_t)owner_gone);
    out_send();
    if (hold_after_exit && !owner_gone) {
        /* Keep the namespaces (every process but us is gone) until the launcher
         * has read the record through them (exec enrichment opens binaries inside
         * /proc/1/root). Bounded. */
        int64_t end = now_ms() + HOLD_MAX_MS;
        while (1) {
            int64_t left = end - now_ms();
            if (left <= 0)
                break;
            struct pollfd one = {CTL, POLLIN, 0};
            int r = poll(&one, 1, (int)left);
            if (r < 0 && errno == EINTR)
                continue;
            if (r <= 0)
                break;
            n = recv_msg(fds, &nfds);
            for (int i = 0; i < nfds; i++)
                close(fds[i]);
            if (n <= 0)
                break;
            memcpy(&type, inbuf, 4);
            if (type == DSEC_MSG_RELEASE)
                break;
        }
    }
    return 0;
}
