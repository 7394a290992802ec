"""One OCI layer tar, checked and unpacked into an overlayfs lower directory.

    info = scan(blob, media_type, where)                 # check only (at import): nothing is written
    info = unpack(blob, media_type, dest_root, where)    # the same checks, and the tree under dest_root

`where` names the image and layer for errors ("image app:1 layer 2/3 sha256:ab12..."):
every refusal is one ImageError line starting with it.

What a layer may hold, and what becomes of it (docs/images.md "What is verified"):
  regular files, directories, symlinks, hard links (to a file earlier in the same
  layer), FIFOs        kept with owner (numeric uid/gid), mode (setuid/setgid/sticky
                       too: they do nothing under no_new_privs), mtime and xattrs
                       (user.*, security.capability, system.posix_acl_*)
  .wh.NAME             an OCI whiteout: becomes the overlayfs whiteout, a 0/0
                       character device NAME
  .wh..wh..opq         an OCI opaque directory: trusted.overlay.opaque=y on the dir
  the root entry       "/", "./" or ".": its owner, mode and mtime go to the layer root
refused (ImageError; a partial tree is never used, see store.py):
  absolute names (other than the root entry), '..' components, device nodes,
  relative symlinks whose target climbs above the layer root, hard links to
  anything but an earlier non-directory of this layer, names that pass through a
  symlink or a file of the layer, trusted.* xattrs (overlayfs' own), names
  longer than PATH_MAX, more than MAX_ENTRIES entries, a decompressed size over
  the limit, content whose sha256 is not the config's diff_id.

Absolute symlink targets are kept: the kernel resolves them inside the
sandbox's root, once it has pivoted there; nothing of dsec follows a link in
the layer store. The tree is written through directory file descriptors opened
with O_NOFOLLOW, so no entry can make the unpacker write outside dest_root.

Why this is written here rather than with umoci: umoci (0.4.7, Debian 12) unpacks
a whole image into one flattened rootfs, applying whiteouts as deletions; it has
no per-layer unpack into overlayfs' whiteout format, which a layer store shared
between images needs. Python's tarfile parses the archive; everything about
where and how an entry lands is checked here.
"""
from __future__ import annotations

import errno
import gzip
import hashlib
import os
import stat
import subprocess
import tarfile
import time

from agent.sandbox.images.errors import ImageError
from agent.sandbox import trees

MAX_ENTRIES = 2_000_000
MAX_NAME = 4095
MAX_COMPONENT = 255
DEFAULT_MAX_BYTES = 256 << 30          # decompressed size of one layer
CHUNK = 1 << 20
XATTR_ALLOWED = ("user.", "security.capability", "system.posix_acl_access", "system.posix_acl_default")
WH_PREFIX = ".wh."
WH_OPAQUE = ".wh..wh..opq"
MEDIA_TYPES = {
    "application/vnd.oci.image.layer.v1.tar": "tar",
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar": "tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd": "zstd",
    "application/vnd.docker.image.rootfs.diff.tar": "tar",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip": "gzip",
}


class _Hashing:
    """A read-only stream that hashes and counts what passes through it."""

    def __init__(self, raw, where: str, limit: int):
        self.raw = raw
        self.h = hashlib.sha256()
        self.n = 0
        self.where = where
        self.limit = limit

    def read(self, size=-1):
        data = self.raw.read(size if size is not None and size >= 0 else CHUNK)
        if data:
            self.h.update(data)
            self.n += len(data)
            if self.n > self.limit:
                raise ImageError(f"{self.where}: larger than {self.limit} bytes once decompressed")
        return data

    def drain(self):
        while self.read(CHUNK):
            pass


class _Source:
    """The decompressed tar stream of a blob (gzip in-process, zstd through the zstd tool)."""

    def __init__(self, blob: str, media_type: str, where: str, limit: int):
        kind = MEDIA_TYPES.get(media_type)
        if kind is None:
            raise ImageError(f"{where}: unsupported layer media type {media_type!r}")
        self.proc = None
        self.file = open(blob, "rb")
        if kind == "gzip":
            raw = gzip.GzipFile(fileobj=self.file, mode="rb")
        elif kind == "zstd":
            try:
                self.proc = subprocess.Popen(["zstd", "-dc", "-q"], stdin=self.file, stdout=subprocess.PIPE,
                                             stderr=subprocess.DEVNULL)
            except FileNotFoundError:
                self.file.close()
                raise ImageError(f"{where}: a zstd-compressed layer needs the zstd tool (apt-get install zstd)")
            raw = self.proc.stdout
        else:
            raw = self.file
        self.stream = _Hashing(raw, where, limit)

    def close(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc.stdout.close()
        self.file.close()


def _norm(name: str, where: str, what: str = "entry") -> str | None:
    """A member name as a relative path ('' = the layer root), or an ImageError."""
    if name in ("/", ".", "./", ""):
        return ""
    if name.startswith("/"):
        raise ImageError(f"{where}: {what} {name[:200]!r} is an absolute path")
    parts = []
    for p in name.split("/"):
        if p in ("", "."):
            continue
        if p == "..":
            raise ImageError(f"{where}: {what} {name[:200]!r} has a '..' component")
        if len(os.fsencode(p)) > MAX_COMPONENT:
            raise ImageError(f"{where}: {what} {name[:200]!r}: a name component longer than {MAX_COMPONENT} bytes")
        parts.append(p)
    rel = "/".join(parts)
    if len(os.fsencode(rel)) > MAX_NAME:
        raise ImageError(f"{where}: {what} {name[:200]!r}: longer than {MAX_NAME} bytes")
    return rel


def _link_escapes(rel: str, target: str) -> bool:
    """Does a relative symlink at `rel` climb above the layer root?"""
    depth = rel.count("/")              # directories between the root and the link
    for p in target.split("/"):
        if p == "..":
            depth -= 1
            if depth < 0:
                return True
        elif p not in ("", "."):
            depth += 1
    return False


def _xattrs(m: tarfile.TarInfo, where: str, rel: str) -> list[tuple[str, bytes]]:
    out = []
    for k, v in (m.pax_headers or {}).items():
        if not k.startswith("SCHILY.xattr."):
            continue
        name = k[len("SCHILY.xattr."):]
        if name.startswith("trusted."):
            raise ImageError(f"{where}: entry {rel!r} sets the xattr {name} (overlayfs' own namespace)")
        if name.startswith(XATTR_ALLOWED):
            out.append((name, v.encode("utf-8", "surrogateescape")))
    return out


class _Walker:
    """The checks both scan() and unpack() apply, entry by entry, in archive order."""

    def __init__(self, where: str):
        self.where = where
        self.kinds: dict[str, str] = {"": "dir"}     # rel -> dir | file | link | fifo | whiteout
        self.entries = 0
        self.files = 0
        self.skipped_xattrs = 0

    def check(self, m: tarfile.TarInfo) -> tuple[str, str, str | None]:
        """(action, rel, extra) for one member; raises ImageError."""
        w = self.where
        self.entries += 1
        if self.entries > MAX_ENTRIES:
            raise ImageError(f"{w}: more than {MAX_ENTRIES} entries")
        rel = _norm(m.name, w)
        if m.uid < 0 or m.gid < 0 or m.uid > 0xFFFFFFFE or m.gid > 0xFFFFFFFE:
            raise ImageError(f"{w}: entry {m.name[:200]!r}: uid/gid out of range")
        if rel == "":
            if not m.isdir():
                raise ImageError(f"{w}: the layer root entry {m.name!r} is not a directory")
            return "root", "", None
        parent, _, base = rel.rpartition("/")
        self._parent_ok(parent, rel)
        if base == WH_OPAQUE:
            if self.kinds.get(parent, "dir") != "dir":
                raise ImageError(f"{w}: opaque marker {m.name[:200]!r} inside a non-directory")
            return "opaque", parent, None
        if base.startswith(WH_PREFIX + WH_PREFIX[:-1]):        # .wh..wh.* : aufs metadata, no meaning here
            return "skip", rel, None
        if base.startswith(WH_PREFIX):
            name = base[len(WH_PREFIX):]
            if not name:
                raise ImageError(f"{w}: whiteout {m.name[:200]!r} names nothing")
            target = (parent + "/" if parent else "") + name
            if target in self.kinds:     # whiteouts hide lower layers only, never this layer's own entries
                return "skip", target, None
            self.kinds[target] = "whiteout"
            return "whiteout", target, None
        if m.ischr() or m.isblk():
            raise ImageError(f"{w}: entry {m.name[:200]!r} is a device node "
                             f"({'char' if m.ischr() else 'block'} {m.devmajor}:{m.devminor})")
        if m.isdir():
            self.kinds[rel] = "dir"
            return "dir", rel, None
        if m.issym():
            t = m.linkname
            if not t:
                raise ImageError(f"{w}: symlink {m.name[:200]!r} has an empty target")
            if len(os.fsencode(t)) > MAX_NAME:
                raise ImageError(f"{w}: symlink {m.name[:200]!r}: target longer than {MAX_NAME} bytes")
            if not t.startswith("/") and _link_escapes(rel, t):
                raise ImageError(f"{w}: symlink {m.name[:200]!r} -> {t[:200]!r} points out of the layer")
            self.kinds[rel] = "link"
            return "symlink", rel, t
        if m.islnk():
            t = _norm(m.linkname, w, "hard link target")
            kind = self.kinds.get(t)
            if kind not in ("file", "link", "fifo"):
                raise ImageError(f"{w}: hard link {m.name[:200]!r} -> {m.linkname[:200]!r}: the target is not "
                                 f"a file earlier in this layer")
            self.kinds[rel] = kind
            return "hardlink", rel, t
        if m.isfifo():
            self.kinds[rel] = "fifo"
            return "fifo", rel, None
        if m.isreg():
            self.kinds[rel] = "file"
            self.files += 1
            return "file", rel, None
        raise ImageError(f"{w}: entry {m.name[:200]!r} has an unsupported tar type {m.type!r}")

    def _parent_ok(self, parent: str, rel: str):
        p = parent
        while p:
            k = self.kinds.get(p)
            if k is not None and k != "dir":
                raise ImageError(f"{self.where}: entry {rel[:200]!r} goes through {p[:200]!r}, which is a "
                                 f"{'symlink' if k == 'link' else k} in this layer")
            if k == "dir":
                return              # its parents were checked when it was added
            p = p.rpartition("/")[0]


def _open_tar(src: _Source, where: str):
    try:
        return tarfile.open(fileobj=src.stream, mode="r|", encoding="utf-8", errors="surrogateescape")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise ImageError(f"{where}: not a tar archive ({e})") from None


def _finish(src: _Source, tf, diff_id: str | None, where: str) -> dict:
    try:
        src.stream.drain()           # tar padding after the end-of-archive blocks is part of the digest
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise ImageError(f"{where}: damaged compressed data ({e})") from None
    got = "sha256:" + src.stream.h.hexdigest()
    if diff_id and got != diff_id:
        raise ImageError(f"{where}: its content is {got}, not the diff_id {diff_id} the image config names")
    return {"diff_id": got, "tar_bytes": src.stream.n}


def _members(tf, where: str, done: dict):
    """The archive's members. A tar whose end-of-archive blocks (and the last
    member's padding) are missing -- what umoci 0.4.7's `insert` writes -- ends at
    the last complete member: the diff_id check that follows covers every byte, so
    nothing is lost or altered by tolerating it. The caller sets done["complete"]
    once it has read a member's data in full."""
    try:
        while True:
            m = tf.next()
            if m is None:
                return
            done["complete"] = not m.isreg() or m.size == 0
            yield m
    except ImageError:
        raise
    except tarfile.ReadError as e:
        if str(e) == "unexpected end of data" and done.get("complete"):
            done["unpadded_tail"] = True
            return
        raise ImageError(f"{where}: damaged archive (ReadError: {e})") from None
    except (tarfile.TarError, OSError, EOFError, gzip.BadGzipFile, ValueError) as e:
        raise ImageError(f"{where}: damaged archive ({type(e).__name__}: {e})") from None


def _read_data(tf, m, where: str, sink=None):
    """Read a regular member's data in full (into sink(chunk) if given)."""
    data = tf.extractfile(m)
    left = m.size
    while left > 0:
        chunk = data.read(min(CHUNK, left))
        if not chunk:
            raise ImageError(f"{where}: entry {m.name[:200]!r} is truncated")
        if sink is not None:
            sink(chunk)
        left -= len(chunk)


def scan(blob: str, media_type: str, where: str, diff_id: str | None = None,
         max_bytes: int = DEFAULT_MAX_BYTES) -> dict:
    """Check every entry (and the diff_id) without writing anything."""
    src = _Source(blob, media_type, where, max_bytes)
    try:
        tf = _open_tar(src, where)
        walker = _Walker(where)
        done: dict = {}
        for m in _members(tf, where, done):
            act, rel, _ = walker.check(m)
            if act in ("file", "dir", "symlink", "fifo", "root", "hardlink"):
                _xattrs(m, where, rel)
            if m.isreg() and m.size:
                _read_data(tf, m, where)
                done["complete"] = True
        info = _finish(src, tf, diff_id, where)
        info.update(entries=walker.entries, unpadded_tail=bool(done.get("unpadded_tail")))
        return info
    finally:
        src.close()


class _Tree:
    """Writes entries under a root through O_NOFOLLOW directory fds."""

    def __init__(self, root: str, where: str):
        self.root = root
        self.where = where
        self.rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self.fds: dict[str, int] = {"": self.rootfd}
        self.dirs: dict[str, tuple] = {}          # rel -> (mode, uid, gid, mtime, xattrs): applied at the end

    def close(self):
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}

    def dirfd(self, rel: str) -> int:
        # from the nearest cached ancestor down, one level at a time: a layer's chain of
        # directories can be deeper than the interpreter's recursion limit
        chain = []
        cur = rel
        while cur not in self.fds:                 # "" (the root) always is
            parent, _, base = cur.rpartition("/")
            chain.append((cur, base))
            cur = parent
        pfd = self.fds[cur]
        for sub, base in reversed(chain):
            try:
                fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
            except FileNotFoundError:
                os.mkdir(base, 0o755, dir_fd=pfd)       # a parent the archive did not list (as tar does)
                fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise ImageError(f"{self.where}: {sub[:200]!r} is not a directory in this layer") from None
                raise
            if len(self.fds) > 512:                    # bounded: drop the cached fds below the root
                for k in [k for k in self.fds if k][:256]:
                    os.close(self.fds.pop(k))
            self.fds[sub] = pfd = fd
        return pfd

    def _clear(self, pfd: int, base: str, rel: str, keep_dir: bool) -> bool:
        """Remove what is at base (if anything) unless it is a dir and keep_dir. True if a dir is kept."""
        try:
            st = os.lstat(base, dir_fd=pfd)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            if keep_dir:
                return True
            self._rmtree(pfd, base, rel)
        else:
            os.unlink(base, dir_fd=pfd)
        return False

    def _rmtree(self, pfd: int, base: str, rel: str):
        for k in [k for k in self.fds if k == rel or k.startswith(rel + "/")]:
            os.close(self.fds.pop(k))
        # depth first, without recursion (a layer's chain can be deeper than the interpreter's
        # recursion limit), one directory fd open at a time (back up through ".."; nothing else
        # writes this tree while it is unpacked); each directory listed once
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        cur = os.open(base, flags, dir_fd=pfd)
        try:
            stack = [(base, iter(os.listdir(cur)))]
            while True:
                name, names = stack[-1]
                for n in names:
                    if stat.S_ISDIR(os.lstat(n, dir_fd=cur).st_mode):
                        sub = os.open(n, flags, dir_fd=cur)
                        os.close(cur)
                        cur = sub
                        stack.append((n, iter(os.listdir(cur))))
                        break
                    os.unlink(n, dir_fd=cur)
                else:
                    stack.pop()
                    if not stack:
                        break
                    up = os.open("..", flags, dir_fd=cur)
                    os.close(cur)
                    cur = up
                    os.rmdir(name, dir_fd=cur)
        finally:
            os.close(cur)
        os.rmdir(base, dir_fd=pfd)
        for k in [k for k in self.dirs if k == rel or k.startswith(rel + "/")]:
            del self.dirs[k]

    @staticmethod
    def _proc(pfd: int, base: str) -> str:
        return f"/proc/self/fd/{pfd}/{base}"

    def put(self, act: str, rel: str, extra, m: tarfile.TarInfo, tf, xattrs):
        parent, _, base = rel.rpartition("/")
        if act == "opaque":
            fd = self.dirfd(rel)
            os.setxattr(fd, "trusted.overlay.opaque", b"y")
            return
        pfd = self.dirfd(parent)
        mode = m.mode & 0o7777
        if act == "dir":
            if not self._clear(pfd, base, rel, keep_dir=True):
                os.mkdir(base, 0o700, dir_fd=pfd)
            self.dirs[rel] = (mode, m.uid, m.gid, int(m.mtime), xattrs)
            return
        self._clear(pfd, base, rel, keep_dir=False)
        if act == "whiteout":
            os.mknod(base, stat.S_IFCHR | 0o000, os.makedev(0, 0), dir_fd=pfd)
            return
        if act == "file":
            fd = os.open(base, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=pfd)
            try:
                def sink(chunk):
                    view = memoryview(chunk)
                    while view:
                        n = os.write(fd, view)
                        view = view[n:]
                _read_data(tf, m, self.where, sink)
                os.fchown(fd, m.uid, m.gid)
                os.fchmod(fd, mode)
                for k, v in xattrs:
                    os.setxattr(fd, k, v)
                os.utime(fd, ns=(int(m.mtime) * 10**9, int(m.mtime) * 10**9))
            finally:
                os.close(fd)
            return
        if act == "hardlink":
            tparent, _, tbase = extra.rpartition("/")
            os.link(tbase, base, src_dir_fd=self.dirfd(tparent), dst_dir_fd=self.dirfd(parent),
                    follow_symlinks=False)
            return
        if act == "symlink":
            os.symlink(extra, base, dir_fd=pfd)
        elif act == "fifo":
            os.mkfifo(base, 0o600, dir_fd=pfd)
        os.chown(base, m.uid, m.gid, dir_fd=pfd, follow_symlinks=False)
        if act == "fifo":
            os.chmod(base, mode, dir_fd=pfd)
        for k, v in xattrs:
            os.setxattr(self._proc(pfd, base), k, v, follow_symlinks=False)
        t = int(m.mtime) * 10**9
        os.utime(base, ns=(t, t), dir_fd=pfd, follow_symlinks=False)

    def finish_dirs(self, root_meta):
        """Directory owners, modes, xattrs and mtimes, deepest first (children change a dir's mtime)."""
        for rel in sorted(self.dirs, key=lambda r: r.count("/"), reverse=True):
            mode, uid, gid, mtime, xattrs = self.dirs[rel]
            fd = self.dirfd(rel)
            os.fchown(fd, uid, gid)
            os.fchmod(fd, mode)
            for k, v in xattrs:
                os.setxattr(fd, k, v)
            os.utime(fd, ns=(mtime * 10**9, mtime * 10**9))
        if root_meta:
            mode, uid, gid, mtime = root_meta
            os.fchown(self.rootfd, uid, gid)
            os.fchmod(self.rootfd, mode)
            os.utime(self.rootfd, ns=(mtime * 10**9, mtime * 10**9))


def unpack(blob: str, media_type: str, dest_root: str, where: str, diff_id: str | None = None,
           max_bytes: int = DEFAULT_MAX_BYTES) -> dict:
    """Unpack into dest_root (an empty directory the caller made and will rename or
    remove: on an error it holds a partial tree that must never be used)."""
    t0 = time.monotonic()
    src = _Source(blob, media_type, where, max_bytes)
    tree = None
    try:
        tf = _open_tar(src, where)
        walker = _Walker(where)
        tree = _Tree(dest_root, where)
        root_meta = None
        done: dict = {}
        for m in _members(tf, where, done):
            act, rel, extra = walker.check(m)
            if act == "skip":
                if m.isreg() and m.size:
                    _read_data(tf, m, where)
                    done["complete"] = True
                continue
            if act == "root":
                root_meta = (m.mode & 0o7777, m.uid, m.gid, int(m.mtime))
                continue
            xattrs = _xattrs(m, where, rel) if act in ("file", "dir", "symlink", "fifo") else []
            try:
                tree.put(act, rel, extra, m, tf, xattrs)
                done["complete"] = True
            except ImageError:
                raise
            except OSError as e:
                raise ImageError(f"{where}: cannot unpack {m.name[:200]!r}: {e.strerror or e}") from None
        info = _finish(src, tf, diff_id, where)
        try:
            tree.finish_dirs(root_meta)
        except OSError as e:
            raise ImageError(f"{where}: cannot set directory metadata: {e.strerror or e}") from None
        info.update(entries=walker.entries, files=walker.files, unpack_ms=round((time.monotonic() - t0) * 1000, 3))
        return info
    finally:
        if tree is not None:
            tree.close()
        src.close()


def disk_bytes(root: str) -> int:
    """Bytes a tree occupies on disk (allocated blocks; hard links counted once)."""
    seen = set()
    total = 0
    for dp, dn, fn in trees.walk(root):
        for name in dn + fn:
            try:
                st = os.lstat(os.path.join(dp, name))
            except OSError:
                continue
            if st.st_nlink > 1:
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total
