/* dsec BPF: file events — opens for writing, unlink, rename. (Part of the one
 * source text the loader builds; see common.h.)
 *
 * open/openat/openat2/creat are reported when the flags hold any of O_WRONLY,
 * O_RDWR, O_CREAT, O_TRUNC, O_APPEND (an openat2 whose open_how cannot be
 * read is reported too). unlink/unlinkat/rmdir and rename/renameat/renameat2
 * always. Paths are read as given (relative paths are resolved by the agent
 * against the process's cwd / dirfd) at sys_enter; the record is emitted at
 * sys_exit with the result.
 *
 * The path is read from user memory before the kernel reads it: another
 * thread of the process can change it in between (a TOCTOU window no
 * tracepoint-based auditor closes; an LSM hook would).
 */
#include "common.h"

static __always_inline int dsec_file_enter(u32 kind, u32 sys, int dirfd, const char *path,
                                           int dirfd2, const char *path2,
                                           u64 flags, u64 mode, u64 resolve)
{
    int restart = 0;
    struct dsec_event_small *e = dsec_pending_begin(kind, sys, (u64)path, (u64)path2, &restart);
    if (!e)
        return 0;
    if (restart) {
        dsec_file_paths(e);     /* what the restart reads (common.h dsec_pending_begin) */
        if (restart == 2)
            dsec_pending_store(e);
        return 0;
    }
    e->u.file.sys = sys;
    e->u.file.dirfd = dirfd;
    e->u.file.dirfd2 = dirfd2;
    e->u.file.flags = flags;
    e->u.file.mode = mode;
    e->u.file.resolve = resolve;
    e->u.file.upath = (u64)path;
    e->u.file.upath2 = (u64)path2;
    dsec_file_paths(e);
    dsec_pending_store(e);
    return 0;
}

static __always_inline int dsec_open_enter(u32 sys, int dirfd, const char *path, u64 flags, u64 mode)
{
    if (!(flags & DSEC_WRITE_FLAGS))
        return 0;
    return dsec_file_enter(DSEC_KIND_OPEN_WRITE, sys, dirfd, path, DSEC_AT_FDCWD, 0, flags, mode, 0);
}

TRACEPOINT_PROBE(syscalls, sys_enter_open)
{
    return dsec_open_enter(DSEC_SYS_OPEN, DSEC_AT_FDCWD, args->filename, (u32)args->flags,
                           args->mode);
}

TRACEPOINT_PROBE(syscalls, sys_enter_openat)
{
    return dsec_open_enter(DSEC_SYS_OPENAT, (int)args->dfd, args->filename, (u32)args->flags,
                           args->mode);
}

TRACEPOINT_PROBE(syscalls, sys_enter_openat2)
{
    struct {
        u64 flags;
        u64 mode;
        u64 resolve;
    } how = {};
    if (bpf_probe_read_user(&how, sizeof(how), args->how) < 0) {
        /* cannot tell whether it writes: report it (flags unknown = 0) */
        return dsec_file_enter(DSEC_KIND_OPEN_WRITE, DSEC_SYS_OPENAT2, (int)args->dfd,
                               args->filename, DSEC_AT_FDCWD, 0, 0, 0, 0);
    }
    if (!(how.flags & DSEC_WRITE_FLAGS))
        return 0;
    return dsec_file_enter(DSEC_KIND_OPEN_WRITE, DSEC_SYS_OPENAT2, (int)args->dfd, args->filename,
                           DSEC_AT_FDCWD, 0, how.flags, how.mode, how.resolve);
}

TRACEPOINT_PROBE(syscalls, sys_enter_creat)
{
    /* creat(p, m) == open(p, O_CREAT | O_WRONLY | O_TRUNC, m) */
    return dsec_open_enter(DSEC_SYS_CREAT, DSEC_AT_FDCWD, args->pathname, 0100 | 01 | 01000,
                           args->mode);
}

/* One program for the exit of every file syscall here and of connect (net.c):
 * their sys_exit tracepoints have one layout (__syscall_nr, ret) and the
 * record waiting in `pending` says what the syscall was. */
TRACEPOINT_PROBE(syscalls, sys_exit_open) { return dsec_pending_finish(args->ret); }
DSEC_ATTACH_ALSO(syscalls, sys_exit_open, sys_exit_openat)
DSEC_ATTACH_ALSO(syscalls, sys_exit_open, sys_exit_openat2)
DSEC_ATTACH_ALSO(syscalls, sys_exit_open, sys_exit_creat)

TRACEPOINT_PROBE(syscalls, sys_enter_unlink)
{
    return dsec_file_enter(DSEC_KIND_UNLINK, DSEC_SYS_UNLINK, DSEC_AT_FDCWD, args->pathname,
                           DSEC_AT_FDCWD, 0, 0, 0, 0);
}

TRACEPOINT_PROBE(syscalls, sys_enter_unlinkat)
{
    return dsec_file_enter(DSEC_KIND_UNLINK, DSEC_SYS_UNLINKAT, (int)args->dfd, args->pathname,
                           DSEC_AT_FDCWD, 0, (u32)args->flag, 0, 0);
}

TRACEPOINT_PROBE(syscalls, sys_enter_rmdir)
{
    return dsec_file_enter(DSEC_KIND_UNLINK, DSEC_SYS_RMDIR, DSEC_AT_FDCWD, args->pathname,
                           DSEC_AT_FDCWD, 0, 0x200 /* AT_REMOVEDIR */, 0, 0);
}

DSEC_ATTACH_ALSO(syscalls, sys_exit_open, sys_exit_unlink)
DSEC_ATTACH_ALSO(syscalls, sys_exit_open, sys_exit_unlinkat)
DSEC_ATTACH_ALSO(syscalls, sys_exit_open, sys_exit_rmdir)

TRACEPOINT_PROBE(syscalls, sys_enter_rename)
{
    return dsec_file_enter(DSEC_KIND_RENAME, DSEC_SYS_RENAME, DSEC_AT_FDCWD, args->oldname,
                           DSEC_AT_FDCWD, args->newname, 0, 0, 0);
}

TRACEPOINT_PROBE(syscalls, sys_enter_renameat)
{
    return dsec_file_enter(DSEC_KIND_RENAME, DSEC_SYS_RENAMEAT, (int)args->olddfd, args->oldname,
                           (int)args->newdfd, args->newname, 0, 0, 0);
}

TRACEPOINT_PROBE(syscalls, sys_enter_renameat2)
{
    return dsec_file_enter(DSEC_KIND_RENAME, DSEC_SYS_RENAMEAT2, (int)args->olddfd, args->oldname,
                           (int)args->newdfd, args->newname, (u32)args->flags, 0, 0);
}

DSEC_ATTACH_ALSO(syscalls, sys_exit_open, sys_exit_rename)
DSEC_ATTACH_ALSO(syscalls, sys_exit_open, sys_exit_renameat)
DSEC_ATTACH_ALSO(syscalls, sys_exit_open, sys_exit_renameat2)
