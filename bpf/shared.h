/* dsec BPF: what the two sensors share — the audit sensor (common.h,
 * process.c, net.c, files.c) and the enforcement sensor (enforce.c).
 *
 * No maps and no map calls here: BCC rewrites map calls only in the main
 * source text, and this header is #included (see membership.h). Each helper
 * works on the counters, token-bucket word or record header it is handed; the
 * sensors wrap them with their own maps (sbx_state / enf_state, events /
 * enf_events). The sandbox lookup and the process tree both sensors keep are
 * membership.h's.
 */
#ifndef DSEC_SHARED_H
#define DSEC_SHARED_H

#include "events.h"

#define DSEC_SIGKILL 9
#define DSEC_CLONE_THREAD 0x00010000ULL
#define DSEC_CLONE_PARENT 0x00008000ULL

/* DSEC_ATTACH_ALSO(category, event, also): the program of
 * TRACEPOINT_PROBE(category, event) runs at category:also too. Expands to
 * nothing; the loader reads these lines (agent/sensors/common.py attach_also)
 * and attaches the one program to both, after checking that the two
 * tracepoints' formats are field for field the same (so the program reads
 * every one's arguments where they are). For tracepoints whose programs would
 * be the same code: BCC compiles and the verifier checks it once, not once per
 * tracepoint (each program is compiled, inlined helpers and all, on its own). */
#define DSEC_ATTACH_ALSO(category, event, also)

/* hide a value's range from clang so that the mask that follows is kept for
 * the verifier */
#define DSEC_BARRIER(x) asm volatile("" : "+r"(x))

/* ---- counters (a state's emitted[] and lost[]) ------------------------------ */

/* lost[reason * DSEC_NKINDS + kind] += 1 */
static __always_inline void dsec_count_reason(u64 *lost, u32 reason, u32 kind)
{
    u32 i = reason * DSEC_NKINDS + (kind & (DSEC_NKINDS - 1));
    if (i < DSEC_NLOST * DSEC_NKINDS)
        __sync_fetch_and_add(&lost[i], 1);
}

/* emitted[kind] += 1 */
static __always_inline void dsec_count_kind(u64 *emitted, u32 kind)
{
    __sync_fetch_and_add(&emitted[kind & (DSEC_NKINDS - 1)], 1);
}

/* Fair share (audit) / event budget (enforcement): GCRA, the token bucket with
 * rate 1e9/interval_ns per second and burst tolerance_ns/interval_ns + 1, kept
 * in one word (*tat, the theoretical arrival time) updated with
 * compare-and-swap. 1: admitted; 0: over budget (the caller counts it). */
static __always_inline int dsec_gcra(u64 *tat, u64 interval, u64 tol)
{
    if (interval == 0)
        return 1;
    u64 now = bpf_ktime_get_ns();
    /* a loop, not four copies (compile time: bpf/membership.h dsec_sandbox) */
#pragma nounroll
    for (int i = 0; i < 4; i++) {
        u64 t = *(volatile u64 *)tat;
        u64 base = t > now ? t : now;
        if (base - now > tol)
            break;
        if (__sync_val_compare_and_swap(tat, t, base + interval) == t)
            return 1;
    }
    return 0;
}

/* Byte budget: the same GCRA with a cost. A byte costs `ps_per_byte`
 * picoseconds (1e12 / bytes per second); the bucket holds `tol` ns (the
 * burst's bytes). A record of `bytes` is admitted when the bucket has room for
 * all of it. Kept in ns like the event budget (ps would wrap a u64 after
 * ~200 days of uptime). */
static __always_inline int dsec_gcra_bytes(u64 *tat, u64 ps_per_byte, u64 tol, u64 bytes)
{
    if (ps_per_byte == 0)
        return 1;
    u64 now = bpf_ktime_get_ns();
    u64 cost = (bytes * ps_per_byte) / 1000;
    /* a loop, not four copies (compile time: bpf/membership.h dsec_sandbox) */
#pragma nounroll
    for (int i = 0; i < 4; i++) {
        u64 t = *(volatile u64 *)tat;
        u64 base = t > now ? t : now;
        if (base + cost - now > tol)
            break;
        if (__sync_val_compare_and_swap(tat, t, base + cost) == t)
            return 1;
    }
    return 0;
}

/* ---- records ------------------------------------------------------------------ */

/* The header of a record of the current task, all but ppid (the caller looks
 * it up in its sensor's parents map); returns the task's tgid. */
static __always_inline u32 dsec_hdr_fill(struct dsec_hdr *h, u32 kind, u64 cgid, u32 step)
{
    u64 pt = bpf_get_current_pid_tgid();
    u64 ug = bpf_get_current_uid_gid();
    u32 tgid = pt >> 32;
    h->ts_ns = bpf_ktime_get_ns();
    h->cgroup_id = cgid;
    h->kind = kind;
    h->size = DSEC_FIXED_BYTES;
    h->pid = tgid;
    h->tid = (u32)pt;
    h->uid = (u32)ug;
    h->gid = ug >> 32;
    h->step = step;
    bpf_get_current_comm(h->comm, sizeof(h->comm));
    return tgid;
}

/* The bytes to emit of a variable-size record built in a map value of `max`
 * bytes: between DSEC_FIXED_BYTES and max, as the verifier can see. */
static __always_inline u64 dsec_record_size(u64 size, u64 max)
{
    DSEC_BARRIER(size);
    if (size > max)
        size = max;
    if (size < DSEC_FIXED_BYTES)
        size = DSEC_FIXED_BYTES;
    return size;
}

/* ---- relative execs: does a process's verified cwd count? -------------------- */
/* g, c: its enf_cwd_gen and enf_cwd entries (enforce.c "relative execs"). The one
 * rule both the exec check (enforce.c) and the exec record (process.c, which reads
 * the same maps, shared through bpffs) apply at sched_process_exec: so what learning
 * records as <cwd>/<name> is what enforcement matches. */
static __always_inline int dsec_cwd_counts(const struct dsec_cwd_gen *g, const struct dsec_cwd *c)
{
    return g && c && g->gen != 0 && !g->inflight && !g->flags && c->gen == g->gen
        && c->len != 0 && c->len <= DSEC_EXEC_KEY_PATH - 2;
}

#endif /* DSEC_SHARED_H */
