/* dsec BPF: policy enforcement and violation reporting — the second sensor,
 * next to the audit sensor (process.c, net.c, files.c). Loaded by
 * agent/sensors/enforce.py as its own object (its own maps and ring buffer):
 * membership.h and this file are its main source text; events.h holds the
 * types and shared.h the helpers both sensors use (counters, GCRA, record
 * headers).
 *
 * Why this file is long: one BPF object is one source text (BCC compiles a
 * sensor's programs together, and the maps they share are declared here); each
 * concern is a section of its own: egress, relative execs' cwd, exec, sockets,
 * process tree, syscalls.
 *
 * Rules (as for the audit sensor): never dereference a kernel struct (the
 * headers are 6.1, the kernel 6.18): only tracepoint data, helper results and
 * UAPI contexts (struct bpf_sock_addr); every loop bounded; every record that
 * cannot be emitted is counted in the sandbox's dsec_enf_state.lost.
 *
 * Sandboxes are keyed by cgroup2 id (the task's cgroup or a registered
 * ancestor) in `sandboxes` (membership.h, the lookup both sensors share; the
 * loader puts it first in this sensor's source text), written by userspace;
 * each concern has its own mode there (DSEC_MODE_OFF / LEARN / AUDIT /
 * ENFORCE).
 *
 * egress   cgroup/connect4, connect6, sendmsg4, sendmsg6 (dsec_enf_c4/c6/s4/s6),
 *          attached by userspace to each sandbox's own cgroup2 directory.
 *          Destination -> LPM trie (egress4 / egress6, keyed by the sandbox's
 *          rule-set index) -> port ranges + protocols of every rule covering
 *          it. enforce: return 0 (the caller gets EPERM) + one egress_denied;
 *          audit: allow + one egress_violation; learn: allow + count the
 *          destination in egress_dest. An IPv4-mapped IPv6 destination is
 *          checked as IPv4.
 * exec     sched/sched_process_exec: the kernel's filename (the path as given
 *          to execve; see docs/enforcement.md), which must be canonical
 *          (absolute, no '//', '/./', '/../', not /dev/fd/N: enf_canonical)
 *          -> LPM trie exec_allow (exact paths with their NUL, prefixes
 *          without). enforce: bpf_send_signal (SIGKILL) — delivered before the
 *          new image runs any instruction — + exec_denied; audit:
 *          exec_violation. An executable mmap of a file refused with EPERM
 *          (a noexec writable layer: `ld.so /tmp/x`, dlopen of a dropped .so)
 *          is an exec_denied too (syscalls sys_enter/exit_mmap). A relative
 *          filename is matched as <cwd>/<name>, with the cwd the agent read
 *          while the process was stopped at its chdir ("relative execs").
 * sockets  socket()/socketpair() arguments outside the policy's socket rules
 *          (sock_rules): audit mode at syscalls:sys_enter_socket/socketpair
 *          (seccomp LOG lets them run), enforce mode at the raw sys_exit
 *          tracepoint (seccomp refused them before sys_enter; the arguments
 *          are read from the entry registers, whose x86_64 layout is ABI).
 * syscalls raw_syscalls: sys_enter (raw tracepoint; the id is ctx->args[1])
 *          counts calls per syscall in learn mode and reports calls outside
 *          the allow bitmap in audit mode; sys_exit (tracepoint: id and ret
 *          are tracepoint data) reports them in enforce mode — seccomp
 *          refuses a denied call before sys_enter fires, but sys_exit still
 *          fires with the call's number and the errno seccomp returned.
 *          Reports are rate-limited per (sandbox, syscall): at most one
 *          record per report_ns, each carrying the running total.
 * exempt   tasks registered by userspace (the sandbox supervisor) and their
 *          children up to their first exec are not syscall-checked: the
 *          supervisor's own calls are not the workload's.
 */
#define DSEC_EPERM 1
#define DSEC_AF_INET 2
#define DSEC_AF_INET6 10
#define DSEC_IPPROTO_TCP 6
#define DSEC_IPPROTO_UDP 17
/* x86_64 struct pt_regs (arch/x86/include/uapi/asm/ptrace.h): offsets of the entry registers */
#define DSEC_PT_REGS_DX 96
#define DSEC_PT_REGS_SI 104
#define DSEC_PT_REGS_DI 112
#define DSEC_PT_REGS_ORIG_AX 120

/* ---- maps ---------------------------------------------------------------- */
BPF_RINGBUF_OUTPUT(enf_events, DSEC_ENF_RING_PAGES);
BPF_HASH(enf_state, u64, struct dsec_enf_state, DSEC_MAX_SANDBOXES);
BPF_F_TABLE("lpm_trie", struct dsec_lpm4_key, struct dsec_egress_rule, egress4, DSEC_EGRESS_ENTRIES,
            BPF_F_NO_PREALLOC);
BPF_F_TABLE("lpm_trie", struct dsec_lpm6_key, struct dsec_egress_rule, egress6, DSEC_EGRESS_ENTRIES,
            BPF_F_NO_PREALLOC);
BPF_F_TABLE("lpm_trie", struct dsec_exec_key, u8, exec_allow, DSEC_EXEC_ENTRIES, BPF_F_NO_PREALLOC);
BPF_PERCPU_ARRAY(exec_key_scratch, struct dsec_exec_key, 1);
/* exec records are built here (a path does not fit the 512-byte stack); the
 * value type is also how userspace learns the record layout */
BPF_PERCPU_ARRAY(enf_scratch, struct dsec_event_small, 1);
BPF_F_TABLE("hash", struct dsec_sys_key, struct dsec_sys_viol, sys_viol, DSEC_SYSVIOL_ENTRIES,
            BPF_F_NO_PREALLOC);
/* learn mode: entries created by userspace at registration, only looked up here */
BPF_F_TABLE("hash", u64, struct dsec_sys_counts, sys_counts, DSEC_MAX_LEARN, BPF_F_NO_PREALLOC);
BPF_F_TABLE("hash", struct dsec_dest_key, struct dsec_dest_val, egress_dest, DSEC_DEST_ENTRIES,
            BPF_F_NO_PREALLOC);
/* tgid -> sandbox cgroup id: not syscall-checked (the sandbox's init, its children until they exec) */
BPF_HASH(enf_exempt, u32, u64, 65536);
/* The syscalls allowed by number in every enforce-mode sandbox (bit n of word
 * n/64; clone, unshare, socket and socketpair never: their exits are checked
 * whatever their number allows), written by userspace: narrowed before a
 * sandbox is registered, widened after one is removed. So any bit read set,
 * from whichever write (a write can be read half-done, a byte at a time), is
 * set in the bitmap of every enforce-mode sandbox whose tasks can run: the
 * exit of such a call has nothing to report, in any sandbox, and returns
 * before the membership look-up (agent/sensors/enforce.py _sys_common_set). */
BPF_ARRAY(sys_common, u64, DSEC_SYSCALL_NR_MAX / 64);
/* The same for sys_enter (learn and audit mode): the syscalls every audit-mode
 * sandbox allows, none while a learn-mode sandbox is registered (it counts
 * every call); written by the same rules. */
BPF_ARRAY(sys_common_audit, u64, DSEC_SYSCALL_NR_MAX / 64);
BPF_F_TABLE("hash", struct dsec_sock_key, struct dsec_sock_rule, sock_rules, DSEC_SOCK_ENTRIES, BPF_F_NO_PREALLOC);
/* tid -> fd of an executable file mapping in flight (exec-enforced sandboxes) */
BPF_HASH(mmap_pending, u32, s64, 16384);
/* entries put in mmap_pending and not yet deleted (more if one was overwritten):
 * 0 = none, and the mmap exits of the node skip the hash lookup */
BPF_ARRAY(mmap_inflight, s64, 1);

/* ---- accounting and records ------------------------------------------------ */

static __always_inline void enf_count_lost(struct dsec_enf_state *st, u32 reason, u32 kind)
{
    if (st)
        dsec_count_reason(st->lost, reason, kind);
}

static __always_inline void enf_count_emitted(struct dsec_enf_state *st, u32 kind)
{
    dsec_count_kind(st->emitted, kind);
}

/* event budget (shared.h's GCRA): over budget = counted, not emitted */
static __always_inline int enf_admit(struct dsec_enf_sandbox *cfg, struct dsec_enf_state *st, u32 kind)
{
    if (dsec_gcra(&st->tat, cfg->interval_ns, cfg->tolerance_ns))
        return 1;
    enf_count_lost(st, DSEC_LOST_OVER_BUDGET, kind);
    return 0;
}

/* byte budget (shared.h): a record of `size` bytes fits the sandbox's share,
 * else counted (over_bytes) and not emitted */
static __always_inline int enf_admit_bytes(struct dsec_enf_sandbox *cfg, struct dsec_enf_state *st, u32 kind,
                                           u64 size)
{
    if (dsec_gcra_bytes(&st->btat, cfg->byte_ps, cfg->byte_tol_ns, size))
        return 1;
    enf_count_lost(st, DSEC_LOST_OVER_BYTES, kind);
    return 0;
}

/* a fixed-size record (no strings): reserve, fill the header, return the body
 * (0: over the byte budget or no room, counted as lost) */
static __always_inline struct dsec_event_small *enf_reserve(struct dsec_enf_sandbox *cfg,
                                                            struct dsec_enf_state *st,
                                                            u32 kind, u64 cgid)
{
    if (!enf_admit_bytes(cfg, st, kind, DSEC_FIXED_BYTES))
        return 0;
    struct dsec_event_small *e = enf_events.ringbuf_reserve(DSEC_FIXED_BYTES);
    if (!e) {
        enf_count_lost(st, DSEC_LOST_RINGBUF_FULL, kind);
        return 0;
    }
    __builtin_memset(&e->u, 0, sizeof(e->u));
    dsec_fill_hdr(&e->h, kind, cgid, cfg->step);
    return e;
}

static __always_inline void enf_submit(struct dsec_event_small *e, struct dsec_enf_state *st, u32 kind)
{
    enf_events.ringbuf_submit(e, 0);
    enf_count_emitted(st, kind);
}

/* ---- egress ------------------------------------------------------------------ */

static __always_inline u32 enf_proto_bit(u32 protocol)
{
    if (protocol == DSEC_IPPROTO_TCP)
        return DSEC_PROTO_TCP;
    if (protocol == DSEC_IPPROTO_UDP)
        return DSEC_PROTO_UDP;
    return DSEC_PROTO_OTHER;
}

static __always_inline int enf_rule_hit(struct dsec_egress_rule *r, u32 port, u32 pbit)
{
    if (!r)
        return 0;
    u32 n = r->n;
    for (int i = 0; i < DSEC_EGRESS_RANGES; i++) {
        if ((u32)i >= n)
            break;
        if ((r->r[i].protos & pbit) && port >= r->r[i].lo && port <= r->r[i].hi)
            return 1;
    }
    return 0;
}

static __always_inline void enf_learn_dest(struct dsec_enf_state *st, u64 cgid, u32 family, u32 protocol,
                                           u32 port, u32 hook, const u8 *addr)
{
    struct dsec_dest_key k = {};
    k.cgroup_id = cgid;
    k.family = family;
    k.protocol = protocol;
    k.port = port;
    k.hook = hook;
    __builtin_memcpy(k.addr, addr, 16);
    u64 now = bpf_ktime_get_ns();
    struct dsec_dest_val *v = egress_dest.lookup(&k);
    if (!v) {
        struct dsec_dest_val nv = {};
        nv.first_ns = now;
        egress_dest.insert(&k, &nv);
        v = egress_dest.lookup(&k);
        if (!v) {
            if (st)
                __sync_fetch_and_add(&st->learn_lost, 1);
            return;
        }
    }
    __sync_fetch_and_add(&v->count, 1);
    v->last_ns = now;
}

static __always_inline int enf_egress(struct bpf_sock_addr *ctx, u32 hook, int v6)
{
    u64 cgid = 0;
    struct dsec_enf_sandbox *cfg = dsec_sandbox(&cgid);
    if (!cfg)
        return 0;   /* attached to this cgroup but no rules (being removed): fail closed */
    u32 mode = cfg->egress;
    if (mode == DSEC_MODE_OFF)
        return 1;
    struct dsec_enf_state *st = enf_state.lookup(&cgid);

    u32 protocol = ctx->protocol;
    u32 sock_type = ctx->type;
    u32 p = ctx->user_port;
    u32 port = ((p & 0xff) << 8) | ((p >> 8) & 0xff);
    u8 addr[16] = {};
    u32 family = DSEC_AF_INET;
    u32 status = 0;
    if (v6) {
        u32 w0 = ctx->user_ip6[0];
        u32 w1 = ctx->user_ip6[1];
        u32 w2 = ctx->user_ip6[2];
        u32 w3 = ctx->user_ip6[3];
        if (w0 == 0 && w1 == 0 && w2 == __builtin_bswap32(0x0000ffff)) {
            /* ::ffff:a.b.c.d connects over IPv4: check it as IPv4 */
            __builtin_memcpy(&addr[0], &w3, 4);
            status |= DSEC_ST_IPV4_MAPPED;
        } else {
            family = DSEC_AF_INET6;
            __builtin_memcpy(&addr[0], &w0, 4);
            __builtin_memcpy(&addr[4], &w1, 4);
            __builtin_memcpy(&addr[8], &w2, 4);
            __builtin_memcpy(&addr[12], &w3, 4);
        }
    } else {
        u32 ip = ctx->user_ip4;
        __builtin_memcpy(&addr[0], &ip, 4);
    }

    if (mode == DSEC_MODE_LEARN) {
        enf_learn_dest(st, cgid, family, protocol, port, hook, addr);
        return 1;
    }

    struct dsec_egress_rule *r;
    if (family == DSEC_AF_INET) {
        struct dsec_lpm4_key k = {};
        k.prefixlen = 32 + 32;
        k.idx = cfg->idx;
        __builtin_memcpy(k.addr, addr, 4);
        r = egress4.lookup(&k);
    } else {
        struct dsec_lpm6_key k = {};
        k.prefixlen = 32 + 128;
        k.idx = cfg->idx;
        __builtin_memcpy(k.addr, addr, 16);
        r = egress6.lookup(&k);
    }
    int hit = enf_rule_hit(r, port, enf_proto_bit(protocol));
    int allowed = cfg->egress_default == DSEC_EGRESS_DEFAULT_DENY ? hit : !hit;
    if (allowed)
        return 1;

    int enforce = mode == DSEC_MODE_ENFORCE;
    u32 kind = enforce ? DSEC_KIND_EGRESS_DENIED : DSEC_KIND_EGRESS_VIOLATION;
    if (st && enf_admit(cfg, st, kind)) {
        struct dsec_event_small *e = enf_reserve(cfg, st, kind, cgid);
        if (e) {
            e->u.egress.hook = hook;
            e->u.egress.family = family;
            e->u.egress.protocol = protocol;
            e->u.egress.sock_type = sock_type;
            e->u.egress.port = port;
            e->u.egress.status = status;
            __builtin_memcpy(e->u.egress.addr, addr, 16);
            enf_submit(e, st, kind);
        }
    }
    return enforce ? 0 : 1;
}

int dsec_enf_c4(struct bpf_sock_addr *ctx) { return enf_egress(ctx, DSEC_HOOK_CONNECT4, 0); }
int dsec_enf_c6(struct bpf_sock_addr *ctx) { return enf_egress(ctx, DSEC_HOOK_CONNECT6, 1); }
int dsec_enf_s4(struct bpf_sock_addr *ctx) { return enf_egress(ctx, DSEC_HOOK_SENDMSG4, 0); }
int dsec_enf_s6(struct bpf_sock_addr *ctx) { return enf_egress(ctx, DSEC_HOOK_SENDMSG6, 1); }

/* ---- exec ------------------------------------------------------------------- */

/* Is this a name the exec allowlist may match? Absolute, no empty, "." or ".."
 * component, not the /dev/fd/N[/...] name the kernel gives execveat with a
 * dirfd or fexecve, and short enough to be checked whole: at most
 * DSEC_EXEC_KEY_PATH - 1 bytes (the verifier bounds the scan; a longer name
 * matches no pattern). `len` excludes the NUL. */
static __always_inline int enf_canonical(const char *p, u32 len)
{
    if (len == 0 || len >= DSEC_EXEC_KEY_PATH || p[0] != '/')
        return 0;
    if (len >= 8 && p[1] == 'd' && p[2] == 'e' && p[3] == 'v' && p[4] == '/' && p[5] == 'f' &&
        p[6] == 'd' && p[7] == '/')
        return 0;
    /* no state carried between iterations (so the verifier prunes them): at
     * each '/', look at the next three bytes (the NUL ends the name) */
    asm volatile("" : "+r"(len));
    for (u32 i = 0; i < DSEC_EXEC_KEY_PATH; i++) {
        if (i >= len)
            break;
        if (p[i & (DSEC_PATH_MAX - 1)] != '/')
            continue;
        char a = p[(i + 1) & (DSEC_PATH_MAX - 1)];
        if (a == '/')
            return 0;                           /* "//" */
        if (a != '.')
            continue;
        char b = p[(i + 2) & (DSEC_PATH_MAX - 1)];
        if (b == '/' || b == 0)
            return 0;                           /* "/./", "/." at the end */
        if (b != '.')
            continue;
        char c = p[(i + 3) & (DSEC_PATH_MAX - 1)];
        if (c == '/' || c == 0)
            return 0;                           /* "/../", "/.." at the end */
    }
    return 1;
}

/* ---- relative execs: the cwd, as the agent read it ---------------------------- */
/* (issue 21) The exec check sees the filename as given to execve. A relative
 * one ("./prog", "bin/tool") is matched as <cwd>/<name>, the way learning
 * resolved it. BPF cannot read a task's cwd (task->fs is a kernel struct), and
 * the string a process passes to chdir is user memory that another thread or
 * a shared mapping can change between our read and the kernel's (TOCTOU), so
 * the cwd used here is the kernel's own, read by the agent from
 * /proc/<tgid>/task/<tid>/cwd (agent/sensors/cwd.py):
 *  - chdir/fchdir entered: inflight++; returned: inflight--, and on success a
 *    new gen (a global counter: never reused, by no process), SIGSTOP to the
 *    process and a cwd_req record. The agent reads the cwd, writes
 *    enf_cwd[tgid] = {gen, path} and sends SIGCONT.
 *  - enf_cwd counts only while its gen equals enf_cwd_gen's, no chdir is in
 *    flight and no flag is set. The invariant (docs/enforcement.md, "Early
 *    SIGCONT"): the agent reads the cwd after the gen it writes was made, and
 *    every later change of the cwd is made by a chdir of this process that is
 *    in flight or has bumped the gen -- so a current entry names the cwd, and
 *    a process continued early (a sibling's SIGCONT, the kernel's orphaned
 *    process group SIGHUP+SIGCONT, a tracer swallowing the SIGSTOP) only ever
 *    finds its cwd unknown. The stop is for availability, not for safety.
 *  - what breaks "every change is a chdir of this process" sets a flag, and
 *    the cwd is unknown for good (cwd_unknown): clone(CLONE_FS) without
 *    CLONE_THREAD (both processes: either may change the one cwd), a thread
 *    created without CLONE_FS or unshare(CLONE_FS) (threads with cwds of their
 *    own: the agent reads one thread's), and leaving the sandbox's view of
 *    paths -- unshare(CLONE_NEWNS), setns, chroot -- which the children
 *    inherit (a pivot_root in the new namespace moves their cwds too).
 *  - fork: the child inherits the verified cwd (a copy of the parent's) when
 *    the parent's counts; otherwise it starts unknown until its own chdir. Its
 *    entries are always rewritten (a reused pid never inherits stale ones).
 *  - exempt tasks (dsec-init and its children until they exec: dsec's own
 *    code, which no workload code runs in) are not stopped: an absolute path
 *    they chdir to counts at once (read at sys_enter), and the agent verifies
 *    it too.
 * With no agent (no heartbeat in cwd_agent for 2 s) nothing is stopped: the cwd
 * just becomes unknown. These programs are pinned with the exec check (they
 * outlive the agent, so a cwd never goes stale unseen).
 * Tracked in sandboxes whose exec check is on (audit or enforce: audit mode
 * must report what enforce would refuse, no more) and in learn mode, where
 * process.c reads these maps (pinned, shared) at the same sched_process_exec
 * and puts the cwd that counts into the exec record: learning's <cwd>/<name>
 * is the check's by construction, whether or not the process is still there
 * when the record is decoded. Anything else -- cwd not
 * known, '.', '..' or empty components once joined, too long -- is refused,
 * with a status bit saying why. */
BPF_F_TABLE("hash", u32, struct dsec_cwd_gen, enf_cwd_gen, DSEC_CWD_ENTRIES, BPF_F_NO_PREALLOC);
BPF_F_TABLE("hash", u32, struct dsec_cwd, enf_cwd, DSEC_CWD_ENTRIES, BPF_F_NO_PREALLOC);
/* tid -> the path an exempt task passed to chdir (sys_enter -> sys_exit) */
BPF_F_TABLE("hash", u32, struct dsec_cwd, cwd_entered, 4096, BPF_F_NO_PREALLOC);
BPF_PERCPU_ARRAY(cwd_scratch, struct dsec_cwd, 1);
BPF_PERCPU_ARRAY(cwd_join, struct dsec_cwd_join, 1);
BPF_PERF_OUTPUT(cwd_req);
/* [0] = bpf_ktime_get_ns() of the agent's last heartbeat (agent/sensors/cwd.py): with
 * no agent to continue it, a process is not stopped -- its cwd just stays unknown */
BPF_ARRAY(cwd_agent, u64, 1);
/* [0] = the last gen handed out (a gen is never 0) */
BPF_ARRAY(cwd_seq, u64, 1);
#define DSEC_CWD_AGENT_NS 2000000000ULL

#define DSEC_SIGSTOP 19
#define DSEC_CLONE_FS 0x00000200ULL
#define DSEC_CLONE_NEWNS 0x00020000ULL

static __always_inline int cwd_tracked(void)
{
    u64 cgid = 0;
    struct dsec_enf_sandbox *cfg = dsec_sandbox(&cgid);
    /* learn mode too (whatever its exec rules): the audit sensor's exec record of a
     * relative exec carries the verified cwd (process.c), so learning places it where
     * the check will match it (issue 21) */
    return cfg && (cfg->exec == DSEC_MODE_ENFORCE || cfg->exec == DSEC_MODE_AUDIT || cfg->sys == DSEC_MODE_LEARN);
}

/* the current process's gen entry, created when missing (NULL: no room -- an
 * enf_cwd entry never counts without one) */
static __always_inline struct dsec_cwd_gen *cwd_gen_of(u32 tgid)
{
    struct dsec_cwd_gen *g = enf_cwd_gen.lookup(&tgid);
    if (g)
        return g;
    struct dsec_cwd_gen ng = {};
    enf_cwd_gen.update(&tgid, &ng);
    return enf_cwd_gen.lookup(&tgid);
}

static __always_inline void cwd_enter(const char *filename)
{
    if (!cwd_tracked())
        return;
    u64 pt = bpf_get_current_pid_tgid();
    u32 tgid = pt >> 32, tid = (u32)pt;
    struct dsec_cwd_gen *g = cwd_gen_of(tgid);
    if (!g)
        return;
    __sync_fetch_and_add(&g->inflight, 1);
    if (!filename || !enf_exempt.lookup(&tgid))
        return;
    u32 zero = 0;
    struct dsec_cwd *c = cwd_scratch.lookup(&zero);
    if (!c)
        return;
    long n = bpf_probe_read_user_str(c->path, sizeof(c->path), filename);
    if (n <= 1 || n >= (long)sizeof(c->path) || c->path[0] != '/')
        return;            /* relative, empty or too long: left to the agent */
    c->len = n - 1;
    cwd_entered.update(&tid, c);
}

static __always_inline void cwd_exit(void *ctx, long ret)
{
    u64 pt = bpf_get_current_pid_tgid();
    u32 tgid = pt >> 32, tid = (u32)pt;
    struct dsec_cwd_gen *g = enf_cwd_gen.lookup(&tgid);
    if (!g) {
        cwd_entered.delete(&tid);
        return;
    }
    if (g->inflight)
        __sync_fetch_and_add(&g->inflight, (u32)-1);
    if (ret != 0) {
        cwd_entered.delete(&tid);
        return;            /* failed: the cwd did not change */
    }
    /* gen: a global counter, so a late verification of a pid that died never
     * matches the process that reuses the pid, and two threads' chdirs never
     * get one gen */
    u32 zero = 0;
    u64 *seq = cwd_seq.lookup(&zero);
    if (!seq) {
        g->gen = 0;        /* matches no entry (the agent never writes gen 0) */
        cwd_entered.delete(&tid);
        return;
    }
    u64 gen = __sync_fetch_and_add(seq, 1) + 1;
    g->gen = gen;
    u64 cgid = 0;
    struct dsec_enf_sandbox *cfg = dsec_sandbox(&cgid);
    if (!cfg) {
        cwd_entered.delete(&tid);
        return;
    }
    struct dsec_cwd_req r = {};
    r.cgroup_id = cgid;
    r.gen = gen;
    r.tgid = tgid;
    r.tid = tid;
    if (enf_exempt.lookup(&tgid)) {
        struct dsec_cwd *c = cwd_entered.lookup(&tid);
        if (c) {
            c->gen = gen;
            enf_cwd.update(&tgid, c);
            cwd_entered.delete(&tid);
        }
    } else {
        /* stopped until the agent has read the cwd: a relative exec right after
         * the chdir (subprocess's cwd=, make -C) is then matched, not refused */
        u64 *hb = cwd_agent.lookup(&zero);
        if (!hb || bpf_ktime_get_ns() - *hb > DSEC_CWD_AGENT_NS)
            return;        /* no agent: not stopped; the new gen leaves the cwd unknown */
        r.stopped = bpf_send_signal(DSEC_SIGSTOP) == 0;
    }
    cwd_req.perf_submit(ctx, &r, sizeof(r));
}

TRACEPOINT_PROBE(syscalls, sys_enter_chdir)
{
    cwd_enter(args->filename);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_fchdir)
{
    cwd_enter(0);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_chdir)
{
    cwd_exit(args, args->ret);
    return 0;
}
DSEC_ATTACH_ALSO(syscalls, sys_exit_chdir, sys_exit_fchdir)     /* one layout (shared.h) */

/* the current process's cwd is no longer one the agent can read for it
 * (DSEC_CWD_SPLIT / _SHARED / _NS): unknown for good. Not for exempt tasks
 * (dsec-init sets the sandbox's namespaces up: that is the sandbox's view). */
static __always_inline void cwd_mark(u32 flag)
{
    u64 cgid = 0;
    if (!dsec_sandbox(&cgid))
        return;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (enf_exempt.lookup(&tgid))
        return;
    struct dsec_cwd_gen *g = cwd_gen_of(tgid);
    if (g)
        __sync_fetch_and_or(&g->flags, flag);
}

/* task_newtask, a process in a sandbox: it gets a copy of the parent's cwd --
 * or the same one (CLONE_FS) */
static __always_inline void cwd_fork(u32 child, u64 flags)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    struct dsec_cwd_gen *g = enf_cwd_gen.lookup(&tgid);
    if (!g) {
        /* the parent's cwd is unknown: so is the child's (a reused pid's stale entries go) */
        enf_cwd_gen.delete(&child);
        enf_cwd.delete(&child);
        return;
    }
    struct dsec_cwd_gen ng = {};
    ng.gen = g->gen;
    ng.flags = g->flags & DSEC_CWD_NS;      /* another view of paths: its children's too */
    /* the parent's entry holds for the child only when it counts for the parent
     * and the child gets a copy */
    int copy = !g->inflight && !g->flags && !(flags & DSEC_CLONE_FS);
    if (flags & DSEC_CLONE_FS) {
        ng.flags |= DSEC_CWD_SHARED;
        if (!enf_exempt.lookup(&tgid))
            __sync_fetch_and_or(&g->flags, DSEC_CWD_SHARED);
    }
    struct dsec_cwd *c = enf_cwd.lookup(&tgid);
    if (enf_cwd_gen.update(&child, &ng) != 0) {
        enf_cwd_gen.delete(&child);
        copy = 0;
    }
    if (c && copy && c->gen == g->gen)
        enf_cwd.update(&child, c);
    else
        enf_cwd.delete(&child);
}

static __always_inline void cwd_gone(u32 tgid)
{
    /* looked up first (see dsec_track_exit): most exits of the node have neither */
    if (enf_cwd_gen.lookup(&tgid))
        enf_cwd_gen.delete(&tgid);
    if (enf_cwd.lookup(&tgid))
        enf_cwd.delete(&tgid);
}

TRACEPOINT_PROBE(syscalls, sys_enter_setns)
{
    cwd_mark(DSEC_CWD_NS);         /* a mount namespace's root and cwd replace the process's */
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_chroot)
{
    cwd_mark(DSEC_CWD_NS);         /* the same cwd, under another root: another path */
    return 0;
}

/* Is <cwd>/<name> in the allowlist? k holds the kernel's relative filename (n
 * bytes with its NUL, as read into the key) and is rewritten to the joined
 * path. Returns 1 (allowed) or 0, and ORs DSEC_ST_CWD_JOINED / _CWD_UNKNOWN /
 * _NOT_CANONICAL into *status. */
static __always_inline int enf_exec_relative(struct dsec_exec_key *k, u32 idx, long n, u32 *status)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    struct dsec_cwd_gen *g = enf_cwd_gen.lookup(&tgid);
    struct dsec_cwd *c = enf_cwd.lookup(&tgid);
    if (!dsec_cwd_counts(g, c)) {         /* shared.h: the exec record applies the same rule */
        *status |= DSEC_ST_CWD_UNKNOWN;
        return 0;
    }
    if (n >= (long)sizeof(k->path)) {
        *status |= DSEC_ST_NOT_CANONICAL;      /* cut in the key: too long to be checked whole */
        return 0;
    }
    u32 zero = 0;
    struct dsec_cwd_join *j = cwd_join.lookup(&zero);
    if (!j)
        return 0;
    u32 skip = 0;      /* leading "./" */
    for (int i = 0; i < 8; i++) {
        if (k->path[skip & 127] == '.' && k->path[(skip + 1) & 127] == '/')
            skip += 2;
        else
            break;
    }
    u32 len = c->len;
    if (len == 0 || len > DSEC_EXEC_KEY_PATH - 2) {
        *status |= DSEC_ST_CWD_UNKNOWN;
        return 0;
    }
    if (len == 1)
        len = 0;       /* cwd "/": "/" + name */
    asm volatile("" : "+r"(len));      /* keep the mask: the verifier needs the bound */
    len &= 255;
    if (len > DSEC_EXEC_KEY_PATH - 2)
        return 0;
    bpf_probe_read_kernel(j->b, len, c->path);
    j->b[len & 255] = '/';
    long m = bpf_probe_read_kernel_str(&j->b[(len + 1) & 255], 256, &k->path[skip & 127]);
    if (m <= 1) {
        *status |= DSEC_ST_NOT_CANONICAL;      /* "./" alone */
        return 0;
    }
    u32 total = len + 1 + (u32)m;      /* with the NUL */
    /* canonical once joined (the cwd is the kernel's): no "//", "/./", "/../",
     * no trailing "/." "/..", short enough for a key -- enf_canonical, as for
     * an absolute filename */
    if (total > DSEC_EXEC_PATTERN_MAX + 1 || !enf_canonical(j->b, total - 1)) {
        *status |= DSEC_ST_NOT_CANONICAL;
        return 0;
    }
    *status |= DSEC_ST_CWD_JOINED;
    __builtin_memset(k->path, 0, sizeof(k->path));
    bpf_probe_read_kernel(k->path, DSEC_EXEC_KEY_PATH, j->b);
    k->prefixlen = (4 + total) * 8;
    k->idx = idx;
    return exec_allow.lookup(k) != 0;
}

TRACEPOINT_PROBE(sched, sched_process_exec)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    /* a fresh image: an exempt task (the supervisor's child) is the workload now */
    enf_exempt.delete(&tgid);

    u64 cgid = 0;
    struct dsec_enf_sandbox *cfg = dsec_sandbox(&cgid);
    if (!cfg)
        return 0;
    u32 mode = cfg->exec;
    if (mode != DSEC_MODE_AUDIT && mode != DSEC_MODE_ENFORCE)
        return 0;

    u32 zero = 0;
    struct dsec_exec_key *k = exec_key_scratch.lookup(&zero);
    struct dsec_event_small *e = enf_scratch.lookup(&zero);
    if (!k || !e)
        return 0;
    u32 floc = args->data_loc_filename & 0xFFFF;
    const char *fname = (const char *)args + floc;
    long m = bpf_probe_read_kernel_str(&e->buf[0], DSEC_PATH_MAX, fname);
    __builtin_memset(k->path, 0, sizeof(k->path));
    long n = bpf_probe_read_kernel_str(k->path, sizeof(k->path), fname);
    int canonical = m > 0 && enf_canonical(&e->buf[0], (u32)m - 1);
    int hit = 0;
    int rel = n > 1 && k->path[0] != '/';
    u32 rel_status = 0;
    if (rel) {
        hit = enf_exec_relative(k, cfg->idx, n, &rel_status);     /* issue 21: <cwd>/<name> */
    } else if (n > 0 && canonical) {
        u32 bytes = n;     /* with the NUL */
        if (bytes >= DSEC_EXEC_KEY_PATH)
            bytes = DSEC_EXEC_KEY_PATH - 1;   /* cut: the NUL is not the filename's end */
        k->prefixlen = (4 + bytes) * 8;
        k->idx = cfg->idx;
        hit = exec_allow.lookup(k) != 0;
    }
    if (hit)
        return 0;

    int enforce = mode == DSEC_MODE_ENFORCE;
    long sret = 0;
    struct dsec_enf_state *st = enf_state.lookup(&cgid);
    if (enforce) {
        /* pending SIGKILL: delivered on the way back to user space, before the
         * new image (or its dynamic loader) runs a single instruction */
        sret = bpf_send_signal(DSEC_SIGKILL);
        if (st)
            __sync_fetch_and_add(&st->killed, 1);
    }
    if (!st)
        return 0;
    u32 kind = enforce ? DSEC_KIND_EXEC_DENIED : DSEC_KIND_EXEC_VIOLATION;
    if (!enf_admit(cfg, st, kind))
        return 0;
    __builtin_memset(&e->u, 0, sizeof(e->u));
    dsec_fill_hdr(&e->h, kind, cgid, cfg->step);
    e->u.exec_check.signal_ret = sret;
    e->u.exec_check.old_tid = args->old_pid;
    u32 status = 0;
    if (m > 0 && !canonical && !rel)
        status |= DSEC_ST_NOT_CANONICAL;      /* (a relative name: rel_status says) */
    if (m <= 0) {
        e->buf[0] = 0;
        m = 1;
        status |= DSEC_ST_PATH_FAULT;
    } else if (m == DSEC_PATH_MAX) {
        status |= DSEC_ST_PATH_TRUNC;
    }
    if (e->buf[0] != '/')
        status |= DSEC_ST_NOT_ABSOLUTE;
    status |= rel_status;
    e->u.exec_check.path_len = m - 1;
    e->u.exec_check.status = status;
    u64 size = dsec_record_size(DSEC_FIXED_BYTES + m, sizeof(struct dsec_event_small));
    e->h.size = size;
    if (!enf_admit_bytes(cfg, st, kind, size))
        return 0;
    if (enf_events.ringbuf_output(e, size, 0) == 0)
        enf_count_emitted(st, kind);
    else
        enf_count_lost(st, DSEC_LOST_RINGBUF_FULL, kind);
    return 0;
}

/* A refused executable mapping (a file on a noexec layer): the exec check's
 * second half. PROT_EXEC = 4; the fd comes with the record, userspace names
 * the file. Only sandboxes whose exec rules are enforced. */
TRACEPOINT_PROBE(syscalls, sys_enter_mmap)
{
    if (!(args->prot & 4) || (long)args->fd < 0)
        return 0;
    u64 cgid = 0;
    struct dsec_enf_sandbox *cfg = dsec_sandbox(&cgid);
    if (!cfg || cfg->exec != DSEC_MODE_ENFORCE)
        return 0;
    u32 tid = bpf_get_current_pid_tgid();
    s64 fd = (long)args->fd;
    u32 zero = 0;
    s64 *n = mmap_inflight.lookup(&zero);
    if (!n)
        return 0;
    __sync_fetch_and_add(n, 1);             /* counted before the entry is there */
    if (mmap_pending.update(&tid, &fd) != 0)
        __sync_fetch_and_add(n, -1);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_mmap)
{
    u32 zero = 0;
    s64 *n = mmap_inflight.lookup(&zero);
    if (!n || *(volatile s64 *)n <= 0)
        return 0;
    u32 tid = bpf_get_current_pid_tgid();
    s64 *pfd = mmap_pending.lookup(&tid);
    if (!pfd)
        return 0;
    s64 fd = *pfd;
    if (mmap_pending.delete(&tid) == 0)
        __sync_fetch_and_add(n, -1);        /* uncounted after it is gone */
    if (args->ret != -DSEC_EPERM)
        return 0;
    u64 cgid = 0;
    struct dsec_enf_sandbox *cfg = dsec_sandbox(&cgid);
    if (!cfg)
        return 0;
    struct dsec_enf_state *st = enf_state.lookup(&cgid);
    if (!st || !enf_admit(cfg, st, DSEC_KIND_EXEC_DENIED))
        return 0;
    struct dsec_event_small *e = enf_reserve(cfg, st, DSEC_KIND_EXEC_DENIED, cgid);
    if (!e)
        return 0;
    e->u.exec_check.status = DSEC_ST_MMAP_NOEXEC;
    e->u.exec_check.fd = (s32)fd;
    e->u.exec_check.path_len = 0;            /* no path: a fixed-size record */
    enf_submit(e, st, DSEC_KIND_EXEC_DENIED);
    return 0;
}

/* ---- sockets ------------------------------------------------------------------- */

static __always_inline int enf_sock_proto_ok(struct dsec_sock_rule *r, u64 proto)
{
    u32 n = r->nproto;
    if (n == 0)
        return 1;
    for (int i = 0; i < DSEC_SOCK_PROTOS; i++) {
        if ((u32)i >= n)
            break;
        if (r->proto[i] == proto)
            return 1;
    }
    return 0;
}

/* do the policy's socket rules let socket(family, type, protocol) through? */
static __always_inline int enf_sock_ok(u32 idx, u64 family, u64 type, u64 proto)
{
    struct dsec_sock_key k = {};
    k.idx = idx;
    k.family = DSEC_SOCK_RULES_ON;
    k.type = DSEC_SOCK_ANY_TYPE;
    if (!sock_rules.lookup(&k))
        return 1;                   /* no socket rules: any socket */
    if (family >= DSEC_SOCK_RULES_ON || proto > 0xFFFF)
        return 0;
    k.family = family;
    k.type = type & 0xf;
    struct dsec_sock_rule *r = sock_rules.lookup(&k);
    if (r && enf_sock_proto_ok(r, proto))
        return 1;
    k.type = DSEC_SOCK_ANY_TYPE;
    r = sock_rules.lookup(&k);
    return r && enf_sock_proto_ok(r, proto);
}

/* One violation of syscall number `nr` (already mapped: every number >=
 * DSEC_SYSCALL_NR_MAX is DSEC_SYSCALL_NR_OTHER): counted in sys_viol under
 * (sandbox, nr), at most DSEC_SYSVIOL_PER_SANDBOX keys per sandbox (the rest is
 * counted in the sandbox's sys_overflow and as table_full): one sandbox cannot
 * fill the table for the others, and userspace walks the counters only of
 * sandboxes that have some (st->sys_entries). Reported at most once per
 * report_ns per key, through the sandbox's event and byte budgets: the reserved
 * record (total, ret, nr filled; *stp its sandbox's state, for enf_submit), or
 * NULL when this one is only counted. */
static __always_inline struct dsec_event_small *enf_sys_record(struct dsec_enf_sandbox *cfg, u64 cgid, u32 kind,
                                                               u32 nr, long ret, struct dsec_enf_state **stp)
{
    struct dsec_enf_state *st = enf_state.lookup(&cgid);
    if (!st)
        return NULL;
    struct dsec_sys_key k = {};
    k.cgroup_id = cgid;
    k.nr = nr;
    struct dsec_sys_viol *v = sys_viol.lookup(&k);
    if (!v) {
        u64 n = __sync_fetch_and_add(&st->sys_entries, 1);
        if (n >= DSEC_SYSVIOL_PER_SANDBOX) {
            __sync_fetch_and_add(&st->sys_entries, -1);
            __sync_fetch_and_add(&st->sys_overflow, 1);
            enf_count_lost(st, DSEC_LOST_TABLE_FULL, kind);
            return NULL;
        }
        struct dsec_sys_viol nv = {};
        if (sys_viol.insert(&k, &nv) != 0)
            __sync_fetch_and_add(&st->sys_entries, -1);   /* another CPU's, or no room */
        v = sys_viol.lookup(&k);
        if (!v) {
            __sync_fetch_and_add(&st->sys_overflow, 1);
            enf_count_lost(st, DSEC_LOST_TABLE_FULL, kind);
            return NULL;
        }
    }
    u64 total = __sync_fetch_and_add(&v->count, 1) + 1;
    v->last_pid = bpf_get_current_pid_tgid() >> 32;
    v->last_ret = ret;
    u64 now = bpf_ktime_get_ns();
    u64 last = *(volatile u64 *)&v->last_ns;
    if (last && now - last < cfg->report_ns)
        return NULL;     /* counted; reported with a later record or by userspace */
    if (__sync_val_compare_and_swap(&v->last_ns, last, now) != last)
        return NULL;     /* another CPU reports it */
    if (!enf_admit(cfg, st, kind))
        return NULL;     /* counted over_budget; the total still reaches userspace's summary */
    struct dsec_event_small *e = enf_reserve(cfg, st, kind, cgid);
    if (!e)
        return NULL;
    e->u.syscall.total = total;
    e->u.syscall.ret = ret;
    e->u.syscall.nr = nr;
    *stp = st;
    return e;
}

static __always_inline void enf_sock_violation(struct dsec_enf_sandbox *cfg, u64 cgid, u32 kind, long id,
                                               long ret, u64 family, u64 type, u64 proto)
{
    struct dsec_enf_state *st = NULL;
    struct dsec_event_small *e = enf_sys_record(cfg, cgid, kind, (u32)id, ret, &st);
    if (!e || !st)
        return;
    e->u.syscall.status = DSEC_ST_SOCKET;
    e->u.syscall.sock_family = family;
    e->u.syscall.sock_type = type;
    e->u.syscall.sock_protocol = proto;
    enf_submit(e, st, kind);
}

static __always_inline void enf_sock_audit(long id, u64 family, u64 type, u64 proto)
{
    u64 cgid = 0;
    struct dsec_enf_sandbox *cfg = dsec_sandbox(&cgid);
    if (!cfg || cfg->sys != DSEC_MODE_AUDIT)
        return;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (enf_exempt.lookup(&tgid))
        return;
    if (!enf_sock_ok(cfg->idx, family, type, proto))
        enf_sock_violation(cfg, cgid, DSEC_KIND_SYSCALL_VIOLATION, id, 0, family, type, proto);
}

TRACEPOINT_PROBE(syscalls, sys_enter_socket)
{
    enf_sock_audit(DSEC_NR_SOCKET, (u64)args->family, (u64)args->type, (u64)args->protocol);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_socketpair)
{
    enf_sock_audit(DSEC_NR_SOCKETPAIR, (u64)args->family, (u64)args->type, (u64)args->protocol);
    return 0;
}

/* ---- process tree: exemption inheritance, parents ------------------------------ */

TRACEPOINT_PROBE(task, task_newtask)
{
    if (args->clone_flags & DSEC_CLONE_THREAD) {
        /* a thread without CLONE_FS has a cwd of its own: the process's is not one */
        if (!(args->clone_flags & DSEC_CLONE_FS))
            cwd_mark(DSEC_CWD_SPLIT);
        return 0;
    }
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u32 child = args->pid;
    u64 *ex = enf_exempt.lookup(&tgid);
    if (ex) {
        u64 c = *ex;
        /* no room: the child is checked (reports too much, never too little) */
        enf_exempt.update(&child, &c);
    }
    u64 cgid = 0;
    if (dsec_track_fork(child, args->clone_flags, &cgid))
        cwd_fork(child, args->clone_flags);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    if (!args->group_dead)
        return 0;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (enf_exempt.lookup(&tgid))
        enf_exempt.delete(&tgid);
    dsec_track_exit(tgid);
    cwd_gone(tgid);
    return 0;
}

/* ---- syscalls ------------------------------------------------------------------ */

static __always_inline int enf_sys_allowed(struct dsec_enf_sandbox *cfg, long id)
{
    if (id < 0 || id >= DSEC_SYSCALL_NR_MAX)
        return 0;
    u32 i = id;
    u8 byte = cfg->sys_allow[(i >> 3) & (DSEC_SYSCALL_NR_MAX / 8 - 1)];
    return (byte >> (i & 7)) & 1;
}

/* One violation of syscall `id` (enf_sys_record counts and reports it). */
static __always_inline void enf_sys_violation(struct dsec_enf_sandbox *cfg, u64 cgid, u32 kind,
                                              long id, long ret, u32 status)
{
    u32 nr = (id >= 0 && id < DSEC_SYSCALL_NR_MAX) ? (u32)id : DSEC_SYSCALL_NR_OTHER;
    struct dsec_enf_state *st = NULL;
    struct dsec_event_small *e = enf_sys_record(cfg, cgid, kind, nr, ret, &st);
    if (!e || !st)
        return;
    e->u.syscall.status = status;
    enf_submit(e, st, kind);
}

/* Is syscall `id` set in sys_common (enforce mode's exits) or, `audit`,
 * sys_common_audit (learn and audit mode's entries)? */
static __always_inline int enf_sys_common(long id, int audit)
{
    if (id < 0 || id >= DSEC_SYSCALL_NR_MAX)
        return 0;
    u32 w = (u32)id >> 6;
    u64 *bits = audit ? sys_common_audit.lookup(&w) : sys_common.lookup(&w);
    return bits && ((*bits >> (id & 63)) & 1);
}

RAW_TRACEPOINT_PROBE(sys_enter)
{
    long id = (long)ctx->args[1];
    if (enf_sys_common(id, 1))      /* nothing any sandbox counts or reports */
        return 0;
    u64 cgid = 0;
    struct dsec_enf_sandbox *cfg = dsec_sandbox(&cgid);
    if (!cfg)
        return 0;
    u32 mode = cfg->sys;
    if (mode != DSEC_MODE_LEARN && mode != DSEC_MODE_AUDIT)
        return 0;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (enf_exempt.lookup(&tgid))
        return 0;
    if (mode == DSEC_MODE_LEARN) {
        struct dsec_sys_counts *c = sys_counts.lookup(&cgid);
        if (!c)
            return 0;
        if (id >= 0 && id < DSEC_SYSCALL_NR_MAX) {
            u32 i = id;
            __sync_fetch_and_add(&c->n[i & (DSEC_SYSCALL_NR_MAX - 1)], 1);
        } else {
            struct dsec_enf_state *st = enf_state.lookup(&cgid);
            if (st)
                __sync_fetch_and_add(&st->sys_out_of_range, 1);
        }
        return 0;
    }
    /* audit: seccomp is permissive (SCMP_ACT_LOG), every call comes through here */
    if (!enf_sys_allowed(cfg, id))
        enf_sys_violation(cfg, cgid, DSEC_KIND_SYSCALL_VIOLATION, id, 0, 0);
    return 0;
}

/* audit mode and namespaces: deny: seccomp lets a namespace-creating clone/unshare
 * through (SCMP_ACT_LOG); the syscall tracepoints give the flags without reading
 * any kernel struct. CLONE_NEW{NS,CGROUP,UTS,IPC,USER,PID,NET,TIME}. */
#define DSEC_CLONE_NEW_ANY (0x00020000UL | 0x02000000UL | 0x04000000UL | 0x08000000UL | \
                            0x10000000UL | 0x20000000UL | 0x40000000UL | 0x00000080UL)

static __always_inline void enf_ns_audit(long id, unsigned long flags)
{
    u64 cgid = 0;
    struct dsec_enf_sandbox *cfg = dsec_sandbox(&cgid);
    if (!cfg || cfg->sys != DSEC_MODE_AUDIT || !cfg->ns_deny || !(flags & DSEC_CLONE_NEW_ANY))
        return;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (enf_exempt.lookup(&tgid))
        return;
    enf_sys_violation(cfg, cgid, DSEC_KIND_SYSCALL_VIOLATION, id, 0, DSEC_ST_NAMESPACES);
}

TRACEPOINT_PROBE(syscalls, sys_enter_unshare)
{
    enf_ns_audit(DSEC_NR_UNSHARE, args->unshare_flags);
    if (args->unshare_flags & DSEC_CLONE_NEWNS)
        cwd_mark(DSEC_CWD_NS);         /* another mount namespace (and, implied, CLONE_FS) */
    else if (args->unshare_flags & DSEC_CLONE_FS)
        cwd_mark(DSEC_CWD_SPLIT);      /* this thread's cwd is its own from now on */
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_clone)
{
    enf_ns_audit(DSEC_NR_CLONE, args->clone_flags);
    return 0;
}

/* enforce mode, every syscall exit of a sandbox (attached only while one needs
 * it: it runs for every syscall on the host). The raw tracepoint: ctx->args[1]
 * is the result, ctx->args[0] the entry registers (x86_64 struct pt_regs, a
 * fixed ABI layout: orig_ax, di, si, dx) -- cheaper than raw_syscalls:sys_exit,
 * the tracepoint this was (bench/kcost.py --policy default: 221 ns a run there,
 * and a second program on this one for the socket rules, 83 ns a run). A call
 * allowed by number in every enforce-mode sandbox returns after one bitmap
 * test (sys_common), before the membership look-up (its hash look-up was
 * ~40% of a sandbox task's run); one allowed by its own sandbox's after a
 * second; the exemption is looked up only for what would be reported.
 *
 * Reported: a call seccomp refused (no sys_enter: its number and what seccomp
 * returned, -errno; the number itself when it killed), a call outside the
 * bitmap that returned normally (docs/enforcement.md "Syscalls"), a namespace
 * clone/unshare refused with EPERM, and a socket()/socketpair() refused whose
 * arguments are outside the policy's socket rules. */
RAW_TRACEPOINT_PROBE(sys_exit)
{
    const char *regs = (const char *)ctx->args[0];
    u64 nr = 0;
    bpf_probe_read_kernel(&nr, sizeof(nr), regs + DSEC_PT_REGS_ORIG_AX);
    long id = (long)nr;
    /* id -1: rt_sigreturn sets orig_ax to -1 (no syscall restart) and the exit
     * then reports the interrupted call's restored result: not a call */
    if (id < 0)
        return 0;
    if (enf_sys_common(id, 0))      /* allowed in every enforce-mode sandbox: done */
        return 0;
    u64 cgid = 0;
    struct dsec_enf_sandbox *cfg = dsec_sandbox(&cgid);
    if (!cfg || cfg->sys != DSEC_MODE_ENFORCE)
        return 0;
    long ret = (long)ctx->args[1];
    int sock = ret < 0 && (nr == DSEC_NR_SOCKET || nr == DSEC_NR_SOCKETPAIR);
    int allowed = enf_sys_allowed(cfg, id);
    /* clone/unshare are allowed by number; seccomp checks their flags */
    int ns = allowed && cfg->ns_deny && ret == -DSEC_EPERM && (id == DSEC_NR_CLONE || id == DSEC_NR_UNSHARE);
    if (allowed && !ns && !sock)
        return 0;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (enf_exempt.lookup(&tgid))
        return 0;
    if (sock) {
        u64 a[3] = {};
        bpf_probe_read_kernel(&a[0], 8, regs + DSEC_PT_REGS_DI);
        bpf_probe_read_kernel(&a[1], 8, regs + DSEC_PT_REGS_SI);
        bpf_probe_read_kernel(&a[2], 8, regs + DSEC_PT_REGS_DX);
        if (!enf_sock_ok(cfg->idx, a[0], a[1], a[2]))
            enf_sock_violation(cfg, cgid, DSEC_KIND_SYSCALL_DENIED, id, ret, a[0], a[1], a[2]);
        if (allowed)
            return 0;
    }
    if (ns)
        enf_sys_violation(cfg, cgid, DSEC_KIND_SYSCALL_DENIED, id, ret, DSEC_ST_NAMESPACES);
    else if (!allowed)
        enf_sys_violation(cfg, cgid, DSEC_KIND_SYSCALL_DENIED, id, ret, 0);
    return 0;
}
