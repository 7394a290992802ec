/* The batch decoder's loop for open_write and unlink records, in C (issue 15).
 *
 * agent/sensors/batchdecode.py BatchDecoder.decode_many calls
 * dsec_decode_files(ctx, blob, spans, i, out) at a record of those kinds: from
 * spans[i] on it decodes records exactly as the Python loop does (the same
 * template copy, the same fields and caches, the same decoder state: the
 * sequence number, the sandbox's recent pids through info.saw) and appends
 * them to `out`, and returns the index of the first record it leaves to the
 * Python loop: another kind, a short record, an unknown cgroup, a template not
 * made yet, a relative path, an extra not cached yet, a ppid neither given nor
 * remembered. Nothing is changed for a record it leaves. -1: a Python error is
 * set (ctypes.PyDLL raises it). ctx is built by batchdecode.py (_c_context).
 */
#include <Python.h>
#include <string.h>

enum { H_TS, H_CG, H_KIND, H_PID, H_TID, H_PPID, H_UID, H_GID, H_STEP, H_N };
enum { B_RET, B_FLAGS, B_MODE, B_RESOLVE, B_DIRFD, B_SYS, B_STATUS, B_PLEN, B_N };
enum { K_RET, K_FLAGS, K_PATH, K_PATH_RAW, K_DIRFD, K_EXTRA, K_EVENT_ID, K_TS, K_STEP, K_PID, K_PPID, K_UID,
       K_COMM, K_N };
#define CACHE_MAX 4096

typedef struct { Py_ssize_t off; int size; int sign; } field_t;

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
        if (PyErr_Occurred() || (f[i].size != 1 && f[i].size != 2 && f[i].size != 4 && f[i].size != 8))
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

Py_ssize_t dsec_decode_files(PyObject *ctx, PyObject *blob, PyObject *spans, Py_ssize_t i, PyObject *out)
{
    if (!PyTuple_Check(ctx) || PyTuple_GET_SIZE(ctx) != 12 || !PyBytes_Check(blob) || !PyList_Check(spans) ||
        !PyList_Check(out)) {
        PyErr_SetString(PyExc_TypeError, "dsec_decode_files: bad arguments");
        return -1;
    }
    PyObject *layout = PyTuple_GET_ITEM(ctx, 0);
    field_t hf[H_N], bf[B_N];
    if (!PyTuple_Check(layout) || PyTuple_GET_SIZE(layout) != 5 ||
        fields_of(PyTuple_GET_ITEM(ctx, 1), hf, H_N) || fields_of(PyTuple_GET_ITEM(ctx, 2), bf, B_N)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "dsec_decode_files: bad layout");
        return -1;
    }
    Py_ssize_t hdr_off = PyLong_AsSsize_t(PyTuple_GET_ITEM(layout, 0));
    Py_ssize_t body_off = PyLong_AsSsize_t(PyTuple_GET_ITEM(layout, 1));
    Py_ssize_t buf_off = PyLong_AsSsize_t(PyTuple_GET_ITEM(layout, 2));
    Py_ssize_t fixed = PyLong_AsSsize_t(PyTuple_GET_ITEM(layout, 3));
    Py_ssize_t comm_off = PyLong_AsSsize_t(PyTuple_GET_ITEM(layout, 4));
    if (PyErr_Occurred())
        return -1;
    PyObject *kinds = PyTuple_GET_ITEM(ctx, 3);      /* kind number -> kind name (open_write, unlink) */
    PyObject *sandboxes = PyTuple_GET_ITEM(ctx, 4);  /* cgroup id -> SandboxInfo */
    PyObject *tmpl = PyTuple_GET_ITEM(ctx, 5);       /* (cgroup id, kind number) -> (info, template) */
    PyObject *comms = PyTuple_GET_ITEM(ctx, 6);      /* comm bytes -> str */
    PyObject *extras = PyTuple_GET_ITEM(ctx, 7);     /* the extra's key -> its JSON */
    PyObject *parents = PyTuple_GET_ITEM(ctx, 8);    /* pid -> ppid */
    PyObject *keys = PyTuple_GET_ITEM(ctx, 9);       /* the field names, K_* order */
    PyObject *state = PyTuple_GET_ITEM(ctx, 10);     /* [seq, offset_ns, event id prefix, "AT_FDCWD", unlink] */
    PyObject *strs = PyTuple_GET_ITEM(ctx, 11);      /* ("recent_pids", "saw", AT_FDCWD as an int) */
    if (!PyDict_Check(kinds) || !PyDict_Check(sandboxes) || !PyDict_Check(tmpl) || !PyDict_Check(comms) ||
        !PyDict_Check(extras) || !PyDict_Check(parents) || !PyTuple_Check(keys) || PyTuple_GET_SIZE(keys) != K_N ||
        !PyList_Check(state) || PyList_GET_SIZE(state) != 5 || !PyTuple_Check(strs) || PyTuple_GET_SIZE(strs) != 3) {
        PyErr_SetString(PyExc_TypeError, "dsec_decode_files: bad context");
        return -1;
    }
    PyObject **K = ((PyTupleObject *)keys)->ob_item;
    unsigned long long seq = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(state, 0));
    PyObject *offset_ns = PyList_GET_ITEM(state, 1);
    PyObject *prefix = PyList_GET_ITEM(state, 2);
    PyObject *at_fdcwd_s = PyList_GET_ITEM(state, 3);
    PyObject *unlink = PyList_GET_ITEM(state, 4);
    PyObject *s_recent = PyTuple_GET_ITEM(strs, 0), *s_saw = PyTuple_GET_ITEM(strs, 1);
    long long at_fdcwd = PyLong_AsLongLong(PyTuple_GET_ITEM(strs, 2));
    if (PyErr_Occurred())
        return -1;
    const unsigned char *base = (const unsigned char *)PyBytes_AS_STRING(blob);
    Py_ssize_t blen = PyBytes_GET_SIZE(blob);
    Py_ssize_t nspans = PyList_GET_SIZE(spans);
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
        if (n < fixed || o < 0 || o + n > blen)
            break;
        const unsigned char *r = base + o;
        const unsigned char *h = r + hdr_off;
        const unsigned char *b = r + body_off;
        /* which kind: the Python loop takes everything but open_write and unlink */
        PyObject *kind_o = int_of(h, &hf[H_KIND]);
        if (kind_o == NULL)
            goto error;
        PyObject *kname = PyDict_GetItemWithError(kinds, kind_o);      /* borrowed */
        if (kname == NULL) {
            Py_DECREF(kind_o);
            if (PyErr_Occurred())
                goto error;
            break;
        }
        PyObject *cg_o = int_of(h, &hf[H_CG]);
        if (cg_o == NULL) {
            Py_DECREF(kind_o);
            goto error;
        }
        PyObject *info = PyDict_GetItemWithError(sandboxes, cg_o);     /* borrowed, held below */
        PyObject *tkey = info ? PyTuple_Pack(2, cg_o, kind_o) : NULL;
        Py_DECREF(cg_o);
        Py_DECREF(kind_o);
        if (info == NULL) {
            if (PyErr_Occurred())
                goto error;
            break;                              /* unattributed: counted by the Python loop */
        }
        if (tkey == NULL)
            goto error;
        PyObject *ent = PyDict_GetItemWithError(tmpl, tkey);           /* borrowed */
        Py_DECREF(tkey);
        if (ent == NULL) {
            if (PyErr_Occurred())
                goto error;
            break;                              /* no template yet: the Python loop makes it */
        }
        if (!PyTuple_Check(ent) || PyTuple_GET_SIZE(ent) != 2 || PyTuple_GET_ITEM(ent, 0) != info ||
            !PyDict_CheckExact(PyTuple_GET_ITEM(ent, 1)))
            break;                              /* a template of an earlier sandbox of this cgroup id */
        PyObject *t = PyTuple_GET_ITEM(ent, 1);
        /* the path: within the record, absolute */
        unsigned long long plen = rd_u(b, &bf[B_PLEN]);
        Py_ssize_t bo = o + buf_off, end = o + n;
        Py_ssize_t pend = bo + (Py_ssize_t)(plen > (unsigned long long)(end - bo) ? (unsigned long long)(end - bo) : plen);
        if (bo >= end || pend <= bo || base[bo] != '/')
            break;                              /* relative (or empty): resolved through /proc by decode() */
        int is_unlink = kname == unlink || PyObject_RichCompareBool(kname, unlink, Py_EQ) == 1;
        /* the extra, as cached by _file_extra: (kind, tid or None, gid, sys, status, mode, resolve) */
        unsigned long long pid = rd_u(h, &hf[H_PID]), tid = rd_u(h, &hf[H_TID]);
        PyObject *ekey = PyTuple_New(7);
        if (ekey == NULL)
            goto error;
        Py_INCREF(kname);
        PyTuple_SET_ITEM(ekey, 0, kname);
        if (tid != pid) {
            PyTuple_SET_ITEM(ekey, 1, int_of(h, &hf[H_TID]));
        } else {
            Py_INCREF(Py_None);
            PyTuple_SET_ITEM(ekey, 1, Py_None);
        }
        PyTuple_SET_ITEM(ekey, 2, int_of(h, &hf[H_GID]));
        PyTuple_SET_ITEM(ekey, 3, int_of(b, &bf[B_SYS]));
        PyTuple_SET_ITEM(ekey, 4, int_of(b, &bf[B_STATUS]));
        PyTuple_SET_ITEM(ekey, 5, is_unlink ? PyLong_FromLong(0) : int_of(b, &bf[B_MODE]));
        PyTuple_SET_ITEM(ekey, 6, is_unlink ? PyLong_FromLong(0) : int_of(b, &bf[B_RESOLVE]));
        for (int e = 1; e < 7; e++)
            if (PyTuple_GET_ITEM(ekey, e) == NULL) {
                Py_DECREF(ekey);
                goto error;
            }
        PyObject *extra = PyDict_GetItemWithError(extras, ekey);       /* borrowed */
        Py_DECREF(ekey);
        if (extra == NULL) {
            if (PyErr_Occurred())
                goto error;
            break;                              /* not cached yet: _file_extra builds it */
        }
        /* ppid: the kernel's, else the one remembered (else decode's /proc lookup, in Python) */
        PyObject *ppid_o = int_of(h, &hf[H_PPID]);
        PyObject *pid_o = int_of(h, &hf[H_PID]);
        if (ppid_o == NULL || pid_o == NULL) {
            Py_XDECREF(ppid_o);
            Py_XDECREF(pid_o);
            goto error;
        }
        if (!PyObject_IsTrue(ppid_o)) {
            PyObject *p = PyDict_GetItemWithError(parents, pid_o);     /* borrowed */
            if (p == NULL && PyErr_Occurred()) {
                Py_DECREF(ppid_o);
                Py_DECREF(pid_o);
                goto error;
            }
            if (p == NULL || !PyObject_IsTrue(p)) {
                Py_DECREF(ppid_o);
                Py_DECREF(pid_o);
                break;
            }
            Py_INCREF(p);
            Py_DECREF(ppid_o);
            ppid_o = p;
        }
        /* every check passed: the record, in decode_many's order of effects */
        PyObject *rec = PyDict_Copy(t);
        if (rec == NULL) {
            Py_DECREF(ppid_o);
            Py_DECREF(pid_o);
            goto error;
        }
        const char *praw = (const char *)base + bo;
        long long dirfd = rd_s(b, &bf[B_DIRFD]);
        PyObject *path = PyUnicode_DecodeUTF8(praw, pend - bo, "surrogateescape");
        int bad = put(rec, K[K_RET], int_of(b, &bf[B_RET])) ||
                  put(rec, K[K_FLAGS], PyLong_FromUnsignedLongLong(rd_u(b, &bf[B_FLAGS]) & 0xFFFFFFFFULL)) ||
                  path == NULL || PyDict_SetItem(rec, K[K_PATH], path) || PyDict_SetItem(rec, K[K_PATH_RAW], path);
        Py_XDECREF(path);
        if (!bad) {
            if (dirfd == at_fdcwd)
                bad = PyDict_SetItem(rec, K[K_DIRFD], at_fdcwd_s);
            else
                bad = put(rec, K[K_DIRFD], PyUnicode_FromFormat("%lld", dirfd));
        }
        if (!bad)
            bad = PyDict_SetItem(rec, K[K_EXTRA], extra);
        if (!bad) {
            char hex[24];
            seq++;
            snprintf(hex, sizeof hex, "%016llx", seq);
            bad = put(rec, K[K_EVENT_ID], PyUnicode_FromFormat("%U%s", prefix, hex));
        }
        if (!bad) {
            PyObject *ts = int_of(h, &hf[H_TS]);
            bad = ts == NULL || put(rec, K[K_TS], PyNumber_Add(ts, offset_ns));
            Py_XDECREF(ts);
        }
        bad = bad || put(rec, K[K_STEP], int_of(h, &hf[H_STEP])) || PyDict_SetItem(rec, K[K_PID], pid_o) ||
              PyDict_SetItem(rec, K[K_PPID], ppid_o) || put(rec, K[K_UID], int_of(h, &hf[H_UID]));
        Py_DECREF(ppid_o);
        if (!bad) {
            /* comm: cached by its 16 bytes, as decode_many's comms */
            PyObject *cb = PyBytes_FromStringAndSize((const char *)h + comm_off, 16);
            PyObject *c = cb ? PyDict_GetItemWithError(comms, cb) : NULL;
            if (c != NULL) {
                bad = PyDict_SetItem(rec, K[K_COMM], c);
            } else if (cb == NULL || PyErr_Occurred()) {
                bad = 1;
            } else {
                const char *cs = (const char *)h + comm_off;
                const char *z = memchr(cs, 0, 16);
                if (PyDict_GET_SIZE(comms) >= CACHE_MAX)
                    PyDict_Clear(comms);
                c = PyUnicode_DecodeUTF8(cs, z ? z - cs : 16, "surrogateescape");
                bad = c == NULL || PyDict_SetItem(comms, cb, c) || PyDict_SetItem(rec, K[K_COMM], c);
                Py_XDECREF(c);
            }
            Py_XDECREF(cb);
        }
        if (!bad) {
            /* the sandbox's recent pids: info.saw(pid) unless it is the last one */
            Py_INCREF(info);                    /* borrowed from sandboxes: held across Python code */
            PyObject *rp = PyObject_GetAttr(info, s_recent);
            int last = 0;
            if (rp == NULL) {
                bad = 1;
            } else {
                if (PyList_Check(rp) && PyList_GET_SIZE(rp) > 0) {
                    last = PyObject_RichCompareBool(PyList_GET_ITEM(rp, PyList_GET_SIZE(rp) - 1), pid_o, Py_EQ);
                    if (last < 0)
                        bad = 1;
                }
                Py_DECREF(rp);
                if (!bad && last != 1) {
                    PyObject *res = PyObject_CallMethodOneArg(info, s_saw, pid_o);
                    if (res == NULL)
                        bad = 1;
                    Py_XDECREF(res);
                }
            }
            Py_DECREF(info);
        }
        Py_DECREF(pid_o);
        if (bad || PyList_Append(out, rec)) {
            Py_DECREF(rec);
            goto error;
        }
        Py_DECREF(rec);
        PyObject *s = PyLong_FromUnsignedLongLong(seq);
        if (s == NULL || PyList_SetItem(state, 0, s))
            goto error;
    }
    return i;
error:
    return -1;
}
