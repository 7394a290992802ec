/* libdsec_spawn: start a sandbox's dsec-init with clone3 (agent/sandbox/spawn.py
 * loads it through ctypes, which releases the GIL for the call).
 *
 *     pid = dsec_spawn(path, argv, fds, nfds, ns_flags, cgroup_fd, netns_fd, nofile, &pidfd)
 *
 * One clone3 does what the launcher otherwise does in three parts (a thread that
 * unshares the namespaces, posix_spawn from it, then cgroup.procs writes from the
 * parent): the child is created in the new pid, mount, ipc, uts and net namespaces
 * (ns_flags), directly in the cgroup2 directory `cgroup_fd` (CLONE_INTO_CGROUP:
 * the kernel's fork path takes only the read side of cgroup_threadgroup_rwsem; a
 * cgroup.procs write takes the write side and waits for an RCU grace period
 * whenever no migration happened on the node within the last one, ~10 ms), with
 * a pidfd returned by the same call (CLONE_PIDFD: no pid-reuse window).
 *
 * As posix_spawn does: CLONE_VM | CLONE_VFORK on a stack of its own (no copy of
 * the agent's page tables; this thread waits until the child has exec'd or
 * failed), every signal blocked around the clone, and in the child only system
 * calls (the agent is multithreaded and its memory is shared until the exec):
 * every signal at its default action, none blocked, the network namespace
 * `netns_fd` joined when one is given (made ahead by agent/sandbox/netpool.py:
 * the clone then has no CLONE_NEWNET, ~0.6 ms less), fds[i] as fd 3+i (every
 * other fd of the agent is close-on-exec), then the open-file limit (when given),
 * an empty environment, execve. An exec failure is reported through the shared
 * memory (the child then exits 127 and is reaped here).
 *
 * files_below > 0: the agent has put fds[] below files_below (spawn.py's reserved low
 * slots), and the child shares the agent's fd table (CLONE_FILES) until it takes a
 * table of its own holding only the fds below files_below (close_range(files_below,
 * ~0, CLOSE_RANGE_UNSHARE), Linux 5.9). Without it the clone copies the agent's whole
 * table and the exec closes every copy again: an agent holding a few thousand fds
 * (~8 a live sandbox) paid ~0.5 ms more a start beside 500 sandboxes (measured:
 * posix_spawn of /bin/true beside 4,000 close-on-exec fds 1.12 ms, without 0.56).
 * Where close_range cannot, the child unshares the whole table (as without it).
 *
 * Returns the pid, or -errno (*child_failed set when the child's set-up or exec
 * failed, not the clone): -ENOSYS where the kernel has no clone3 (before 5.3)
 * or this is not x86_64, -E2BIG / -EINVAL where it lacks CLONE_INTO_CGROUP (before
 * 5.7): spawn.py then falls back to the older path and says so. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef CLONE_INTO_CGROUP
#define CLONE_INTO_CGROUP 0x200000000ULL
#endif
#ifndef CLONE_PIDFD
#define CLONE_PIDFD 0x00001000
#endif
#ifndef CLOSE_RANGE_UNSHARE
#define CLOSE_RANGE_UNSHARE (1U << 1)
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif
#define MAX_FDS 16
#define STACK_BYTES (32 * 1024)

struct child_args {
    const char *path;
    char *const *argv;
    const int *fds;
    int nfds;
    int netns_fd;                   /* >= 0: joined instead of a new network namespace */
    int files_below;                /* > 0: the agent's fd table shared until the child's own */
    const struct rlimit *nofile;
    volatile int err;               /* set by the child when it fails; read once it is gone */
};

/* raw system calls: no errno, no libc state touched in the child */
static inline long sys3(long n, long a, long b, long c)
{
    long r;
    __asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c) : "rcx", "r11", "memory");
    return r;
}

static inline long sys4(long n, long a, long b, long c, long d)
{
    long r;
    register long r10 __asm__("r10") = d;
    __asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10) : "rcx", "r11", "memory");
    return r;
}

struct ksigaction {                 /* the kernel's struct sigaction (x86_64) */
    void (*handler)(int);
    unsigned long flags;
    void (*restorer)(void);
    uint64_t mask;
};

#if defined(__x86_64__)
/* long dsec_clone3(struct clone_args *args, size_t size, int (*fn)(void *), void *arg):
 * the child runs fn(arg) on the stack given in args and exits with its value
 * (glibc's __clone3, which glibc 2.36 does not export) */
long dsec_clone3(struct clone_args *args, size_t size, int (*fn)(void *), void *arg);
__asm__(
    ".text\n"
    ".p2align 4\n"
    ".globl dsec_clone3\n"
    ".hidden dsec_clone3\n"
    ".type dsec_clone3,@function\n"
    "dsec_clone3:\n"
    "    mov %rcx, %r8\n"            /* arg: r8 and rdx (fn) survive the system call */
    "    mov $435, %eax\n"           /* __NR_clone3 */
    "    syscall\n"
    "    test %rax, %rax\n"
    "    jz 1f\n"
    "    ret\n"                      /* parent: the pid, or -errno */
    "1:  xor %ebp, %ebp\n"           /* child: the outermost frame, on its own stack */
    "    and $-16, %rsp\n"
    "    mov %r8, %rdi\n"
    "    call *%rdx\n"
    "    mov %rax, %rdi\n"
    "    mov $60, %eax\n"            /* exit (this thread, which is the child's only one) */
    "    syscall\n"
    "    hlt\n"
    ".size dsec_clone3, .-dsec_clone3\n");
#endif

static int child_main(void *p)
{
    struct child_args *a = p;
    struct ksigaction dfl;
    long r;
    memset(&dfl, 0, sizeof(dfl));   /* SIG_DFL; inlined stores, no call into libc */
    for (int s = 1; s <= 64; s++)
        if (s != SIGKILL && s != SIGSTOP)
            sys4(SYS_rt_sigaction, s, (long)&dfl, 0, 8);
    /* a fresh network namespace made ahead (agent/sandbox/netpool.py) instead of CLONE_NEWNET */
    if (a->netns_fd >= 0 && (r = sys3(SYS_setns, a->netns_fd, CLONE_NEWNET, 0)) < 0)
        goto fail;
    /* a table of its own: only the agent's fds below files_below (its stdio, fds[]) */
    if (a->files_below > 0 && sys3(SYS_close_range, a->files_below, ~0U, CLOSE_RANGE_UNSHARE) < 0 &&
        (r = sys3(SYS_unshare, CLONE_FILES, 0, 0)) < 0)
        goto fail;
    /* each fd first above the targets (a source may be one of 3..3+n), then into place; under
     * the agent's raised limit: an agent with hundreds of sandboxes holds every fd below the
     * workload's limit (1024 under a default unit), and F_DUPFD past the limit is EMFILE */
    int tmp[MAX_FDS];
    for (int i = 0; i < a->nfds; i++)
        if ((r = tmp[i] = (int)sys3(SYS_fcntl, a->fds[i], F_DUPFD_CLOEXEC, 3 + a->nfds)) < 0)
            goto fail;
    for (int i = 0; i < a->nfds; i++)
        if ((r = sys3(SYS_dup2, tmp[i], 3 + i, 0)) < 0)
            goto fail;
    /* then the limit the agent started with (fds above it, all close-on-exec, go at the exec) */
    if (a->nofile && (r = sys4(SYS_prlimit64, 0, RLIMIT_NOFILE, (long)a->nofile, 0)) < 0)
        goto fail;
    uint64_t none = 0;
    sys4(SYS_rt_sigprocmask, SIG_SETMASK, (long)&none, 0, 8);
    static char *const empty_env[] = {NULL};
    r = sys3(SYS_execve, (long)a->path, (long)a->argv, (long)empty_env);
fail:
    a->err = (int)-r;
    return 127;
}

long dsec_spawn(const char *path, char *const argv[], const int *fds, int nfds, uint64_t ns_flags,
                int cgroup_fd, int netns_fd, const struct rlimit *nofile, int *pidfd_out, int *child_failed,
                int files_below)
{
    *child_failed = 0;
#if !defined(__x86_64__)
    (void)path; (void)argv; (void)fds; (void)nfds; (void)ns_flags; (void)cgroup_fd; (void)netns_fd; (void)nofile;
    (void)files_below;
    *pidfd_out = -1;
    return -ENOSYS;
#else
    if (nfds < 0 || nfds > MAX_FDS)
        return -EINVAL;
    char stack[STACK_BYTES] __attribute__((aligned(16)));
    struct child_args a = {path, argv, fds, nfds, netns_fd, files_below, nofile, 0};
    int pidfd = -1;
    struct clone_args ca;
    memset(&ca, 0, sizeof(ca));
    ca.flags = CLONE_VM | CLONE_VFORK | CLONE_PIDFD | (netns_fd >= 0 ? ns_flags & ~(uint64_t)CLONE_NEWNET : ns_flags);
    if (files_below > 0)
        ca.flags |= CLONE_FILES;
    ca.pidfd = (uint64_t)(uintptr_t)&pidfd;
    ca.exit_signal = SIGCHLD;
    ca.stack = (uint64_t)(uintptr_t)stack;
    ca.stack_size = sizeof(stack);
    if (cgroup_fd >= 0) {
        ca.flags |= CLONE_INTO_CGROUP;
        ca.cgroup = (uint64_t)cgroup_fd;
    }
    uint64_t all = ~0ULL, old = 0;   /* libc's own signals (32, 33) too: raw */
    sys4(SYS_rt_sigprocmask, SIG_SETMASK, (long)&all, (long)&old, 8);
    long pid = dsec_clone3(&ca, sizeof(ca), child_main, &a);
    sys4(SYS_rt_sigprocmask, SIG_SETMASK, (long)&old, 0, 8);
    if (pid < 0) {
        *pidfd_out = -1;
        return pid;
    }
    if (a.err) {                     /* the child failed before or at its exec, and has exited */
        int status;
        while (waitpid((pid_t)pid, &status, 0) < 0 && errno == EINTR)
            ;
        close(pidfd);
        *pidfd_out = -1;
        *child_failed = 1;
        return -a.err;
    }
    *pidfd_out = pidfd;
    return pid;
#endif
}
