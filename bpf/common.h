/* dsec BPF: maps and helpers shared by process.c, net.c and files.c.
 *
 * How the source is built: BCC rewrites map calls (.lookup, .ringbuf_output,
 * ...) only in its main source text, not in #included files. So
 * agent/sensors/audit.py concatenates membership.h (the sandbox lookup and
 * process tree both sensors share), common.h, process.c, net.c and files.c, in
 * that order and with #line markers (compiler messages name the real file),
 * and compiles that one text. events.h (types) and shared.h (the helpers the
 * enforcement sensor, enforce.c, uses too) hold no map calls and are
 * #included.
 *
 * Rules for every program here:
 *  - never dereference a kernel struct: the kernel headers (6.1) do not match
 *    the running kernel. Only tracepoint arguments, helpers and
 *    bpf_probe_read_user* of user memory;
 *  - only tasks whose cgroup2 (or a cgroup2 ancestor) is in `sandboxes` are
 *    looked at; nothing else is ever emitted;
 *  - every loop is bounded; every event that cannot be emitted is counted in
 *    the sandbox's dsec_state.lost, by reason and kind.
 *
 * Why this file is long: admission, budgets, the pending table, the kernel's
 * aggregation of repeats and the emit path are shared by every program of the
 * three concerns, and BCC rewrites map calls only in one source text; that is
 * what keeps process.c, net.c and files.c short.
 */
#ifndef DSEC_COMMON_H
#define DSEC_COMMON_H

#include "shared.h"

#define DSEC_AT_FDCWD (-100)
/* O_WRONLY | O_RDWR | O_CREAT | O_TRUNC | O_APPEND */
#define DSEC_WRITE_FLAGS (01 | 02 | 0100 | 01000 | 02000)

/* ---- maps ---------------------------------------------------------------- */
BPF_RINGBUF_OUTPUT(events, DSEC_RING_PAGES);
BPF_HASH(sbx_state, u64, struct dsec_state, DSEC_MAX_SANDBOXES);
/* scratch space to build records in (too big for the 512-byte stack);
 * programs run with preemption disabled, one slot per CPU */
BPF_ARRAY(exec_scratch, struct dsec_event, DSEC_NCPU);
BPF_PERCPU_ARRAY(file_scratch, struct dsec_event_small, 1);
/* syscalls between enter and exit, by thread id. An exec's record (process.c
 * dsec_exec_store) waits in pending_exec_small when its path and argv fit
 * DSEC_EXEC_SMALL_BUF (preallocated: ~2.3 KiB an entry, ~4.7 MiB), else in
 * pending_exec (48 KiB values, allocated on demand). Copying a 48 KiB value in
 * and allocating it was most of sys_enter_execve's time: bench/kcost.py. */
BPF_TABLE("hash", u32, struct dsec_event_exec_small, pending_exec_small, DSEC_PENDING_EXEC_ENTRIES);
BPF_F_TABLE("hash", u32, struct dsec_event, pending_exec, DSEC_PENDING_EXEC_ENTRIES, BPF_F_NO_PREALLOC);
/* A file or connect record waits in pending_small when its strings fit
 * DSEC_FILE_SMALL_BUF and none faulted (a faulted path is read again at the
 * exit, and may be long then): preallocated, ~0.5 KiB an entry (~4.5 MiB);
 * else -- or when that table is full -- in `pending` (12 KiB values,
 * allocated on demand: copying and allocating one at every open was most of
 * sys_enter_openat's time, bench/kcost.py). A thread has one entry at most,
 * in one of the two; pending_used counts both. */
BPF_TABLE("hash", u32, struct dsec_event_file_small, pending_small, DSEC_PENDING_SMALL_ENTRIES);
BPF_F_TABLE("hash", u32, struct dsec_event_small, pending, DSEC_PENDING_ENTRIES, BPF_F_NO_PREALLOC);
/* a pending_small entry copied out, full-size, to be emitted or read into again */
BPF_PERCPU_ARRAY(pending_copy, struct dsec_event_small, 1);
/* entries of pending_small and `pending` taken, all sandboxes (their fair sharing, see dsec_pending_take) */
BPF_ARRAY(pending_used, s64, 1);
/* how a process is ending: tgid -> exit_group code or fatal signal */
BPF_TABLE("lru_hash", u32, struct dsec_exit_info, exit_info, 65536);
/* last fatal-by-default signal generated for a pid (the kernel reports a
 * group-wide fatal signal as SIGKILL at delivery) */
BPF_TABLE("lru_hash", u32, u32, sig_generated, 16384);

/* ---- ring buffer wake-ups ------------------------------------------------------
 * The kernel's adaptive wake-up (flags 0) signals the reader for every record
 * that finds it caught up -- nearly every record while the agent keeps up: an
 * irq_work, a self-IPI and a cross-CPU wake-up, 4-20 us inside the program on
 * this VM (bench/kcost.py; 0.5-1.5 us without). So the reader is woken at most
 * once per DSEC_WAKE_NS while records flow: the first record after that long
 * forces a wake-up, the others ask for none. Nothing waits longer than that
 * while records keep coming, nor longer than the reader's poll timeout after
 * the last one (the agent's poll thread waits 20 ms at most; epoll/poll on the
 * ring's fd is level-triggered: a reader that comes back with records in the
 * ring returns at once, common.py _ring_poll takes them after a timeout too).
 * DSEC_WAKE_NS is that poll timeout, 20 ms: at 4 ms a fork+exec+exit loop
 * (~0.6 ms an iteration) still paid ~3.4 us of wake-ups per iteration, mostly
 * in sched_process_exit (the record after the longest gap); the ring (32 MiB)
 * holds far more than 20 ms of records at any rate the agent keeps up with. */
#define DSEC_RB_NO_WAKEUP 1
#define DSEC_RB_FORCE_WAKEUP 2
#ifndef DSEC_WAKE_NS
#define DSEC_WAKE_NS 20000000
#endif
BPF_ARRAY(ring_wake, u64, 1);

static __always_inline u64 dsec_wake_flags(void)
{
    u32 zero = 0;
    u64 *last = ring_wake.lookup(&zero);
    if (!last)
        return 0;
    u64 now = bpf_ktime_get_ns();
    u64 t = *(volatile u64 *)last;
    if (now - t < DSEC_WAKE_NS || __sync_val_compare_and_swap(last, t, now) != t)
        return DSEC_RB_NO_WAKEUP;   /* woken recently (or by another CPU just now) */
    return DSEC_RB_FORCE_WAKEUP;
}

/* ---- accounting ------------------------------------------------------------ */

static __always_inline void dsec_count_lost(struct dsec_sandbox *cfg, struct dsec_state *st,
                                            u32 reason, u32 kind)
{
    dsec_count_reason(st->lost, reason, kind);
    if (cfg && cfg->mode == DSEC_OVER_STOP) {
        /* the record of this sandbox now has a hole: stop the offender at
         * once; the agent stops the rest of the sandbox */
        bpf_send_signal(DSEC_SIGKILL);
        __sync_fetch_and_add(&st->stopped, 1);
    }
}

static __always_inline void dsec_count_emitted(struct dsec_state *st, u32 kind)
{
    dsec_count_kind(st->emitted, kind);
}

/* Fair share (shared.h's GCRA): over budget = counted, not emitted. */
static __always_inline int dsec_admit(struct dsec_sandbox *cfg, struct dsec_state *st, u32 kind)
{
    if (dsec_gcra(&st->tat, cfg->interval_ns, cfg->tolerance_ns))
        return 1;
    dsec_count_lost(cfg, st, DSEC_LOST_OVER_BUDGET, kind);
    return 0;
}

/* An event of the current task: its sandbox (*cfg, *cgid; *cfg is 0 outside
 * any) and that sandbox's state when the event is admitted, else 0 (over
 * budget: counted). */
static __always_inline struct dsec_state *dsec_admit_task(u32 kind, u64 *cgid, struct dsec_sandbox **cfg)
{
    *cfg = dsec_sandbox(cgid);
    if (!*cfg)
        return 0;
    struct dsec_state *st = sbx_state.lookup(cgid);
    if (!st || !dsec_admit(*cfg, st, kind))
        return 0;
    return st;
}

/* ---- in flight ---------------------------------------------------------------
 * A syscall's record waits between enter and exit in a pending map. Bounded
 * per sandbox AND per kind (st->inflight_kind[kind] <= DSEC_MAX_INFLIGHT):
 * threads blocked in open(fifo) use up the sandbox's open_write share only,
 * its connects, execs, unlinks and renames are still recorded. Whatever does
 * not fit is counted as lost (inflight_full, that kind) in the sandbox's own
 * state, and over_budget: stop applies (dsec_count_lost). */

static __always_inline s64 *dsec_inflight_slot(struct dsec_state *st, u32 kind)
{
    return &st->inflight_kind[kind & (DSEC_NKINDS - 1)];
}

/* an in-flight syscall's record cannot be kept: out of flight, counted as lost */
static __always_inline void dsec_inflight_lost(struct dsec_sandbox *cfg, struct dsec_state *st, u32 kind)
{
    __sync_fetch_and_add(&st->inflight, -1);
    __sync_fetch_and_add(dsec_inflight_slot(st, kind), -1);
    dsec_count_lost(cfg, st, DSEC_LOST_INFLIGHT_FULL, kind);
}

/* a syscall of this sandbox goes in flight (its record waits in a pending map) */
static __always_inline int dsec_inflight_get(struct dsec_sandbox *cfg, struct dsec_state *st, u32 kind)
{
    __sync_fetch_and_add(&st->inflight, 1);
    s64 n = __sync_fetch_and_add(dsec_inflight_slot(st, kind), 1);
    if (n >= DSEC_MAX_INFLIGHT) {
        dsec_inflight_lost(cfg, st, kind);
        return 0;
    }
    return 1;
}

static __always_inline void dsec_inflight_put(u64 cgid, u32 kind)
{
    struct dsec_state *st = sbx_state.lookup(&cgid);
    if (st) {
        __sync_fetch_and_add(&st->inflight, -1);
        __sync_fetch_and_add(dsec_inflight_slot(st, kind), -1);
    }
}

/* The node-wide `pending` table (file and connect records, DSEC_PENDING_ENTRIES)
 * is shared fairly: once all but DSEC_PENDING_RESERVE entries are taken, only a
 * sandbox holding fewer than DSEC_PENDING_FAIR may take one, so sandboxes that
 * keep thousands of syscalls blocked fill at most the rest and a quiet
 * neighbour's records still have room. 1: taken (st->pending_held and
 * pending_used counted); 0: no room for this sandbox (the caller counts it). */
static __always_inline int dsec_pending_take(struct dsec_state *st)
{
    u32 zero = 0;
    s64 *used = pending_used.lookup(&zero);
    if (!used)
        return 0;
    s64 n = __sync_fetch_and_add(used, 1);
    s64 held = __sync_fetch_and_add(&st->pending_held, 1);
    if (n >= DSEC_PENDING_ENTRIES || (n >= DSEC_PENDING_ENTRIES - DSEC_PENDING_RESERVE &&
                                      held >= DSEC_PENDING_FAIR)) {
        __sync_fetch_and_add(used, -1);
        __sync_fetch_and_add(&st->pending_held, -1);
        return 0;
    }
    return 1;
}

/* an entry of `pending` given back; st: its sandbox's state (0: gone by now) */
static __always_inline void dsec_pending_give_st(struct dsec_state *st)
{
    u32 zero = 0;
    s64 *used = pending_used.lookup(&zero);
    if (used)
        __sync_fetch_and_add(used, -1);
    if (st)
        __sync_fetch_and_add(&st->pending_held, -1);
}

static __always_inline void dsec_pending_give(u64 cgid)
{
    dsec_pending_give_st(sbx_state.lookup(&cgid));
}

/* Nothing of any thread in `pending`: pending_used counts its entries (taken
 * before an entry goes in, given back after it is deleted), so 0 means none,
 * and the hash lookup by tid is skipped -- the exits of every open/connect/
 * unlink/rename of the node, and every thread's exit, while nothing is in flight. */
static __always_inline int dsec_pending_none(void)
{
    u32 zero = 0;
    s64 *used = pending_used.lookup(&zero);
    return used && *(volatile s64 *)used <= 0;
}

/* The byte budget (shared.h): a record of `size` bytes of an admitted event
 * fits the sandbox's byte share, else it is counted (over_bytes) and not
 * emitted. Checked when the record's size is known, just before it goes into
 * the ring: every kind, fixed or variable size. */
static __always_inline int dsec_admit_bytes(struct dsec_sandbox *cfg, struct dsec_state *st, u32 kind, u64 size)
{
    if (!cfg || dsec_gcra_bytes(&st->btat, cfg->byte_ps, cfg->byte_tol_ns, size))
        return 1;
    dsec_count_lost(cfg, st, DSEC_LOST_OVER_BYTES, kind);
    return 0;
}

/* ---- record building ------------------------------------------------------- */

/* A fixed-size record (no strings) of an admitted event: reserved in the ring
 * buffer with its header filled, or 0 (no room: counted as lost). */
static __always_inline struct dsec_event *dsec_reserve(struct dsec_sandbox *cfg, struct dsec_state *st,
                                                      u32 kind, u64 cgid)
{
    if (!dsec_admit_bytes(cfg, st, kind, DSEC_FIXED_BYTES))
        return 0;
    struct dsec_event *e = events.ringbuf_reserve(DSEC_FIXED_BYTES);
    if (!e) {
        dsec_count_lost(cfg, st, DSEC_LOST_RINGBUF_FULL, kind);
        return 0;
    }
    __builtin_memset(&e->u, 0, sizeof(e->u));
    dsec_fill_hdr(&e->h, kind, cgid, cfg->step);
    return e;
}

static __always_inline void dsec_submit(struct dsec_event *e, struct dsec_state *st, u32 kind)
{
    events.ringbuf_submit(e, dsec_wake_flags());
    dsec_count_emitted(st, kind);
}

/* Read a user path into dst (DSEC_PATH_MAX bytes of room); returns its length
 * without the NUL and sets the status bits. */
static __always_inline u32 dsec_read_path(char *dst, const char *src, u32 *status,
                                          u32 trunc_bit, u32 fault_bit)
{
    long n = bpf_probe_read_user_str(dst, DSEC_PATH_MAX, src);
    if (n <= 0) {
        *status |= fault_bit;
        dst[0] = 0;
        return 0;
    }
    if (n == DSEC_PATH_MAX) {
        char c = 0;
        bpf_probe_read_user(&c, 1, src + DSEC_PATH_MAX - 1);
        if (c)
            *status |= trunc_bit;
    }
    return n - 1;
}

/* Emit a record held in a map value (variable size) of sandbox cgid, whose
 * state is st (0: removed while the syscall was in flight) and configuration
 * cfg (0: removed); counts it either way. 1: emitted. */
static __always_inline int dsec_output_cfg(void *rec, u64 size, u64 max, u64 cgid, u32 kind,
                                           struct dsec_state *st, struct dsec_sandbox *cfg)
{
    if (!st)
        return 0;
    size = dsec_record_size(size, max);
    if (!dsec_admit_bytes(cfg, st, kind, size))
        return 0;
    if (events.ringbuf_output(rec, size, dsec_wake_flags()) == 0) {
        dsec_count_emitted(st, kind);
        return 1;
    }
    dsec_count_lost(cfg, st, DSEC_LOST_RINGBUF_FULL, kind);
    return 0;
}

static __always_inline void dsec_output_st(void *rec, u64 size, u64 max, u64 cgid, u32 kind,
                                           struct dsec_state *st)
{
    if (st)
        dsec_output_cfg(rec, size, max, cgid, kind, st, sandboxes.lookup(&cgid));
}

static __always_inline void dsec_output(void *rec, u64 size, u64 max, u64 cgid, u32 kind)
{
    dsec_output_st(rec, size, max, cgid, kind, sbx_state.lookup(&cgid));
}

/* ---- repeats: counted in the kernel, not copied into the ring --------------
 * A file or connect record that repeats one already emitted -- the same
 * process, sandbox, step, kind, syscall, flags, mode, dirfd, result, comm,
 * ids and strings: every byte of the record but its timestamp and thread id --
 * is counted in `agg` instead of being emitted, when the sandbox's
 * configuration allows its kind (dsec_sandbox.agg_kinds, set by userspace only
 * where the policy's decision cannot be anything but "allowed" for it:
 * agent/sensors/repeats.py) and the record qualifies (dsec_agg_wanted: no
 * status bits, absolute paths, no failed write, a loopback or unix connect).
 * The first occurrence is emitted in full at once, and makes the entry; the
 * entry keeps it and counts the repeats (count, last_ns). Userspace reads the
 * counts every flush period and turns what grew into summary records; it
 * retires a generation (bumps dsec_sandbox.agg_gen: at a step change, when the
 * sandbox holds too many entries) and, once no program can still be counting
 * into it, reads it a last time and deletes its entries, as it does all of a
 * sandbox's at its removal. Every counted occurrence is also counted in
 * dsec_state.aggregated: what the summaries report adds up to it. */
BPF_F_TABLE("hash", struct dsec_agg_key, struct dsec_agg_val, agg, DSEC_AGG_ENTRIES, BPF_F_NO_PREALLOC);
BPF_PERCPU_ARRAY(agg_scratch, struct dsec_agg_val, 1);

#define DSEC_AGG_WORDS ((DSEC_FIXED_BYTES + DSEC_AGG_STR) / 8)
#define DSEC_AGG_HDR_WORDS (DSEC_FIXED_BYTES / 8)     /* header and body; the strings after */
/* a file record's header and body: the union's rest is 0 for it (dsec_pending_begin) */
#define DSEC_AGG_FILE_WORDS ((sizeof(struct dsec_hdr) + sizeof(struct dsec_file) + 7) / 8)
#define DSEC_AF_UNIX 1
#define DSEC_AF_INET 2
#define DSEC_AF_INET6 10
#define DSEC_AGG_MUL 0x100000001B3ULL

/* What identifies an occurrence: the words of its record from 1 (word 0 is
 * the timestamp) to hb (the end of the kind's body), the thread id (the upper
 * half of word 3: pid, tid) masked off, then its strings (words
 * DSEC_AGG_HDR_WORDS to n), the last word cut at the record's size.
 *
 * The loops keep their constant bounds and leave at hb / n through a copy of
 * the counter clang cannot see through: it otherwise turns them into loops
 * that end at i == n, whose bound the verifier cannot see. A branch that left
 * the loop does not multiply the verifier's states; one that goes on in it
 * would (the last word's mask is arithmetic for that). */
static __always_inline u64 dsec_agg_cut(u64 x, u32 i, u32 n, u64 tail)
{
    u64 z = (u64)(i ^ (n - 1));             /* 0 on the last word */
    u64 last = (z - 1) & ~z;                /* sign bit set iff z == 0 */
    DSEC_BARRIER(last);
    return x & (tail | ~(u64)((s64)last >> 63));
}

/* The identity words of record w, hashed (the return value), and compared
 * with those of record s: *diff is 0 when they are the same (s = w: just the hash). */
static __always_inline u64 dsec_agg_walk(const u64 *w, const u64 *s, u32 hb, u32 n, u64 tail, u64 *diff)
{
    u64 h = 0x9E3779B97F4A7C15ULL ^ n;
    u64 d = 0;
#pragma nounroll
    for (u32 i = 1; i < DSEC_AGG_HDR_WORDS; i++) {
        u32 j = i;
        DSEC_BARRIER(j);
        if (j >= hb)
            break;
        u64 x = w[i], y = s[i];
        if (i == 3) {       /* i is the loop's own counter: one path per iteration */
            x &= 0xffffffffULL;
            y &= 0xffffffffULL;
        }
        d |= x ^ y;
        h = (h ^ x) * DSEC_AGG_MUL;
        h ^= h >> 29;
    }
#pragma nounroll
    for (u32 i = DSEC_AGG_HDR_WORDS; i < DSEC_AGG_WORDS; i++) {
        u32 j = i;
        DSEC_BARRIER(j);
        if (j >= n)
            break;
        u64 x = dsec_agg_cut(w[i], j, n, tail);
        d |= x ^ dsec_agg_cut(s[i], j, n, tail);
        h = (h ^ x) * DSEC_AGG_MUL;
        h ^= h >> 29;
    }
    *diff = d;
    return h;
}

/* a word count, at most DSEC_AGG_WORDS */
static __always_inline u32 dsec_agg_n(u32 n)
{
    return n > DSEC_AGG_WORDS ? DSEC_AGG_WORDS : n;
}

/* Does this record qualify, and under which hash? Its user pointers (read
 * late, if at all, by now) are cleared: they are no part of what it says.
 * *nwords: its words (n) | the end of its header and body (hb) << 16. */
static __always_inline int dsec_agg_wanted(struct dsec_sandbox *cfg, struct dsec_event_small *e, u32 kind,
                                           u64 *hash, u32 *nwords, u64 *tail)
{
    if (!(cfg->agg_kinds & (1U << (kind & 31))))
        return 0;
    u64 size = e->h.size;
    if (size < DSEC_FIXED_BYTES || size > DSEC_FIXED_BYTES + DSEC_AGG_STR)
        return 0;
    if (kind == DSEC_KIND_CONNECT) {
        if (e->u.connect.status)
            return 0;
        u16 fam = *(u16 *)&e->u.connect.addr[0];
        u32 alen = e->u.connect.addrlen;
        if (fam == DSEC_AF_INET) {
            if (alen < 8 || e->u.connect.addr[4] != 127)     /* 127.0.0.0/8 */
                return 0;
        } else if (fam == DSEC_AF_INET6) {
            u64 *a = (u64 *)&e->u.connect.addr[8];             /* ::1 exactly */
            if (alen < 24 || a[0] != 0 || a[1] != 0x0100000000000000ULL)
                return 0;
        } else if (fam != DSEC_AF_UNIX) {
            return 0;
        }
        e->u.connect.uaddr = 0;
    } else {
        if (e->u.file.status || e->u.file.ret < 0 || e->buf[0] != '/')
            return 0;
        if (kind == DSEC_KIND_RENAME) {
            u32 off = e->u.file.path2_off;
            if (off >= DSEC_AGG_STR || e->buf[off] != '/')
                return 0;
        }
        e->u.file.upath = 0;
        e->u.file.upath2 = 0;
    }
    u32 n = dsec_agg_n((size + 7) / 8);
    u64 t = size & 7 ? (1ULL << ((size & 7) * 8)) - 1 : ~0ULL;
    u32 hb = kind == DSEC_KIND_CONNECT ? DSEC_AGG_HDR_WORDS : DSEC_AGG_FILE_WORDS;
    u64 same;
    *hash = dsec_agg_walk((const u64 *)e, (const u64 *)e, hb, n, t, &same);
    *nwords = n | (hb << 16);
    *tail = t;
    return 1;
}

/* A repeat of an entry of `agg`: counted (1), or 0 -- no entry, or one whose
 * bytes differ (a hash collision: emitted in full, never merged). A counted
 * repeat gives back what its admission took of the sandbox's fair share
 * (dsec_admit at its sys_enter): it costs the pipeline nothing, so a loop of
 * repeats is not cut by the budget meant to protect it. */
static __always_inline int dsec_agg_repeat(struct dsec_sandbox *cfg, struct dsec_state *st,
                                           struct dsec_event_small *e, struct dsec_agg_key *k, u32 n, u64 tail)
{
    struct dsec_agg_val *v = agg.lookup(k);
    if (!v)
        return 0;
    u64 diff;
    dsec_agg_walk((const u64 *)e, (const u64 *)&v->rec, n >> 16, n & 0xffff, tail, &diff);
    if (diff)
        return 0;
    __sync_fetch_and_add(&v->count, 1);
    v->last_ns = e->h.ts_ns;
    dsec_count_kind(st->aggregated, e->h.kind);
    if (cfg->interval_ns)
        __sync_fetch_and_add(&st->tat, -cfg->interval_ns);
    return 1;
}

/* The first occurrence was emitted: it makes the entry its repeats count in
 * (when the sandbox's share of `agg`, and the table, have room). */
static __always_inline void dsec_agg_first(struct dsec_sandbox *cfg, struct dsec_state *st,
                                           struct dsec_event_small *e, struct dsec_agg_key *k,
                                           u32 n, u64 tail)
{
    u64 held = __sync_fetch_and_add(&st->agg_held, 1);
    if (held - cfg->agg_released >= DSEC_AGG_PER_SANDBOX) {
        __sync_fetch_and_add(&st->agg_held, -1);
        return;
    }
    u32 zero = 0;
    struct dsec_agg_val *v = agg_scratch.lookup(&zero);
    if (!v) {
        __sync_fetch_and_add(&st->agg_held, -1);
        return;
    }
    v->count = 0;
    v->last_ns = e->h.ts_ns;
    const u64 *w = (const u64 *)e;
    u64 *d = (u64 *)&v->rec;
    n &= 0xffff;
#pragma nounroll
    for (u32 i = 0; i < DSEC_AGG_WORDS; i++) {     /* the whole record, the words past its size 0 */
        u64 below = (u64)i - (u64)n;                /* i < n: the sign bit set */
        DSEC_BARRIER(below);
        d[i] = dsec_agg_cut(w[i], i, n, tail) & (u64)((s64)below >> 63);
    }
    if (agg.insert(k, v) != 0)      /* there already (another CPU's first), or no room */
        __sync_fetch_and_add(&st->agg_held, -1);
}

/* Emit the record `e` of sandbox cgid (state st, 0: gone) -- or count it, a
 * repeat. */
static __always_inline void dsec_emit_or_count(struct dsec_event_small *e, u64 cgid, u32 kind,
                                               struct dsec_state *st)
{
    if (!st)
        return;
    struct dsec_sandbox *cfg = sandboxes.lookup(&cgid);
    struct dsec_agg_key k = {};
    u32 n = 0;
    u64 tail = 0;
    if (!cfg || !dsec_agg_wanted(cfg, e, kind, &k.hash, &n, &tail)) {
        dsec_output_cfg(e, e->h.size, sizeof(struct dsec_event_small), cgid, kind, st, cfg);
        return;
    }
    k.cgroup_id = cgid;
    k.tgid = e->h.pid;
    k.gen = cfg->agg_gen;
    if (dsec_agg_repeat(cfg, st, e, &k, n, tail))
        return;
    if (dsec_output_cfg(e, e->h.size, sizeof(struct dsec_event_small), cgid, kind, st, cfg))
        dsec_agg_first(cfg, st, e, &k, n, tail);
}

/* ---- file and connect syscalls: enter stores, exit emits ------------------ */

/* The paths of a file record, from the user pointers saved in its body:
 * path at buf[0], path2 (rename) right after it. */
static __always_inline void dsec_file_paths(struct dsec_event_small *e)
{
    u32 status = e->u.file.status & ~(DSEC_ST_PATH_TRUNC | DSEC_ST_PATH_FAULT |
                                      DSEC_ST_PATH2_TRUNC | DSEC_ST_PATH2_FAULT);
    const char *path = (const char *)e->u.file.upath;
    const char *path2 = (const char *)e->u.file.upath2;
    u32 len = dsec_read_path(&e->buf[0], path, &status, DSEC_ST_PATH_TRUNC, DSEC_ST_PATH_FAULT);
    e->u.file.path_len = len;
    u64 end = (u64)len + 1;
    if (path2) {
        u64 off = end;
        DSEC_BARRIER(off);
        off &= DSEC_FILE_OFF_MASK;
        u32 len2 = dsec_read_path(&e->buf[off], path2, &status, DSEC_ST_PATH2_TRUNC,
                                  DSEC_ST_PATH2_FAULT);
        e->u.file.path2_off = off;
        e->u.file.path2_len = len2;
        end = off + len2 + 1;
    }
    e->u.file.status = status;
    e->h.size = DSEC_FIXED_BYTES + end;
}

static __always_inline void dsec_connect_addr(struct dsec_event_small *e)
{
    int addrlen = (int)e->u.connect.addrlen;
    u64 n = addrlen > 0 ? (u64)addrlen : 0;
    DSEC_BARRIER(n);
    if (n > DSEC_SOCKADDR_MAX)
        n = DSEC_SOCKADDR_MAX;
    e->u.connect.status &= ~DSEC_ST_ADDR_FAULT;
    if (n > 0 && bpf_probe_read_user(e->u.connect.addr, n, (void *)e->u.connect.uaddr) < 0)
        e->u.connect.status |= DSEC_ST_ADDR_FAULT;
}

/* Interrupted syscalls. A signal (a stop, a freeze, a handler, even an ignored
 * SIGCHLD that woke a thread) ends a blocked syscall with a restart code at
 * sys_exit (-ERESTARTSYS ...: kernel-internal, never seen by the process); the
 * kernel then either restarts it (the same syscall, same arguments, enters
 * again: no handler runs -- a stop, a freeze, an ignored signal -- or a handler
 * with SA_RESTART) or returns -EINTR (a handler without SA_RESTART). So the
 * record is not emitted at that exit: it stays in `pending`, still in flight,
 * with the restart code in its ret, and is settled by
 *  - signal_deliver of a handler that makes it -EINTR (process.c): emitted, ret -EINTR;
 *  - the thread's next file/connect syscall: its restart (same syscall and user
 *    pointers) and the record waits on for the final result; anything else
 *    (a handler's own syscall, a restart_syscall): emitted with ret -EINTR;
 *  - the thread's exit (a fatal signal): emitted with ret -EINTR.
 * One syscall of the process, one record. */
#define DSEC_EINTR 4

static __always_inline int dsec_restart_code(long ret)
{
    /* ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND, ERESTART_RESTARTBLOCK */
    return ret == -512 || ret == -513 || ret == -514 || ret == -516;
}

static __always_inline s64 *dsec_entry_ret(struct dsec_event_small *e)
{
    return e->h.kind == DSEC_KIND_CONNECT ? &e->u.connect.ret : &e->u.file.ret;
}

/* Thread tid's record in flight: pending_small's entry (*small = 1: only its
 * header and body may be read or written through this pointer, its string
 * area is short -- dsec_pending_copy gives the whole record) or pending's
 * (*small = 0). 0: none. */
static __always_inline struct dsec_event_small *dsec_pending_find(u32 tid, int *small)
{
    struct dsec_event_small *e = (struct dsec_event_small *)pending_small.lookup(&tid);
    *small = e != 0;
    if (!e)
        e = pending.lookup(&tid);
    return e;
}

/* thread tid's entry out of its table; 1: it was there */
static __always_inline int dsec_pending_del(u32 tid, int small)
{
    return (small ? pending_small.delete(&tid) : pending.delete(&tid)) == 0;
}

/* A pending_small entry's record (h.size bytes) copied into this CPU's
 * pending_copy, whose string area is full-size (the bytes past h.size are
 * stale: nothing emits or compares them, dsec_agg_cut). 0: no scratch (a
 * per-CPU slot: cannot happen). */
static __always_inline struct dsec_event_small *dsec_pending_copy(struct dsec_event_small *s)
{
    u32 zero = 0;
    struct dsec_event_small *c = pending_copy.lookup(&zero);
    if (c && bpf_probe_read_kernel(c, dsec_record_size(s->h.size, sizeof(struct dsec_event_file_small)), s) != 0)
        c = 0;
    return c;
}

/* Thread tid's pending_small entry of sandbox cgid (state st), whose record
 * could not be copied out (cannot happen: a per-CPU slot): out of flight,
 * counted lost, its share given back. */
static __always_inline void dsec_pending_small_lost(u32 tid, u64 cgid, u32 kind, struct dsec_state *st)
{
    if (st)
        dsec_inflight_lost(sandboxes.lookup(&cgid), st, kind);
    if (dsec_pending_del(tid, 1))
        dsec_pending_give_st(st);
}

/* Emit the record of the current thread's (tid's) entry `e` (of pending_small
 * when `small`, see dsec_pending_find) with result `ret` and take it out of
 * flight. `late`: read a path/sockaddr that was not resident at entry again
 * (the syscall ran: the kernel has faulted it in). */
static __always_inline void dsec_pending_emit(u32 tid, struct dsec_event_small *e, long ret, int late,
                                              int small)
{
    u64 cgid = e->h.cgroup_id;
    u32 kind = e->h.kind;
    /* one lookup of the sandbox's state for the whole exit */
    struct dsec_state *st = sbx_state.lookup(&cgid);
    if (small) {
        e = dsec_pending_copy(e);
        if (!e) {
            dsec_pending_small_lost(tid, cgid, kind, st);
            return;
        }
    }
    if (st) {
        __sync_fetch_and_add(&st->inflight, -1);
        __sync_fetch_and_add(dsec_inflight_slot(st, kind), -1);
    }
    if (kind == DSEC_KIND_CONNECT) {
        e->u.connect.ret = ret;
        if (late && (e->u.connect.status & DSEC_ST_ADDR_FAULT)) {
            dsec_connect_addr(e);
            if (!(e->u.connect.status & DSEC_ST_ADDR_FAULT))
                e->u.connect.status |= DSEC_ST_LATE_READ;
        }
    } else {
        e->u.file.ret = ret;
        if (late && (e->u.file.status & (DSEC_ST_PATH_FAULT | DSEC_ST_PATH2_FAULT))) {
            dsec_file_paths(e);
            if (!(e->u.file.status & (DSEC_ST_PATH_FAULT | DSEC_ST_PATH2_FAULT)))
                e->u.file.status |= DSEC_ST_LATE_READ;
        }
    }
    dsec_emit_or_count(e, cgid, kind, st);
    if (dsec_pending_del(tid, small))
        dsec_pending_give_st(st);
}

/* signal_deliver on the current thread (tid): a handler is about to run. Its
 * interrupted syscall, if any, returns -EINTR unless the kernel restarts it
 * after the handler (ERESTARTNOINTR, or ERESTARTSYS with SA_RESTART: then
 * marked ERESTARTNOINTR, decided, for a second signal's handler). */
#define DSEC_SA_RESTART 0x10000000
static __always_inline void dsec_pending_signal(u32 tid, u64 handler, u64 flags)
{
    if (handler == 0 /* SIG_DFL */ || handler == 1 /* SIG_IGN */)
        return;     /* no handler runs: restarted */
    if (dsec_pending_none())
        return;
    int small = 0;
    struct dsec_event_small *e = dsec_pending_find(tid, &small);
    if (!e)
        return;
    s64 *ret = dsec_entry_ret(e);
    s64 r = *ret;
    if (!dsec_restart_code(r))
        return;
    if (r == -513 || (r == -512 && (flags & DSEC_SA_RESTART))) {
        *ret = -513;
        return;
    }
    dsec_pending_emit(tid, e, -DSEC_EINTR, 0, small);
}

/* The current thread enters syscall `sys` (user pointers p1, p2; connect: the
 * sockaddr and the fd): settle what it still has in flight. Its record: this
 * is the restart of its interrupted syscall (the record waits on, as that
 * syscall's) -- `pending`'s entry itself (*restart = 1), or a pending_small
 * entry taken out of its table into pending_copy, still in flight and holding
 * its share (*restart = 2: the caller stores it again, dsec_pending_store);
 * 0: nothing left (an interrupted one emitted with -EINTR, one whose exit was
 * never seen given back). */
static __always_inline struct dsec_event_small *dsec_pending_settle(u32 sys, u64 p1, u64 p2, int *restart)
{
    if (dsec_pending_none())
        return 0;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    int small = 0;
    struct dsec_event_small *e = dsec_pending_find(tid, &small);
    if (!e)
        return 0;
    s64 *ret = dsec_entry_ret(e);
    u64 scg = e->h.cgroup_id;
    if (dsec_restart_code(*ret)) {
        int same = e->h.kind == DSEC_KIND_CONNECT
            ? e->u.connect.sys == sys && e->u.connect.uaddr == p1 && (u64)(s64)e->u.connect.fd == p2
            : e->u.file.sys == sys && e->u.file.upath == p1 && e->u.file.upath2 == p2;
        if (!same) {
            dsec_pending_emit(tid, e, -DSEC_EINTR, 0, small);
            return 0;
        }
        *ret = 0;
        if (!small) {
            *restart = 1;
            return e;
        }
        struct dsec_event_small *c = dsec_pending_copy(e);
        if (!c) {
            dsec_pending_small_lost(tid, scg, e->h.kind, sbx_state.lookup(&scg));
            return 0;
        }
        pending_small.delete(&tid);     /* still in flight, its share held: stored again */
        *restart = 2;
        return c;
    }
    /* an entry whose exit was never seen: its accounting given back */
    dsec_inflight_put(scg, e->h.kind);
    if (dsec_pending_del(tid, small))
        dsec_pending_give(scg);
    return 0;
}

/* Admit syscall `sys` of kind `kind` (user pointers p1, p2, see
 * dsec_pending_settle) and return a zeroed record in the per-CPU scratch with
 * its header filled, or 0 (not a sandbox / counted as lost). A restart: its
 * entry in `pending`, *restart set (the caller reads the user memory again: the
 * kernel does, and a thread of the process may have changed it while the call
 * was blocked; the record names what the restart used). */
static __always_inline struct dsec_event_small *dsec_pending_begin(u32 kind, u32 sys, u64 p1, u64 p2,
                                                                    int *restart)
{
    u64 cgid = 0;
    struct dsec_sandbox *cfg = dsec_sandbox(&cgid);
    if (!cfg)
        return 0;
    struct dsec_event_small *again = dsec_pending_settle(sys, p1, p2, restart);
    if (again)
        return again;
    struct dsec_state *st = sbx_state.lookup(&cgid);
    if (!st || !dsec_admit(cfg, st, kind) || !dsec_inflight_get(cfg, st, kind))
        return 0;
    if (!dsec_pending_take(st)) {
        dsec_inflight_lost(cfg, st, kind);
        return 0;
    }
    u32 zero = 0;
    struct dsec_event_small *e = file_scratch.lookup(&zero);
    if (!e) {
        dsec_pending_give(cgid);
        dsec_inflight_lost(cfg, st, kind);
        return 0;
    }
    __builtin_memset(&e->u, 0, sizeof(e->u));
    dsec_fill_hdr(&e->h, kind, cgid, cfg->step);
    return e;
}

/* The record goes in flight (the thread's old entry was settled at begin):
 * into pending_small when it fits (its strings, none faulted), else -- or
 * when that table is full -- into `pending`. */
static __always_inline void dsec_pending_store(struct dsec_event_small *e)
{
    u32 tid = e->h.tid;
    u64 cgid = e->h.cgroup_id;
    u32 kind = e->h.kind;
    u32 fault = kind == DSEC_KIND_CONNECT ? 0
        : e->u.file.status & (DSEC_ST_PATH_FAULT | DSEC_ST_PATH2_FAULT);
    if (!fault && e->h.size <= sizeof(struct dsec_event_file_small) &&
        pending_small.update(&tid, (struct dsec_event_file_small *)e) == 0)
        return;
    if (pending.update(&tid, e) != 0) {
        dsec_pending_give(cgid);
        struct dsec_state *st = sbx_state.lookup(&cgid);
        if (st)
            dsec_inflight_lost(sandboxes.lookup(&cgid), st, kind);
    }
}

static __always_inline int dsec_pending_finish(long ret)
{
    if (dsec_pending_none())
        return 0;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    int small = 0;
    struct dsec_event_small *e = dsec_pending_find(tid, &small);
    if (!e)
        return 0;
    e->h.ts_ns = bpf_ktime_get_ns();
    if (dsec_restart_code(ret)) {
        /* interrupted: restarted or -EINTR, settled later (see dsec_pending_settle);
         * stamped now, when the process was interrupted */
        *dsec_entry_ret(e) = ret;
        return 0;
    }
    dsec_pending_emit(tid, e, ret, 1, small);
    return 0;
}

#endif /* DSEC_COMMON_H */
