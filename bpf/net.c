/* dsec BPF: network events — connect(2). (Part of the one source text the
 * loader builds; see common.h.)
 *
 * The sockaddr is copied from user memory at sys_enter_connect (the first
 * min(addrlen, 128) bytes; family, address and port are decoded in
 * userspace) and the record is emitted at sys_exit_connect with the result.
 * Not seen: sendto/sendmsg with a destination address (UDP without connect),
 * io_uring connects. Egress enforcement is the cgroup connect hooks' job.
 */
#include "common.h"

TRACEPOINT_PROBE(syscalls, sys_enter_connect)
{
    int restart = 0;
    struct dsec_event_small *e = dsec_pending_begin(DSEC_KIND_CONNECT, DSEC_SYS_CONNECT, (u64)args->uservaddr,
                                                    (u64)(s64)(int)args->fd, &restart);
    if (!e)
        return 0;
    if (restart) {
        dsec_connect_addr(e);   /* what the restart reads (common.h dsec_pending_begin) */
        if (restart == 2)
            dsec_pending_store(e);
        return 0;
    }
    e->u.connect.fd = (int)args->fd;
    e->u.connect.addrlen = (u32)args->addrlen;
    e->u.connect.sys = DSEC_SYS_CONNECT;
    e->u.connect.uaddr = (u64)args->uservaddr;
    dsec_connect_addr(e);
    e->h.size = DSEC_FIXED_BYTES;
    dsec_pending_store(e);
    return 0;
}

/* the exit: files.c's program for every syscall whose record waits in `pending` */
DSEC_ATTACH_ALSO(syscalls, sys_exit_open, sys_exit_connect)
