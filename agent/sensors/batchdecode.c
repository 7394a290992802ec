/* The batch decoder's loop for open_write, unlink, fork, exit and connect
 * records, in C (issue 15).
 *
 * agent/sensors/batchdecode.py BatchDecoder.decode_many calls
 * decode(prepare(ctx), blob, spans, i, out) at a record of those kinds (the two
 * builtin functions dsec_batchdecode_functions() makes; prepare once per
 * decode_many call): from
 * spans[i] on it decodes records exactly as the Python loop does (the same
 * template copy, the same fields and caches, the same decoder state: the
 * sequence number, the remembered parents -- a fork's child remembered, an
 * exit's pid forgotten -- and the sandbox's recent pids through info.saw) and
 * appends them to `out`, and returns the index of the first record it leaves
 * to the Python loop: another kind (rename, exec, the enforcement sensor's), a
 * short record, an unknown cgroup, a template not made yet, a relative path, an
 * extra or a sockaddr not cached yet, a ppid neither given nor remembered, a
 * fork when the remembered parents are full (the Python loop evicts). Nothing
 * is changed for a record it leaves. -1: a Python error is set (ctypes.PyDLL
 * raises it). ctx is built by batchdecode.py (_c_context); the meaning of each
 * field is the Python loop's (BatchDecoder._fork, _exit, _connect and the
 * open_write/unlink code inline in decode_many), mirrored here.
 *
 * Lengths from the ring are checked against the record before any read: the
 * record against the blob (o + n <= blob length) and the fixed part (n >=
 * fixed, which holds the header and every kind's body), a path against the
 * record's end, a sockaddr's addrlen against its array.
 */
#include <Python.h>
#include <stdarg.h>
#include <string.h>

enum { H_TS, H_CG, H_KIND, H_PID, H_TID, H_PPID, H_UID, H_GID, H_STEP, H_N };
enum { B_RET, B_FLAGS, B_MODE, B_RESOLVE, B_DIRFD, B_SYS, B_STATUS, B_PLEN, B_N };       /* file */
enum { FK_CLONE_FLAGS, FK_CHILD, FK_N };                                                 /* fork */
enum { X_CODE, X_SIGNAL, X_HOW, X_N };                                                   /* exit */
enum { C_RET, C_FD, C_ADDRLEN, C_STATUS, C_N };                                          /* connect */
enum { K_RET, K_FLAGS, K_PATH, K_PATH_RAW, K_DIRFD, K_EXTRA, K_EVENT_ID, K_TS, K_STEP, K_PID, K_PPID, K_UID,
       K_COMM, K_CHILD_PID, K_EXIT_CODE, K_SIGNAL, K_FAMILY, K_ADDR, K_PORT, K_N };
enum { KIND_OPEN_WRITE, KIND_UNLINK, KIND_FORK, KIND_EXIT, KIND_CONNECT };              /* ctx kinds' codes */
enum { X_LAYOUT, X_HDR, X_FILE, X_KINDS, X_SANDBOXES, X_TMPL, X_COMMS, X_EXTRAS, X_PARENTS, X_KEYS, X_STATE,
       X_STRS, X_FORK, X_EXIT, X_CONNECT, X_ADDR, X_SOCKS, X_NCTX };
#define CACHE_MAX 4096

typedef struct { Py_ssize_t off; int size; int sign; } field_t;

typedef struct {
    Py_ssize_t hdr_off, body_off, buf_off, fixed, comm_off, addr_off, addr_size, max_parents;
    field_t hf[H_N], bf[B_N], kf[FK_N], xf[X_N], cf[C_N];
    PyObject *kinds, *sandboxes, *tmpl, *comms, *extras, *parents, *socks, **K;
    PyObject *offset_ns, *prefix, *at_fdcwd_s, *s_recent, *s_saw, *state;
    long long at_fdcwd;
    unsigned long long seq;
    const unsigned char *base;
    Py_ssize_t blen;
} ctx_t;

static int fields_of(PyObject *t, field_t *f, int n)
{
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != n)
        return -1;
    for (int i = 0; i < n; i++) {
        PyObject *d = PyTuple_GET_ITEM(t, i);
        if (!PyTuple_Check(d) || PyTuple_GET_SIZE(d) != 3)
            return -1;
        f[i].off = PyLong_AsSsize_t(PyTuple_GET_ITEM(d, 0));
        f[i].size = (int)PyLong_AsLong(PyTuple_GET_ITEM(d, 1));
        f[i].sign = (int)PyLong_AsLong(PyTuple_GET_ITEM(d, 2));
        if (PyErr_Occurred() || f[i].off < 0 || (f[i].size != 1 && f[i].size != 2 && f[i].size != 4 && f[i].size != 8))
            return -1;
    }
    return 0;
}

/* little-endian, as struct's "<" formats (x86-64 only: ringbuf.py's bulk reader) */
static long long rd_s(const unsigned char *p, const field_t *f)
{
    switch (f->size) {
    case 1: { int8_t v; memcpy(&v, p + f->off, 1); return v; }
    case 2: { int16_t v; memcpy(&v, p + f->off, 2); return v; }
    case 4: { int32_t v; memcpy(&v, p + f->off, 4); return v; }
    default: { int64_t v; memcpy(&v, p + f->off, 8); return v; }
    }
}

static unsigned long long rd_u(const unsigned char *p, const field_t *f)
{
    switch (f->size) {
    case 1: { uint8_t v; memcpy(&v, p + f->off, 1); return v; }
    case 2: { uint16_t v; memcpy(&v, p + f->off, 2); return v; }
    case 4: { uint32_t v; memcpy(&v, p + f->off, 4); return v; }
    default: { uint64_t v; memcpy(&v, p + f->off, 8); return v; }
    }
}

static PyObject *int_of(const unsigned char *p, const field_t *f)
{
    return f->sign ? PyLong_FromLongLong(rd_s(p, f)) : PyLong_FromUnsignedLongLong(rd_u(p, f));
}

/* set d[k] = v, stealing v; -1 on error */
static int put(PyObject *d, PyObject *k, PyObject *v)
{
    if (v == NULL)
        return -1;
    int r = PyDict_SetItem(d, k, v);
    Py_DECREF(v);
    return r;
}

/* a tuple of n new references (stolen, NULL for a failed one: then NULL) */
static PyObject *pack(int n, ...)
{
    va_list ap;
    PyObject *t = PyTuple_New(n);
    int bad = t == NULL;
    va_start(ap, n);
    for (int i = 0; i < n; i++) {
        PyObject *v = va_arg(ap, PyObject *);
        if (v == NULL || bad) {
            bad = 1;
            Py_XDECREF(v);
            continue;
        }
        PyTuple_SET_ITEM(t, i, v);
    }
    va_end(ap);
    if (bad) {
        if (t != NULL) {                        /* the unset items are NULL: fill them before the decref */
            for (int i = 0; i < n; i++)
                if (PyTuple_GET_ITEM(t, i) == NULL) {
                    Py_INCREF(Py_None);
                    PyTuple_SET_ITEM(t, i, Py_None);
                }
            Py_DECREF(t);
        }
        return NULL;
    }
    return t;
}

static PyObject *new_ref(PyObject *o)
{
    Py_INCREF(o);
    return o;
}

/* the extra keys' second item: the tid when it is not the pid, else None */
static PyObject *tid_key(const ctx_t *c, const unsigned char *h)
{
    if (rd_u(h, &c->hf[H_TID]) != rd_u(h, &c->hf[H_PID]))
        return int_of(h, &c->hf[H_TID]);
    return new_ref(Py_None);
}

/* one record: 1 decoded and appended, 0 left to the Python loop (nothing changed), -1 error */
static int one(ctx_t *c, Py_ssize_t o, Py_ssize_t n, PyObject *out)
{
    int res = -1, code;
    PyObject *kind_o = NULL, *cg_o = NULL, *tkey = NULL, *ekey = NULL, *skey = NULL, *pid_o = NULL;
    PyObject *ppid_o = NULL, *rec = NULL, *info = NULL, *path = NULL;
    PyObject *kv, *kname, *ent, *t, *extra = NULL, *sock = NULL;     /* borrowed */
    const unsigned char *r, *h, *b;
    Py_ssize_t bo = 0, pend = 0;

    if (n < c->fixed || o < 0 || n < 0 || o > c->blen - n)
        return 0;
    r = c->base + o;
    h = r + c->hdr_off;
    b = r + c->body_off;
    /* which kind: the Python loop takes the others */
    if ((kind_o = int_of(h, &c->hf[H_KIND])) == NULL)
        goto done;
    kv = PyDict_GetItemWithError(c->kinds, kind_o);
    if (kv == NULL || !PyTuple_Check(kv) || PyTuple_GET_SIZE(kv) != 2) {
        res = PyErr_Occurred() ? -1 : 0;
        goto done;
    }
    kname = PyTuple_GET_ITEM(kv, 0);
    code = (int)PyLong_AsLong(PyTuple_GET_ITEM(kv, 1));
    if (code == -1 && PyErr_Occurred())
        goto done;
    if ((cg_o = int_of(h, &c->hf[H_CG])) == NULL)
        goto done;
    info = PyDict_GetItemWithError(c->sandboxes, cg_o);
    if (info == NULL) {                         /* unattributed: counted by the Python loop */
        res = PyErr_Occurred() ? -1 : 0;
        goto done;
    }
    Py_INCREF(info);                            /* held across Python code (info.saw) */
    if ((tkey = PyTuple_Pack(2, cg_o, kind_o)) == NULL)
        goto done;
    ent = PyDict_GetItemWithError(c->tmpl, tkey);
    if (ent == NULL) {                          /* no template yet: the Python loop makes it */
        res = PyErr_Occurred() ? -1 : 0;
        goto done;
    }
    if (!PyTuple_Check(ent) || PyTuple_GET_SIZE(ent) != 2 || PyTuple_GET_ITEM(ent, 0) != info ||
        !PyDict_CheckExact(PyTuple_GET_ITEM(ent, 1))) {
        res = 0;                                /* a template of an earlier sandbox of this cgroup id */
        goto done;
    }
    t = PyTuple_GET_ITEM(ent, 1);

    /* the kind's checks and its extra's key, as the Python loop caches it */
    switch (code) {
    case KIND_OPEN_WRITE:
    case KIND_UNLINK: {
        /* the path: within the record, absolute (decode's buf[:path_len]) */
        unsigned long long plen = rd_u(b, &c->bf[B_PLEN]);
        Py_ssize_t end = o + n;
        bo = o + c->buf_off;
        if (bo >= end) {
            res = 0;
            goto done;
        }
        pend = bo + (Py_ssize_t)(plen > (unsigned long long)(end - bo) ? (unsigned long long)(end - bo) : plen);
        if (pend <= bo || c->base[bo] != '/') {
            res = 0;                            /* relative (or empty): resolved through /proc by decode() */
            goto done;
        }
        /* (kind, tid or None, gid, sys, status, mode, resolve): _file_extra's key */
        int ul = code == KIND_UNLINK;
        ekey = pack(7, new_ref(kname), tid_key(c, h), int_of(h, &c->hf[H_GID]), int_of(b, &c->bf[B_SYS]),
                    int_of(b, &c->bf[B_STATUS]), ul ? PyLong_FromLong(0) : int_of(b, &c->bf[B_MODE]),
                    ul ? PyLong_FromLong(0) : int_of(b, &c->bf[B_RESOLVE]));
        break;
    }
    case KIND_FORK: {
        if (PyDict_GET_SIZE(c->parents) >= c->max_parents) {
            res = 0;                            /* _remember_parent evicts: the Python loop */
            goto done;
        }
        /* (fork, tid or None, gid, clone_flags if its high half else 0), only when one of them is set */
        unsigned long long cf = rd_u(b, &c->kf[FK_CLONE_FLAGS]);
        int hi = (cf >> 32) != 0;
        if (rd_u(h, &c->hf[H_TID]) != rd_u(h, &c->hf[H_PID]) || rd_u(h, &c->hf[H_GID]) || hi)
            ekey = pack(4, new_ref(kname), tid_key(c, h), int_of(h, &c->hf[H_GID]),
                        hi ? int_of(b, &c->kf[FK_CLONE_FLAGS]) : PyLong_FromLong(0));
        else
            goto no_extra;                      /* the template's extra */
        break;
    }
    case KIND_EXIT:
        /* (exit, tid or None, gid, how) */
        ekey = pack(4, new_ref(kname), tid_key(c, h), int_of(h, &c->hf[H_GID]), int_of(b, &c->xf[X_HOW]));
        break;
    case KIND_CONNECT: {
        /* the sockaddr's first min(addrlen, its array) bytes: decode_sockaddr's result, cached by them */
        unsigned long long alen = rd_u(b, &c->cf[C_ADDRLEN]);
        Py_ssize_t k = alen > (unsigned long long)c->addr_size ? c->addr_size : (Py_ssize_t)alen;
        if ((skey = PyBytes_FromStringAndSize((const char *)b + c->addr_off, k)) == NULL)
            goto done;
        sock = PyDict_GetItemWithError(c->socks, skey);
        if (sock == NULL || !PyTuple_Check(sock) || PyTuple_GET_SIZE(sock) != 4) {
            res = PyErr_Occurred() ? -1 : 0;    /* not cached yet: decode_sockaddr in the Python loop */
            goto done;
        }
        /* (connect, tid or None, gid, sockaddr bytes, fd, status) */
        ekey = pack(6, new_ref(kname), tid_key(c, h), int_of(h, &c->hf[H_GID]), new_ref(skey),
                    int_of(b, &c->cf[C_FD]), int_of(b, &c->cf[C_STATUS]));
        break;
    }
    default:
        res = 0;
        goto done;
    }
    if (ekey == NULL)
        goto done;
    extra = PyDict_GetItemWithError(c->extras, ekey);
    if (extra == NULL) {                        /* not cached yet: the Python loop builds it */
        res = PyErr_Occurred() ? -1 : 0;
        goto done;
    }
no_extra:
    /* ppid: the kernel's, else the one remembered (else decode's /proc lookup, in Python) */
    if ((pid_o = int_of(h, &c->hf[H_PID])) == NULL)
        goto done;
    if (rd_u(h, &c->hf[H_PPID])) {
        if ((ppid_o = int_of(h, &c->hf[H_PPID])) == NULL)
            goto done;
    } else {
        PyObject *p = PyDict_GetItemWithError(c->parents, pid_o);
        if (p == NULL && PyErr_Occurred())
            goto done;
        if (p == NULL || PyObject_IsTrue(p) != 1) {
            res = PyErr_Occurred() ? -1 : 0;
            goto done;
        }
        ppid_o = new_ref(p);
    }

    /* every check passed: the record, in decode_many's order of effects */
    if ((rec = PyDict_Copy(t)) == NULL)
        goto done;
    PyObject **K = c->K;
    switch (code) {
    case KIND_OPEN_WRITE:
    case KIND_UNLINK: {
        long long dirfd = rd_s(b, &c->bf[B_DIRFD]);
        path = PyUnicode_DecodeUTF8((const char *)c->base + bo, pend - bo, "surrogateescape");
        if (put(rec, K[K_RET], int_of(b, &c->bf[B_RET])) ||
            put(rec, K[K_FLAGS], PyLong_FromUnsignedLongLong(rd_u(b, &c->bf[B_FLAGS]) & 0xFFFFFFFFULL)) ||
            path == NULL || PyDict_SetItem(rec, K[K_PATH], path) || PyDict_SetItem(rec, K[K_PATH_RAW], path))
            goto done;
        if (dirfd == c->at_fdcwd ? PyDict_SetItem(rec, K[K_DIRFD], c->at_fdcwd_s)
                                 : put(rec, K[K_DIRFD], PyUnicode_FromFormat("%lld", dirfd)))
            goto done;
        break;
    }
    case KIND_FORK:
        if (put(rec, K[K_CHILD_PID], int_of(b, &c->kf[FK_CHILD])) ||
            put(rec, K[K_FLAGS], PyLong_FromUnsignedLongLong(rd_u(b, &c->kf[FK_CLONE_FLAGS]) & 0xFFFFFFFFULL)))
            goto done;
        break;
    case KIND_EXIT:
        if (put(rec, K[K_EXIT_CODE], int_of(b, &c->xf[X_CODE])) || put(rec, K[K_SIGNAL], int_of(b, &c->xf[X_SIGNAL])))
            goto done;
        break;
    case KIND_CONNECT:
        if (PyDict_SetItem(rec, K[K_FAMILY], PyTuple_GET_ITEM(sock, 0)) ||
            PyDict_SetItem(rec, K[K_ADDR], PyTuple_GET_ITEM(sock, 1)) ||
            PyDict_SetItem(rec, K[K_PORT], PyTuple_GET_ITEM(sock, 2)) || put(rec, K[K_RET], int_of(b, &c->cf[C_RET])))
            goto done;
        break;
    }
    if (extra != NULL && PyDict_SetItem(rec, K[K_EXTRA], extra))
        goto done;
    {
        char hex[24];
        PyObject *ts = int_of(h, &c->hf[H_TS]);
        snprintf(hex, sizeof hex, "%016llx", c->seq + 1);
        int bad = put(rec, K[K_EVENT_ID], PyUnicode_FromFormat("%U%s", c->prefix, hex)) ||
                  ts == NULL || put(rec, K[K_TS], PyNumber_Add(ts, c->offset_ns));
        Py_XDECREF(ts);
        if (bad || put(rec, K[K_STEP], int_of(h, &c->hf[H_STEP])) || PyDict_SetItem(rec, K[K_PID], pid_o) ||
            PyDict_SetItem(rec, K[K_PPID], ppid_o) || put(rec, K[K_UID], int_of(h, &c->hf[H_UID])))
            goto done;
    }
    {
        /* comm: cached by its 16 bytes, as decode_many's comms */
        PyObject *cb = PyBytes_FromStringAndSize((const char *)h + c->comm_off, 16);
        PyObject *cs = cb ? PyDict_GetItemWithError(c->comms, cb) : NULL;
        int bad;
        if (cs != NULL) {
            bad = PyDict_SetItem(rec, K[K_COMM], cs);
        } else if (cb == NULL || PyErr_Occurred()) {
            bad = 1;
        } else {
            const char *s = (const char *)h + c->comm_off;
            const char *z = memchr(s, 0, 16);
            if (PyDict_GET_SIZE(c->comms) >= CACHE_MAX)
                PyDict_Clear(c->comms);
            cs = PyUnicode_DecodeUTF8(s, z ? z - s : 16, "surrogateescape");
            bad = cs == NULL || PyDict_SetItem(c->comms, cb, cs) || PyDict_SetItem(rec, K[K_COMM], cs);
            Py_XDECREF(cs);
        }
        Py_XDECREF(cb);
        if (bad)
            goto done;
    }
    c->seq++;
    /* the decoder's state: a fork's child remembered (_remember_parent, not full: checked above),
     * an exit's pid forgotten, the sandbox's recent pids (info.saw unless it is the last one; not
     * for an exit) */
    if (code == KIND_FORK) {
        PyObject *child = PyDict_GetItemWithError(rec, K[K_CHILD_PID]);
        if (child == NULL || PyDict_SetItem(c->parents, child, pid_o))
            goto done;
    } else if (code == KIND_EXIT) {
        int has = PyDict_Contains(c->parents, pid_o);
        if (has < 0 || (has && PyDict_DelItem(c->parents, pid_o)))
            goto done;
    }
    if (code != KIND_EXIT) {
        PyObject *rp = PyObject_GetAttr(info, c->s_recent);
        int last = 0;
        if (rp == NULL)
            goto done;
        if (PyList_Check(rp) && PyList_GET_SIZE(rp) > 0)
            last = PyObject_RichCompareBool(PyList_GET_ITEM(rp, PyList_GET_SIZE(rp) - 1), pid_o, Py_EQ);
        Py_DECREF(rp);
        if (last < 0)
            goto done;
        if (last != 1) {
            PyObject *got = PyObject_CallMethodOneArg(info, c->s_saw, pid_o);
            if (got == NULL)
                goto done;
            Py_DECREF(got);
        }
    }
    if (PyList_Append(out, rec))
        goto done;
    res = 1;
done:
    Py_XDECREF(kind_o);
    Py_XDECREF(cg_o);
    Py_XDECREF(tkey);
    Py_XDECREF(ekey);
    Py_XDECREF(skey);
    Py_XDECREF(pid_o);
    Py_XDECREF(ppid_o);
    Py_XDECREF(rec);
    Py_XDECREF(info);
    Py_XDECREF(path);
    return res;
}

static Py_ssize_t ssize_at(PyObject *t, Py_ssize_t i)
{
    return PyLong_AsSsize_t(PyTuple_GET_ITEM(t, i));
}

/* ctx (batchdecode.py _c_context) -> *cp; -1 with an error set. The pointers borrowed from ctx stay
 * valid while ctx lives (the capsule holds it). */
static int parse_ctx(PyObject *ctx, ctx_t *cp)
{
#define c (*cp)
    if (!PyTuple_Check(ctx) || PyTuple_GET_SIZE(ctx) != X_NCTX) {
        PyErr_SetString(PyExc_TypeError, "batchdecode: bad arguments");
        return -1;
    }
    PyObject *layout = PyTuple_GET_ITEM(ctx, X_LAYOUT), *addr = PyTuple_GET_ITEM(ctx, X_ADDR);
    if (!PyTuple_Check(layout) || PyTuple_GET_SIZE(layout) != 5 || !PyTuple_Check(addr) ||
        PyTuple_GET_SIZE(addr) != 2 || fields_of(PyTuple_GET_ITEM(ctx, X_HDR), c.hf, H_N) ||
        fields_of(PyTuple_GET_ITEM(ctx, X_FILE), c.bf, B_N) || fields_of(PyTuple_GET_ITEM(ctx, X_FORK), c.kf, FK_N) ||
        fields_of(PyTuple_GET_ITEM(ctx, X_EXIT), c.xf, X_N) || fields_of(PyTuple_GET_ITEM(ctx, X_CONNECT), c.cf, C_N)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "batchdecode: bad layout");
        return -1;
    }
    c.hdr_off = ssize_at(layout, 0);
    c.body_off = ssize_at(layout, 1);
    c.buf_off = ssize_at(layout, 2);
    c.fixed = ssize_at(layout, 3);
    c.comm_off = ssize_at(layout, 4);
    c.addr_off = ssize_at(addr, 0);
    c.addr_size = ssize_at(addr, 1);
    if (PyErr_Occurred())
        return -1;
    /* every field read lies within the fixed part, which every record handed on has (n >= fixed) */
    Py_ssize_t hsz = c.body_off - c.hdr_off, bsz = c.fixed - c.body_off;
    int ok = c.hdr_off >= 0 && hsz >= 0 && bsz >= 0 && c.buf_off <= c.fixed && c.comm_off >= 0 &&
             c.comm_off + 16 <= hsz && c.addr_off >= 0 && c.addr_size >= 0 && c.addr_off + c.addr_size <= bsz;
    for (int k = 0; k < H_N; k++)
        ok = ok && c.hf[k].off + c.hf[k].size <= hsz;
    for (int k = 0; k < B_N; k++)
        ok = ok && c.bf[k].off + c.bf[k].size <= bsz;
    for (int k = 0; k < FK_N; k++)
        ok = ok && c.kf[k].off + c.kf[k].size <= bsz;
    for (int k = 0; k < X_N; k++)
        ok = ok && c.xf[k].off + c.xf[k].size <= bsz;
    for (int k = 0; k < C_N; k++)
        ok = ok && c.cf[k].off + c.cf[k].size <= bsz;
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "batchdecode: a field outside the fixed part");
        return -1;
    }
    c.kinds = PyTuple_GET_ITEM(ctx, X_KINDS);          /* kind number -> (kind name, KIND_* code) */
    c.sandboxes = PyTuple_GET_ITEM(ctx, X_SANDBOXES);  /* cgroup id -> SandboxInfo */
    c.tmpl = PyTuple_GET_ITEM(ctx, X_TMPL);            /* (cgroup id, kind number) -> (info, template) */
    c.comms = PyTuple_GET_ITEM(ctx, X_COMMS);          /* comm bytes -> str */
    c.extras = PyTuple_GET_ITEM(ctx, X_EXTRAS);        /* the extra's key -> its JSON */
    c.parents = PyTuple_GET_ITEM(ctx, X_PARENTS);      /* pid -> ppid */
    c.socks = PyTuple_GET_ITEM(ctx, X_SOCKS);          /* sockaddr bytes -> decode_sockaddr's result */
    PyObject *keys = PyTuple_GET_ITEM(ctx, X_KEYS);    /* the field names, K_* order */
    PyObject *state = PyTuple_GET_ITEM(ctx, X_STATE);  /* [seq, offset_ns, event id prefix, "AT_FDCWD", max_parents] */
    PyObject *strs = PyTuple_GET_ITEM(ctx, X_STRS);    /* ("recent_pids", "saw", AT_FDCWD as an int) */
    if (!PyDict_Check(c.kinds) || !PyDict_Check(c.sandboxes) || !PyDict_Check(c.tmpl) || !PyDict_Check(c.comms) ||
        !PyDict_Check(c.extras) || !PyDict_Check(c.parents) || !PyDict_Check(c.socks) || !PyTuple_Check(keys) ||
        PyTuple_GET_SIZE(keys) != K_N || !PyList_Check(state) || PyList_GET_SIZE(state) != 5 ||
        !PyTuple_Check(strs) || PyTuple_GET_SIZE(strs) != 3 || !PyUnicode_Check(PyList_GET_ITEM(state, 2))) {
        PyErr_SetString(PyExc_TypeError, "batchdecode: bad context");
        return -1;
    }
    c.K = ((PyTupleObject *)keys)->ob_item;
    c.state = state;
    c.prefix = PyList_GET_ITEM(state, 2);
    c.at_fdcwd_s = PyList_GET_ITEM(state, 3);
    c.max_parents = PyLong_AsSsize_t(PyList_GET_ITEM(state, 4));
    c.s_recent = PyTuple_GET_ITEM(strs, 0);
    c.s_saw = PyTuple_GET_ITEM(strs, 1);
    c.at_fdcwd = PyLong_AsLongLong(PyTuple_GET_ITEM(strs, 2));
    if (PyErr_Occurred())
        return -1;
    return 0;
#undef c
}

/* decode(prepared, blob, spans, i, out) -> the index of the first record left to the Python loop */
static Py_ssize_t run(ctx_t *cp, PyObject *blob, PyObject *spans, Py_ssize_t i, PyObject *out)
{
#define c (*cp)
    PyObject *state = c.state;
    if (!PyBytes_Check(blob) || !PyList_Check(spans) || !PyList_Check(out)) {
        PyErr_SetString(PyExc_TypeError, "batchdecode: bad arguments");
        return -1;
    }
    c.seq = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(state, 0));
    c.offset_ns = PyList_GET_ITEM(state, 1);
    if (PyErr_Occurred())
        return -1;
    c.base = (const unsigned char *)PyBytes_AS_STRING(blob);
    c.blen = PyBytes_GET_SIZE(blob);
    unsigned long long seq0 = c.seq;
    Py_ssize_t nspans = PyList_GET_SIZE(spans);
    int got = 1;
    for (; i < nspans; i++) {
        PyObject *sp = PyList_GET_ITEM(spans, i);
        if (!PyTuple_Check(sp) || PyTuple_GET_SIZE(sp) != 2)
            break;
        Py_ssize_t o = PyLong_AsSsize_t(PyTuple_GET_ITEM(sp, 0));
        Py_ssize_t n = PyLong_AsSsize_t(PyTuple_GET_ITEM(sp, 1));
        if ((o == -1 || n == -1) && PyErr_Occurred()) {
            PyErr_Clear();
            break;
        }
        if ((got = one(&c, o, n, out)) != 1)
            break;
    }
    if (c.seq != seq0) {                        /* the records appended so far, also on an error */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyObject *s = PyLong_FromUnsignedLongLong(c.seq);
        if (s == NULL || PyList_SetItem(state, 0, s)) {
            Py_XDECREF(et);
            Py_XDECREF(ev);
            Py_XDECREF(tb);
            return -1;
        }
        PyErr_Restore(et, ev, tb);
    }
    return got < 0 ? -1 : i;
#undef c
}

/* Called from Python as builtin functions (one ctypes call at load, not one per run: a ctypes
 * call costs about a microsecond, a run of records between two execs is one or two records). */
typedef struct { ctx_t c; PyObject *ctx; } prepared_t;
static const char CAPSULE[] = "dsec.batchdecode.ctx";

static void prepared_free(PyObject *cap)
{
    prepared_t *p = PyCapsule_GetPointer(cap, CAPSULE);
    if (p != NULL) {
        Py_XDECREF(p->ctx);
        PyMem_Free(p);
    }
}

/* prepare(ctx) -> a capsule: ctx parsed once per decode_many call */
static PyObject *py_prepare(PyObject *self, PyObject *ctx)
{
    (void)self;
    prepared_t *p = PyMem_Malloc(sizeof *p);
    if (p == NULL)
        return PyErr_NoMemory();
    if (parse_ctx(ctx, &p->c)) {
        PyMem_Free(p);
        return NULL;
    }
    Py_INCREF(ctx);
    p->ctx = ctx;
    PyObject *cap = PyCapsule_New(p, CAPSULE, prepared_free);
    if (cap == NULL) {
        Py_DECREF(ctx);
        PyMem_Free(p);
    }
    return cap;
}

/* decode(prepared, blob, spans, i, out) -> int */
static PyObject *py_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "decode(prepared, blob, spans, i, out)");
        return NULL;
    }
    prepared_t *p = PyCapsule_GetPointer(args[0], CAPSULE);
    if (p == NULL)
        return NULL;
    Py_ssize_t i = PyLong_AsSsize_t(args[3]);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t j = run(&p->c, args[1], args[2], i, args[4]);
    return j < 0 ? NULL : PyLong_FromSsize_t(j);
}

static PyMethodDef methods[] = {
    {"prepare", (PyCFunction)py_prepare, METH_O, "batchdecode.c's view of a BatchDecoder's context"},
    {"decode", (PyCFunction)(void (*)(void))py_decode, METH_FASTCALL, "decode a run of records from spans[i]"},
};

/* (prepare, decode) as builtin functions (a new reference: ctypes' py_object restype takes it) */
PyObject *dsec_batchdecode_functions(void)
{
    PyObject *a = PyCFunction_New(&methods[0], NULL), *b = PyCFunction_New(&methods[1], NULL);
    if (a == NULL || b == NULL) {
        Py_XDECREF(a);
        Py_XDECREF(b);
        return NULL;
    }
    PyObject *t = PyTuple_Pack(2, a, b);
    Py_DECREF(a);
    Py_DECREF(b);
    return t;
}
