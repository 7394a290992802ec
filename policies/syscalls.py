"""The x86_64 system call table: names <-> numbers, and close-match suggestions.

The table comes from libseccomp (Debian python3-seccomp, `resolve_syscall`
over numbers 0..NR_MAX-1) so that a name dsec accepts is a name the seccomp
compiler can place in a filter. libseccomp 2.5.4 (Debian 12) stops at
futex_requeue (456) and lacks uretprobe (335); the calls added to the kernel
since then are supplied from the kernel's own x86_64 table below, so a
policy can name them (they are added to filters by number).

When libseccomp is not importable (a machine without python3-seccomp) the
table is empty and `available()` is False: loading a policy then fails with
a clear error rather than accepting names nobody checked.
"""
from __future__ import annotations

import difflib
import functools

ARCH = "x86_64"
NR_MAX = 512          # numbers are < NR_MAX; syscall_bitmap() has NR_MAX bits

# Present in arch/x86/entry/syscalls/syscall_64.tbl up to Linux 6.18, absent
# from libseccomp 2.5.4's table.
_SUPPLEMENT = {
    335: "uretprobe",
    457: "statmount",
    458: "listmount",
    459: "lsm_get_self_attr",
    460: "lsm_set_self_attr",
    461: "lsm_list_modules",
    462: "mseal",
    463: "setxattrat",
    464: "getxattrat",
    465: "listxattrat",
    466: "removexattrat",
    467: "open_tree_attr",
    468: "file_getattr",
    469: "file_setattr",
}


@functools.lru_cache(maxsize=1)
def _tables() -> tuple[dict[str, int], dict[int, str], frozenset[int]]:
    by_name: dict[str, int] = {}
    by_nr: dict[int, str] = {}
    libseccomp_nrs: set[int] = set()
    try:
        import seccomp
    except ImportError:
        return {}, {}, frozenset()
    arch = seccomp.Arch.X86_64
    for nr in range(NR_MAX):
        try:
            name = seccomp.resolve_syscall(arch, nr)
        except (ValueError, TypeError, OverflowError):
            continue
        if isinstance(name, bytes):
            name = name.decode("ascii", "replace")
        if not name or name.startswith("UNKNOWN"):
            continue
        by_name[name] = nr
        by_nr[nr] = name
        libseccomp_nrs.add(nr)
    for nr, name in _SUPPLEMENT.items():
        if nr not in by_nr and name not in by_name:
            by_name[name] = nr
            by_nr[nr] = name
    return by_name, by_nr, frozenset(libseccomp_nrs)


def available() -> bool:
    """True when the table could be built (libseccomp's Python bindings import)."""
    return bool(_tables()[0])


def names() -> list[str]:
    """Every known x86_64 syscall name, sorted."""
    return sorted(_tables()[0])


def number(name: str) -> int | None:
    """The x86_64 number of NAME, or None when NAME is not an x86_64 syscall."""
    return _tables()[0].get(name)


def name_of(nr: int) -> str | None:
    return _tables()[1].get(nr)


def is_syscall(name: str) -> bool:
    return name in _tables()[0]


def known_to_libseccomp(name: str) -> bool:
    """False for the supplemented calls (libseccomp can only take them by number)."""
    nr = number(name)
    return nr is not None and nr in _tables()[2]


def suggest(name: str, n: int = 3) -> list[str]:
    """Close matches for a misspelt name (difflib), best first."""
    if not isinstance(name, str):
        return []
    return difflib.get_close_matches(name.lower(), _tables()[0].keys(), n=n, cutoff=0.75)


def unknown_message(name: str) -> str:
    """`unknown syscall 'opne' (did you mean 'open'?)`"""
    msg = f"unknown syscall {name!r}"
    if not available():
        return msg + " (the syscall table needs libseccomp's Python bindings: apt-get install python3-seccomp)"
    close = suggest(name)
    if close:
        msg += " (did you mean " + " or ".join(repr(c) for c in close) + "?)"
    else:
        msg += f" (not an {ARCH} system call)"
    return msg
