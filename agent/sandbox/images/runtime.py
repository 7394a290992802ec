"""An image's config applied to a sandbox: Env, WorkingDir, User, Entrypoint/Cmd,
with dsec's secure defaults winning where they conflict (docs/images.md
"The image's config"):

  User        the image's, unless it is root (uid 0, or none given): then dsec's
              unprivileged default user `sandbox` (a host uid leased for this sandbox,
              agent/sandbox/uids.py) -- root only with an explicit --user root /
              user="root". An explicit user always wins. An image's own non-root user
              runs as its uid from the image (shared by sandboxes of that image).
  Env         the image's, then the caller's on top; HOSTNAME stays the sandbox id.
  WorkingDir  an explicit workdir, else the image's, else /workspace.
  Entrypoint  `dsec run --image X -- CMD` runs Entrypoint + CMD (Entrypoint + Cmd
  / Cmd       without CMD), like `docker run`; --entrypoint replaces it ('' drops it).
              Steps of a long-lived sandbox (Exec) run their argv as given.
  ignored     Volumes (only --volume from the agent's allowed roots is mounted),
              ExposedPorts, StopSignal, Healthcheck; nothing in a config grants a
              capability, a device or a privilege (all are dropped, no_new_privs).

    r = apply(img, lowers, argv=[], user=None, workdir=None, env={})
    r["argv"], r["user"] ("UID:GID"), r["workdir"], r["env"], r["overridden"]
"""
from __future__ import annotations

import os
import stat

from agent.sandbox.images.errors import ImageError

DEFAULT_USER = "sandbox"          # the launcher's default user: a leased host uid
DEFAULT_WORKDIR = "/workspace"


def _safe_file(layer: str, rel: str) -> str | None:
    """layer/rel if it is a regular file reached without following a symlink of the image."""
    p = layer
    parts = rel.split("/")
    for i, part in enumerate(parts):
        p = os.path.join(p, part)
        try:
            st = os.lstat(p)
        except OSError:
            return None
        last = i == len(parts) - 1
        if last and not stat.S_ISREG(st.st_mode):
            return None
        if not last and not stat.S_ISDIR(st.st_mode):
            return None
    return p


def _top(lowers: list[str], rel: str) -> str | None:
    """The file as the sandbox sees it: the top-most layer that has it (or None when
    a higher layer deletes it or it is not a plain file)."""
    for d in lowers:
        d = os.path.realpath(d)                   # the store's own short link, never the image's
        p = os.path.join(d, rel)
        if os.path.lexists(p):
            return _safe_file(d, rel)
    return None


def passwd_root(lowers: list[str]) -> str:
    """A dir whose etc/passwd is the sandbox's (a plain file, no symlink followed),
    for the launcher's user lookup; the top layer when there is none."""
    p = _top(lowers, "etc/passwd")
    return os.path.dirname(os.path.dirname(p)) if p else os.path.realpath(lowers[0])


def _table(lowers, rel) -> list[list[str]]:
    p = _top(lowers, rel)
    if not p:
        return []
    try:
        with open(p, errors="surrogateescape") as f:
            return [line.rstrip("\n").split(":") for line in f.read(1 << 20).splitlines()]
    except OSError:
        return []


def resolve_user(lowers: list[str], user: str, where: str) -> tuple[int, int]:
    """NAME, UID, NAME:GROUP, UID:GID ... against the image's /etc/passwd and /etc/group."""
    u, _, g = user.partition(":")
    passwd = _table(lowers, "etc/passwd")
    uid = gid = None
    if u.isdigit():
        uid = int(u)
        for e in passwd:
            if len(e) >= 4 and e[2] == u and e[3].isdigit():
                gid = int(e[3])
                break
    else:
        for e in passwd:
            if len(e) >= 4 and e[0] == u and e[2].isdigit() and e[3].isdigit():
                uid, gid = int(e[2]), int(e[3])
                break
        if uid is None:
            raise ImageError(f"{where}: user {u!r} is not in the image's /etc/passwd")
    if g:
        if g.isdigit():
            gid = int(g)
        else:
            gid = next((int(e[2]) for e in _table(lowers, "etc/group") if len(e) >= 3 and e[0] == g
                        and e[2].isdigit()), None)
            if gid is None:
                raise ImageError(f"{where}: group {g!r} is not in the image's /etc/group")
    if gid is None:
        gid = uid
    if uid > 0xFFFFFFFE or gid > 0xFFFFFFFE:
        raise ImageError(f"{where}: user {user!r}: uid/gid out of range")
    return uid, gid


def apply(img, lowers: list[str], *, argv, user, workdir, env, entrypoint=None) -> dict:
    """The sandbox's argv, user ("UID:GID" or the explicit one), workdir and env."""
    cfg = img.config or {}
    where = f"image {img.asked}"
    overridden = []
    if user is None:
        iu = cfg.get("User") or ""
        uid, gid = resolve_user(lowers, iu, where) if iu else (0, 0)
        if uid == 0:
            if iu:
                overridden.append(f"User {iu!r} (root): dsec runs images unprivileged unless asked")
            user = DEFAULT_USER
        else:
            user = f"{uid}:{gid}"
    out_env = {}
    for item in cfg.get("Env") or []:
        k, sep, v = str(item).partition("=")
        if not sep or not k or "\0" in item:
            continue
        if k == "HOSTNAME":
            overridden.append("Env HOSTNAME: the sandbox id")
            continue
        out_env[k] = v
    out_env.update(env or {})
    wd = workdir or cfg.get("WorkingDir") or DEFAULT_WORKDIR
    if not wd.startswith("/"):
        wd = "/" + wd
    return {"argv": command(img, argv, entrypoint), "user": user, "workdir": wd, "env": out_env,
            "overridden": overridden}


def command(img, argv, entrypoint=None) -> list:
    """What `dsec run --image` runs: Entrypoint (or the override) + CMD (or the image's Cmd)."""
    cfg = img.config or {}
    ep = list(cfg.get("Entrypoint") or []) if entrypoint is None else list(entrypoint)
    return ep + (list(argv) if argv else list(cfg.get("Cmd") or []))


def prepare_spec(store, spec, img, *, argv=(), user=None, workdir=None, env=None, entrypoint=None) -> dict:
    """Unpack (once, coalesced) and lease img's layers for spec.sandbox_id, and apply its
    config to the launcher's SandboxSpec: layers, argv, user, workdir, env, image (the record's)."""
    spec.layers, spec.lease = store.prepare_lease(img, spec.sandbox_id)
    r = apply(img, spec.layers, argv=argv, user=user, workdir=workdir, env=env, entrypoint=entrypoint)
    spec.argv, spec.user, spec.workdir, spec.env = r["argv"], r["user"], r["workdir"], r["env"]
    spec.image = dict(img.record(), overridden=r["overridden"])
    return r
