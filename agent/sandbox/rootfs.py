"""The sandbox's root filesystem: the default read-only base, overlay layout,
and the file-change manifest of the upper layer.

Default rootfs: a small skeleton directory that dsec writes itself (a minimal
/etc, empty mount points) as the lower layer of the root overlay, plus one
overlay per host system directory (/usr, and /bin, /sbin, /lib* where they are
real directories; on merged-/usr hosts they are symlinks, copied as such).
Nothing else of the host is visible: not /root, /home, /var, /run, /etc.

Every overlay has a private upper layer under the sandbox's state directory:
every write lands there, the host is never modified.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import time

from agent.sandbox import trees

STATE_ROOT = os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec")
BASE_ROOT = os.path.join(STATE_ROOT, "base")
HOST_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
SANDBOX_UID = 1000
SANDBOX_GID = 1000

# /etc entries copied from the host: none of them is a secret.
HOST_ETC_COPY = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime",
                 "ssl/certs/ca-certificates.crt", "ssl/openssl.cnf", "os-release",
                 "debian_version", "shells", "mime.types", "protocols", "services",
                 "ethertypes", "inputrc", "bash.bashrc", "profile", "environment",
                 "python3", "python3.11")
# ... and the configuration toolchains under /usr read from /etc (not secrets either): the
# JDK's java.security, jvm.cfg ... (/usr/lib/jvm/*/conf links there on Debian)
HOST_ETC_TOOLCHAINS = ("java-",)

PASSWD = """root:x:0:0:root:/root:/bin/sh
sandbox:x:1000:1000:sandbox:/workspace:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
"""
GROUP = """root:x:0:
sandbox:x:1000:
nogroup:x:65534:
"""
HOSTS = """127.0.0.1\tlocalhost
::1\tlocalhost ip6-localhost ip6-loopback
"""
NSSWITCH = """passwd: files
group: files
shadow: files
hosts: files dns
networks: files
protocols: files
services: files
"""


def _host_nameservers() -> list[str]:
    out = []
    try:
        with open("/etc/resolv.conf") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "nameserver" and not parts[1].startswith(("127.", "::1")):
                    out.append(parts[1])
    except OSError:
        pass
    return out


def _base_spec() -> dict:
    host = {}
    for d in HOST_DIRS:
        p = "/" + d
        if os.path.islink(p):
            host[d] = ["link", os.readlink(p)]
        elif os.path.isdir(p):
            host[d] = ["dir"]
    etc = {}
    try:
        toolchains = sorted(n for n in os.listdir("/etc") if n.startswith(HOST_ETC_TOOLCHAINS)
                            and os.path.isdir(os.path.join("/etc", n)))
    except OSError:
        toolchains = []
    for e in HOST_ETC_COPY + tuple(toolchains):
        p = os.path.join("/etc", e)
        try:
            st = os.lstat(p)
            etc[e] = [st.st_mtime_ns, st.st_size]
        except OSError:
            pass
    return {"v": 3, "host": host, "etc": etc, "dns": _host_nameservers()}


def _spec_hash(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def host_overlay_dirs(spec: dict | None = None) -> list[str]:
    """The host directories that get an overlay each (real dirs, not symlinks)."""
    spec = spec or _base_spec()
    return [d for d, v in spec["host"].items() if v[0] == "dir"]


FS_IOC_GETFLAGS, FS_IOC_SETFLAGS = 0x80086601, 0x40086602
FS_TOPDIR_FL = 0x00020000          # chattr +T: "the top of a directory hierarchy" (ext2/3/4)


def spread_subdirs(path: str) -> bool:
    """Flag directory `path` as the top of a hierarchy (chattr +T) so that ext4
    places each new subdirectory -- here each sandbox's state directory, with
    its upper and work layers and everything the overlay creates in them -- in
    a block group of its own choosing (the Orlov allocator), not all next to
    `path`. Why: on an ext4 without a journal, every inode allocation skips the
    free inodes of its group deleted within the last 60 s (recently_deleted(),
    up to 360 s while their block is dirty), looking each one up, one by one;
    with ~30 inodes made and freed per sandbox, at 50 sandboxes/s all in one
    group, each allocation walked thousands of them (perf: ~20% of the node's
    CPU, in the agent, dsec-init's overlay mounts and ClickHouse's inserts;
    docs/launch-figures.md). Best effort: True once set; a file system without
    the flag (xfs, btrfs, tmpfs) is left as it is."""
    import fcntl
    import struct
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        flags = struct.unpack("l", fcntl.ioctl(fd, FS_IOC_GETFLAGS, struct.pack("l", 0)))[0] & 0xFFFFFFFF
        if not flags & FS_TOPDIR_FL:
            fcntl.ioctl(fd, FS_IOC_SETFLAGS, struct.pack("l", flags | FS_TOPDIR_FL))
            flags = struct.unpack("l", fcntl.ioctl(fd, FS_IOC_GETFLAGS, struct.pack("l", 0)))[0] & 0xFFFFFFFF
        return bool(flags & FS_TOPDIR_FL)
    except OSError:
        return False
    finally:
        os.close(fd)


BASE_SPEC_TTL_S = 1.0      # the host's /etc, /usr links and resolv.conf are looked at again after this
_base_seen: tuple | None = None     # (monotonic time, path, host dirs) of the last look


def ensure_base() -> tuple[str, list[str]]:
    """Build (once) the skeleton lower layer; returns (path, host dirs to overlay). What it
    depends on (~50 stats and reads of the host's /etc and top directories) is looked at
    once per BASE_SPEC_TTL_S, not at every start: a change there reaches the sandboxes
    started a second later."""
    global _base_seen
    seen = _base_seen
    if seen is not None and time.monotonic() - seen[0] < BASE_SPEC_TTL_S and os.path.isdir(seen[1]):
        return seen[1], list(seen[2])
    spec = _base_spec()
    path = os.path.join(BASE_ROOT, _spec_hash(spec))
    if os.path.isdir(path):
        _base_seen = (time.monotonic(), path, tuple(host_overlay_dirs(spec)))
        return path, list(_base_seen[2])
    import shutil
    import tempfile
    os.makedirs(BASE_ROOT, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".build-", dir=BASE_ROOT)
    try:
        _build_base(tmp, spec)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, path)
        except OSError:
            if not os.path.isdir(path):   # lost a race to a concurrent builder: fine
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path, host_overlay_dirs(spec)


def _build_base(root: str, spec: dict):
    import shutil
    for d, v in spec["host"].items():
        if v[0] == "link":
            os.symlink(v[1], os.path.join(root, d))
        else:
            os.mkdir(os.path.join(root, d), 0o755)
    for d, mode in (("dev", 0o755), ("proc", 0o555), ("sys", 0o555), ("tmp", 0o1777),
                    ("etc", 0o755), ("root", 0o700), ("home", 0o755), ("run", 0o755),
                    ("var", 0o755), ("var/tmp", 0o1777), ("mnt", 0o755), ("opt", 0o755),
                    ("workspace", 0o755)):
        os.mkdir(os.path.join(root, d))
        os.chmod(os.path.join(root, d), mode)
    os.chown(os.path.join(root, "workspace"), SANDBOX_UID, SANDBOX_GID)
    etc = os.path.join(root, "etc")
    for name, text in (("passwd", PASSWD), ("group", GROUP), ("hosts", HOSTS),
                       ("nsswitch.conf", NSSWITCH), ("hostname", "sandbox\n"),
                       ("resolv.conf", "".join(f"nameserver {ns}\n" for ns in spec["dns"]))):
        with open(os.path.join(etc, name), "w") as f:
            f.write(text)
        os.chmod(os.path.join(etc, name), 0o644)
    os.symlink("../proc/self/mounts", os.path.join(etc, "mtab"))
    for e in spec["etc"]:
        src, dst = os.path.join("/etc", e), os.path.join(etc, e)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.isdir(src) and not os.path.islink(src):
            shutil.copytree(src, dst, symlinks=True)
        else:
            shutil.copy2(src, dst, follow_symlinks=False)


# --- files.writable against the root filesystem ------------------------------------

def _host_view(path: str, lower: str, host_dirs: list[str]) -> str:
    """Where sandbox path `path` comes from before the sandbox writes anything:
    a host system directory (/usr ...) or the lower layer."""
    rel = path.lstrip("/")
    top = rel.split("/", 1)[0]
    if top in host_dirs:
        return "/" + rel
    return os.path.join(lower, rel)


def writable_conflicts(writable: list[str], lower: str | None = None,
                       host_dirs: list[str] | None = None) -> list[tuple[int, str, str]]:
    """files.writable entries the sandbox's layout cannot make writable:
    [(index, path, why)]. A path under a regular file (/etc/group/x: the
    directory cannot be created) or that is itself neither a directory nor a
    regular file. Checked against the default rootfs unless `lower` is given."""
    if lower is None:
        lower, host_dirs = ensure_base()
    host_dirs = list(host_dirs or [])
    out = []
    for i, w in enumerate(writable):
        w = w.rstrip("/")
        if not w:
            continue
        parts = w.strip("/").split("/")
        for j in range(1, len(parts)):
            anc = "/" + "/".join(parts[:j])
            hv = _host_view(anc, lower, host_dirs)
            try:
                st = os.stat(hv)          # follows symlinks (lib -> usr/lib) as the mount does
            except FileNotFoundError:
                break                     # created when the sandbox starts
            except OSError as e:
                out.append((i, w, f"{anc} cannot be read in the sandbox's root filesystem ({e.strerror})"))
                break
            if not stat.S_ISDIR(st.st_mode):
                out.append((i, w, f"{anc} is a {_kind(st.st_mode)}, not a directory, in the sandbox's root "
                                  "filesystem: nothing can be created under it"))
                break
        else:
            hv = _host_view(w, lower, host_dirs)
            try:
                st = os.lstat(hv)
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode) or not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                out.append((i, w, f"{w} is a {_kind(st.st_mode)} in the sandbox's root filesystem "
                                  "(only directories and regular files can be made writable)"))
    return out
# --- reading a rootfs safely ----------------------------------------------------

READ_MAX = 1 << 20


def read_in_root(root: str, rel: str, limit: int = READ_MAX) -> bytes | None:
    """The bytes of `rel` inside the directory tree `root`, or None when it does
    not exist or is not a regular file. Resolution never leaves `root`
    (openat2 RESOLVE_IN_ROOT: absolute symlinks and ".." stop at it, /proc
    magic links are refused), the file is opened non-blocking (a FIFO or a
    device is never waited on, never read) and at most `limit` bytes are read."""
    from agent.sandbox import sysutil as su
    try:
        dfd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fd = su.openat2(dfd, rel, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY,
                        su.RESOLVE_IN_ROOT | su.RESOLVE_NO_MAGICLINKS)
    except OSError:
        return None
    finally:
        os.close(dfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        out = b""
        while len(out) <= limit:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            out += chunk
        return out[:limit]
    except OSError:
        return None
    finally:
        os.close(fd)


def read_in_layers(layers: list[str], rel: str) -> bytes | None:
    """The file `rel` as the overlay of `layers` (topmost first) shows it (a
    whiteout or a non-regular file in an upper layer hides it; opaque
    directories are not followed: good enough for /etc/passwd)."""
    from agent.sandbox import sysutil as su
    for layer in layers:
        data = read_in_root(layer, rel)
        if data is not None:
            return data
        try:
            dfd = os.open(layer, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fd = su.openat2(dfd, rel, os.O_PATH | os.O_NOFOLLOW, su.RESOLVE_IN_ROOT | su.RESOLVE_NO_MAGICLINKS)
            os.close(fd)
            return None                 # present but not a regular file: it hides the lower ones
        except OSError:
            pass
        finally:
            os.close(dfd)
    return None


_lower_seen: dict[tuple, tuple] = {}     # the built-in base's lowers -> lower_facts' answer


def _is_base(lowers: list[str]) -> bool:
    """Is the lower stack the built-in base alone? It is content-addressed and never changed
    once in place (ensure_base builds it aside and renames it in): what is read of it holds
    for the process's life."""
    return len(lowers) == 1 and os.path.dirname(lowers[0]) == BASE_ROOT


def lower_facts(lowers: list[str]) -> tuple:
    """What seed_upper reads of the lower stack: (its etc/passwd, its etc/group, whether
    it has an etc directory, whether it has a /workspace). The built-in base's are read
    once per process (_is_base); an image's or a --rootfs's at each start (~20 system calls)."""
    key = tuple(lowers)
    fixed = _is_base(lowers)
    if fixed and key in _lower_seen:
        return _lower_seen[key]
    facts = (read_in_layers(lowers, "etc/passwd"), read_in_layers(lowers, "etc/group"),
             any(os.path.isdir(os.path.join(lw, "etc")) for lw in lowers),
             read_in_layers(lowers, "workspace") is not None
             or any(os.path.isdir(os.path.join(lw, "workspace")) for lw in lowers))
    if fixed:
        if len(_lower_seen) >= 16:       # a base per host /etc change: a handful in an agent's life
            _lower_seen.clear()
        _lower_seen[key] = facts
    return facts


def seed_upper(upper_root: str, lowers: list[str], user: str, uid: int, gid: int) -> tuple[list, dict, dict]:
    """What dsec writes into a root's upper layer before it is mounted: `user`'s
    passwd/group entries (uid, gid) and /workspace owned by it. Returns (mountpoints it
    created, {sandbox path: sha256} of the files it generated over the lowers' own,
    {upper path: (inode, ctime_ns, size, sha256)} of the files as written: the manifest
    takes one it finds unchanged from there (changes(known=...)) without reading it)."""
    passwd, group, etc_in_lower, ws_in_lower = lower_facts(lowers)
    created, generated, seeded = [], {}, {}
    etc = os.path.join(upper_root, "etc")
    os.mkdir(etc)                       # the upper layer is new: nothing is in it yet
    if not etc_in_lower:
        created.append("/etc")
    for name, old, group_file in (("passwd", passwd, False), ("group", group, True)):
        data = with_user(old, user, uid, gid, "/workspace", group=group_file)
        path = os.path.join(etc, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, 0o644)        # whatever the umask
            st = os.fstat(fd)
        finally:
            os.close(fd)
        digest = hashlib.sha256(data).hexdigest()
        seeded[path] = (st.st_ino, st.st_ctime_ns, st.st_size, digest)
        if old is None:
            created.append(f"/etc/{name}")
        else:
            generated[f"/etc/{name}"] = digest
    ws = os.path.join(upper_root, "workspace")
    os.mkdir(ws, 0o755)
    os.chown(ws, uid, gid)
    if not ws_in_lower:
        created.append("/workspace")
    return created, generated, seeded


def parse_passwd(data: bytes | None) -> list[tuple[str, int, int, str]]:
    entries = []
    for line in (data or b"").decode("utf-8", "surrogateescape").splitlines():
        p = line.split(":")
        if len(p) >= 7 and p[2].isdigit() and p[3].isdigit():
            entries.append((p[0], int(p[2]), int(p[3]), p[5]))
    return entries


def with_user(data: bytes | None, name: str, uid: int, gid: int, home: str, group: bool = False) -> bytes:
    """passwd (or group, group=True) text with `name` set to uid/gid: its line
    replaced, or appended when it has none."""
    lines = (data or b"").decode("utf-8", "surrogateescape").splitlines()
    new = f"{name}:x:{gid}:" if group else f"{name}:x:{uid}:{gid}:{name}:{home}:/bin/sh"
    out, done = [], False
    for line in lines:
        if line.split(":", 1)[0] == name:
            if not done:
                out.append(new)
                done = True
            continue
        out.append(line)
    if not done:
        out.append(new)
    return ("\n".join(out) + "\n").encode("utf-8", "surrogateescape")


REFUSED_ROOTS = ("/proc", "/sys", "/dev", "/run")


def check_rootfs(path: str, allowed_roots=None) -> str:
    """A custom rootfs directory, resolved (realpath), or ValueError saying why
    not: "/" and the kernel's and dsec's own trees are refused; with
    `allowed_roots` (the agent's rootfs_roots) it must lie under one of them."""
    ab = os.path.abspath(path)
    for r in REFUSED_ROOTS:
        if ab == r or ab.startswith(r + "/"):
            raise ValueError(f"{r} is not a rootfs")
    try:
        rf = os.path.realpath(path, strict=True)
    except OSError as e:
        raise ValueError(e.strerror or "cannot resolve") from None
    if not os.path.isdir(rf):
        raise ValueError("no such directory")
    if any(c in rf for c in ",:\\"):
        raise ValueError("path must not contain ',', ':' or '\\'")
    if rf == "/":
        raise ValueError("the host's / is not a rootfs")
    own = [os.path.realpath(STATE_ROOT)]
    for r in list(REFUSED_ROOTS):
        if rf == r or rf.startswith(r + "/"):
            raise ValueError(f"{r} is not a rootfs")
    for r in own:
        if rf == r or rf.startswith(r + "/") and not rf.startswith(os.path.join(r, "images") + "/"):
            raise ValueError(f"dsec's own state ({r}) is not a rootfs")
    if allowed_roots is not None:
        for a in allowed_roots:
            a = os.path.realpath(a)
            if rf == a or rf.startswith(a.rstrip("/") + "/"):
                return rf
        raise ValueError("not under an allowed rootfs root (agent config rootfs_roots: "
                         f"{', '.join(allowed_roots) or 'none configured'})")
    return rf


def strip_privileges(tree: str) -> int:
    """Clear setuid/setgid bits and file capabilities in a kept tree (it
    outlives the sandbox on the host); returns how many files changed."""
    n = 0
    for dirpath, dirnames, filenames in trees.walk(tree):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode):
                continue
            changed = False
            if st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                os.chmod(p, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
                changed = True
            try:
                os.removexattr(p, "security.capability", follow_symlinks=False)
                changed = True
            except OSError:
                pass
            n += changed
    return n


# --- change manifest -----------------------------------------------------------

MAX_CHANGES = 10_000
MAX_HASH_BYTES = 1 << 30          # a file is hashed only up to this size
MAX_HASH_TOTAL = 1 << 30          # and a manifest hashes this much in all: a workload's sparse files
                                  # (1,000 x 1 GiB, no disk used) would cost the close a TiB of reading


def _sha256(path: str) -> str | None:
    """The file's sha256 (None: it cannot be opened); read with plain read(2)s, without the
    buffered file object's fstat, ioctl and lseek."""
    h = hashlib.sha256()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        while chunk := os.read(fd, 1 << 20):
            h.update(chunk)
    finally:
        os.close(fd)
    return h.hexdigest()


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


_base_shows: dict[tuple[str, str], bool] = {}    # (built-in base, rel) -> _in_lowers' answer


def _in_lowers(lowers: list[str], rel: str) -> bool:
    """Does the lower stack (top first) show `rel`? A whiteout (0/0 char device)
    in a higher layer hides what lower ones have. The built-in base's answers are kept
    (_is_base): a manifest looks up the same few paths (/etc, /workspace ...) at every close."""
    if _is_base(lowers):
        key = (lowers[0], rel)
        got = _base_shows.get(key)
        if got is None:
            if len(_base_shows) >= 4096:
                _base_shows.clear()
            got = _base_shows[key] = _in_lowers_read(lowers, rel)
        return got
    return _in_lowers_read(lowers, rel)


def _in_lowers_read(lowers: list[str], rel: str) -> bool:
    for d in lowers:
        try:
            st = os.lstat(os.path.join(d, rel))
        except OSError:
            continue
        return not (stat.S_ISCHR(st.st_mode) and st.st_rdev == 0)
    return False


def _entry(full: str, spath: str, st: os.stat_result, in_lower: bool) -> dict | None:
    """The manifest entry of one path of an upper layer (None: a copied-up parent directory,
    no change of its own); a regular file's sha256 is None, for the caller's budget."""
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
        return {"path": spath, "change": "deleted", "kind": "whiteout"}
    change = "modified" if in_lower else "added"
    if stat.S_ISDIR(st.st_mode):
        opaque = False
        try:
            opaque = os.getxattr(full, "trusted.overlay.opaque") == b"y"
        except OSError:
            pass
        if in_lower and not opaque:
            return None
        return {"path": spath, "change": change, "kind": "dir", "mode": oct(st.st_mode & 0o7777)}
    entry = {"path": spath, "change": change, "kind": _kind(st.st_mode), "mode": oct(st.st_mode & 0o7777)}
    if stat.S_ISREG(st.st_mode):
        entry["size"] = st.st_size
        entry["sha256"] = None
    elif stat.S_ISLNK(st.st_mode):
        entry["target"] = os.fsdecode(os.readlink(full))
    return entry


def _not_walked(spath: str, in_lower: bool, kind: str, why: str) -> dict:
    return {"path": spath, "change": "modified" if in_lower else "added", "kind": kind, "not_walked": why}


def changes(layers: list[tuple[str, str, str]], limit: int = MAX_CHANGES,
            known: dict | None = None) -> tuple[list[dict], int]:
    """Walk upper layers; layers = [(sandbox path prefix, upper dir, lower dir)].

    Returns (entries, total). Each entry: path, change (added | modified | deleted),
    kind, and for files size and sha256; symlinks carry their target. Paths are
    str with non-UTF-8 bytes as surrogate escapes (lossless, see audit_schema).
    known: {upper file path: (inode, ctime_ns, size, sha256)} of files dsec wrote: one
    found with the same inode, ctime and size is not read again (any write, chmod,
    utimes or rename onto it moves its ctime, which no call sets back).
    """
    out: list[dict] = []
    unwalked: list[dict] = []
    total = hashed = 0
    for prefix, upper, lower in layers:
        if not os.path.isdir(upper):
            continue
        lowers = lower.split(":")          # an image: its layers, top first
        def unlisted(e, upper=upper, prefix=prefix, lowers=lowers):   # a directory that cannot be listed
            rel = os.path.relpath(e.filename, upper)
            unwalked.append(_not_walked(os.path.normpath(prefix.rstrip("/") + "/" + rel), _in_lowers(lowers, rel),
                                        "dir", f"cannot list it ({e.strerror}): what is below it is not listed"))
        for dirpath, dirnames, filenames in trees.walk(upper, onerror=unlisted):
            rel_dir = os.path.relpath(dirpath, upper)
            for name in sorted(dirnames) + sorted(filenames):
                full = os.path.join(dirpath, name)
                rel = os.path.normpath(os.path.join(rel_dir, name))
                spath = os.path.normpath(prefix.rstrip("/") + "/" + rel)
                in_lower = _in_lowers(lowers, rel)
                try:
                    st = os.lstat(full)
                except OSError as e:
                    if e.errno == errno.ENOENT:
                        continue              # gone since the listing (the sandbox is stopped: not expected)
                    # e.g. ENAMETOOLONG: a tree deeper than PATH_MAX (4,096 bytes) by path; said, not skipped
                    entry = _not_walked(spath, in_lower, "dir" if name in dirnames else "unknown",
                                        f"cannot read it ({e.strerror}): it and what is below it are not listed")
                    if name in dirnames:
                        dirnames.remove(name)
                else:
                    entry = _entry(full, spath, st, in_lower)
                    if entry is None:
                        continue              # a copied-up parent, not a change of its own
                    if "size" in entry:       # a regular file: hashed within the budget
                        if st.st_size > MAX_HASH_BYTES:
                            entry["sha256_skipped"] = f"larger than {MAX_HASH_BYTES} bytes"
                        elif hashed + st.st_size > MAX_HASH_TOTAL:
                            entry["sha256_skipped"] = f"the manifest's hashing budget ({MAX_HASH_TOTAL} bytes) is spent"
                        elif len(out) < limit:        # an entry past the listed ones is not hashed
                            k = known.get(full) if known else None
                            same = k is not None and (st.st_ino, st.st_ctime_ns, st.st_size) == k[:3]
                            entry["sha256"] = k[3] if same else _sha256(full)
                            hashed += st.st_size
                total += 1
                if len(out) < limit:
                    out.append(entry)
    listed = {e["path"]: e for e in out if e["kind"] == "dir"}
    for u in unwalked:                     # said on the directory's own entry, or as one
        if u["path"] in listed:
            listed[u["path"]]["not_walked"] = u["not_walked"]
        else:
            total += 1
            if len(out) < limit:
                out.append(u)
    out.sort(key=lambda e: e["path"])
    return out, total
