"""Step snapshots of a sandbox's filesystem (issue 17, first part; docs/snapshots.md).

    store = SnapshotStore()                               # DSEC_SNAPSHOT_STORE or /var/lib/dsec/snapshots
    snap = store.take(sb, context={"step": 3, ...})       # sb: a running launcher.Sandbox on an image or rootfs
    lowers = store.lowers(snap)                           # [snapshot layers..., base layers...], top first
    snapexport.export(store, snap, "out-dir", image_store) # an OCI image layout (agent/sandbox/snapexport.py)

take(): the sandbox's processes are frozen (cgroup2 cgroup.freeze, or the v1
freezer), its writable layer is copied (`cp -a`: modes, owners, mtimes,
xattrs, overlay whiteouts and opaque dirs) into snapshots/layers/.tmp-..., then
thawed; the copy is walked for the manifest of changes (path, change, kind,
mode, uid, gid, mtime, ctime, size, sha256), ordered by the live layer's ctimes
(read while frozen: the order the changes were made in), and the snapshot's id
is the sha256 of that manifest by path (without ctimes) and its parent chain:
the same state gives the same id (content-addressed), and an
existing one is reused. The sandbox keeps running on its writable layer;
a later snapshot holds everything since the start (not a delta: docs).
Freezing has a timeout (FREEZE_TIMEOUT_S) and is retried (RETRIES); on a
failure the sandbox is always thawed and nothing is left in the store.

Layout:
    snapshots/<id>.json        sandbox, node, step context, base (image digest + layer digests, or
                               rootfs), parent snapshot, the manifest, sizes, timings, auto
    layers/<id>/root/          the frozen writable layer (overlayfs format)
    leases/<sandbox>.<r>.json  the snapshots a running fork or restored sandbox stands on (remove()
                               refuses them; live while the lease's sandbox's state dir exists on its node)

A disk budget (take(budget=...)) bounds the bytes of files held by the store
(the records' `bytes`): a snapshot that would exceed it is refused before the
copy (estimated from the writable layer) and again before it is committed
(exact), leaving nothing behind.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import stat
import struct
import subprocess
import time

from agent.errors import DsecError, EXIT_USAGE
from agent.sandbox import rootfs
from agent.sandbox.plan import OVERLAY_VOLATILE
from agent.sandbox import trees

FREEZE_TIMEOUT_S = 5.0
RETRIES = 3
LEASE_GRACE_S = 300.0         # a lease younger than this is live even before its sandbox's state dir exists
SANDBOX_DIR = os.path.join(rootfs.STATE_ROOT, "sandboxes")     # the launcher's (a lease lives while it does)
ID_RE = re.compile(r"^[0-9a-f]{12,64}$")


class SnapshotError(DsecError):
    def __init__(self, message: str, code: int = 1):
        super().__init__(message, code)


def default_root() -> str:
    return os.environ.get("DSEC_SNAPSHOT_STORE") or os.path.join(rootfs.STATE_ROOT, "snapshots")


def criu_feature() -> dict:
    """Can a snapshot include a live step's processes? Only where CRIU works (`criu check`);
    dsec's snapshots hold the filesystem and the step context, never processes, until then."""
    import shutil as _sh
    if _sh.which("criu") is None:
        return {"available": False, "detail": "criu is not installed (apt-get install criu)"}
    try:
        r = subprocess.run(["criu", "check"], capture_output=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"available": False, "detail": f"criu check: {e}"}
    text = (r.stdout + r.stderr).decode(errors="replace").strip().splitlines()
    ok = r.returncode == 0 and not any("Error" in ln for ln in text)
    return {"available": False, "works_here": ok,
            "detail": ("criu check passes, but process snapshots are not built into dsec yet" if ok else
                       f"criu check fails on this kernel: {text[-1][:200] if text else r.returncode}")}


# --- the freezer ---------------------------------------------------------------------

def _freeze_files(cg) -> tuple[str, str, str]:
    """(control file, frozen value, thawed value) of the sandbox's freezer."""
    if cg.v2_path and os.path.exists(os.path.join(cg.v2_path, "cgroup.freeze")):
        return os.path.join(cg.v2_path, "cgroup.freeze"), "1", "0"
    root = cg.layout.v1_roots.get("freezer") or "/sys/fs/cgroup/freezer"
    p = os.path.join(root, "dsec", cg.sandbox_id, "freezer.state")
    if os.path.exists(p):
        return p, "FROZEN", "THAWED"
    raise SnapshotError(f"sandbox {cg.sandbox_id}: no cgroup freezer (cgroup2 cgroup.freeze or the v1 freezer): "
                        f"a snapshot would not be consistent")


def _frozen(cg, control: str) -> bool:
    if control.endswith("cgroup.freeze"):
        with open(os.path.join(cg.v2_path, "cgroup.events")) as f:
            return "frozen 1" in f.read()
    with open(control) as f:
        return f.read().strip() == "FROZEN"


def freeze(cg, timeout: float = FREEZE_TIMEOUT_S) -> str:
    control, on, _ = _freeze_files(cg)
    with open(control, "w") as f:
        f.write(on)
    deadline = time.monotonic() + timeout
    delay = 0.0002
    while not _frozen(cg, control):
        if time.monotonic() > deadline:
            thaw(cg)
            raise SnapshotError(f"sandbox {cg.sandbox_id}: not frozen within {timeout:g}s")
        time.sleep(delay)
        delay = min(delay * 2, 0.01)
    return control


def thaw(cg):
    control, _, off = _freeze_files(cg)
    with open(control, "w") as f:
        f.write(off)


# --- the store -----------------------------------------------------------------------

def _extents(fd: int, size: int) -> list[tuple[int, int]]:
    """The data extents [(start, end)] of an open file (SEEK_DATA / SEEK_HOLE): [(0, size)]
    for a file without holes, and where the file system cannot say."""
    whole = [(0, size)] if size else []
    try:
        if os.lseek(fd, 0, os.SEEK_HOLE) >= size:
            return whole
        out, off = [], 0
        while off < size:
            try:
                start = os.lseek(fd, off, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:        # nothing but a hole from off to the end
                    break
                raise
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            out.append((start, end))
            off = end
        return out
    except OSError:                               # EINVAL: no SEEK_HOLE on this file system
        return whole


def file_identity(path: str, copy_to: str | None = None) -> dict:
    """The content identity of a regular file, read without its holes: {"sha256": the sha256
    of its bytes} for a file without holes; for a sparse one {"sha256": None, "extents_sha256":
    the sha256 of its size and of each data extent's offset, length and bytes, "data_bytes":
    the bytes of its extents}. A workload's `truncate -s 1T` (no disk used) costs no reading:
    the plain sha256 would read, and hash, a terabyte of zeros. copy_to: the bytes are written
    there too, its holes left holes (a fork's copy of a sparse file uses no more disk)."""
    with open(path, "rb") as src, (open(copy_to, "wb") if copy_to else contextlib.nullcontext()) as dst:
        fd = src.fileno()
        size = os.fstat(fd).st_size
        ext = _extents(fd, size)
        sparse = ext != ([(0, size)] if size else [])
        h = hashlib.sha256(b"dsec-extents-v1\0" + struct.pack("<Q", size)) if sparse else hashlib.sha256()
        data = 0
        for start, end in ext:
            if sparse:
                h.update(struct.pack("<QQ", start, end - start))
            os.lseek(fd, start, os.SEEK_SET)
            if dst is not None:
                dst.seek(start)
            left = end - start
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:                     # shorter than it said: hashed as read
                    break
                h.update(chunk)
                if dst is not None:
                    dst.write(chunk)
                left -= len(chunk)
                data += len(chunk)
        if dst is not None:
            dst.truncate(size)                    # the trailing hole
    if not sparse:
        return {"sha256": h.hexdigest()}
    return {"sha256": None, "extents_sha256": h.hexdigest(), "data_bytes": data}


def ctimes(root: str) -> dict[str, int]:
    """{path: ctime_ns} of a tree (taken from the live writable layer while it is frozen:
    a copy's ctimes are the copy's, made in readdir order, and tie within a clock tick)."""
    out = {}
    for dp, dn, fn in trees.walk(root):
        for name in dn + fn:
            full = os.path.join(dp, name)
            try:
                out["/" + os.fsdecode(os.path.relpath(full, root))] = os.lstat(full).st_ctime_ns
            except OSError:
                pass
    return out


def snapshot_id(man: list[dict], chain: list[str], base: list[str]) -> str:
    """The content address of a snapshot: its entries by path (not by when they changed:
    that order is a record, and two copies of one state must have one id), chain and base."""
    entries = sorted(({k: v for k, v in e.items() if k != "ctime_ns"} for e in man), key=lambda e: e["path"])
    key = json.dumps({"manifest": entries, "chain": chain, "base": base}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()


def manifest(root: str, order: dict[str, int] | None = None) -> list[dict]:
    """Every entry of a writable layer, in the order it was last changed (ctime; `order`:
    the ctimes of the tree `root` was copied from, which win over the copy's own)."""
    order = order or {}
    out = []
    for dp, dn, fn in trees.walk(root):
        dn.sort()
        for name in sorted(dn) + sorted(fn):
            full = os.path.join(dp, name)
            st = os.lstat(full)
            rel = "/" + os.path.relpath(full, root)
            e = {"path": os.fsdecode(rel), "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid, "gid": st.st_gid,
                 "mtime_ns": st.st_mtime_ns, "ctime_ns": order.get(os.fsdecode(rel), st.st_ctime_ns)}
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                e["kind"] = "whiteout"
            elif stat.S_ISDIR(st.st_mode):
                e["kind"] = "dir"
                try:
                    e["opaque"] = os.getxattr(full, "trusted.overlay.opaque") == b"y"
                except OSError:
                    e["opaque"] = False
            elif stat.S_ISLNK(st.st_mode):
                e["kind"], e["target"] = "symlink", os.fsdecode(os.readlink(full))
            elif stat.S_ISREG(st.st_mode):
                e["kind"], e["size"] = "file", st.st_size
                e.update(file_identity(full))
            else:
                e["kind"] = "other"
            out.append(e)
    out.sort(key=lambda e: (e["ctime_ns"], e["path"]))
    return out


class SnapshotStore:
    def __init__(self, root: str | None = None):
        self.root = os.path.abspath(root or default_root())
        for d in ("layers", "snapshots", "leases"):
            os.makedirs(os.path.join(self.root, d), mode=0o700, exist_ok=True)

    @contextlib.contextmanager
    def _locked(self):
        """The store's lock (flock; never nested): budget checks and commits, leases, removals."""
        fd = os.open(os.path.join(self.root, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def usage(self, exclude=()) -> int:
        """Bytes of files the store holds (the records' `bytes`), but those of `exclude`."""
        return sum(s["bytes"] for s in self.list() if s["id"] not in exclude)

    # -- leases ---------------------------------------------------------------------------
    def lease(self, sandbox_id: str, snaps: list[dict], kind: str) -> str:
        """Sandbox `sandbox_id` (a fork, or restored) stands on these snapshots (and their
        chains); the lease's path (release() it when the sandbox ends)."""
        ids = []
        for snap in snaps:
            for s in [snap["id"]] + snap.get("chain", []):
                if s not in ids:
                    ids.append(s)
        rec = {"sandbox_id": sandbox_id, "node": os.uname().nodename, "kind": kind, "snapshots": ids,
               "created_ns": time.time_ns()}
        path = os.path.join(self.root, "leases", f"{os.path.basename(sandbox_id)}.{os.urandom(4).hex()}.json")
        with self._locked():
            with open(path + ".tmp", "w") as f:
                json.dump(rec, f)
            os.rename(path + ".tmp", path)
        return path

    def release(self, path: str | None) -> None:
        if not path:
            return
        with self._locked():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def leases(self) -> list[dict]:
        """The live leases; stale ones (their sandbox gone from this node) are removed."""
        out, node, now = [], os.uname().nodename, time.time()
        d = os.path.join(self.root, "leases")
        for fn in sorted(os.listdir(d)):
            if not fn.endswith(".json"):
                continue
            p = os.path.join(d, fn)
            try:
                st = os.stat(p)
                with open(p) as f:
                    lease = json.load(f)
            except (OSError, ValueError):
                continue
            sid = str(lease.get("sandbox_id") or "")
            if lease.get("node") == node and now - st.st_mtime > LEASE_GRACE_S and \
                    not os.path.isdir(os.path.join(SANDBOX_DIR, os.path.basename(sid))):
                try:
                    os.unlink(p)                         # its sandbox ended without releasing it
                except OSError:
                    pass
                continue
            out.append(lease)
        return out

    def users(self, snap_id: str) -> list[dict]:
        """The live leases on snapshot `snap_id`."""
        return [x for x in self.leases() if snap_id in x.get("snapshots", [])]

    def _meta(self, sid: str) -> str:
        return os.path.join(self.root, "snapshots", sid + ".json")

    def layer_root(self, sid: str) -> str:
        return os.path.join(self.root, "layers", sid, "root")

    def get(self, ref: str) -> dict:
        if not ref or not ID_RE.match(ref.removeprefix("snap-")):
            raise SnapshotError(f"snapshot {ref[:80]!r}: not a snapshot id (hex digits)", EXIT_USAGE)
        h = ref.removeprefix("snap-")
        hits = [f[:-5] for f in os.listdir(os.path.join(self.root, "snapshots")) if f.startswith(h) and f.endswith(".json")]
        if len(hits) != 1:
            raise SnapshotError(f"snapshot {ref}: {'no such snapshot' if not hits else 'ambiguous prefix'} "
                                f"in {self.root}", EXIT_USAGE)
        with open(self._meta(hits[0])) as f:
            snap = json.load(f)
        for s in [snap["id"]] + snap.get("chain", []):
            if not os.path.isdir(self.layer_root(s)):
                raise SnapshotError(f"snapshot {snap['id'][:12]}: its layer {s[:12]} is missing from {self.root}",
                                    EXIT_USAGE)
        return snap

    def list(self) -> list[dict]:
        out = []
        for f in sorted(os.listdir(os.path.join(self.root, "snapshots"))):
            if f.endswith(".json"):
                with open(os.path.join(self.root, "snapshots", f)) as fh:
                    out.append(json.load(fh))
        return sorted(out, key=lambda s: s["created_ns"])

    def lowers(self, snap: dict) -> list[str]:
        """The overlay lower dirs of a sandbox restored from `snap`, top first."""
        own = [self.layer_root(s) for s in [snap["id"]] + snap.get("chain", [])]
        return own + list(snap["base"]["lowers"])

    def take(self, sb, context: dict | None = None, *, timeout: float = FREEZE_TIMEOUT_S,
             retries: int = RETRIES, budget: int | None = None, freed=(), auto: bool = False) -> dict:
        """Freeze, copy the writable layer, thaw; record the snapshot. `sb` is a running
        launcher.Sandbox whose root is an image or a --rootfs (one overlay). `budget`:
        the store's bytes at most, counting the snapshots of `freed` (to be removed after
        this one) as gone; `auto`: taken by policy (retention may remove it later)."""
        spec = sb.spec
        if not spec.layers and not spec.rootfs:
            raise SnapshotError(f"sandbox {sb.sid}: snapshots need a sandbox on an image or a --rootfs "
                                f"(the default root is several overlays over host directories)", EXIT_USAGE)
        if sb.state != "running" or sb.cg is None:
            raise SnapshotError(f"sandbox {sb.sid} is {sb.state}: only a running sandbox can be snapshotted",
                                EXIT_USAGE)
        # the root's writable layer (after a restore: the fresh one the restore mounted)
        upper = sb.layers[0][1] if sb.layers else os.path.join(sb.dir, "upper", "_root")
        lowers = list(spec.layers) if spec.layers else [os.path.abspath(spec.rootfs)]
        parent = getattr(spec, "snapshot", None) or {}
        chain = ([parent["id"]] + parent.get("chain", [])) if parent else []
        base_lowers = lowers[len(chain):] if parent else lowers
        if budget is not None:
            self._check_budget(sb.sid, _tree_bytes(upper), budget, freed, "the writable layer holds")
        tmp = os.path.join(self.root, "layers", f".tmp-{os.getpid()}-{os.urandom(4).hex()}")
        attempts, last, ok = 0, None, False
        t0 = time.monotonic()
        while attempts < retries and not ok:
            attempts += 1
            try:
                os.makedirs(tmp, 0o700)
                tf = time.monotonic()
                freeze(sb.cg, timeout)
                try:
                    frozen_at = time.monotonic()
                    r = subprocess.run(["cp", "-a", upper, os.path.join(tmp, "root")], capture_output=True)
                    if r.returncode != 0:
                        err = _cut(" ".join(r.stderr.decode(errors="replace").split()))
                        raise SnapshotError(f"sandbox {sb.sid}: copying the writable layer failed: {err}")
                    order = ctimes(upper)                  # still frozen: the order changes were made in
                finally:
                    thaw(sb.cg)
                frozen_ms = (time.monotonic() - tf) * 1000
                copy_ms = (time.monotonic() - frozen_at) * 1000
                ok = True
            except (SnapshotError, OSError) as e:
                last = e
                trees.remove(tmp)
                if sb.state != "running":
                    break
        if not ok:
            msg = last.message if isinstance(last, SnapshotError) else str(last)
            raise SnapshotError(f"sandbox {sb.sid}: snapshot failed after {attempts} attempt(s): {msg}")
        try:
            try:
                man = manifest(os.path.join(tmp, "root"), order)
            except OSError as e:       # e.g. a chain deeper than PATH_MAX: cp -a copied it, a path cannot name it
                raise SnapshotError(f"sandbox {sb.sid}: snapshot refused: its writable layer cannot be read back "
                                    f"by path ({e.strerror}: {_cut(os.fsdecode(e.filename or ''))!r})") from None
            sid = snapshot_id(man, chain, base_lowers)
            with self._locked():
                return self._commit(sb, spec, tmp, sid, man, chain, base_lowers, context, attempts, frozen_ms,
                                    copy_ms, t0, budget, freed, auto)
        finally:
            trees.remove(tmp)         # moved in place, or nothing half-made

    def _check_budget(self, sandbox_id, nbytes: int, budget: int, freed, what: str):
        used = self.usage(exclude=freed)
        if used + nbytes > budget:
            raise SnapshotError(f"sandbox {sandbox_id}: snapshot refused: the snapshot store's disk budget is "
                                f"{budget} bytes, it holds {used} and {what} {nbytes} (snapshots.disk_budget; "
                                f"remove snapshots with `dsec snapshot rm` or lower snapshots.retention)",
                                EXIT_USAGE)

    def _commit(self, sb, spec, tmp, sid, man, chain, base_lowers, context, attempts, frozen_ms, copy_ms,
                t0, budget, freed, auto) -> dict:
        """Under the store's lock: the budget (exact), the layer moved in place, the record."""
        nbytes = sum(e.get("data_bytes", e.get("size", 0)) for e in man)     # a sparse file: its data
        final = os.path.join(self.root, "layers", sid)
        old = None
        if os.path.isdir(final):                              # the same state: one layer
            try:
                with open(self._meta(sid)) as f:
                    old = json.load(f)
            except (OSError, ValueError):
                old = None
        else:
            if budget is not None:
                self._check_budget(sb.sid, nbytes, budget, freed, "this snapshot would add")
            os.rename(tmp, final)
        ctx = dict(context or {})
        snap = {"id": sid, "sandbox_id": sb.sid, "node": os.uname().nodename, "created_ns": time.time_ns(),
                "step": ctx.get("step", 0), "context": ctx, "chain": chain,
                "base": {"image": spec.image, "rootfs": None if spec.layers else os.path.abspath(spec.rootfs),
                         "lowers": base_lowers},
                "changes": man, "files": sum(1 for e in man if e["kind"] == "file"),
                "bytes": nbytes, "attempts": attempts,
                "auto": bool(auto and (old is None or old.get("auto"))),   # taken on request once: kept
                "frozen_ms": round(frozen_ms, 3), "copy_ms": round(copy_ms, 3),
                "total_ms": round((time.monotonic() - t0) * 1000, 3)}
        tmpm = self._meta(sid) + f".{os.getpid()}.tmp"
        with open(tmpm, "w") as f:
            json.dump(snap, f)
        os.rename(tmpm, self._meta(sid))
        return snap

    def remove(self, ref: str) -> dict:
        """Remove a snapshot no other snapshot chains to and no running sandbox stands on."""
        snap = self.get(ref)
        with self._locked():
            users = [s["id"] for s in self.list() if snap["id"] in s.get("chain", [])]
            if users:
                raise SnapshotError(f"snapshot {snap['id'][:12]} is the parent of {len(users)} other snapshot(s) "
                                    f"({', '.join(u[:12] for u in users[:4])})", EXIT_USAGE)
            held = self.users(snap["id"])
            if held:
                who = ", ".join(f"{x['sandbox_id']} ({'a fork' if x.get('kind') == 'fork' else 'restored'} on "
                                f"{x.get('node')})" for x in held[:4])
                raise SnapshotError(f"snapshot {snap['id'][:12]} is in use by sandbox {who}: it is released when "
                                    f"that sandbox ends", EXIT_USAGE)
            os.unlink(self._meta(snap["id"]))
            trees.remove(os.path.join(self.root, "layers", snap["id"]))
        return snap


def _cut(text: str) -> str:
    """At most ~300 characters of a message about a long path: its start and its end (where
    cp says why)."""
    return text if len(text) <= 300 else text[:100] + " ... " + text[-200:]


def _tree_bytes(root: str) -> int:
    """Bytes of the regular files under `root` (the estimate of a snapshot's size)."""
    n = 0
    for dp, _dn, fn in trees.walk(root):
        for name in fn:
            try:
                st = os.lstat(os.path.join(dp, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                n += min(st.st_size, st.st_blocks * 512)      # a sparse file: what it holds
    return n


def fork_spec(spec, snap: dict, store: "SnapshotStore", image_store=None, *, user=None, workdir=None) -> None:
    """Make `spec` a sandbox starting from `snap`: its own writable layer over the
    snapshot's layers and their base (the base image's layers unpacked if evicted and
    leased to spec.sandbox_id), the parent's user, workdir and env unless given, the
    lineage; its steps go on from the snapshot's step (`first_step`)."""
    ctx = snap.get("context") or {}
    spec.layers = store.lowers(snap)
    spec.image = snap["base"].get("image")
    spec.rootfs = None
    if spec.image and image_store is not None:
        own = len(snap.get("chain", [])) + 1
        img = image_store.resolve(spec.image["digest"])
        base, spec.lease = image_store.prepare_lease(img, spec.sandbox_id)
        spec.layers = spec.layers[:own] + base
    spec.snapshot = snap
    if ctx.get("uid") is not None and (user or ctx.get("user") or "sandbox") == "sandbox":
        # the parent's default user ran as its own leased uid; this sandbox gets another
        own = len(snap.get("chain", [])) + 1
        spec.reown = {"uid": int(ctx["uid"]), "gid": int(ctx.get("gid", ctx["uid"])), "layers": spec.layers[:own]}
    spec.first_step = int(snap.get("step") or 0) + 1
    spec.lineage = {"parent_sandbox": snap["sandbox_id"], "snapshot": snap["id"], "step": snap["step"]}
    if not user and ctx.get("user"):
        spec.user = ctx["user"]
    if not workdir and ctx.get("workdir"):
        spec.workdir = ctx["workdir"]
    env = dict(ctx.get("env") or {})
    env.pop("HOSTNAME", None)
    env.update(spec.env)
    spec.env = env


def reown_into(upper: str, layers: list[str], old_uid: int, old_gid: int, uid: int, gid: int) -> dict:
    """A fork runs its default user as a uid of its own (agent/sandbox/uids.py), but
    the snapshot's files belong to the parent's: copy every entry the parent's user
    owned (as the overlay of `layers`, top first, shows it) into the fork's upper
    layer `upper`, owned by the new uid/gid, so the fork's user can change what its
    parent made. Files are copied (immutable snapshot layers are never chowned):
    the cost grows with the size of what the parent's user wrote. Returns {sandbox
    path: sha256} of the copies (not changes of the workload: launcher.generated)."""
    seen: set[str] = set()
    hidden: list[str] = []            # opaque directories of an upper layer: lower ones end there
    out: dict[str, str] = {}

    def new_owner(st):
        return (uid if st.st_uid == old_uid else st.st_uid), (gid if st.st_gid == old_gid else st.st_gid)

    def ensure_parents(rel: str, layer: str):
        parts = rel.strip("/").split("/")[:-1]
        for i in range(1, len(parts) + 1):
            r = "/".join(parts[:i])
            dst = os.path.join(upper, r)
            if os.path.isdir(dst):
                continue
            st = os.lstat(os.path.join(layer, r))
            os.mkdir(dst, stat.S_IMODE(st.st_mode))
            os.chown(dst, *new_owner(st))
            os.chmod(dst, stat.S_IMODE(st.st_mode))
            os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))

    for li, layer in enumerate(layers):
        for dp, dn, fn in trees.walk(layer):
            dn.sort()
            rel_dir = os.path.relpath(dp, layer)
            rel_dir = "" if rel_dir == "." else rel_dir
            for name in dn + sorted(fn):
                rel = os.path.join(rel_dir, name)
                if rel in seen or any(rel == h or rel.startswith(h + "/") for h in hidden if li > 0):
                    continue
                seen.add(rel)
                full = os.path.join(layer, rel)
                st = os.lstat(full)
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                    continue                          # a whiteout: deleted, nothing to own
                if stat.S_ISDIR(st.st_mode):
                    try:
                        if os.getxattr(full, "trusted.overlay.opaque") == b"y":
                            hidden.append(rel)
                    except OSError:
                        pass
                if st.st_uid != old_uid and st.st_gid != old_gid:
                    continue
                ensure_parents(rel, layer)
                dst = os.path.join(upper, rel)
                if stat.S_ISDIR(st.st_mode):
                    if not os.path.isdir(dst):
                        os.mkdir(dst, 0o700)
                elif stat.S_ISREG(st.st_mode):
                    out["/" + rel] = file_identity(full, copy_to=dst)["sha256"]    # None: sparse
                elif stat.S_ISLNK(st.st_mode):
                    os.symlink(os.readlink(full), dst)
                else:
                    continue                          # fifos, sockets: left as they are
                os.lchown(dst, *new_owner(st))
                if not stat.S_ISLNK(st.st_mode):
                    os.chmod(dst, stat.S_IMODE(st.st_mode))
                    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
    return out


# --- rollback of a live sandbox ----------------------------------------------------------

_SYS_OPEN_TREE, _SYS_MOVE_MOUNT = 428, 429          # x86_64
_OPEN_TREE_CLONE, _AT_RECURSIVE, _MOVE_MOUNT_F_EMPTY_PATH, _AT_FDCWD = 1, 0x8000, 0x04, -100


def _helper(sup_pid: int, lowers: str, upper: str, work: str, mnt: str, err_w: int):
    """In a forked child: mount the new root in a private namespace, carry it into the
    sandbox's mount namespace, move /proc, /sys, /dev, /tmp and volumes onto it and
    pivot_root: every process whose root was the old root (PID 1) now has the new one."""
    import ctypes
    from agent.sandbox import sysutil as su
    libc = ctypes.CDLL(None, use_errno=True)
    stage = "unshare"
    try:
        su.unshare(su.CLONE_NEWNS)
        su.mount(None, "/", None, su.MS_REC | su.MS_PRIVATE)
        stage = "overlay"
        su.mount("overlay", mnt, "overlay", su.MS_NOSUID | su.MS_NODEV,
                 f"lowerdir={lowers},upperdir={upper},workdir={work}{OVERLAY_VOLATILE}")
        stage = "open_tree"
        fd = libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, os.fsencode(mnt), _OPEN_TREE_CLONE | os.O_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "open_tree")
        stage = "setns"
        ns = os.open(f"/proc/{sup_pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        su.setns(ns, su.CLONE_NEWNS)
        os.chdir("/")
        with open("/proc/1/mountinfo") as f:
            info = f.read()
        rows = [line.split() for line in info.splitlines() if line.strip()]
        root_id = next(r[0] for r in rows if r[4] == "/")
        tops = [r[4] for r in rows if r[1] == root_id and r[4] != "/"]
        stage = "attach"
        target = "/.dsec-restore"
        if not os.path.isdir(target):
            os.mkdir(target, 0o700)        # in the old root's upper layer, which is discarded
        if libc.syscall(_SYS_MOVE_MOUNT, fd, b"", _AT_FDCWD, os.fsencode(target), _MOVE_MOUNT_F_EMPTY_PATH) < 0:
            raise OSError(ctypes.get_errno(), "move_mount")
        stage = "move"
        for p in tops:
            if p == target:
                continue
            dst = target + p
            if not os.path.lexists(dst):
                os.makedirs(dst, 0o755, exist_ok=True)
            su.mount(p, dst, None, su.MS_MOVE)
        stage = "pivot_root"
        os.chdir(target)
        su.pivot_root(".", ".")
        su.umount2(".", su.MNT_DETACH)
        os.chdir("/")
        os.write(err_w, b"ok")
        os._exit(0)
    except BaseException as e:  # noqa: BLE001 - never return into the caller's process
        try:
            os.write(err_w, f"{stage}: {getattr(e, 'strerror', None) or e}".encode()[:500])
        finally:
            os._exit(1)


def restore(store: "SnapshotStore", sb, snap: dict, image_store=None, *, force: bool = False) -> dict:
    """Roll a live sandbox back to `snap`: its processes (all but PID 1) are ended, its
    root becomes a fresh writable layer over the snapshot's layers; the sandbox keeps
    its id, cgroup, network, policy and PID 1. Restoring twice gives the same state;
    a restore that fails before the switch leaves the previous state as it was."""
    import signal
    spec = sb.spec
    if sb.state != "running":
        raise SnapshotError(f"sandbox {sb.sid} is {sb.state}: only a running sandbox can be restored", EXIT_USAGE)
    from policies.compile import mount_layout
    lay = mount_layout(spec.policy)
    if lay.writable is not None or lay.noexec:
        # the read-only layout (files.writable binds, noexec layers, a read-only image) is
        # built by dsec-init at start; a live restore would hand the sandbox a plain writable root
        raise SnapshotError(f"sandbox {sb.sid}: its policy {spec.policy.name} (enforce) mounts a read-only "
                            f"layout that a live restore cannot rebuild: fork from the snapshot instead "
                            f"(client.fork, CreateSandbox from_snapshot)", EXIT_USAGE)
    running = [s for s in sb.steps.values() if not s.done]
    if running and not force:
        raise SnapshotError(f"sandbox {sb.sid}: step {running[0].step} is running; restore ends it only "
                            f"when forced (force=True / --force)", EXIT_USAGE)
    own = len(snap.get("chain", [])) + 1
    lowers = store.lowers(snap)
    if snap["base"].get("image") and image_store is not None:
        img = image_store.resolve(snap["base"]["image"]["digest"])
        lowers = lowers[:own] + image_store.prepare(img, sb.sid)
    n = len([d for d in os.listdir(sb.dir) if d.startswith("upper")])
    upper = os.path.join(sb.dir, f"upper.{n}", "_root")
    work = os.path.join(sb.dir, f"work.{n}", "_root")
    mnt = os.path.join(sb.dir, f"restore.{n}")
    for d in (upper, work, mnt):
        os.makedirs(d, 0o755)
    t0 = time.monotonic()
    # end every process but PID 1 (frozen first, so nothing forks meanwhile)
    freeze(sb.cg)
    try:
        for pid in sb.cg.pids():
            if pid != sb.sup_pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    finally:
        thaw(sb.cg)
    deadline = time.monotonic() + 5
    while set(sb.cg.pids()) - {sb.sup_pid}:
        if time.monotonic() > deadline:
            raise SnapshotError(f"sandbox {sb.sid}: its processes did not end within 5 s")
        time.sleep(0.002)
    killed_ms = (time.monotonic() - t0) * 1000
    r, w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _helper(sb.sup_pid, ":".join(lowers), upper, work, mnt, w)
    os.close(w)
    msg = b""
    while chunk := os.read(r, 1024):
        msg += chunk
    os.close(r)
    os.waitpid(pid, 0)
    os.rmdir(mnt)
    if msg != b"ok":
        trees.remove(os.path.dirname(upper))
        trees.remove(os.path.dirname(work))
        raise SnapshotError(f"sandbox {sb.sid}: restore of {snap['id'][:12]} failed ({msg.decode(errors='replace')}); "
                            f"the sandbox is as it was")
    # the launcher's view: the change manifest walks the new upper over the new lowers
    sb.layers = [("/", upper, ":".join(lowers))]
    spec.layers = lowers
    spec.snapshot = snap
    return {"snapshot": snap["id"], "step": snap["step"], "killed_ms": round(killed_ms, 3),
            "total_ms": round((time.monotonic() - t0) * 1000, 3)}
