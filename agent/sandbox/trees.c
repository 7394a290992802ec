/* libdsec_trees: remove a directory tree in one call (agent/sandbox/trees.py loads it
 * through ctypes, which releases the GIL once for the whole removal).
 *
 *     rc = dsec_rmtree(path)     0, or -errno of the first failure (what could be removed is)
 *
 * Why: the node agent's trash thread removes every closed sandbox's state
 * directory (~21 entries). shutil.rmtree makes ~5 system calls an entry and
 * gives up the interpreter lock around each one; with the agent's other threads
 * waiting for it, each is a hand-off between threads: the trash thread was the
 * agent's busiest in context switches (~90 a sandbox) and ~2 ms of its CPU per
 * sandbox at 57 sandboxes/s (docs/launch-figures.md).
 *
 * The walk is by file descriptor (openat/unlinkat: no path length limit), never
 * follows a symlink (O_NOFOLLOW; a symlink is unlinked), and stays on the file
 * system of `path`: a directory on another device is not entered (-EXDEV; the
 * caller then removes with `rm -rf --one-file-system`). It goes at most MAX_DEPTH
 * levels deep (one descriptor a level) and returns -ELOOP below that, after
 * removing what is above it: the caller finishes with rm, which has no depth limit.
 * Entries that vanish meanwhile (another remover) are fine. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_DEPTH 128
#define DENTS_BYTES 32768                      /* as glibc's readdir buffer */
#define T_DIR 4                                /* dirent.h's DT_DIR */

struct dent64 {                                /* getdents64(2)'s record */
    unsigned long long d_ino;
    long long d_off;
    unsigned short d_reclen;
    unsigned char d_type;
    char d_name[];
};

static int rm_dir(int dfd, const char *name, dev_t dev, int depth);

/* One entry of a directory: a file is unlinked; a directory (by its d_type, else by the
 * unlink's EISDIR) is emptied and removed. */
static int rm_entry(int dfd, const char *name, unsigned char type, dev_t dev, int depth)
{
    if (type != T_DIR) {
        if (unlinkat(dfd, name, 0) == 0 || errno == ENOENT)
            return 0;
        if (errno != EISDIR && errno != EPERM)
            return -errno;
    }
    return rm_dir(dfd, name, dev, depth);
}

/* The directory `name` of dfd, emptied and removed. Its entries are read with getdents64
 * on its own descriptor (no fdopendir: its fstat and fcntl a directory) and their d_type
 * says which are directories (no failed unlink first), ~4 system calls less a directory. */
static int rm_dir(int dfd, const char *name, dev_t dev, int depth)
{
    if (depth >= MAX_DEPTH)
        return -ELOOP;
    int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT)
            return 0;
        if (errno == ENOTDIR || errno == ELOOP)  /* replaced by a file or a symlink meanwhile */
            return unlinkat(dfd, name, 0) == 0 || errno == ENOENT ? 0 : -errno;
        return -errno;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return -e;
    }
    if (st.st_dev != dev) {
        close(fd);
        return -EXDEV;
    }
    char *buf = malloc(DENTS_BYTES);
    if (buf == NULL) {
        close(fd);
        return -ENOMEM;
    }
    int rc = 0;
    for (int pass = 0; pass < 3; pass++) {     /* again when an entry came back meanwhile */
        if (pass > 0 && lseek(fd, 0, SEEK_SET) < 0) {
            rc = -errno;
            break;
        }
        for (;;) {
            long n = syscall(SYS_getdents64, fd, buf, DENTS_BYTES);
            if (n < 0) {
                if (rc == 0)
                    rc = -errno;
                break;
            }
            if (n == 0)
                break;
            for (long off = 0; off < n;) {
                struct dent64 *e = (struct dent64 *)(buf + off);
                off += e->d_reclen;
                if (e->d_name[0] == '.' && (e->d_name[1] == 0 || (e->d_name[1] == '.' && e->d_name[2] == 0)))
                    continue;
                int r = rm_entry(fd, e->d_name, e->d_type, dev, depth + 1);
                if (r != 0 && rc == 0)
                    rc = r;
            }
        }
        if (rc != 0)
            break;
        if (unlinkat(dfd, name, AT_REMOVEDIR) == 0 || errno == ENOENT) {
            free(buf);
            close(fd);
            return 0;
        }
        if (errno != ENOTEMPTY) {
            rc = -errno;
            break;
        }
    }
    free(buf);
    close(fd);
    return rc != 0 ? rc : -ENOTEMPTY;
}

int dsec_rmtree(const char *path)
{
    struct stat st;
    if (lstat(path, &st) != 0)
        return errno == ENOENT ? 0 : -errno;
    if (!S_ISDIR(st.st_mode))
        return unlink(path) == 0 || errno == ENOENT ? 0 : -errno;
    return rm_dir(AT_FDCWD, path, st.st_dev, 0);
}
