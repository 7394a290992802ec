"""Records -> columns for the spool's append, in C (issue 15).

    got = columns(records, names)     # ([values of a field, ...], classes, ranges) or None
    build()                           # scripts/setup.sh: compile exporters/columns.c

The spool frames an append by column (exporters/spool.py "batch frames"):
transposing ~1,000-4,000 freshly decoded dicts of 39 fields was the
largest part of the poll thread's append (~2.6 us a record in place, the
records no longer in the CPU's caches). exporters/columns.c walks each
record's fields once (PyDict_Next), checks that they are exactly `names` in
that order, and gives the columns, each column's classes (a bitmask,
CLS_*) and the (min, max) of its ints (None: none, or one outside int64):
what the spool's validation by column needs, from the same pass.
None: some record is not a dict of exactly those fields in that order (the
spool then transposes by name, in Python, as before).

The library is built by `make setup` into exporters/build/ (like dsec-init);
without it (not built, or older than its source) the same result comes
from py_columns() and a warning says so once. tests/test_spool.py compares
the two on the same records.
"""
from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sysconfig
import threading

log = logging.getLogger("dsec.spool")

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "columns.c")
LIB = os.path.join(HERE, "build", "libdsec_columns.so")
CLS_NONE, CLS_INT, CLS_STR, CLS_LIST, CLS_TUPLE, CLS_OTHER = 1, 2, 4, 8, 16, 32
_CLASS_BITS = {type(None): CLS_NONE, int: CLS_INT, str: CLS_STR, list: CLS_LIST, tuple: CLS_TUPLE}

_I64 = (-2**63, 2**63 - 1)
_fn = None
_loaded = False
_lock = threading.Lock()


def build(out: str = LIB) -> str:
    """Compile columns.c into a shared library for this Python (scripts/setup.sh)."""
    return build_extension(SRC, out)


def build_extension(src: str, out: str) -> str:
    """Compile the C file `src` into the shared library `out` (written whole, then
    renamed), loaded through ctypes: columns.c here and agent/sensors/batchdecode.c
    (against Python's C API, through ctypes.PyDLL), agent/sandbox/spawn.c and trees.c
    (plain C)."""
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = f"{out}.{os.getpid()}.tmp"
    cmd = ["cc", "-O2", "-Wall", "-Wextra", "-shared", "-fPIC", "-I" + sysconfig.get_config_var("INCLUDEPY"),
           "-o", tmp, src]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise RuntimeError(f"cannot build {out} ({' '.join(cmd)}): {e.strerror}") from None
    if r.returncode != 0:
        raise RuntimeError(f"cannot build {out}: {(r.stderr.strip().splitlines() or ['cc failed'])[-1]}")
    os.rename(tmp, out)
    return out


def _load():
    global _fn, _loaded
    with _lock:
        if _loaded:
            return _fn
        _loaded = True
        why = None
        try:
            if os.stat(LIB).st_mtime < os.stat(SRC).st_mtime:
                why = "older than exporters/columns.c"
            else:
                lib = ctypes.PyDLL(LIB)
                fn = lib.dsec_columns
                fn.restype = ctypes.py_object
                fn.argtypes = (ctypes.py_object, ctypes.py_object)
                _fn = fn
        except FileNotFoundError:
            why = "not built"
        except OSError as e:
            why = str(e)
        if why:
            log.warning("spool: %s %s (run `make setup`); columns are built in Python (slower)", LIB, why)
        return _fn


def py_columns(records: list, names: tuple):
    """What columns.c gives, in Python (the reference, and the fallback)."""
    if records.__class__ is not list or names.__class__ is not tuple:
        return None
    k = len(names)
    for r in records:
        if r.__class__ is not dict or len(r) != k or tuple(r) != names:
            return None
    cols = [[r[name] for r in records] for name in names]
    masks, ranges = [], []
    for col in cols:
        m = 0
        for c in set(map(type, col)):
            m |= _CLASS_BITS.get(c, CLS_OTHER)
        masks.append(m)
        ints = [v for v in col if v.__class__ is int]
        ranges.append((min(ints), max(ints)) if ints and _I64[0] <= min(ints) and max(ints) <= _I64[1] else None)
    return cols, bytes(masks), ranges


def columns(records: list, names: tuple):
    """([the values of each field of names, one per record], classes, ranges)
    of records that are all dicts of exactly those fields in that order; else None."""
    fn = _fn if _loaded else _load()
    if fn is None:
        return py_columns(records, names)
    return fn(records, names)
