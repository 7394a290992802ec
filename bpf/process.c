/* dsec BPF: process events — fork, exec, exit. (Part of the one source text
 * the loader builds; see common.h.)
 *
 * fork:  task/task_newtask (clone flags known; threads are not reported),
 *        parent recorded in `parents` for every later event's ppid.
 * exec:  path and argv captured at sys_enter_execve/execveat, the record waits
 *        in pending_exec_small (pending_exec when it is big) and is emitted
 *        at sched_process_exec (success, with the new comm) or at
 *        sys_exit_execve/execveat (failure, with -errno).
 *        An exec seen only at sched_process_exec (args not captured, e.g. a
 *        32-bit syscall) is still emitted, with the kernel's filename and
 *        DSEC_ST_NO_ARGV.
 * exit:  sched_process_exit of the last thread (group_dead). The status comes
 *        from sys_enter_exit_group / sys_enter_exit (code) or from
 *        signal_deliver of a fatal signal with the default action; a
 *        group-wide fatal signal is delivered as SIGKILL, so the signal last
 *        generated for the process (signal_generate) names the real one.
 */
#include "common.h"

/* default action terminates (or dumps core) */
static __always_inline int dsec_sig_fatal_default(int sig)
{
    if (sig <= 0 || sig > 64)
        return 0;
    switch (sig) {
    case 17: /* SIGCHLD */
    case 18: /* SIGCONT */
    case 19: /* SIGSTOP */
    case 20: /* SIGTSTP */
    case 21: /* SIGTTIN */
    case 22: /* SIGTTOU */
    case 23: /* SIGURG */
    case 28: /* SIGWINCH */
        return 0;
    }
    return 1;
}

/* ---- fork ------------------------------------------------------------------ */

TRACEPOINT_PROBE(task, task_newtask)
{
    u64 flags = args->clone_flags;
    if (flags & DSEC_CLONE_THREAD)
        return 0;
    u64 cgid = 0;
    u32 child = args->pid;
    struct dsec_sandbox *cfg = dsec_track_fork(child, flags, &cgid);
    if (!cfg)
        return 0;
    /* a reused pid's stale entries go; a lookup first: a delete takes the
     * bucket lock even when nothing is there (bench/kcost.py) */
    if (sig_generated.lookup(&child))
        sig_generated.delete(&child);
    if (exit_info.lookup(&child))
        exit_info.delete(&child);

    struct dsec_state *st = sbx_state.lookup(&cgid);
    if (!st || !dsec_admit(cfg, st, DSEC_KIND_FORK))
        return 0;
    struct dsec_event *e = dsec_reserve(cfg, st, DSEC_KIND_FORK, cgid);
    if (!e)
        return 0;
    e->u.fork.child_pid = child;
    e->u.fork.clone_flags = flags;
    dsec_submit(e, st, DSEC_KIND_FORK);
    return 0;
}

/* ---- exec ------------------------------------------------------------------ */

/* argv into e->buf from offset `off`: at most DSEC_MAX_ARGS strings and
 * DSEC_ARGV_BYTES bytes (NULs included); the prefix that fits is kept.
 * Every unusual case leaves the loop (one path per iteration keeps the
 * verifier's work linear); the reason is sorted out after it. */
#define DSEC_ARGV_END 0     /* NULL pointer reached: argv complete */
#define DSEC_ARGV_COUNT 1   /* DSEC_MAX_ARGS read */
#define DSEC_ARGV_FULL 2    /* the byte budget is used up */
#define DSEC_ARGV_FAULTED 3 /* unreadable pointer or string */
static __always_inline void dsec_read_argv(struct dsec_event *e, const char *const *argv, u64 off)
{
    u64 start = off;
    u32 argc = 0;
    u32 why = DSEC_ARGV_COUNT;
    const char *last = 0;
    u64 last_room = 0;
    if (!argv)
        why = DSEC_ARGV_END;
    for (int i = 0; i < DSEC_MAX_ARGS && argv; i++) {
        const char *p = 0;
        if (bpf_probe_read_user(&p, sizeof(p), &argv[i]) < 0) {
            why = DSEC_ARGV_FAULTED;
            break;
        }
        if (!p) {
            why = DSEC_ARGV_END;
            break;
        }
        u64 used = off - start;
        if (used >= DSEC_ARGV_BYTES) {
            why = DSEC_ARGV_FULL;
            break;
        }
        u64 room = DSEC_ARGV_BYTES - used;
        DSEC_BARRIER(room);
        if (room > DSEC_ARGV_BYTES)
            room = DSEC_ARGV_BYTES;
        u64 o = off;
        DSEC_BARRIER(o);
        o &= DSEC_EXEC_OFF_MASK;
        long n = bpf_probe_read_user_str(&e->buf[o], room, p);
        if (n <= 0) {
            why = DSEC_ARGV_FAULTED;
            break;
        }
        off += n;
        argc++;
        if ((u64)n == room) {
            why = DSEC_ARGV_FULL;
            last = p;
            last_room = room;
            break;
        }
    }
    u32 status = 0;
    if (why == DSEC_ARGV_FAULTED) {
        status |= DSEC_ST_ARGV_FAULT;
    } else if (why != DSEC_ARGV_END) {
        /* budget or count used up: truncated if anything is left */
        char c = 0;
        if (last && last_room)
            bpf_probe_read_user(&c, 1, last + last_room - 1);
        const char *next = 0;
        u32 idx = argc;
        DSEC_BARRIER(idx);
        idx &= 0xffff;
        bpf_probe_read_user(&next, sizeof(next), &argv[idx]);
        if (c || next)
            status |= DSEC_ST_ARGV_TRUNC;
    }
    e->u.exec.argv_off = start;
    e->u.exec.argv_len = off - start;
    e->u.exec.argc = argc;
    e->u.exec.status |= status;
    e->h.size = DSEC_FIXED_BYTES + off;
}

/* this CPU's exec record, zeroed, with its header filled (0: no slot) */
static __always_inline struct dsec_event *dsec_exec_scratch(struct dsec_sandbox *cfg, u64 cgid)
{
    u32 cpu = bpf_get_smp_processor_id();
    struct dsec_event *e = exec_scratch.lookup(&cpu);
    if (e) {
        __builtin_memset(&e->u, 0, sizeof(e->u));
        dsec_fill_hdr(&e->h, DSEC_KIND_EXEC, cgid, cfg->step);
    }
    return e;
}

/* The exec record built in this CPU's scratch goes in flight: into
 * pending_exec_small when it fits (the map update copies its value size,
 * ~2.3 KiB, into a preallocated entry), else -- or when that table is full --
 * into pending_exec (48 KiB, allocated on demand). No room in either: counted
 * lost (inflight_full). */
static __always_inline void dsec_exec_store(struct dsec_sandbox *cfg, struct dsec_state *st,
                                            struct dsec_event *e)
{
    u32 tid = e->h.tid;
    if (e->h.size <= sizeof(struct dsec_event_exec_small) &&
        pending_exec_small.update(&tid, (struct dsec_event_exec_small *)e) == 0)
        return;
    if (pending_exec.update(&tid, e) != 0)
        dsec_inflight_lost(cfg, st, DSEC_KIND_EXEC);
}

/* Thread tid's exec record in flight, taken at its exit or sched_process_exec:
 * from the small table copied into this CPU's scratch (and taken out of the
 * table), or pending_exec's entry itself (*big = 1: the caller deletes it once
 * emitted). 0: none (*found = 0), or -- the scratch unavailable, which the
 * loader's DSEC_NCPU rules out -- out of flight and counted lost (*found = 1). */
static __always_inline struct dsec_event *dsec_exec_take(u32 tid, int *big, int *found)
{
    struct dsec_event_exec_small *s = pending_exec_small.lookup(&tid);
    if (!s) {
        struct dsec_event *x = pending_exec.lookup(&tid);
        *big = 1;
        *found = x != 0;
        return x;
    }
    *found = 1;
    u64 cgid = s->h.cgroup_id;
    u32 cpu = bpf_get_smp_processor_id();
    struct dsec_event *e = exec_scratch.lookup(&cpu);
    if (e && bpf_probe_read_kernel(e, dsec_record_size(s->h.size, sizeof(*s)), s) != 0)
        e = 0;
    pending_exec_small.delete(&tid);
    if (!e) {
        struct dsec_state *st = sbx_state.lookup(&cgid);
        if (st)
            dsec_inflight_lost(sandboxes.lookup(&cgid), st, DSEC_KIND_EXEC);
    }
    return e;
}

/* an exec of sandbox cgid out of flight: its state (one lookup for the whole exit) */
static __always_inline struct dsec_state *dsec_exec_done(u64 cgid)
{
    struct dsec_state *st = sbx_state.lookup(&cgid);
    if (st) {
        __sync_fetch_and_add(&st->inflight, -1);
        __sync_fetch_and_add(dsec_inflight_slot(st, DSEC_KIND_EXEC), -1);
    }
    return st;
}

/* Thread tid's exec record in flight emitted now, with ret. */
static __always_inline void dsec_exec_emit(u32 tid, long ret)
{
    int big = 0, found = 0;
    struct dsec_event *e = dsec_exec_take(tid, &big, &found);
    if (!e)
        return;
    u64 cgid = e->h.cgroup_id;
    struct dsec_state *st = dsec_exec_done(cgid);
    e->u.exec.ret = ret;
    dsec_output_st(e, e->h.size, sizeof(struct dsec_event), cgid, DSEC_KIND_EXEC, st);
    if (big)
        pending_exec.delete(&tid);
}

/* Interrupted execs, as interrupted file syscalls (common.h dsec_pending_settle):
 * an execve that a signal ends with a restart code (-ERESTARTNOINTR: it waited
 * for the process's cred_guard_mutex, e.g. behind another thread's exec, whose
 * de_thread kills it; -ERESTARTNOHAND: a fatal signal while its strings were
 * copied) is not emitted at its sys_exit: its record stays in flight, stamped
 * then, and is settled by what the thread does next --
 *  - its restart (execve again, same syscall and filename pointer): out of
 *    flight unemitted, the restart's enter records afresh what it reads;
 *  - any other exec: emitted with ret -EINTR;
 *  - the thread's exit (sched_process_exit): emitted with ret -EINTR.
 * An exec whose exit was never seen is taken out of flight unemitted (its
 * accounting given back), never mistaken for the next one's record. sys = 0:
 * the thread's exit (nothing is its restart). */
static __always_inline void dsec_exec_settle(u32 tid, u32 sys, u64 upath)
{
    struct dsec_event_exec_small *s = pending_exec_small.lookup(&tid);
    struct dsec_event *x = s ? 0 : pending_exec.lookup(&tid);
    struct dsec_exec *b = s ? &s->u.exec : x ? &x->u.exec : 0;
    if (!b)
        return;
    if (dsec_restart_code(b->ret) && !(sys && b->sys == sys && b->upath == upath)) {
        dsec_exec_emit(tid, -DSEC_EINTR);
        return;
    }
    if (s) {
        dsec_inflight_put(s->h.cgroup_id, DSEC_KIND_EXEC);
        pending_exec_small.delete(&tid);
    } else {
        dsec_inflight_put(x->h.cgroup_id, DSEC_KIND_EXEC);
        pending_exec.delete(&tid);
    }
}

/* sys_exit of an exec with a restart code: its record waits on (dsec_exec_settle),
 * stamped now, when the thread was interrupted */
static __always_inline void dsec_exec_interrupted(u32 tid, long ret)
{
    struct dsec_event_exec_small *s = pending_exec_small.lookup(&tid);
    struct dsec_event *x = s ? 0 : pending_exec.lookup(&tid);
    struct dsec_exec *b = s ? &s->u.exec : x ? &x->u.exec : 0;
    if (!b)
        return;
    b->ret = ret;
    if (s)
        s->h.ts_ns = bpf_ktime_get_ns();
    else
        x->h.ts_ns = bpf_ktime_get_ns();
}

static __always_inline int dsec_exec_enter(u32 sys, int dirfd, const char *path,
                                           const char *const *argv, u32 at_flags)
{
    u64 cgid = 0;
    struct dsec_sandbox *cfg = dsec_sandbox(&cgid);
    if (!cfg)
        return 0;
    dsec_exec_settle((u32)bpf_get_current_pid_tgid(), sys, (u64)path);
    struct dsec_state *st = sbx_state.lookup(&cgid);
    if (!st || !dsec_admit(cfg, st, DSEC_KIND_EXEC) || !dsec_inflight_get(cfg, st, DSEC_KIND_EXEC))
        return 0;
    struct dsec_event *e = dsec_exec_scratch(cfg, cgid);
    if (!e) {
        dsec_inflight_lost(cfg, st, DSEC_KIND_EXEC);
        return 0;
    }
    e->u.exec.sys = sys;
    e->u.exec.dirfd = dirfd;
    e->u.exec.at_flags = at_flags;
    e->u.exec.upath = (u64)path;
    u32 status = 0;
    u32 plen = dsec_read_path(&e->buf[0], path, &status, DSEC_ST_PATH_TRUNC, DSEC_ST_PATH_FAULT);
    e->u.exec.path_len = plen;
    e->u.exec.status = status;
    dsec_read_argv(e, argv, (u64)plen + 1);
    dsec_exec_store(cfg, st, e);
    return 0;
}

/* The exec'd path was not resident at enter: read it late, after argv. From
 * user memory at a failed exec's exit (the kernel faulted it in), or from the
 * sched_process_exec tracepoint data (the kernel's copy) on success. */
static __always_inline void dsec_exec_late_path(struct dsec_event *e, const char *src, int from_kernel)
{
    if (!(e->u.exec.status & DSEC_ST_PATH_FAULT))
        return;
    u64 off = (u64)e->u.exec.argv_off + e->u.exec.argv_len;
    DSEC_BARRIER(off);
    off &= DSEC_EXEC_OFF_MASK;
    long n;
    if (from_kernel)
        n = bpf_probe_read_kernel_str(&e->buf[off], DSEC_PATH_MAX, src);
    else
        n = bpf_probe_read_user_str(&e->buf[off], DSEC_PATH_MAX, src);
    if (n <= 0)
        return;
    e->u.exec.late_off = off;
    e->u.exec.late_len = n - 1;
    e->u.exec.status = (e->u.exec.status & ~DSEC_ST_PATH_FAULT) | DSEC_ST_LATE_READ;
    e->h.size = DSEC_FIXED_BYTES + off + n;
}

static __always_inline int dsec_exec_exit(long ret)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    if (dsec_restart_code(ret)) {
        dsec_exec_interrupted(tid, ret);
        return 0;
    }
    int big = 0, found = 0;
    struct dsec_event *e = dsec_exec_take(tid, &big, &found);
    if (!e)
        return 0;   /* not captured, or already emitted at sched_process_exec */
    u64 cgid = e->h.cgroup_id;
    struct dsec_state *st = dsec_exec_done(cgid);
    e->u.exec.ret = ret;
    dsec_exec_late_path(e, (const char *)e->u.exec.upath, 0);
    e->h.ts_ns = bpf_ktime_get_ns();
    dsec_output_st(e, e->h.size, sizeof(struct dsec_event), cgid, DSEC_KIND_EXEC, st);
    if (big)
        pending_exec.delete(&tid);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_execve)
{
    return dsec_exec_enter(DSEC_SYS_EXECVE, DSEC_AT_FDCWD, args->filename, args->argv, 0);
}

TRACEPOINT_PROBE(syscalls, sys_enter_execveat)
{
    return dsec_exec_enter(DSEC_SYS_EXECVEAT, (int)args->fd, args->filename, args->argv,
                           (u32)args->flags);
}

TRACEPOINT_PROBE(syscalls, sys_exit_execve)
{
    return dsec_exec_exit(args->ret);
}
DSEC_ATTACH_ALSO(syscalls, sys_exit_execve, sys_exit_execveat)

/* A relative execve (issue 21): the cwd the enforcement sensor's exec check joins
 * the name to (enforce.c "relative execs"), from its own maps -- pinned by that
 * sensor and opened here (DSEC_CWD_PIN_GEN/_CWD, agent/sensors/audit.py) -- with
 * its rule (shared.h dsec_cwd_counts), at the same tracepoint: appended to the
 * record (exec.cwd_len, DSEC_ST_CWD_JOINED), or DSEC_ST_CWD_UNKNOWN. Learning
 * then places the name where enforcement will look for it, even when the
 * process is gone by the time the record is decoded. Without the enforcement
 * sensor nothing is added (the decoder joins after the fact, best effort). */
#ifdef DSEC_CWD_PIN_GEN
BPF_TABLE_PINNED7("hash", u32, struct dsec_cwd_gen, enf_cwd_gen, DSEC_CWD_ENTRIES, DSEC_CWD_PIN_GEN,
                  BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED7("hash", u32, struct dsec_cwd, enf_cwd, DSEC_CWD_ENTRIES, DSEC_CWD_PIN_CWD,
                  BPF_F_NO_PREALLOC);

static __always_inline void dsec_exec_cwd(struct dsec_event *e, u32 tgid)
{
    if (e->u.exec.dirfd != DSEC_AT_FDCWD || (e->u.exec.status & (DSEC_ST_PATH_FAULT | DSEC_ST_PATH_TRUNC)))
        return;
    u64 end = (u64)e->u.exec.argv_off + e->u.exec.argv_len;
    char first = e->buf[0];
    if (e->u.exec.status & DSEC_ST_LATE_READ) {
        u64 lo = e->u.exec.late_off;
        DSEC_BARRIER(lo);
        lo &= DSEC_EXEC_OFF_MASK;
        first = e->buf[lo];
        end = lo + e->u.exec.late_len + 1;
    } else if (e->u.exec.path_len == 0) {
        return;
    }
    if (first == '/' || first == 0)
        return;
    struct dsec_cwd_gen *g = enf_cwd_gen.lookup(&tgid);
    struct dsec_cwd *c = enf_cwd.lookup(&tgid);
    if (!dsec_cwd_counts(g, c)) {
        e->u.exec.status |= DSEC_ST_CWD_UNKNOWN;
        return;
    }
    if (end > DSEC_EXEC_OFF_MASK)
        return;            /* no room after a full argv: left to the decoder (best effort) */
    DSEC_BARRIER(end);
    end &= DSEC_EXEC_OFF_MASK;
    u32 len = c->len;
    DSEC_BARRIER(len);
    len &= 255;
    if (len == 0 || len > DSEC_EXEC_KEY_PATH - 2)
        return;
    if (bpf_probe_read_kernel(&e->buf[end], len, c->path) != 0)
        return;
    e->u.exec.cwd_len = len;
    e->u.exec.status |= DSEC_ST_CWD_JOINED;
    e->h.size = DSEC_FIXED_BYTES + end + len;
}
#else
static __always_inline void dsec_exec_cwd(struct dsec_event *e, u32 tgid) {}
#endif

TRACEPOINT_PROBE(sched, sched_process_exec)
{
    u64 pt = bpf_get_current_pid_tgid();
    u32 tgid = pt >> 32;
    u32 old = args->old_pid;
    /* a fresh image: what was recorded about the old one's ending is void
     * (de_thread delivers SIGKILL to the other threads); looked up first:
     * every exec of the node comes here, and a delete of a key that is not
     * there still takes the bucket lock */
    if (exit_info.lookup(&tgid))
        exit_info.delete(&tgid);

    int big = 0, found = 0;
    struct dsec_event *e = dsec_exec_take(old, &big, &found);
    if (e) {
        u64 cgid = e->h.cgroup_id;
        u64 ug = bpf_get_current_uid_gid();
        struct dsec_state *st = dsec_exec_done(cgid);
        e->h.ts_ns = bpf_ktime_get_ns();
        e->h.pid = tgid;
        e->h.tid = (u32)pt;
        e->h.uid = (u32)ug;
        e->h.gid = ug >> 32;
        bpf_get_current_comm(e->h.comm, sizeof(e->h.comm));
        e->u.exec.ret = 0;
        e->u.exec.old_tid = old;
        u32 floc = args->data_loc_filename & 0xFFFF;
        dsec_exec_late_path(e, (const char *)args + floc, 1);
        dsec_exec_cwd(e, tgid);
        dsec_output_st(e, e->h.size, sizeof(struct dsec_event), cgid, DSEC_KIND_EXEC, st);
        if (big)
            pending_exec.delete(&old);
        return 0;
    }
    if (found)
        return 0;   /* captured, but no scratch to finish it in: counted lost */

    /* not captured at enter: still report the exec, without argv */
    u64 cgid = 0;
    struct dsec_sandbox *cfg = 0;
    struct dsec_state *st = dsec_admit_task(DSEC_KIND_EXEC, &cgid, &cfg);
    if (!st)
        return 0;
    e = dsec_exec_scratch(cfg, cgid);
    if (!e) {
        dsec_count_lost(cfg, st, DSEC_LOST_INFLIGHT_FULL, DSEC_KIND_EXEC);
        return 0;
    }
    e->u.exec.old_tid = old;
    e->u.exec.dirfd = DSEC_AT_FDCWD;
    e->u.exec.status = DSEC_ST_NO_ARGV;
    /* the kernel's filename (tracepoint data, not a kernel struct) */
    u32 loc = args->data_loc_filename & 0xFFFF;
    long n = bpf_probe_read_kernel_str(&e->buf[0], DSEC_PATH_MAX, (void *)args + loc);
    if (n <= 0) {
        e->buf[0] = 0;
        e->u.exec.status |= DSEC_ST_PATH_FAULT;
        n = 1;
    }
    e->u.exec.path_len = n - 1;
    e->u.exec.argv_off = n;
    e->h.size = DSEC_FIXED_BYTES + n;
    dsec_exec_cwd(e, tgid);
    dsec_output(e, e->h.size, sizeof(struct dsec_event), cgid, DSEC_KIND_EXEC);
    return 0;
}

/* ---- exit ------------------------------------------------------------------ */

/* exit_group(2) / exit(2) of a sandbox task: the code, should the process end */
static __always_inline int dsec_exit_call(u32 how, long error_code)
{
    u64 cgid = 0;
    if (!dsec_sandbox(&cgid))
        return 0;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (how == DSEC_EXIT_EXIT) {
        struct dsec_exit_info *old = exit_info.lookup(&tgid);
        if (old && old->how != DSEC_EXIT_EXIT)
            return 0;   /* exit_group or a fatal signal came first */
    }
    struct dsec_exit_info info = {};
    info.code = (int)(error_code & 0xff);
    info.how = how;
    exit_info.update(&tgid, &info);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_exit_group)
{
    return dsec_exit_call(DSEC_EXIT_EXIT_GROUP, args->error_code);
}

TRACEPOINT_PROBE(syscalls, sys_enter_exit)
{
    /* exit(2) of one thread: without exit_group, the status of the process is
     * that of the thread that exits last, so the latest exit() wins */
    return dsec_exit_call(DSEC_EXIT_EXIT, args->error_code);
}

TRACEPOINT_PROBE(signal, signal_generate)
{
    /* sender's context: the target may be a sandbox task; only remembered */
    int sig = args->sig;
    if (args->result != 0 || sig == DSEC_SIGKILL || !dsec_sig_fatal_default(sig))
        return 0;
    u32 pid = args->pid;
    u32 s = sig;
    sig_generated.update(&pid, &s);
    return 0;
}

TRACEPOINT_PROBE(signal, signal_deliver)
{
    u64 cgid = 0;
    if (!dsec_sandbox(&cgid))
        return 0;
    u64 pt = bpf_get_current_pid_tgid();
    u32 tgid = pt >> 32;
    u32 tid = (u32)pt;
    dsec_pending_signal(tid, args->sa_handler, args->sa_flags);
    int sig = args->sig;
    if (args->sa_handler != 0 /* SIG_DFL */ || !dsec_sig_fatal_default(sig)) {
        sig_generated.delete(&tid);
        sig_generated.delete(&tgid);
        return 0;
    }
    u32 s = sig;
    if (sig == DSEC_SIGKILL) {
        u32 *g = sig_generated.lookup(&tgid);
        if (!g)
            g = sig_generated.lookup(&tid);
        if (g && *g)
            s = *g;
    }
    struct dsec_exit_info info = {};
    info.code = -1;
    info.signal = s;
    info.how = DSEC_EXIT_SIGNAL;
    exit_info.insert(&tgid, &info);   /* the first cause wins */
    return 0;
}

/* a thread that dies inside a syscall leaves no pending record behind; one whose
 * syscall was interrupted (common.h dsec_pending_settle) has it emitted, ret -EINTR */
static __always_inline void dsec_drop_pending(u32 tid)
{
    int small = 0;
    struct dsec_event_small *p = dsec_pending_none() ? 0 : dsec_pending_find(tid, &small);
    if (p) {
        u64 cgid = p->h.cgroup_id;
        if (dsec_restart_code(*dsec_entry_ret(p))) {
            dsec_pending_emit(tid, p, -DSEC_EINTR, 0, small);
        } else {
            dsec_inflight_put(cgid, p->h.kind);
            if (dsec_pending_del(tid, small))
                dsec_pending_give(cgid);
        }
    }
    dsec_exec_settle(tid, 0, 0);
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 pt = bpf_get_current_pid_tgid();
    u32 tgid = pt >> 32;
    dsec_drop_pending((u32)pt);
    if (!args->group_dead)
        return 0;
    u64 cgid = 0;
    struct dsec_sandbox *cfg = 0;
    struct dsec_state *st = dsec_admit_task(DSEC_KIND_EXIT, &cgid, &cfg);
    if (!cfg)
        return 0;
    /* the process's entries are looked up once and deleted only when there:
     * a delete takes the bucket lock even for a key that is not (kcost) */
    struct dsec_exit_info *info = exit_info.lookup(&tgid);
    struct dsec_event *e = 0;
    if (st && (e = dsec_reserve(cfg, st, DSEC_KIND_EXIT, cgid))) {
        if (info) {
            e->u.exit.exit_code = info->code;
            e->u.exit.signal = info->signal;
            e->u.exit.how = info->how;
        } else {
            e->u.exit.exit_code = -1;
            e->u.exit.how = DSEC_EXIT_UNKNOWN;
        }
        dsec_submit(e, st, DSEC_KIND_EXIT);
    }
    dsec_track_exit(tgid);
    if (info)
        exit_info.delete(&tgid);
    if (sig_generated.lookup(&tgid))
        sig_generated.delete(&tgid);
    return 0;
}
