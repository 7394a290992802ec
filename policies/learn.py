"""Deriving a policy from observed runs (learning mode), with provenance.

Why this file is long: derivation (observe), generalisation, convergence and the
commented rendering share one provenance structure and one set of notes; split
apart, each piece would re-read the others' keys.

    policy = derive_policy(runs, base=None, name="learned")   # a Policy, mode audit
    text = render(policy)                                      # YAML with a comment per entry
    prov = provenance(policy)                                  # the provenance, as plain data

A run is {run_id, records: [audit record dicts], syscall_counts: {name: count}}
(plus optional `source` and `stats`, as policies.strace produces). Records are
what the recorder/ClickHouse hold (audit_schema.events.FIELDS; `extra` a JSON
string or a dict); syscall counts come from the in-kernel per-sandbox counter
or from strace. Pure: no I/O.

What is derived (each rule documented in docs/learning.md):

  syscalls   `default: deny`, allow = every call any run made, plus the runtime's
             own unavoidable calls (execve: dsec starts CMD with it, the only call
             between loading the filter and CMD; exit_group: every process ends
             with it), marked `runtime`. `namespaces: deny` stays: an observed
             clone3 adds clone (glibc falls back to it on clone3's ENOSYS); an
             observed setns is not allowed (noted). Names that are not x86_64
             calls are noted, not allowed.
  egress     `default: deny`; one allow rule per destination (address as /32 or
             /128, or the hostname when the record carries one) and protocol
             (tcp/udp when the record says, else any), with the ports seen; from
             connect records of family ipv4/ipv6 whose ret is 0 or -EINPROGRESS.
             Port-53 destinations become `dns` resolvers. Loopback destinations
             ARE kept (marked): the egress rules have no loopback exemption, so
             leaving them out would deny what the run did; inside a sandbox's
             own network namespace loopback never leaves the sandbox. Failed
             connects and unix sockets are noted, not learned.
  exec       the exact paths of successful execs (ret 0).
  files      written paths (open_write, unlink, rename old+new, mkdir) generalised
             into a few writable directories (see generalise()); attempts the
             environment refused (EACCES/EPERM/EROFS) are noted, not learned.
  mode       audit.

Provenance -- which runs, how often, why -- is kept in metadata.annotations
(`dsec.learn/provenance`, JSON, one entry per line, split over `.2`, `.3` ...
keys when long) so it survives loading, merging and promotion (annotations
are not part of the content hash), and is rendered as a YAML comment beside
each entry by render().
"""
from __future__ import annotations

import errno as _errno
import ipaddress
import json
import posixpath
import re
from collections import Counter, defaultdict
from typing import Iterable

import yaml

from policies.errors import PoliciesError, USAGE as EXIT_USAGE
from policies import model as m
from policies import syscalls as sc
from policies.model import Policy
from policies.compile import relative_exec_canonical
from policies.evaluate import _ret  # noqa: F401 (one reading of a record's result)
from policies.provenance import (PROV_KEY, SEEN_MAX, SUMMARY_KEY, _entry,  # noqa: F401 (API)
                                 _summary, _valid, egress_key, merge_entry, new_provenance, provenance,
                                 provenance_annotations, strip_provenance, under)


RUNTIME = {
    "execve": "runtime: dsec starts the command with it (the only call between loading the filter and CMD)",
    "exit_group": "runtime: every process ends with it",
}
# Calls whose appearance in a run depends on timing, not on what the program does:
# a sleep or a lock wait that had nothing left to wait for, a spin's back-off, a
# signal that arrived mid-sleep or at all, the vDSO's clocks falling back to the
# kernel. A run that did not make one proves nothing about the next, and none
# grants anything (no file, network, process or namespace reach), so every learned
# allow list has them, marked `timing` (systemd's @default group holds the same
# kind of call for the same reason). Learning them only when seen made a learned
# CPython suite fail under enforce once in a few runs (its sleep poll).
_SLEEP = "timing: a sleep: skipped when what it waits for is already done"
_VDSO = "timing: the vDSO's {}: a real call only when the vDSO falls back to the kernel"
TIMING = {
    "clock_nanosleep": _SLEEP,
    "nanosleep": _SLEEP,
    "futex": "timing: lock waits and wake-ups: made only under contention",
    "sched_yield": "timing: a spin's back-off: made only under contention",
    "restart_syscall": "timing: the kernel's resumption of a sleep a signal interrupted",
    "rt_sigreturn": "timing: the return from a signal handler: made when a signal arrives",
    **{n: _VDSO.format("clock") for n in ("clock_gettime", "clock_getres", "gettimeofday", "time")},
    "getcpu": _VDSO.format("getcpu"),
}
EINPROGRESS = _errno.EINPROGRESS
REFUSED = {_errno.EACCES, _errno.EPERM, _errno.EROFS}

# Always writable in a sandbox whatever files.writable says (policies.evaluate.SCRATCH
# has /tmp too; /tmp is listed explicitly when written, so reviewers see it).
SCRATCH = ("/dev", "/proc/self", "/proc/thread-self")
# Trees where a written file stays an exact entry (no generalisation to its directory):
# letting a sandbox write /etc/hosts must not let it write /etc/passwd.
SYSTEM_TREES = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/boot", "/proc", "/sys")
# Top-level directories shared by unrelated things: never generalised to on their own
# (/var/log/a and /var/lib/b stay two entries, not /var).
SHARED_ROOTS = ("/var", "/home", "/run", "/srv", "/mnt", "/media", "/opt", "/snap", "/nix", "/usr", "/etc")
# Temporary directories: programs write random names there (tempfile.mkdtemp ...), so
# anything under one generalises to the directory itself.
TEMP_DIRS = ("/tmp", "/var/tmp")
# Fresh in every sandbox (tmpfs or an empty base directory): whatever is there to
# execute, the sandbox wrote itself.
FRESH_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
WRITE_KINDS = ("open_write", "unlink", "rename", "mkdir")
# Ports the kernel hands out for bind(port 0) / connect (Linux's default
# ip_local_port_range): a loopback server the sandbox started itself listens on
# a different one every run.
EPHEMERAL = (32768, 60999)

# Names that differ every run: tempfile's tmpXXXXXXXX (8 of [a-z0-9_]),
# multiprocessing's pymp-XXXXXXXX, mktemp(1)'s tmp.XXXXXXXXXX, long hex ids
# (uuids, hashes of time), pid-numbered names (name_1234, name-1234, name.1234).
RANDOM_NAMES = (
    ("tempfile name", re.compile(r"^(?:tmp|pymp-)[a-z0-9_]{8}(?![a-z0-9_])")),
    ("mktemp name", re.compile(r"^tmp\.[A-Za-z0-9]{6,12}$")),
    ("random id", re.compile(r"(?:^|[^0-9a-f])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{12,}(?:$|[^0-9a-f])")),
    ("pid-numbered name", re.compile(r"(?:^|[_.@-])[0-9]{3,7}(?:$|[_.-])")),
)


class LearnError(PoliciesError):
    def __init__(self, message: str):
        super().__init__(message, EXIT_USAGE)


# ---------------------------------------------------------------- small helpers

def _extra(rec: dict) -> dict:
    e = rec.get("extra")
    if isinstance(e, dict):
        return e
    if isinstance(e, str) and e.startswith("{"):
        try:
            v = json.loads(e)
            return v if isinstance(v, dict) else {}
        except ValueError:
            return {}
    return {}


def _show(s: str) -> str:
    """Printable form of a (possibly non-UTF-8, surrogateescaped) string, one line."""
    t = s.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in t)


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _errname(ret: int | None) -> str:
    if ret is None:
        return "result unknown"
    return _errno.errorcode.get(-ret, str(ret)) if ret < 0 else str(ret)


def _add(d: dict, run: str, n: int = 1):
    d[run] = d.get(run, 0) + n


# ---------------------------------------------------------------- path generalisation

def random_name(component: str) -> str | None:
    """What kind of per-run random name `component` is (None: looks stable)."""
    for kind, rx in RANDOM_NAMES:
        if rx.search(component):
            return kind
    return None


def random_cut(p: str) -> tuple[str, str, str] | None:
    """(the directory above the first random component of p, that component, its
    kind), or None when no component looks random."""
    parts = p.split("/")
    for i in range(1, len(parts)):
        kind = random_name(parts[i])
        if kind:
            return "/".join(parts[:i]) or "/", parts[i], kind
    return None


def _is_scratch(p: str) -> bool:
    return any(under(p, s) for s in SCRATCH)


def _system(p: str) -> bool:
    return any(under(p, t) for t in SYSTEM_TREES)


def _depth(p: str) -> int:
    return 0 if p == "/" else p.count("/")


def _mergeable_ancestor(a: str) -> bool:
    """May several entries be generalised to directory `a`?"""
    if a == "/" or _system(a):
        return False
    if _depth(a) == 1 and a in SHARED_ROOTS:
        return False
    return True


def _common(a: str, b: str) -> str:
    pa, pb = a.strip("/").split("/"), b.strip("/").split("/")
    out = []
    for x, y in zip(pa, pb):
        if x != y:
            break
        out.append(x)
    return "/" + "/".join(out)


def generalise(paths: Iterable[str]) -> dict[str, list[str]]:
    """Written paths (absolute, normalized) -> {writable entry: [observed paths]}.

    1. Paths under a scratch mount (/dev, /proc/self/fd: always writable) map to
       the key "" (listed in the provenance, not in files.writable); paths under
       a temporary directory (/tmp, /var/tmp: random names) map to it.
    2. Under a system tree (/etc, /usr, /bin, /sbin, /lib*, /boot, /proc, /sys)
       a path stays exact: nothing else in that directory becomes writable.
    3. Elsewhere a path maps to its directory (creating, replacing or removing a
       file needs its directory writable); a path directly under "/" stays exact.
       A path with a per-run random component (random_name(): tempfile's
       tmpXXXXXXXX, pid-numbered names ...) maps to the directory above that
       component: next run's name will differ.
    4. Entries sharing an ancestor collapse into it, repeatedly, when the
       ancestor is neither "/" nor a system tree nor a shared top-level directory
       (/var, /home, /run, /srv, /mnt, /media, /opt ...): /workspace/a and
       /workspace/b/c become /workspace; /home/u/.cache/x and /home/u/src/y
       become /home/u; /var/log/x and /var/lib/y stay apart.
    5. An entry inside another entry is dropped into it.
    Never produces "/".
    """
    out: dict[str, list[str]] = defaultdict(list)
    cand: dict[str, list[str]] = defaultdict(list)
    for p in sorted(set(paths)):
        if _is_scratch(p):
            out[""].append(p)
            continue
        if p == "/":
            continue
        tmp = next((t for t in TEMP_DIRS if under(p, t)), None)
        if tmp is not None:
            cand[tmp].append(p)
            continue
        if _system(p):
            cand[p].append(p)
            continue
        cut = random_cut(p)
        if cut is not None and cut[0] != "/" and not _system(cut[0]):
            cand[cut[0]].append(p)          # a per-run random name: its directory, not itself
            continue
        parent = posixpath.dirname(p)
        cand[p if parent == "/" else parent].append(p)
    # collapse: repeatedly merge the pair of entries with the deepest common mergeable ancestor
    keys = sorted(cand)
    changed = True
    while changed:
        changed = False
        # 5: entries inside another entry
        for k in list(keys):
            for o in keys:
                if o != k and under(k, o) and not _system(k):
                    cand[o].extend(cand.pop(k))
                    keys.remove(k)
                    changed = True
                    break
            if changed:
                break
        if changed:
            continue
        best = None
        for i, a in enumerate(keys):
            if _system(a):
                continue
            for b in keys[i + 1:]:
                if _system(b):
                    continue
                c = _common(a, b)
                if _mergeable_ancestor(c) and (best is None or _depth(c) > _depth(best[0])):
                    best = (c, a, b)
        if best is not None:
            c, a, b = best
            merged = cand.pop(a) + cand.pop(b)
            keys.remove(a)
            keys.remove(b)
            cand[c].extend(merged)
            if c not in keys:
                keys.append(c)
                keys.sort()
            changed = True
    for k in keys:
        out[k].extend(cand[k])
    return {k: sorted(set(v)) for k, v in sorted(out.items())}


# ---------------------------------------------------------------- derivation

def _check_runs(runs) -> list[dict]:
    if not isinstance(runs, (list, tuple)):
        raise LearnError(f"runs must be a list of runs, got {type(runs).__name__}")
    out, seen = [], Counter()
    for i, r in enumerate(runs):
        if not isinstance(r, dict):
            raise LearnError(f"run {i}: expected a mapping with run_id, records, syscall_counts, "
                             f"got {type(r).__name__}")
        rid = r.get("run_id")
        if not isinstance(rid, str) or not rid:
            raise LearnError(f"run {i}: run_id must be a non-empty string")
        recs = r.get("records", [])
        if not isinstance(recs, (list, tuple)):
            raise LearnError(f"run {rid}: records must be a list")
        counts = r.get("syscall_counts", {})
        if not isinstance(counts, dict):
            raise LearnError(f"run {rid}: syscall_counts must be a mapping of syscall name to count")
        seen[rid] += 1
        if seen[rid] > 1:
            rid = f"{rid}#{seen[rid]}"
        out.append({**r, "run_id": rid, "records": recs, "syscall_counts": counts})
    if not out:
        raise LearnError("no runs to learn from")
    return out


def _syscall_name(k) -> str | None:
    if isinstance(k, bool):
        return None
    if isinstance(k, int) or (isinstance(k, str) and k.isdigit()):
        return sc.name_of(int(k))
    if isinstance(k, str):
        mm = re.match(r"^syscall_(0x[0-9a-fA-F]+|\d+)$", k)
        if mm:
            return sc.name_of(int(mm.group(1), 0))
        return k
    return None


def _norm_path(p: str) -> str:
    n = posixpath.normpath(p)
    return "/" + n.lstrip("/") if n.startswith("/") else n


def _run_info(r: dict, lost: int) -> dict:
    info = {"id": r["run_id"], "from": str(r.get("source") or "sandbox")}
    info["syscalls"] = int(sum(v for v in r["syscall_counts"].values()
                               if isinstance(v, int) and not isinstance(v, bool)))
    info["records"] = len(r["records"])
    if lost:
        info["lost"] = lost
    stats = r.get("stats") if isinstance(r.get("stats"), dict) else {}
    if stats.get("bad"):
        info["bad_lines"] = int(stats["bad"])
    return info


class _Notes:
    """Notes grouped by kind: 'what (runs) xN, ...' one line per kind."""

    def __init__(self):
        self.items: dict[str, Counter] = defaultdict(Counter)
        self.free: list[str] = []

    def add(self, kind: str, what: str, n: int = 1):
        self.items[kind][what] += n

    def lines(self) -> list[str]:
        out = list(self.free)
        for kind, c in self.items.items():
            top = c.most_common(12)
            s = ", ".join(f"{w} x{n}" if n > 1 else w for w, n in top)
            if len(c) > len(top):
                s += f", ... ({len(c) - len(top)} more)"
            out.append(f"{kind}: {s}")
        return out


def observe(runs, layout_check=None) -> tuple[dict, dict]:
    """Runs -> (spec dict in audit mode, provenance); the core of derive_policy.
    layout_check(paths) -> [(index, path, why)]: writable entries the sandbox's root
    filesystem cannot hold (agent.sandbox.rootfs.writable_conflicts); they are left
    out and listed in the notes."""
    runs = _check_runs(runs)
    prov = new_provenance()
    notes = _Notes()
    sysc: dict[str, dict] = {}
    egress: dict[tuple, dict] = {}          # (target, protocol) -> {"ports": set, entry}
    dns: dict[str, dict] = {}
    dns_order: list[str] = []
    execs: dict[str, dict] = {}
    exec_obs: list[tuple[str, str, str, str]] = []   # (run, absolute path, relative name or "", path_resolution)
    written: dict[str, dict] = defaultdict(dict)     # path -> {run: n}
    run_written: dict[str, set] = defaultdict(set)   # run -> paths it created or replaced

    for r in runs:
        rid = r["run_id"]
        lost = 0
        for k, n in r["syscall_counts"].items():
            name = _syscall_name(k)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise LearnError(f"run {rid}: syscall_counts[{k!r}] must be a non-negative integer")
            if n == 0:
                continue
            if name is None or not sc.is_syscall(name):
                notes.add("not x86_64 system calls, not learned", _show(str(k)), n)
                continue
            _add(sysc.setdefault(name, _entry())["runs"], rid, n)
        stats = r.get("stats") if isinstance(r.get("stats"), dict) else {}
        for n_, c in (stats.get("other_abi_counts") or {}).items():
            notes.add("calls of a 32-bit process (not x86_64: not learned)", _show(str(n_)), int(c))
        if stats.get("bad"):
            notes.free.append(f"run {rid}: {stats['bad']} line(s) of its log could not be parsed "
                              "(what they held is missing here)")
        for rec in r["records"]:
            if not isinstance(rec, dict):
                raise LearnError(f"run {rid}: a record is not a mapping")
            kind = rec.get("kind")
            ex = _extra(rec)
            if kind == "events_lost":
                lost += int(rec.get("count") or 0)
            elif kind == "connect":
                _observe_connect(rid, rec, ex, egress, dns, dns_order, notes)
            elif kind == "exec":
                path = rec.get("path") or ""
                ret = _ret(rec)
                if ret != 0:
                    if ret is None:
                        notes.add("execs with an unknown result, not learned", _show(path) or "?")
                    else:
                        notes.add("execs that failed (the kernel refused them: not learned)",
                                  f"{_show(path) or '?'} ({_errname(ret)})")
                    continue
                raw = rec.get("path_raw") or ""
                how = rec.get("path_resolution") or ""
                rel = raw if raw and not raw.startswith("/") else ""
                if rel and not relative_exec_canonical(rel):
                    # the kernel's exec check joins a relative name to the cwd only when it is
                    # canonical after its leading "./" (bpf/enforce.c): enforce would refuse it
                    notes.add("execs by a relative name with '.', '..' or empty components (the exec "
                              "check refuses them under enforce: run them by a plain name), not learned",
                              f"{_show(raw)} (-> {_show(path)})")
                    continue
                if rel and how and how != "verified":
                    # a live record of a relative exec the kernel could not place at a verified
                    # cwd (cwd_unknown: CLONE_FS, unshare, a chdir not verified) -- what /proc
                    # showed later is a guess, and the exec check refuses it under enforce
                    notes.add("relative execs whose cwd was not verified (the exec check refuses them: "
                              "run them by an absolute path), not learned",
                              _show(raw) + (f" (/proc showed {_show(path)} later)" if path.startswith("/") else ""))
                    continue
                if not path.startswith("/"):
                    notes.add("execs of an unresolved relative path, not learned", _show(path))
                    continue
                ok = _valid(m._check_exec_pattern, path) if _utf8(path) and "*" not in path else None
                if ok is None or _norm_path(path) != path:
                    notes.add("exec paths an exec allowlist cannot hold, not learned", _show(path))
                    continue
                exec_obs.append((rid, path, rel, how))
            elif kind in WRITE_KINDS:
                ret = _ret(rec)
                paths = [rec.get("path") or ""]
                if kind == "rename":
                    paths.append(rec.get("path2") or "")
                for p in paths:
                    if not p:
                        continue
                    if ret is not None and ret < 0:
                        what = f"{_show(p)} ({_errname(ret)})"
                        if -ret in REFUSED:
                            notes.add("write attempts the environment refused (permissions, read-only), "
                                      "not learned", what)
                        else:
                            notes.add("write attempts that failed (the kernel refused them: not learned)", what)
                        continue
                    if not p.startswith("/"):
                        notes.add("writes to an unresolved relative path, not learned", _show(p))
                        continue
                    p = _norm_path(p)
                    raw = rec.get("path_raw") if p == _norm_path(paths[0]) else ex.get("path2_raw")
                    if raw and not str(raw).startswith("/") and _system(p):
                        # resolved by the agent after the fact, through the process's cwd or a
                        # dirfd that may have been closed and reused by then: never trusted for
                        # an exact entry in a system tree
                        notes.add("relative writes placed in a system tree only after the fact (the cwd "
                                  "or dirfd may have changed by then), not learned", f"{_show(p)} (as {_show(raw)})")
                        continue
                    if p.startswith("/proc/") and re.match(r"^/proc/(\d+|thread-self)(/|$)", p):
                        p = re.sub(r"^/proc/(\d+|thread-self)", "/proc/self", p)
                    _add(written[p], rid)
                    if kind != "unlink" and (kind != "rename" or p == _norm_path(paths[-1])):
                        run_written[rid].add(p)
        if lost:
            notes.free.append(f"run {rid} LOST {lost} audit event(s): entries may be missing; learn again")
        prov["runs"].append(_run_info(r, lost))

    # ---- syscalls
    allow = set(sysc)
    if "clone3" in allow:
        e = sysc.setdefault("clone", _entry())
        e.setdefault("why", []).append("fallback: clone3 gets ENOSYS under namespaces: deny and glibc "
                                       "falls back to clone")
        allow.add("clone")
        allow.discard("clone3")
        notes.free.append("clone3 was observed: with namespaces: deny it returns ENOSYS and glibc uses "
                          "clone (allowed) instead")
    if "setns" in allow:
        allow.discard("setns")
        notes.free.append("setns was observed but is not allowed (namespaces: deny); audit mode will "
                          "report it as would-deny")
    for name, why in {**RUNTIME, **TIMING}.items():
        e = sysc.setdefault(name, _entry())
        e.setdefault("why", []).append(why)
        allow.add(name)
    for name in list(sysc):
        if name not in allow:
            del sysc[name]
    prov["syscalls"] = sysc

    # ---- egress
    rules = []
    for (target, proto), d in sorted(egress.items()):
        rule = {("host" if d["host"] else "cidr"): target,
                "ports": sorted(d["ports"], key=lambda x: m.port_range(x)), "protocol": proto}
        rules.append(rule)
        prov["egress"][egress_key(rule)] = d["entry"]
    egress_spec: dict = {"default": "deny", "allow": rules}
    if dns_order:
        egress_spec["dns"] = dns_order
    prov["dns"] = dns

    # ---- files
    gen = generalise(written)
    writable = []
    for d, observed in gen.items():
        if d == "":
            for p in observed:
                notes.add("written paths that are always writable (scratch mounts), not listed", _show(p),
                          sum(written[p].values()))
            continue
        if _valid(m._check_writable, d) is None or not _utf8(d):
            notes.add("written paths no writable entry can hold, not learned", _show(d))
            continue
        if layout_check is not None:
            bad = layout_check([d])
            if bad:
                notes.add("writable paths the sandbox's root filesystem cannot hold, not learned",
                          f"{_show(d)}: {bad[0][2]}")
                continue
        writable.append(d)
        e = _entry()
        e["seen"] = {}
        kinds = set()
        for p in observed:
            for rid, n in written[p].items():
                _add(e["runs"], rid, n)
            e["seen"][p] = dict(written[p])
            cut = random_cut(p)
            if cut is not None and (cut[0] == d or under(cut[0], d)):
                kinds.add(f"{cut[2]} {cut[1]}")
        if kinds:
            ex = sorted(kinds)
            e["why"] = [f"per-run random names under it ({', '.join(ex[:2])}{' ...' if len(ex) > 2 else ''}): "
                        "generalised to this directory"]
        prov["files"][d] = e

    # ---- exec: exact paths, except files the sandbox wrote itself under a writable
    # directory (a script in a fresh temporary directory: a new name every run),
    # which become an exec.allow_written_under rule for that directory
    written_under: dict[str, dict] = {}
    for rid, path, rel, how in exec_obs:
        root = _written_root(path, writable)
        if root is not None and (root in FRESH_DIRS or path in run_written[rid] or random_cut(path)):
            e = written_under.setdefault(root, _entry())
            _add(e["runs"], rid)
            _add(e.setdefault("seen", {}).setdefault(path + (f" (as {rel})" if rel else ""), {}), rid)
            continue
        e = execs.setdefault(path, _entry())
        _add(e["runs"], rid)
        if rel and how == "verified":
            w = (f"run by its relative name {_show(rel)} (placed at the cwd the agent verified at the "
                 "process's last chdir, carried in the kernel's exec record; under audit and enforce the "
                 "kernel's check joins it to that same cwd)")
        elif rel:
            w = (f"run by its relative name {_show(rel)} (resolved against the process's cwd as the trace "
                 "shows it; under enforce the kernel's check joins it to the cwd the agent verifies at each "
                 "chdir)")
        if rel:
            if w not in e.setdefault("why", []):
                e["why"].append(w)
    prov["exec"] = dict(execs)
    for root, e in written_under.items():
        e["why"] = [f"files the sandbox wrote itself under {root} and then ran (new names every run): "
                    "any file there may run; remove this rule to refuse it"]
        prov["exec"][WRITTEN_KEY + root] = e

    spec = {
        "mode": "audit",
        "syscalls": {"default": "deny", "action": "errno", "errno": "EPERM", "namespaces": "deny",
                     "allow": sorted(allow)},
        "egress": egress_spec,
        "exec": {"allow": sorted(execs)},
        "files": {"writable": sorted(writable)},
    }
    if written_under:
        spec["exec"]["allow_written_under"] = sorted(written_under)
    prov["notes"] = notes.lines()
    return spec, prov


WRITTEN_KEY = "written-under:"      # provenance key prefix of exec.allow_written_under entries


def _written_root(path: str, writable: list[str]) -> str | None:
    """The writable directory `path` is under: a fresh scratch directory (/tmp,
    /var/tmp, /dev/shm) or a learned files.writable directory; None otherwise."""
    for d in FRESH_DIRS:
        if under(path, d) and path != d:
            return d
    best = None
    for w in writable:
        if path != w and under(path, w) and not _system(w) and (best is None or len(w) < len(best)):
            best = w
    return best


def _observe_connect(rid, rec, ex, egress, dns, dns_order, notes):
    family = rec.get("family")
    addr = rec.get("addr") or ""
    if family == "unix":
        notes.add("unix socket connects (not egress: no rule needed)", _show(addr) or "(unnamed)")
        return
    if family not in ("ipv4", "ipv6"):
        return
    ret = _ret(rec)
    port = rec.get("port") or 0
    try:
        ip = ipaddress.ip_address(addr.split("%")[0])
        port = int(port)
    except (ValueError, TypeError):
        notes.add("connects to an unreadable address, not learned", _show(f"{addr}:{port}"))
        return
    shown = f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
    if ret not in (0, -EINPROGRESS):
        notes.add("connects that failed, not learned", f"{shown} ({_errname(ret)})")
        return
    if port == 0:
        notes.add("connects without a port (e.g. UDP disconnect), not learned", shown)
        return
    proto = ex.get("protocol") if ex.get("protocol") in ("tcp", "udp") else "any"
    host = rec.get("host") or ex.get("host") or ex.get("hostname")
    host = _valid(m._check_host, host) if isinstance(host, str) and host else None
    if port == 53 and host is None:
        key = str(ip)
        if key not in dns:
            dns[key] = _entry()
            dns_order.append(key)
        _add(dns[key]["runs"], rid)
        if ip.is_loopback:
            dns[key]["loopback"] = True
        return
    target = host or f"{ip}/{ip.max_prefixlen}"
    d = egress.setdefault((target, proto), {"ports": set(), "host": bool(host), "entry": _entry()})
    if ip.is_loopback and EPHEMERAL[0] <= port <= EPHEMERAL[1]:
        # a server the sandbox bound itself (port 0): another port every run
        d["ports"].add(f"{EPHEMERAL[0]}-{EPHEMERAL[1]}")
        why = (f"loopback ports {EPHEMERAL[0]}-{EPHEMERAL[1]}: the kernel's ephemeral range, random per run "
               "(servers the sandbox started itself)")
        if why not in d["entry"].setdefault("why", []):
            d["entry"]["why"].append(why)
    else:
        d["ports"].add(port)
    e = d["entry"]
    _add(e["runs"], rid)
    _add(e.setdefault("seen", {}).setdefault(shown, {}), rid)
    if host:
        e.setdefault("addrs", [])
        if str(ip) not in e["addrs"]:
            e["addrs"].append(str(ip))
    if ip.is_loopback:
        e["loopback"] = True


RULE_KINDS = ("syscalls", "egress", "dns", "exec", "exec.allow_written_under", "files")


def _rule_sets(spec: dict) -> dict[str, set]:
    eg = spec.get("egress") or {}
    x = spec.get("exec") or {}
    return {
        "syscalls": set(spec["syscalls"].get("allow", [])),
        "egress": {f"{r.get('protocol')} {r.get('cidr') or r.get('host')}:{p}"
                   for r in eg.get("allow", []) for p in (r.get("ports") or ["*"])},
        "dns": set(eg.get("dns", [])),
        "exec": set(x.get("allow", [])),
        "exec.allow_written_under": set(x.get("allow_written_under", [])),
        "files": set((spec.get("files") or {}).get("writable", [])),
    }


def additions(runs) -> list[dict]:
    """Per run, in order: what it added to the policy of the runs before it, per rule
    kind ({run_id, added: {kind: [entries]}, total: n}). The first run adds all it
    learned. A run that adds nothing changed nothing in the derived policy."""
    runs = _check_runs(runs)
    out = []
    before = {k: set() for k in RULE_KINDS}
    for i, r in enumerate(runs):
        spec, _ = observe(runs[: i + 1])
        now = _rule_sets(spec)
        added = {k: sorted(now[k] - before[k]) for k in RULE_KINDS if now[k] - before[k]}
        out.append({"run_id": r["run_id"], "added": added, "total": sum(len(v) for v in added.values())})
        before = {k: before[k] | now[k] for k in RULE_KINDS}
    return out


def stable_tail(adds: list[dict]) -> int:
    """How many of the last runs added nothing."""
    n = 0
    for a in reversed(adds):
        if a["total"]:
            break
        n += 1
    return n


def derive_policy(runs, *, base: Policy | None = None, name: str = "learned", layout_check=None) -> Policy:
    """The policy the runs need, in audit mode, with provenance annotations.
    With `base`, the union with base (policies.merge) -- still in audit mode."""
    if _valid(m._check_name, name) is None:
        raise LearnError(f"invalid policy name {name!r}: use 1-63 of [a-z0-9._-], starting and ending "
                         "alphanumeric")
    spec, prov = observe(runs, layout_check)
    ann = {"description": _summary(prov), SUMMARY_KEY: _summary(prov)}
    ann.update(provenance_annotations(prov))
    data = {"apiVersion": m.API_VERSION, "kind": m.KIND, "metadata": {"name": name, "annotations": ann},
            "spec": spec}
    from policies.load import policy_from_data
    learned = policy_from_data(data, source=f"learned:{name}")
    if base is None:
        return learned
    from policies.merge import merge
    return merge(learned, base, name=name, mode="audit")


# ---------------------------------------------------------------- rendering

class _Dumper(yaml.SafeDumper):
    pass


def _str_rep(d, v):
    return d.represent_scalar("tag:yaml.org,2002:str", v, style="|" if "\n" in v else None)


_Dumper.add_representer(str, _str_rep)


def _scalar(v) -> str:
    s = yaml.dump(v, Dumper=yaml.SafeDumper, default_flow_style=True, width=1 << 30, allow_unicode=True,
                  sort_keys=False)
    s = s.rstrip("\n")
    if s.endswith("\n..."):
        s = s[:-4].rstrip("\n")
    return s


def _comment(text: str) -> str:
    return "  # " + _show(text) if text else ""


def _runs_phrase(runs: dict, total: int, unit: str, nruns: int = 0) -> str:
    if not runs:
        return ""
    n = sum(runs.values())
    k = max(nruns, len([r for r in runs if r != "*"]))
    return f"{k}/{total} run{'s' if total != 1 else ''}, {n} {unit}{'s' if n != 1 else ''}"


def _entry_comment(e: dict | None, total: int, unit: str) -> str:
    if not e:
        return ""
    parts = []
    for w in e.get("why", []):
        parts.append(w)
    ph = _runs_phrase(e.get("runs") or {}, total, unit, int(e.get("nruns", 0)))
    if ph:
        parts.append(ph)
    if e.get("from"):
        parts.append("from " + ", ".join(e["from"]))
    if e.get("loopback"):
        parts.append("loopback")
    if e.get("addrs"):
        parts.append("resolved to " + ", ".join(e["addrs"][:3]))
    return "; ".join(parts)


def _seen_phrase(e: dict, total: int, limit: int = 3) -> str:
    seen = e.get("seen") or {}
    items = sorted(seen.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))
    s = ", ".join(k for k, _ in items[:limit])
    more = len(items) - limit + int(e.get("more", 0))
    if more > 0:
        s += f" (+{more} more)"
    return s


def render(policy: Policy, header: list[str] | None = None) -> str:
    """The policy as YAML: a header (runs, generalisation, notes), then the
    normalized policy with a provenance comment beside each entry. Loads back to
    exactly the same policy (checked)."""
    d = m.canonical(policy)
    prov = provenance(policy) or new_provenance()
    total = len(prov["runs"])
    head = list(header or [])
    if prov["runs"]:
        head.append(f"Learned from {total} run{'s' if total != 1 else ''}:")
        for r in prov["runs"]:
            extra = []
            if r.get("syscalls") is not None:
                extra.append(f"{r['syscalls']} calls")
            if r.get("records") is not None:
                extra.append(f"{r['records']} records")
            if r.get("lost"):
                extra.append(f"{r['lost']} events LOST")
            if r.get("bad_lines"):
                extra.append(f"{r['bad_lines']} unparsed lines")
            head.append(f"  {r['id']} ({r.get('from', '?')}): {', '.join(extra)}")
    files = (d["spec"].get("files") or {}).get("writable", [])
    if files and any(prov["files"].get(f, {}).get("seen") for f in files):
        head.append("files.writable, generalised from the written paths:")
        for f in files:
            e = prov["files"].get(f)
            if not e or not e.get("seen"):
                continue
            head.append(f"  {f}  <-")
            items = sorted(e["seen"].items(), key=lambda kv: kv[0])
            for obs, runs in items[:SEEN_MAX]:
                head.append(f"      {obs}  ({', '.join(f'{r} x{n}' for r, n in sorted(runs.items()))})")
            more = len(items) - SEEN_MAX + int(e.get("more", 0))
            if more > 0:
                head.append(f"      ... and {more} more")
    for d_ in (d["spec"].get("exec") or {}).get("allow_written_under", []):
        e = prov["exec"].get(WRITTEN_KEY + d_)
        if not e or not e.get("seen"):
            continue
        head.append(f"exec.allow_written_under {d_}: files the sandbox wrote there itself and ran "
                    "(remove the rule to refuse them):")
        items = sorted(e["seen"].items(), key=lambda kv: kv[0])
        for obs, runs in items[:SEEN_MAX]:
            head.append(f"      {obs}  ({', '.join(f'{r} x{n}' for r, n in sorted(runs.items()))})")
        if len(items) > SEEN_MAX:
            head.append(f"      ... and {len(items) - SEEN_MAX} more")
    if prov["notes"]:
        head.append("Notes (not in the policy; judge them):")
        head += [f"  - {n}" for n in prov["notes"]]
    out = ["".join(f"# {_show(h)}\n" for h in head)]
    out.append(f"apiVersion: {_scalar(d['apiVersion'])}\nkind: {_scalar(d['kind'])}\n")
    out.append(yaml.dump({"metadata": d["metadata"]}, Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                         width=1 << 30, allow_unicode=True))
    spec = d["spec"]
    lines = ["spec:", f"  mode: {_scalar(spec['mode'])}"]
    s = spec["syscalls"]
    lines.append("  syscalls:")
    for k in ("default", "action", "errno", "namespaces"):
        if k in s:
            lines.append(f"    {k}: {_scalar(s[k])}")
    for lst in ("allow", "deny"):
        if lst in s:
            if not s[lst]:
                lines.append(f"    {lst}: []")
                continue
            lines.append(f"    {lst}:")
            for n in s[lst]:
                c = _entry_comment(prov["syscalls"].get(n), total, "call") if lst == "allow" else ""
                lines.append(f"    - {_scalar(n)}{_comment(c)}")
    if s.get("errnos"):
        lines.append("    errnos:")
        for k, v in s["errnos"].items():
            lines.append(f"      {_scalar(k)}: {_scalar(v)}")
    e = spec.get("egress")
    if e is not None:
        lines.append("  egress:")
        lines.append(f"    default: {_scalar(e['default'])}")
        for lst in ("allow", "deny"):
            if lst not in e:
                continue
            if not e[lst]:
                lines.append(f"    {lst}: []")
                continue
            lines.append(f"    {lst}:")
            for rule in e[lst]:
                pe = prov["egress"].get(egress_key(rule)) if lst == "allow" else None
                c = _entry_comment(pe, total, "connect")
                if pe and pe.get("seen"):
                    c = (c + "; " if c else "") + "seen " + _seen_phrase(pe, total)
                lines.append(f"    - {_scalar(rule)}{_comment(c)}")
        if e.get("dns"):
            lines.append("    dns:")
            for a in e["dns"]:
                lines.append(f"    - {_scalar(a)}{_comment(_entry_comment(prov['dns'].get(a), total, 'connect'))}")
    x = spec.get("exec")
    if x is not None:
        if not x["allow"]:
            lines.append("  exec:\n    allow: []")
        else:
            lines.append("  exec:\n    allow:")
            for pat in x["allow"]:
                lines.append(f"    - {_scalar(pat)}{_comment(_entry_comment(prov['exec'].get(pat), total, 'exec'))}")
        if x.get("allow_written_under"):
            lines.append("    allow_written_under:")
            for d_ in x["allow_written_under"]:
                pe = prov["exec"].get(WRITTEN_KEY + d_)
                c = _entry_comment({k: v for k, v in (pe or {}).items() if k != "seen"}, total, "exec")
                if pe and pe.get("seen"):
                    c = (c + "; " if c else "") + "ran " + _seen_phrase(pe, total)
                lines.append(f"    - {_scalar(d_)}{_comment(c)}")
    f = spec.get("files")
    if f is not None:
        if not f["writable"]:
            lines.append("  files:\n    writable: []")
        else:
            lines.append("  files:\n    writable:")
            for pth in f["writable"]:
                pe = prov["files"].get(pth)
                c = _entry_comment({k: v for k, v in (pe or {}).items() if k != "seen"}, total, "write")
                if pe and pe.get("seen"):
                    c = (c + "; " if c else "") + "from " + _seen_phrase(pe, total)
                lines.append(f"    - {_scalar(pth)}{_comment(c)}")
    out.append("\n".join(lines) + "\n")
    text = "".join(out)
    from policies.load import load_policy_text
    try:
        again = load_policy_text(text, "<render>")
    except PoliciesError as err:
        raise PoliciesError(f"internal error: the rendered policy does not load: {err.message}") from None
    if m.canonical(again) != d:
        raise PoliciesError("internal error: the rendered policy differs from the policy")
    return text


__all__ = ["derive_policy", "observe", "additions", "stable_tail", "RULE_KINDS", "random_name", "generalise", "render", "provenance", "provenance_annotations",
           "strip_provenance", "merge_entry", "egress_key", "new_provenance", "LearnError", "PROV_KEY",
           "RUNTIME", "TIMING", "SCRATCH", "SYSTEM_TREES", "SHARED_ROOTS"]
