/* The control protocol between the launcher (agent/sandbox/launcher.py) and
 * dsec-init (PID 1 of a sandbox): the one declaration of its numbers.
 * agent/sandbox/initproto.py reads the DSEC_* defines below with a regex, so
 * a number added here is known to Python at once.
 *
 * Transport: the SOCK_SEQPACKET socket that is fd 3 of dsec-init. One message
 * per packet, both ways:
 *
 *     u32 type, then items: u32 tag, u32 length, length bytes (little endian,
 *     no padding). Integers are 8 bytes (two's complement for signed values),
 *     strings are bytes without a NUL, a nested item holds items.
 *
 * File descriptors travel with an EXEC message by SCM_RIGHTS (stdin, stdout,
 * stderr of the step, in that order; missing ones are /dev/null).
 */
#ifndef DSEC_INIT_PROTO_H
#define DSEC_INIT_PROTO_H

/* ---- launcher -> init ---------------------------------------------------- */
#define DSEC_MSG_CONFIG 1       /* after HELLO: sysctls, hostname, mount plan, credentials, seccomp */
#define DSEC_MSG_GO 2           /* the network is configured (no-op for init; kept for the order) */
#define DSEC_MSG_EXEC 3         /* one step: STEP, ARG..., ENV..., WORKDIR, PATHVAR + fds */
#define DSEC_MSG_SIGNAL 4       /* SIG, STEP (0 = every running step), GROUP */
#define DSEC_MSG_TERMINATE 5    /* SIGTERM to every process of the sandbox */
#define DSEC_MSG_CLOSE 6        /* kill everything, report CLOSED, hold (HOLD), exit */
#define DSEC_MSG_RELEASE 7      /* end the hold */
#define DSEC_MSG_JOIN 8         /* the first message: the `tasks` files (fds) of the v1 cgroups init
                                 * moves itself into before HELLO, one PATH (the hierarchy's name)
                                 * per fd; none when it was born in them, or joined by the launcher */

/* ---- init -> launcher ---------------------------------------------------- */
#define DSEC_MSG_READY 101      /* CREATED... (mount points dsec created in the upper layer) */
#define DSEC_MSG_ERROR 102      /* MSG: set-up failed (init exits 125) */
#define DSEC_MSG_STARTED 103    /* STEP, PID: no longer sent (a step's pid is in its STEP_EXIT) */
#define DSEC_MSG_STEP_EXIT 104  /* STEP, PID, STATUS | EXEC_ERRNO + STAGE + MSG, CPU_US, MAXRSS_KB */
#define DSEC_MSG_CLOSED 105     /* CPU_US, MAXRSS_KB, OWNER_GONE */
#define DSEC_MSG_HELLO 106      /* the first message: init runs (its exec and set-up are done) */

/* ---- item tags ----------------------------------------------------------- */
#define DSEC_T_HOSTNAME 1
#define DSEC_T_UID 2
#define DSEC_T_GID 3
#define DSEC_T_HOLD 4           /* hold the namespaces after CLOSE until RELEASE (bounded) */
#define DSEC_T_OOM_ADJ 5        /* oom_score_adj of every step (signed) */
#define DSEC_T_SECCOMP 6        /* struct sock_filter[] of the seccomp program, loaded before execve */
#define DSEC_T_SYSCTL 7         /* nested: PATH, VALUE, IF_EXISTS */
#define DSEC_T_OP 8             /* nested: one mount-plan operation (KIND ...) */
#define DSEC_T_STEP 9
#define DSEC_T_ARG 10
#define DSEC_T_ENV 11           /* "NAME=value" */
#define DSEC_T_WORKDIR 12
#define DSEC_T_PATHVAR 13       /* PATH used to find a command without '/' (before seccomp) */
#define DSEC_T_SIG 14
#define DSEC_T_GROUP 15
#define DSEC_T_CREATED 16
#define DSEC_T_MSG 17
#define DSEC_T_PID 18
#define DSEC_T_STATUS 19        /* wait status */
#define DSEC_T_EXEC_ERRNO 20
#define DSEC_T_STAGE 21
#define DSEC_T_CPU_US 22
#define DSEC_T_MAXRSS_KB 23
#define DSEC_T_OWNER_GONE 24
#define DSEC_T_KIND 25          /* DSEC_OP_* */
#define DSEC_T_PATH 26
#define DSEC_T_VALUE 27
#define DSEC_T_IF_EXISTS 28     /* skip the operation when the target does not exist */
#define DSEC_T_SRC 29           /* mount source (host path, or a path in the root with SRC_IN_ROOT) */
#define DSEC_T_SRC_IN_ROOT 30
#define DSEC_T_TARGET 31        /* a path in the sandbox root (resolved with RESOLVE_IN_ROOT) */
#define DSEC_T_TARGET_HOST 32   /* the target is a host path (the root overlay itself, "/") */
#define DSEC_T_FSTYPE 33
#define DSEC_T_FLAGS 34         /* mount flags */
#define DSEC_T_DATA 35
#define DSEC_T_MKDIR 36         /* create the target directory (mode) when missing */
#define DSEC_T_MKFILE 37        /* create the target as an empty file when missing */
#define DSEC_T_RECORD 38        /* report what this operation created (not a change of the workload) */
#define DSEC_T_WHAT 39          /* how an error names the operation */
#define DSEC_T_MODE 40
#define DSEC_T_DEV 41
#define DSEC_T_OWNER 42         /* chown what is created to the workload's uid/gid */
#define DSEC_T_DIR 43           /* the target must be a directory */
#define DSEC_T_SELF_OOM_ADJ 44  /* oom_score_adj of init itself */
#define DSEC_T_SECCOMP_SHARED 45 /* load SECCOMP into init once after set-up: every step inherits it */

/* ---- mount-plan operations (DSEC_T_KIND) --------------------------------- */
#define DSEC_OP_MOUNT 1         /* mount(SRC, TARGET, FSTYPE, FLAGS, DATA) */
#define DSEC_OP_ROOT 2          /* TARGET (host path) is the new root: every later path resolves inside it */
#define DSEC_OP_MKDIR 3         /* mkdir -p TARGET (MODE, OWNER) */
#define DSEC_OP_MKNOD 4         /* TARGET, MODE, DEV */
#define DSEC_OP_SYMLINK 5       /* TARGET -> VALUE */
#define DSEC_OP_MASK 6          /* a directory: empty read-only tmpfs; a file: /dev/null bound on it */
#define DSEC_OP_PIVOT 7         /* pivot_root into the root, detach the old one */

#endif
