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
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_DEPTH 128

static int rm_at(int dfd, const char *name, dev_t dev, int depth)
{
    if (unlinkat(dfd, name, 0) == 0 || errno == ENOENT)
        return 0;
    if (errno != EISDIR && errno != EPERM)
        return -errno;
    if (depth >= MAX_DEPTH)
        return -ELOOP;
    int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? 0 : -errno;
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
    DIR *d = fdopendir(fd);
    if (d == NULL) {
        int e = errno;
        close(fd);
        return -e;
    }
    int rc = 0;
    for (int pass = 0; pass < 3; pass++) {     /* again when an entry came back meanwhile */
        struct dirent *e;
        errno = 0;
        while ((e = readdir(d)) != NULL) {
            if (e->d_name[0] == '.' && (e->d_name[1] == 0 || (e->d_name[1] == '.' && e->d_name[2] == 0)))
                continue;
            int r = rm_at(dirfd(d), e->d_name, dev, depth + 1);
            if (r != 0 && rc == 0)
                rc = r;
            errno = 0;
        }
        if (errno != 0 && rc == 0)
            rc = -errno;
        if (rc != 0)
            break;
        if (unlinkat(dfd, name, AT_REMOVEDIR) == 0 || errno == ENOENT) {
            closedir(d);
            return 0;
        }
        if (errno != ENOTEMPTY) {
            rc = -errno;
            break;
        }
        rewinddir(d);
    }
    closedir(d);
    return rc != 0 ? rc : -ENOTEMPTY;
}

int dsec_rmtree(const char *path)
{
    struct stat st;
    if (lstat(path, &st) != 0)
        return errno == ENOENT ? 0 : -errno;
    if (!S_ISDIR(st.st_mode))
        return unlink(path) == 0 || errno == ENOENT ? 0 : -errno;
    return rm_at(AT_FDCWD, path, st.st_dev, 0);
}
