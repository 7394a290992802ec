/* dsec audit events: the one declaration of what leaves the kernel.
 *
 * Userspace never mirrors these structs by hand: agent/sensors/audit.py asks BCC
 * for the ctypes type of a map whose value is `struct dsec_event`
 * (exec_scratch), and agent/sensors/decoder.py reads the header, the body and the
 * string area from it. The #define constants below are read by the loader with
 * a regex (DSEC_KIND_*, DSEC_SYS_*, DSEC_ST_*, DSEC_LOST_*, DSEC_EXIT_*,
 * DSEC_OVER_*), so a name added here is known to Python at once.
 *
 * This header holds types and constants only (no maps, no code): BCC rewrites
 * map calls only in the main source, see common.h.
 *
 * Wire format of one ring-buffer record (variable length, at least
 * DSEC_FIXED_BYTES):
 *
 *     struct dsec_hdr     h     common header (64 bytes)
 *     union dsec_body     u     the kind's fixed fields
 *     char buf[...]             strings, only the used part is sent:
 *        exec:       path at buf[0] (path_len bytes, then NUL),
 *                    argv at buf[argv_off] (argv_len bytes: argc strings,
 *                    each NUL-terminated; the last one may be cut, see status),
 *                    with DSEC_ST_LATE_READ the path at buf[late_off]
 *        open/unlink path at buf[0] (path_len bytes, then NUL)
 *        rename:     old path at buf[0], new path at buf[path2_off]
 *        fork, exit, connect: no strings
 *
 * Bounds (documented in docs/audit.md):
 *   DSEC_PATH_MAX   bytes read for one path, NUL included (PATH_MAX)
 *   DSEC_ARGV_BYTES bytes of argv captured per exec, NULs included
 *   DSEC_MAX_ARGS   arguments captured per exec
 * Anything beyond sets DSEC_ST_ARGV_TRUNC / DSEC_ST_PATH_TRUNC.
 */
#ifndef DSEC_EVENTS_H
#define DSEC_EVENTS_H

/* ---- build-time configuration (the loader passes -D for each) ---------- */
#ifndef DSEC_RING_PAGES
#define DSEC_RING_PAGES 8192           /* 32 MiB with 4 KiB pages; power of two */
#endif
#ifndef DSEC_ARGV_BYTES
#define DSEC_ARGV_BYTES 16384          /* power of two, 4 KiB .. 128 KiB */
#endif
#ifndef DSEC_EXEC_OFF_MASK
#define DSEC_EXEC_OFF_MASK 32767       /* next_pow2(DSEC_PATH_MAX + DSEC_ARGV_BYTES) - 1 */
#endif
#ifndef DSEC_MAX_ARGS
#define DSEC_MAX_ARGS 256
#endif
#ifndef DSEC_NCPU
#define DSEC_NCPU 64                   /* possible CPUs (exec scratch slots) */
#endif
#ifndef DSEC_MAX_INFLIGHT
#define DSEC_MAX_INFLIGHT 512          /* per sandbox and kind: syscalls between enter and exit */
#endif
#ifndef DSEC_PENDING_ENTRIES
#define DSEC_PENDING_ENTRIES 16384     /* all sandboxes: in-flight file/connect syscalls */
#endif
#ifndef DSEC_PENDING_RESERVE
#define DSEC_PENDING_RESERVE (DSEC_PENDING_ENTRIES / 4)   /* of them, kept for sandboxes with few in flight */
#endif
#ifndef DSEC_PENDING_FAIR
#define DSEC_PENDING_FAIR 16           /* per sandbox: in flight that may come out of the reserve */
#endif
#ifndef DSEC_PENDING_EXEC_ENTRIES
#define DSEC_PENDING_EXEC_ENTRIES 2048 /* all sandboxes: in-flight execs (each table, below) */
#endif
#ifndef DSEC_EXEC_SMALL_BUF
#define DSEC_EXEC_SMALL_BUF 2048       /* string area of an exec record in flight in the small table */
#endif
#ifndef DSEC_MAX_SANDBOXES
#define DSEC_MAX_SANDBOXES 4096
#endif
#ifndef DSEC_MAX_LEVEL
#define DSEC_MAX_LEVEL 16              /* cgroup depth searched for a sandbox ancestor */
#endif
#ifndef DSEC_AGG_ENTRIES
#define DSEC_AGG_ENTRIES 16384         /* all sandboxes: repeated records counted in the kernel (`agg`) */
#endif
#ifndef DSEC_AGG_PER_SANDBOX
#define DSEC_AGG_PER_SANDBOX 1024      /* of them, held by one sandbox at once (the rest emitted in full) */
#endif
#define DSEC_AGG_STR 256               /* string area of a record that may be counted as a repeat */
#ifndef DSEC_PENDING_SMALL_ENTRIES
#define DSEC_PENDING_SMALL_ENTRIES 8192 /* of DSEC_PENDING_ENTRIES, in the small table (the rest: the big one) */
#endif
#define DSEC_FILE_SMALL_BUF DSEC_AGG_STR /* string area of a file/connect record in the small table */

#define DSEC_PATH_MAX 4096
#define DSEC_EXEC_BUF_BYTES (DSEC_EXEC_OFF_MASK + 1 + DSEC_ARGV_BYTES)
#define DSEC_FILE_OFF_MASK 8191
#define DSEC_FILE_BUF_BYTES (DSEC_FILE_OFF_MASK + 1 + DSEC_PATH_MAX)
#define DSEC_COMM_LEN 16
#define DSEC_SOCKADDR_MAX 128

/* ---- event kinds (names match audit_schema.events.KINDS) --------------- */
#define DSEC_KIND_EXEC 1
#define DSEC_KIND_FORK 2
#define DSEC_KIND_EXIT 3
#define DSEC_KIND_CONNECT 4
#define DSEC_KIND_OPEN_WRITE 5
#define DSEC_KIND_UNLINK 6
#define DSEC_KIND_RENAME 7
/* enforcement sensor (bpf/enforce.c): `*_denied` = blocked (enforce mode,
 * decision "denied"), `*_violation` = would have been blocked (audit mode,
 * decision "would-deny") */
#define DSEC_KIND_EGRESS_DENIED 8
#define DSEC_KIND_EGRESS_VIOLATION 9
#define DSEC_KIND_EXEC_DENIED 10
#define DSEC_KIND_EXEC_VIOLATION 11
#define DSEC_KIND_SYSCALL_DENIED 12
#define DSEC_KIND_SYSCALL_VIOLATION 13
#define DSEC_NKINDS 16                 /* a power of two (used as a mask); index 0 unused */

/* ---- the syscall behind an event (body.sys) ----------------------------- */
#define DSEC_SYS_EXECVE 1
#define DSEC_SYS_EXECVEAT 2
#define DSEC_SYS_CONNECT 3
#define DSEC_SYS_OPEN 4
#define DSEC_SYS_OPENAT 5
#define DSEC_SYS_OPENAT2 6
#define DSEC_SYS_CREAT 7
#define DSEC_SYS_UNLINK 8
#define DSEC_SYS_UNLINKAT 9
#define DSEC_SYS_RMDIR 10
#define DSEC_SYS_RENAME 11
#define DSEC_SYS_RENAMEAT 12
#define DSEC_SYS_RENAMEAT2 13

/* ---- status bits (body.status) ------------------------------------------ */
#define DSEC_ST_PATH_TRUNC 0x1         /* path longer than DSEC_PATH_MAX - 1 */
#define DSEC_ST_PATH_FAULT 0x2         /* path not readable (not resident / bad pointer) */
#define DSEC_ST_PATH2_TRUNC 0x4
#define DSEC_ST_PATH2_FAULT 0x8
#define DSEC_ST_ARGV_TRUNC 0x10        /* more than DSEC_MAX_ARGS args or DSEC_ARGV_BYTES bytes */
#define DSEC_ST_ARGV_FAULT 0x20        /* an argv pointer or string was not readable */
#define DSEC_ST_NO_ARGV 0x40           /* exec seen only at sched_process_exec: args not captured */
#define DSEC_ST_ADDR_FAULT 0x80        /* connect: sockaddr not readable */
#define DSEC_ST_LATE_READ 0x100        /* not resident at enter: read again at exit (after the
                                        * kernel faulted it in) or taken from sched_process_exec */
#define DSEC_ST_NOT_ABSOLUTE 0x200     /* exec check: the kernel's filename is not absolute (relative
                                        * exec, execveat: /dev/fd/N/..): it can match no pattern */
#define DSEC_ST_IPV4_MAPPED 0x400      /* egress: an IPv4-mapped IPv6 destination, checked as IPv4 */
#define DSEC_ST_NAMESPACES 0x800       /* syscall: clone/unshare refused (EPERM) under namespaces: deny */
#define DSEC_ST_NOT_CANONICAL 0x1000   /* exec check: the filename has '//', '/./', '/../' (or ends in
                                        * '/.' '/..') or is a /dev/fd/N name: it matches no pattern */
#define DSEC_ST_MMAP_NOEXEC 0x2000     /* exec_denied: an executable mapping of a file on a noexec
                                        * (writable) layer was refused (ld.so /tmp/x, dlopen); fd in
                                        * exec_check.fd, no path (userspace resolves it) */
#define DSEC_ST_SOCKET 0x4000          /* syscall: socket()/socketpair() arguments outside the
                                        * policy's socket rules (family/type/protocol in the record) */
#define DSEC_ST_CWD_JOINED 0x8000     /* exec check: a relative filename matched as <verified cwd>/<name>;
                                        * exec record: the verified cwd it was joined to is in the record */
#define DSEC_ST_CWD_UNKNOWN 0x10000   /* exec check / exec record: relative, and the process's cwd is not
                                        * known to the check (not verified since its last chdir, a chdir
                                        * in flight, shared or split: CLONE_FS, unshare, setns, chroot) */

/* ---- loss reasons (index into dsec_state.lost) --------------------------- */
#define DSEC_LOST_RINGBUF_FULL 0       /* ring buffer reservation failed */
#define DSEC_LOST_OVER_BUDGET 1        /* over the sandbox's fair share */
#define DSEC_LOST_INFLIGHT_FULL 2      /* too many syscalls in flight: the sandbox's DSEC_MAX_INFLIGHT of
                                        * that kind, or its share of the node-wide table (common.h) */
#define DSEC_LOST_TABLE_FULL 3         /* enforcement: a kernel table (violation counters, learned
                                        * destinations) had no room, or the sandbox's share of it */
#define DSEC_LOST_OVER_BYTES 4         /* over the sandbox's byte budget (bytes of records per second) */
#define DSEC_NLOST 5

/* ---- how a process ended (body.exit.how) --------------------------------- */
#define DSEC_EXIT_UNKNOWN 0
#define DSEC_EXIT_EXIT_GROUP 1
#define DSEC_EXIT_EXIT 2
#define DSEC_EXIT_SIGNAL 3

/* ---- over-budget behaviour (dsec_sandbox.mode) --------------------------- */
#define DSEC_OVER_SUMMARISE 0          /* count, report as events_lost */
#define DSEC_OVER_STOP 1               /* also SIGKILL the offending process; agent stops the sandbox */

/* ---- the record ---------------------------------------------------------- */
struct dsec_hdr {
    __u64 ts_ns;        /* bpf_ktime_get_ns() (CLOCK_MONOTONIC) at emission */
    __u64 cgroup_id;    /* the registered sandbox cgroup (the task's or an ancestor) */
    __u32 kind;         /* DSEC_KIND_* */
    __u32 size;         /* bytes of this record */
    __u32 pid;          /* tgid, host pid namespace */
    __u32 tid;
    __u32 ppid;         /* parent tgid from fork tracking, 0 = unknown */
    __u32 uid;          /* real uid */
    __u32 gid;          /* real gid */
    __u32 step;         /* the sandbox's step when the syscall was admitted */
    char comm[DSEC_COMM_LEN];
};

struct dsec_exec {
    __s64 ret;          /* 0, or -errno of a failed exec */
    __s32 dirfd;        /* execveat dirfd; -100 (AT_FDCWD) for execve */
    __u32 at_flags;     /* execveat flags */
    __u32 sys;          /* DSEC_SYS_EXECVE / _EXECVEAT, 0 when not captured */
    __u32 status;       /* DSEC_ST_* */
    __u32 path_len;
    __u32 argv_off;
    __u32 argv_len;
    __u32 argc;
    __u32 old_tid;      /* sched_process_exec old_pid (a thread that exec'd) */
    __u32 late_len;     /* path read late (DSEC_ST_LATE_READ) at buf[late_off] */
    __u32 late_off;
    __u32 cwd_len;      /* a relative execve's verified cwd (DSEC_ST_CWD_JOINED): cwd_len bytes,
                         * no NUL, right after the argv (after the late path if read late) */
    __u64 upath;        /* user pointer of the path, for the late read */
};

struct dsec_fork {
    __u64 clone_flags;
    __u32 child_pid;
    __u32 _pad;
};

struct dsec_exit {
    __s32 exit_code;    /* exit status, -1 when killed by a signal or unknown */
    __u32 signal;       /* terminating signal, 0 if none */
    __u32 how;          /* DSEC_EXIT_* */
    __u32 _pad;
};

struct dsec_connect {
    __s64 ret;
    __s32 fd;
    __u32 addrlen;      /* as passed by the caller */
    __u32 sys;
    __u32 status;
    __u64 uaddr;        /* user pointer of the sockaddr, for the late read */
    __u8 addr[DSEC_SOCKADDR_MAX]; /* the first min(addrlen, 128) bytes of the sockaddr */
};

struct dsec_file {
    __s64 ret;
    __u64 flags;        /* open flags / unlinkat flag / renameat2 flags */
    __u64 mode;         /* create mode */
    __u64 resolve;      /* openat2 resolve flags */
    __s32 dirfd;        /* -100 (AT_FDCWD) when the syscall takes none */
    __s32 dirfd2;       /* rename: the new path's dirfd */
    __u32 sys;
    __u32 status;
    __u32 path_len;
    __u32 path2_off;
    __u32 path2_len;
    __u32 _pad;
    __u64 upath;        /* user pointers of the paths, for the late read */
    __u64 upath2;
};

/* egress_denied / egress_violation (cgroup connect4/6, sendmsg4/6) */
struct dsec_egress {
    __u32 hook;         /* DSEC_HOOK_* */
    __u32 family;       /* 2 (AF_INET) or 10 (AF_INET6): as checked (a mapped address is AF_INET) */
    __u32 protocol;     /* IPPROTO_* of the socket */
    __u32 sock_type;    /* SOCK_STREAM, SOCK_DGRAM ... */
    __u32 port;         /* destination port, host byte order */
    __u32 status;       /* DSEC_ST_IPV4_MAPPED */
    __u8 addr[16];      /* destination, network byte order (IPv4: the first 4 bytes) */
};

/* exec_denied / exec_violation (sched_process_exec): the kernel's filename at buf[0] */
struct dsec_exec_check {
    __s64 signal_ret;   /* bpf_send_signal(SIGKILL) result (enforce), 0 otherwise */
    __u32 path_len;
    __u32 status;       /* DSEC_ST_PATH_TRUNC, DSEC_ST_NOT_ABSOLUTE, DSEC_ST_NOT_CANONICAL,
                         * DSEC_ST_MMAP_NOEXEC */
    __u32 old_tid;
    __s32 fd;           /* DSEC_ST_MMAP_NOEXEC: the mapped file's fd */
};

/* syscall_denied / syscall_violation */
struct dsec_syscall {
    __u64 total;        /* violations of this syscall by this sandbox so far (kernel count) */
    __s64 ret;          /* sys_exit (enforce): what the call returned (-errno from seccomp; the
                         * syscall number when seccomp killed); sys_enter (audit): 0 */
    __u32 nr;           /* syscall number (raw_syscalls id) */
    __u32 status;       /* DSEC_ST_NAMESPACES, DSEC_ST_SOCKET */
    __u64 sock_family;  /* DSEC_ST_SOCKET: socket()/socketpair() arguments */
    __u64 sock_type;
    __u64 sock_protocol;
};

union dsec_body {
    struct dsec_exec exec;
    struct dsec_fork fork;
    struct dsec_exit exit;
    struct dsec_connect connect;
    struct dsec_file file;
    struct dsec_egress egress;
    struct dsec_exec_check exec_check;
    struct dsec_syscall syscall;
};

/* exec records (and the type userspace decodes every record with) */
struct dsec_event {
    struct dsec_hdr h;
    union dsec_body u;
    char buf[DSEC_EXEC_BUF_BYTES];
};

/* file and connect records in flight: same layout, smaller string area */
struct dsec_event_small {
    struct dsec_hdr h;
    union dsec_body u;
    char buf[DSEC_FILE_BUF_BYTES];
};

/* file and connect records in flight whose strings fit DSEC_FILE_SMALL_BUF
 * (nearly all): same layout, the string area cut (common.h dsec_pending_store) */
struct dsec_event_file_small {
    struct dsec_hdr h;
    union dsec_body u;
    char buf[DSEC_FILE_SMALL_BUF];
};

/* exec records in flight whose path and argv fit DSEC_EXEC_SMALL_BUF (nearly
 * all): same layout, the string area cut (process.c dsec_exec_store) */
struct dsec_event_exec_small {
    struct dsec_hdr h;
    union dsec_body u;
    char buf[DSEC_EXEC_SMALL_BUF];
};

#define DSEC_FIXED_BYTES (sizeof(struct dsec_hdr) + sizeof(union dsec_body))

/* ---- per-sandbox maps ---------------------------------------------------- */
struct dsec_sandbox {   /* sandboxes: cgroup id -> configuration, written by userspace */
    __u64 interval_ns;  /* fair share: 1e9 / rate; 0 = unlimited */
    __u64 tolerance_ns; /* (burst - 1) * interval_ns */
    __u64 byte_ps;      /* byte budget: picoseconds per byte (1e12 / bytes per second); 0 = unlimited */
    __u64 byte_tol_ns;  /* burst_bytes * byte_ps / 1000 */
    __u32 step;
    __u32 mode;         /* DSEC_OVER_* */
    __u32 agg_kinds;    /* bit (1 << kind): its repeats may be counted in the kernel (common.h "repeats") */
    __u32 agg_gen;      /* the generation new counts go to (bumped by userspace: an older one is retired) */
    __u64 agg_released; /* entries of `agg` userspace has taken back from this sandbox (dsec_state.agg_held) */
};

struct dsec_state {     /* sbx_state: cgroup id -> state, written by the kernel */
    __u64 tat;          /* GCRA theoretical arrival time (ns, CLOCK_MONOTONIC) */
    __u64 btat;         /* the byte budget's GCRA arrival time (ns) */
    __s64 inflight;     /* pending syscalls of this sandbox, every kind */
    __u64 stopped;      /* DSEC_OVER_STOP fired (SIGKILL sent) this many times */
    __u64 emitted[DSEC_NKINDS];
    __u64 lost[DSEC_NLOST * DSEC_NKINDS];   /* [reason * DSEC_NKINDS + kind] */
    __s64 inflight_kind[DSEC_NKINDS];       /* of them, by kind: each at most DSEC_MAX_INFLIGHT */
    __s64 pending_held; /* entries of the node-wide `pending` table it holds (file/connect) */
    __u64 aggregated[DSEC_NKINDS];          /* occurrences counted as repeats in `agg`, not emitted */
    __u64 agg_held;     /* entries of `agg` it ever made (less dsec_sandbox.agg_released: held now) */
};

/* ---- repeats counted in the kernel (common.h "repeats") ------------------ */
struct dsec_agg_key {   /* agg: one identical record of one process, in one generation */
    __u64 cgroup_id;
    __u64 hash;         /* of the record less its timestamp and thread id (the bytes are compared too) */
    __u32 tgid;
    __u32 gen;          /* dsec_sandbox.agg_gen when the first occurrence was emitted */
};

struct dsec_agg_rec {   /* the first occurrence, as emitted (only the used part of buf) */
    struct dsec_hdr h;
    union dsec_body u;
    char buf[DSEC_AGG_STR];
};

struct dsec_agg_val {
    __u64 count;        /* repeats counted since the first occurrence (only ever grows) */
    __u64 last_ns;      /* bpf_ktime_get_ns() of the latest one counted */
    struct dsec_agg_rec rec;
};

struct dsec_exit_info { /* exit_info: tgid -> how it is ending */
    __s32 code;
    __u32 signal;
    __u32 how;
    __u32 _pad;
};

/* ==== enforcement sensor (bpf/enforce.c, agent/sensors/enforce.py) ======== */

#ifndef DSEC_ENF_RING_PAGES
#define DSEC_ENF_RING_PAGES 1024       /* 4 MiB with 4 KiB pages; power of two */
#endif
#ifndef DSEC_EGRESS_ENTRIES
#define DSEC_EGRESS_ENTRIES 65536      /* all sandboxes: networks per LPM trie (IPv4, IPv6) */
#endif
#ifndef DSEC_EXEC_ENTRIES
#define DSEC_EXEC_ENTRIES 65536        /* all sandboxes: exec patterns */
#endif
#ifndef DSEC_SYSVIOL_ENTRIES
#define DSEC_SYSVIOL_ENTRIES 262144   /* all sandboxes: (sandbox, syscall) violation counters */
#endif
#ifndef DSEC_SYSVIOL_PER_SANDBOX
#define DSEC_SYSVIOL_PER_SANDBOX 64    /* distinct syscalls counted per sandbox (the rest: sys_overflow) */
#endif
#ifndef DSEC_DEST_ENTRIES
#define DSEC_DEST_ENTRIES 65536        /* all sandboxes: learned egress destinations */
#endif
#ifndef DSEC_MAX_LEARN
#define DSEC_MAX_LEARN 1024            /* sandboxes in learn mode at once (syscall counters) */
#endif

#define DSEC_EGRESS_RANGES 16          /* port ranges per network entry */
#define DSEC_EXEC_KEY_PATH 252         /* path bytes in an exec LPM key (LPM data <= 256 bytes) */
#define DSEC_EXEC_PATTERN_MAX 250      /* longest exec pattern the kernel matcher takes (a filename
                                        * of 251+ bytes fills the key: its NUL is not compared) */
#define DSEC_SYSCALL_NR_MAX 512        /* syscall numbers in the bitmap / counters */
#define DSEC_SYSCALL_NR_OTHER 512      /* sys_viol key of every number >= DSEC_SYSCALL_NR_MAX (one entry) */
/* x86_64 numbers of the calls whose exits enforce mode checks whatever the
 * bitmap says (namespace flags, socket rules): never in enforce.c sys_common */
#define DSEC_NR_SOCKET 41
#define DSEC_NR_SOCKETPAIR 53
#define DSEC_NR_CLONE 56
#define DSEC_NR_UNSHARE 272

/* ---- per-concern mode (dsec_enf_sandbox.egress/exec/sys) ---------------- */
#define DSEC_MODE_OFF 0                /* the policy has no rules of this kind */
#define DSEC_MODE_LEARN 1              /* nothing enforced; observed (counters, destinations) */
#define DSEC_MODE_AUDIT 2              /* nothing enforced; violations reported (would-deny) */
#define DSEC_MODE_ENFORCE 3            /* violations blocked and reported (denied) */

/* ---- egress -------------------------------------------------------------- */
#define DSEC_EGRESS_DEFAULT_DENY 0     /* the tries hold allow rules */
#define DSEC_EGRESS_DEFAULT_ALLOW 1    /* the tries hold deny rules */
#define DSEC_PROTO_TCP 1               /* dsec_port_range.protos bits */
#define DSEC_PROTO_UDP 2
#define DSEC_PROTO_OTHER 4
#define DSEC_HOOK_CONNECT4 1           /* which cgroup hook saw it (dsec_egress.hook) */
#define DSEC_HOOK_CONNECT6 2
#define DSEC_HOOK_SENDMSG4 3
#define DSEC_HOOK_SENDMSG6 4

struct dsec_enf_sandbox {   /* enf_sandboxes: cgroup id -> configuration, written by userspace */
    __u64 interval_ns;      /* event budget (GCRA): 1e9 / rate; 0 = unlimited */
    __u64 tolerance_ns;     /* (burst - 1) * interval_ns */
    __u64 report_ns;        /* syscall reports: at most one per (sandbox, syscall) per report_ns */
    __u64 byte_ps;          /* byte budget: picoseconds per byte; 0 = unlimited */
    __u64 byte_tol_ns;      /* burst_bytes * byte_ps / 1000 */
    __u32 idx;              /* rule-set index: the first key field of this sandbox's LPM entries */
    __u32 step;
    __u8 egress;            /* DSEC_MODE_* */
    __u8 exec;
    __u8 sys;
    __u8 egress_default;    /* DSEC_EGRESS_DEFAULT_* */
    __u8 ns_deny;           /* policy has namespaces: deny */
    __u8 _pad[7];
    __u8 sys_allow[DSEC_SYSCALL_NR_MAX / 8];   /* bit n (byte n/8, bit n%8) = syscall n allowed */
};

struct dsec_enf_state {     /* enf_state: cgroup id -> counters, written by the kernel */
    __u64 tat;              /* GCRA theoretical arrival time */
    __u64 btat;             /* the byte budget's GCRA arrival time (ns) */
    __u64 sys_entries;      /* sys_viol entries of this sandbox (at most DSEC_SYSVIOL_PER_SANDBOX) */
    __u64 sys_overflow;     /* violations not counted per syscall: the sandbox's share was used */
    __u64 emitted[DSEC_NKINDS];
    __u64 lost[DSEC_NLOST * DSEC_NKINDS];   /* [reason * DSEC_NKINDS + kind] */
    __u64 killed;           /* exec enforcement: SIGKILLs sent */
    __u64 learn_lost;       /* learn mode: destinations not recorded (table full) */
    __u64 sys_out_of_range; /* learn mode: syscall numbers >= DSEC_SYSCALL_NR_MAX seen */
};

struct dsec_cg_cache {      /* sbx_cgcache (membership.h): task cgroup id -> its sandbox (0: none) */
    __u64 gen;              /* sbx_gen[0] when computed; stale when it differs */
    __u64 sandbox;
};

struct dsec_cg_l1 {         /* sbx_l1 (membership.h): one CPU's direct-mapped slot of the same */
    __u64 id;               /* the task cgroup id it answers for */
    __u64 gen;
    __u64 sandbox;
    __u64 check;            /* DSEC_L1_CHECK(id, gen, sandbox), written last: a torn slot is a miss */
};

struct dsec_port_range {
    __u16 lo;               /* inclusive, host byte order */
    __u16 hi;
    __u8 protos;            /* DSEC_PROTO_* bits */
    __u8 _pad[3];
};

struct dsec_egress_rule {   /* value of an LPM entry: every rule whose network covers it */
    __u32 n;
    __u32 _pad;
    struct dsec_port_range r[DSEC_EGRESS_RANGES];
};

/* LPM keys: prefixlen counts the idx bits (32) + the address / path bits */
struct dsec_lpm4_key {
    __u32 prefixlen;
    __u32 idx;
    __u8 addr[4];
};

struct dsec_lpm6_key {
    __u32 prefixlen;
    __u32 idx;
    __u8 addr[16];
};

struct dsec_exec_key {      /* exact pattern: path + NUL; prefix pattern: path bytes only */
    __u32 prefixlen;
    __u32 idx;
    char path[DSEC_EXEC_KEY_PATH];
};

/* relative execs under enforce (enforce.c "relative execs"): the cwd the check
 * joins a relative filename to is the kernel's own, read by the agent */
#ifndef DSEC_CWD_ENTRIES
#define DSEC_CWD_ENTRIES 65536         /* all sandboxes: processes with a tracked cwd */
#endif
/* dsec_cwd_gen.flags: any of them makes the cwd unknown to the exec check for good */
#define DSEC_CWD_SHARED 0x1            /* shared with another process (clone CLONE_FS, no CLONE_THREAD) */
#define DSEC_CWD_SPLIT 0x2             /* threads with cwds of their own (a thread without CLONE_FS,
                                        * unshare(CLONE_FS)) */
#define DSEC_CWD_NS 0x4                /* another view of paths: unshare(CLONE_NEWNS), setns, chroot
                                        * (inherited by children) */

struct dsec_cwd_gen {       /* enf_cwd_gen: tgid -> written by the kernel */
    __u64 gen;              /* set by every successful chdir/fchdir (cwd_seq: never reused) */
    __u32 inflight;         /* chdir/fchdir calls entered, not yet returned */
    __u32 _pad;
    __u64 flags;            /* DSEC_CWD_* (64 bits: BPF's atomic or) */
};

struct dsec_cwd {           /* enf_cwd: tgid -> the verified cwd (userspace; the kernel copies at fork) */
    __u64 gen;              /* the dsec_cwd_gen.gen it was read at: counts only while equal */
    __u32 len;              /* bytes of path, no NUL */
    __u32 _pad;
    char path[DSEC_EXEC_KEY_PATH];
};

struct dsec_cwd_req {       /* cwd_req perf record: verify this process's cwd, then SIGCONT it */
    __u64 cgroup_id;
    __u64 gen;
    __u32 tgid;
    __u32 tid;
    __u32 stopped;          /* 1: SIGSTOP sent (continue it); 0: exempt task, not stopped */
    __u32 _pad;
};

struct dsec_cwd_join {      /* per-CPU scratch: <cwd> '/' <name> (enf_canonical reads it masked) */
    char b[DSEC_PATH_MAX];
};

struct dsec_sys_key {
    __u64 cgroup_id;
    __u32 nr;
    __u32 _pad;
};

struct dsec_sys_viol {      /* sys_viol: (sandbox, syscall) -> violation counter */
    __u64 count;            /* every violation */
    __u64 last_ns;          /* when the kernel last emitted a record for it */
    __u32 last_pid;         /* the latest offender */
    __u32 _pad;
    __s64 last_ret;
};

#define DSEC_SOCK_PROTOS 16           /* protocols per socket rule entry */
#define DSEC_SOCK_ANY_TYPE 0xFFFF      /* dsec_sock_key.type: the rule holds for every type */
#define DSEC_SOCK_RULES_ON 0xFFFF      /* dsec_sock_key.family: present = the rule set has socket rules */
#ifndef DSEC_SOCK_ENTRIES
#define DSEC_SOCK_ENTRIES 65536        /* all sandboxes: (rule set, family, type) socket rules */
#endif

struct dsec_sock_key {      /* sock_rules: socket()/socketpair() allowed by the policy */
    __u32 idx;              /* rule-set index (dsec_enf_sandbox.idx) */
    __u16 family;
    __u16 type;             /* SOCK_* (type & 0xf), or DSEC_SOCK_ANY_TYPE */
};

struct dsec_sock_rule {
    __u32 nproto;           /* 0: any protocol */
    __u16 proto[DSEC_SOCK_PROTOS];
    __u16 _pad[2];
};

struct dsec_sys_counts {    /* sys_counts: learn mode, cgroup id -> calls per syscall number */
    __u64 n[DSEC_SYSCALL_NR_MAX];
};

struct dsec_dest_key {      /* egress_dest: learn mode destinations */
    __u64 cgroup_id;
    __u8 family;            /* 2 / 10 */
    __u8 protocol;          /* IPPROTO_*, truncated */
    __u16 port;             /* host byte order */
    __u8 hook;              /* DSEC_HOOK_* */
    __u8 _pad[3];
    __u8 addr[16];
};

struct dsec_dest_val {
    __u64 count;
    __u64 first_ns;
    __u64 last_ns;
};

#endif /* DSEC_EVENTS_H */
