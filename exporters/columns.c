/* Records -> columns for the spool's append (exporters/columns.py; issue 15).
 *
 * dsec_columns(records, names): records a list of dicts that each hold exactly
 * the fields `names` (a tuple of str) in that order. Returns (columns, classes,
 * ranges):
 * columns a list of one list per name (the values, one per record, new
 * references), classes a bytes object of one mask per name: the classes of that
 * column's values (CLS_* below; exact classes only: a subclass, bool, float,
 * bytes ... is CLS_OTHER) and ranges, a list of one (min, max) per name of
 * the column's ints (None: no int, or one outside the int64 range: the caller
 * then takes min and max itself). Returns None when a record is not an exact dict or
 * has other fields, or the same fields in another order (the caller then
 * transposes by name in Python). Called through ctypes.PyDLL: the GIL is held.
 */
#include <Python.h>

#define CLS_NONE 1
#define CLS_INT 2
#define CLS_STR 4
#define CLS_LIST 8
#define CLS_TUPLE 16
#define CLS_OTHER 32

static unsigned char class_of(PyObject *v)
{
    if (v == Py_None)
        return CLS_NONE;
    if (PyLong_CheckExact(v))
        return CLS_INT;
    if (PyUnicode_CheckExact(v))
        return CLS_STR;
    if (PyList_CheckExact(v))
        return CLS_LIST;
    if (PyTuple_CheckExact(v))
        return CLS_TUPLE;
    return CLS_OTHER;
}

PyObject *dsec_columns(PyObject *records, PyObject *names)
{
    if (!PyList_CheckExact(records) || !PyTuple_CheckExact(names))
        Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(records), k = PyTuple_GET_SIZE(names);
    PyObject *cols = PyList_New(k);
    if (cols == NULL)
        return NULL;
    PyObject *classes = PyBytes_FromStringAndSize(NULL, k);
    if (classes == NULL) {
        Py_DECREF(cols);
        return NULL;
    }
    unsigned char *cls = (unsigned char *)PyBytes_AS_STRING(classes);
    memset(cls, 0, (size_t)k);
    /* per column: ints seen (1), one outside int64 (2); their min and max */
    unsigned char *rng = PyMem_Calloc(k ? (size_t)k : 1, 1);
    long long *mn = PyMem_Calloc(k ? (size_t)k : 1, sizeof(long long));
    long long *mx = PyMem_Calloc(k ? (size_t)k : 1, sizeof(long long));
    if (rng == NULL || mn == NULL || mx == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *c = PyList_New(n);      /* items NULL until set: freed safely on the way out */
        if (c == NULL)
            goto fail;
        PyList_SET_ITEM(cols, j, c);
    }
    PyObject **colv = ((PyListObject *)cols)->ob_item;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyList_GET_ITEM(records, i);
        if (!PyDict_CheckExact(d) || PyDict_GET_SIZE(d) != k)
            goto none;
        Py_ssize_t pos = 0, j = 0;
        PyObject *key, *value;
        while (PyDict_Next(d, &pos, &key, &value)) {
            if (j >= k)
                goto none;
            PyObject *want = PyTuple_GET_ITEM(names, j);
            if (key != want) {
                int same = PyObject_RichCompareBool(key, want, Py_EQ);
                if (same != 1) {
                    if (same < 0)
                        PyErr_Clear();
                    goto none;
                }
            }
            Py_INCREF(value);
            PyList_SET_ITEM(colv[j], i, value);
            unsigned char c = class_of(value);
            cls[j] |= c;
            if (c == CLS_INT && !(rng[j] & 2)) {
                int over = 0;
                long long v = PyLong_AsLongLongAndOverflow(value, &over);
                if (over) {
                    rng[j] |= 2;
                } else if (!(rng[j] & 1)) {
                    rng[j] = 1;
                    mn[j] = mx[j] = v;
                } else if (v < mn[j]) {
                    mn[j] = v;
                } else if (v > mx[j]) {
                    mx[j] = v;
                }
            }
            j++;
        }
        if (j != k)
            goto none;
    }
    PyObject *ranges = PyList_New(k);
    if (ranges == NULL)
        goto fail;
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *r;
        if (rng[j] == 1) {
            r = Py_BuildValue("(LL)", mn[j], mx[j]);
            if (r == NULL) {
                Py_DECREF(ranges);
                goto fail;
            }
        } else {
            r = Py_None;
            Py_INCREF(r);
        }
        PyList_SET_ITEM(ranges, j, r);
    }
    PyObject *out = PyTuple_Pack(3, cols, classes, ranges);
    Py_DECREF(ranges);
    Py_DECREF(cols);
    Py_DECREF(classes);
    PyMem_Free(rng);
    PyMem_Free(mn);
    PyMem_Free(mx);
    return out;
none:
    Py_DECREF(cols);
    Py_DECREF(classes);
    PyMem_Free(rng);
    PyMem_Free(mn);
    PyMem_Free(mx);
    Py_RETURN_NONE;
fail:
    Py_DECREF(cols);
    Py_DECREF(classes);
    PyMem_Free(rng);
    PyMem_Free(mn);
    PyMem_Free(mx);
    return NULL;
}
