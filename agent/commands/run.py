"""Run CMD in a new sandbox and return its exit status.

examples:
  dsec run -- python3 -c 'print("hi")'
  dsec run --memory 256M --pids 64 --timeout 30 -- sh -c 'make test'
  dsec run --network egress --env PIP_INDEX_URL=http://10.0.0.5/simple -- pip download x
  dsec run --user root --keep --summary-json out.json -- sh -c 'echo x > /etc/motd'

The sandbox: its own cgroup (cpu, memory, pids limits), new pid, mount, ipc,
uts and net namespaces (hostname = sandbox id), an overlay root over a
read-only base (host /usr, /bin, /sbin, /lib* and a minimal /etc written by
dsec) with a private upper layer, fresh /proc with OCI masked paths, a minimal
/dev, tmpfs /tmp, no_new_privs, no capabilities, CMD as user "sandbox" (uid
1000) in /workspace, and a supervisor as PID 1.

exit status:
  CMD's own status; 128+N if CMD was killed by signal N; 124 on timeout;
  125 if dsec failed (bad usage, not root, missing rootfs, setup error);
  126 if CMD is not executable; 127 if CMD is not found in the sandbox.
"""
from __future__ import annotations

import os
import sys

from agent.errors import DsecError, EXIT_DSEC, ReportedError

HELP = "run a command in a new sandbox"
USAGE_EXIT = EXIT_DSEC

_SIZE_PATTERN = r"^(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB])?$"
_MULT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DIGITS = frozenset("0123456789")


def _size_parts(t: str) -> tuple[str, str] | None:
    """(number, unit) of a size _SIZE_PATTERN matches, split by hand when it is plain ASCII
    (no `re` import on `dsec run`'s fast path); else by the pattern."""
    if t.isascii() and "\n" not in t:
        num = t.rstrip("bB")
        if len(t) - len(num) > 1:
            return None
        if num != t and num.endswith(("i", "I")):
            num = num[:-1]
            if t[len(num)] == "I":
                return None
        unit = num[-1:] if num[-1:].lower() in _MULT and num[-1:] else ""
        num = num[:len(num) - len(unit)].rstrip()
        whole, dot, frac = num.partition(".")
        if whole and _DIGITS.issuperset(whole) and (not dot or frac and _DIGITS.issuperset(frac)):
            return num, unit
        return None
    import re
    m = re.match(_SIZE_PATTERN, t)
    return (m.group(1), m.group(2)) if m else None


def parse_size(text: str, what: str = "--memory") -> int:
    m = _size_parts(text.strip())
    if not m:
        raise DsecError(f"{what} {text!r}: not a size (examples: 512M, 1G, 1048576)", EXIT_DSEC)
    n = int(float(m[0]) * _MULT[m[1].lower()])
    if n < 4 << 20:
        raise DsecError(f"{what} {text!r}: too small (minimum 4M)", EXIT_DSEC)
    return n


def _positive(kind, what):
    def conv(text):
        try:
            v = kind(text)
        except ValueError:
            raise DsecError(f"{what} {text!r}: not a number", EXIT_DSEC)
        if v <= 0:
            raise DsecError(f"{what} {text!r}: must be positive", EXIT_DSEC)
        return v
    return conv


def register(p):
    import argparse
    p.add_argument("--sandbox-id", metavar="ID", help="sandbox id (default: generated, printed on stderr)")
    p.add_argument("--cpus", metavar="N", help="CPU limit in cores, e.g. 0.5 (default: none)")
    p.add_argument("--memory", metavar="SIZE", default="1G", help="memory limit, e.g. 512M (default: 1G)")
    p.add_argument("--pids", metavar="N", default="1024", help="max processes/threads (default: 1024)")
    p.add_argument("--timeout", metavar="SECONDS", help="kill the sandbox after this long (exit 124)")
    p.add_argument("--grace", metavar="SECONDS", default="3",
                   help="on timeout or signal: SIGTERM, wait this long, then SIGKILL (default: 3)")
    p.add_argument("--rootfs", metavar="DIR", help="read-only lower layer for / (default: host /usr,/bin,/lib* + minimal /etc)")
    p.add_argument("--image", metavar="NAME[:TAG|@DIGEST]",
                   help="run on an imported OCI image (`dsec image ls`); without CMD, its Entrypoint + Cmd")
    p.add_argument("--entrypoint", metavar="CMD", help="with --image: replace the image's Entrypoint ('' drops it)")
    p.add_argument("--volume", action="append", default=[], metavar="HOST:SANDBOX[:ro|rw]",
                   help="bind-mount a host path (read-only unless :rw) from an allowed root "
                        "(DSEC_VOLUME_ROOTS or the agent config's volumes.allowed_roots)")
    p.add_argument("--network", default="none", metavar="none|egress",
                   help="none: loopback only (default); egress: veth + NAT to the outside")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="set an environment variable (repeatable)")
    p.add_argument("--workdir", metavar="DIR", help="working directory inside (default: /workspace, or the image's)")
    p.add_argument("--user", metavar="USER", help="NAME, UID or UID:GID (default: sandbox, a host uid leased for this sandbox; an image's "
                                                  "own user unless it is root)")
    p.add_argument("--keep", action="store_true", help="keep the upper layer after exit (path printed on stderr)")
    p.add_argument("--summary-json", metavar="FILE", help="write the run summary (exit, resources, changes) here")
    p.add_argument("--policy", metavar="FILE|NAME", default="default",
                   help="policy file or built-in name (default: default, which denies what container "
                        "runtimes deny; see `dsec policy list`)")
    p.add_argument("--mode", choices=("learn", "audit", "enforce"),
                   help="override the policy's mode")
    p.add_argument("--audit", choices=("on", "off"), default="on",
                   help="eBPF audit of execs, connects and file writes into the spool and ClickHouse (default: on)")
    p.add_argument("--over-budget", choices=("summarise", "stop"), default="summarise",
                   help="when the sandbox exceeds its audit event budget: count the loss (summarise) "
                        "or kill the sandbox so its record has no holes (stop)")
    p.add_argument("--wait-export", action="store_true",
                   help="through the agent: return once the run's audit record is in ClickHouse (default: "
                        "once it is durable in the agent's spool, which then delivers it)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]")


def _env(items):
    env = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k or "\0" in item:
            raise DsecError(f"--env {item!r}: expected K=V", EXIT_DSEC)
        env[k] = v
    return env


def _check_args(args):
    if args.cmd and args.cmd[0] == "--" and not getattr(args, "_cmd_split", False):
        args.cmd = args.cmd[1:]
    args._cmd_split = True              # once: `dsec run -- -- x` runs `-- x`
    if not args.cmd and not args.image:
        raise DsecError("no command given (usage: dsec run [options] -- CMD [ARGS...])", EXIT_DSEC)


class AgentSpec:
    """What `dsec run` sends the node agent, checked here without importing the
    launcher or the policy model (the agent loads the policy and checks the rest):
    the fast path of `dsec run` through an agent imports little beyond gRPC."""

    def __init__(self, args):
        _check_args(args)
        if args.network not in ("none", "egress"):
            raise DsecError(f"--network {args.network!r}: expected none or egress", EXIT_DSEC)
        if args.workdir and not args.workdir.startswith("/"):
            raise DsecError(f"--workdir {args.workdir!r}: must be an absolute path", EXIT_DSEC)
        self.argv, self.sandbox_id, self.rootfs, self.network = list(args.cmd), args.sandbox_id, args.rootfs, \
            args.network
        self.cpus = _positive(float, "--cpus")(args.cpus) if args.cpus else None
        self.memory, self.pids = parse_size(args.memory), _positive(int, "--pids")(args.pids)
        self.timeout = _positive(float, "--timeout")(args.timeout) if args.timeout else None
        self.grace = float(_positive(float, "--grace")(args.grace))
        self.env, self.workdir = _env(args.env), args.workdir or "/workspace"
        self.user, self.keep = args.user or "sandbox", args.keep


def spec_from_args(args):
    from agent.sandbox.launcher import SandboxSpec
    _check_args(args)
    if args.image and args.rootfs:
        raise DsecError("--image and --rootfs: give one of them", EXIT_DSEC)
    if args.entrypoint is not None and not args.image:
        raise DsecError("--entrypoint goes with --image", EXIT_DSEC)
    if args.network not in ("none", "egress"):
        raise DsecError(f"--network {args.network!r}: expected none or egress", EXIT_DSEC)
    if args.workdir and not args.workdir.startswith("/"):
        raise DsecError(f"--workdir {args.workdir!r}: must be an absolute path", EXIT_DSEC)
    from policies.load import load_policy
    try:
        policy = load_policy(args.policy)
        if args.mode:
            policy = policy.with_mode(args.mode)
    except ReportedError as e:
        raise DsecError(e.message, EXIT_DSEC)
    spec = SandboxSpec(
        policy=policy,
        argv=list(args.cmd), sandbox_id=args.sandbox_id,
        cpus=_positive(float, "--cpus")(args.cpus) if args.cpus else None,
        memory=parse_size(args.memory), pids=_positive(int, "--pids")(args.pids),
        timeout=_positive(float, "--timeout")(args.timeout) if args.timeout else None,
        grace=float(_positive(float, "--grace")(args.grace)),
        rootfs=args.rootfs, network=args.network, env=_env(args.env), workdir=args.workdir or "/workspace",
        user=args.user or "sandbox", keep=args.keep)
    if args.image:
        # resolved here (a digest the agent can check); its layers are unpacked where the sandbox runs
        from agent.sandbox import images
        from agent.commands.image import store
        try:
            img = store().resolve(args.image)
        except ReportedError as e:
            raise DsecError(e.message, EXIT_DSEC)
        spec.image = img.record()
        spec.image_ref = img
        spec.image_args = {"argv": list(args.cmd), "user": args.user, "workdir": args.workdir,
                           "env": _env(args.env), "entrypoint": _entrypoint(args.entrypoint)}
        spec.argv = images.command(img, args.cmd, spec.image_args["entrypoint"])
        if not spec.argv:
            raise DsecError(f"no command given, and image {img.asked} has no Entrypoint or Cmd", EXIT_DSEC)
    return spec


def _entrypoint(text):
    if text is None:
        return None
    import shlex
    try:
        return shlex.split(text)
    except ValueError as e:
        raise DsecError(f"--entrypoint {text!r}: {e}", EXIT_DSEC)


def prepare_image(spec):
    """Unpack and lease the image's layers for spec.sandbox_id and apply its config
    (agent/sandbox/images/runtime.py: dsec's secure defaults win)."""
    from agent.sandbox import images
    from agent.commands.image import store
    try:
        images.prepare_spec(store(), spec, spec.image_ref, **spec.image_args)
    except ReportedError as e:
        raise DsecError(e.message, EXIT_DSEC)


def run(args) -> int:
    if args.summary_json:
        d = os.path.dirname(os.path.abspath(args.summary_json))
        if not os.path.isdir(d):
            raise DsecError(f"--summary-json {args.summary_json}: directory {d} does not exist", EXIT_DSEC)
    # the node agent does the work when one is running or `dsec run` starts one (docs/agent.md);
    # else in-process. Without --image the request is checked here with light imports only.
    from agent.node import via_agent
    result = None
    if via_agent.mode() != "off" and not args.image:
        spec = AgentSpec(args)
        result = via_agent.run(spec, args)
    if result is None:
        result, spec = _run_local(args)
    return _report(result, spec, args)


def _run_local(args):
    """`dsec run` in this process (no agent), or an image run (resolved here first)."""
    from agent.sandbox.launcher import launch, new_sandbox_id
    from agent.sandbox.sysutil import raise_nofile
    raise_nofile()          # the sandbox itself keeps the limit dsec was started with
    spec = spec_from_args(args)
    if args.audit == "off":
        from policies.compile import ebpf_concerns
        concerns = ebpf_concerns(spec.policy)
        if concerns:
            # fail closed: these rules live in eBPF, loaded with the recorder
            raise DsecError(f"policy {spec.policy.name} has {'/'.join(concerns)} rules, enforced by eBPF: "
                            f"--audit off would leave them unenforced (use --audit on)", EXIT_DSEC)
    from agent.node import via_agent
    result = via_agent.run(spec, args) if args.image else None
    if result is None:
        from agent.sandbox import volumes
        try:
            spec.volumes = volumes.parse(args.volume, volumes.default_roots())
        except ReportedError as e:
            raise DsecError(e.message, EXIT_DSEC)
        if not spec.sandbox_id:
            spec.sandbox_id = new_sandbox_id()
            sys.stderr.write(f"dsec: sandbox {spec.sandbox_id}\n")
            sys.stderr.flush()
        if spec.image is not None:
            prepare_image(spec)
        if args.audit == "on":
            from agent.sensors.inprocess import run_audited
            result = run_audited(spec, over_budget=args.over_budget)
        else:
            result = launch(spec)
    return result, spec


def _report(result, spec, args) -> int:
    s = result.summary
    if s.get("error") and result.exit_code == EXIT_DSEC:
        sys.stderr.write(f"dsec run: error: {s['error']}\n")
    elif s.get("exit_code") in (126, 127) and s.get("error"):
        sys.stderr.write(f"dsec run: {spec.argv[0]}: {s['error'].split(': ', 1)[-1]}\n")
    if s.get("timed_out"):
        sys.stderr.write(f"dsec run: sandbox {s['sandbox_id']} timed out after {spec.timeout:g}s\n")
    if s.get("oom_killed"):
        sys.stderr.write(f"dsec run: sandbox {s['sandbox_id']}: out of memory, killed\n")
    audit = s.get("audit") or {}
    if audit.get("lost"):
        sys.stderr.write(f"dsec run: sandbox {s['sandbox_id']}: {audit['lost']} audit events were LOST "
                         f"(the record has holes; see events_lost in `dsec replay`)\n")
    if audit.get("pending"):
        sys.stderr.write(f"dsec run: {audit['pending']} audit events wait in the spool "
                         f"({audit.get('export_error') or 'not yet exported'}); the next export delivers them\n")
    if s.get("kept_upper"):
        sys.stderr.write(f"dsec run: upper layer kept at {s['kept_upper']}\n")
    if args.summary_json:
        import json
        with open(args.summary_json, "w") as f:
            json.dump(s, f, indent=2)
            f.write("\n")
    return result.exit_code


# ---------------------------------------------------------------- the fast path (agent/entry.py)
# `dsec run [OPTIONS] -- CMD...` through a running agent without argparse, re, json, socket,
# signal or threading (their imports were ~60% of the CLI's time before it connects, measured
# with -X importtime). Only the plain form is taken: each option spelled in full, `--opt VALUE`
# or `--opt=VALUE` with a value not starting with '-', then `--` and CMD. Anything else (--help,
# abbreviations, a bad value, no agent answering, --image) goes the ordinary way (agent/cli.py)
# from the start, so its parsing, checks and messages stay those of argparse and run():
# nothing has been sent when the fast path declines. tests/test_run_fast.py holds _OPTIONS
# equal to register()'s arguments.

_OPTIONS = {      # option -> (dest, kind): value | append | flag | a tuple of choices; default
    "--sandbox-id": ("sandbox_id", "value", None), "--cpus": ("cpus", "value", None),
    "--memory": ("memory", "value", "1G"), "--pids": ("pids", "value", "1024"),
    "--timeout": ("timeout", "value", None), "--grace": ("grace", "value", "3"),
    "--rootfs": ("rootfs", "value", None), "--volume": ("volume", "append", None),
    "--network": ("network", "value", "none"), "--env": ("env", "append", None),
    "--workdir": ("workdir", "value", None), "--user": ("user", "value", None),
    "--keep": ("keep", "flag", False), "--summary-json": ("summary_json", "value", None),
    "--policy": ("policy", "value", "default"), "--mode": ("mode", ("learn", "audit", "enforce"), None),
    "--audit": ("audit", ("on", "off"), "on"), "--over-budget": ("over_budget", ("summarise", "stop"), "summarise"),
    "--wait-export": ("wait_export", "flag", False),
}
_SLOW_OPTIONS = ("--image", "--entrypoint")       # resolved in this process: the ordinary way


class FastArgs:
    """What argparse would give for the plain form (register()'s dests and defaults)."""

    def __init__(self):
        for dest, kind, default in _OPTIONS.values():
            setattr(self, dest, [] if kind == "append" else default)
        self.image = self.entrypoint = None
        self.cmd = []
        self.command = "run"


def fast_args(argv: list[str]) -> FastArgs | None:
    """argv after `run` in the plain form, parsed; None when it is not in that form."""
    a = FastArgs()
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            a.cmd = argv[i:]            # as argparse's REMAINDER keeps it: _check_args drops the "--"
            return a if len(a.cmd) > 1 else None
        name, eq, value = tok.partition("=")
        opt = _OPTIONS.get(name)
        if opt is None:
            return None                 # a positional first, --help, an abbreviation, --image ...
        dest, kind, _ = opt
        if kind == "flag":
            if eq:
                return None
            setattr(a, dest, True)
            i += 1
            continue
        if not eq:
            i += 1
            if i >= len(argv):
                return None
            value = argv[i]
        if value.startswith("-") or (isinstance(kind, tuple) and value not in kind):
            return None
        if kind == "append":
            getattr(a, dest).append(value)
        else:
            setattr(a, dest, value)
        i += 1
    return None                         # no "--": argparse decides where CMD begins


def fast(argv: list[str]) -> int | None:
    """`dsec run` through the agent's run socket for the plain form; its exit status, or None
    (nothing sent: the caller runs the ordinary CLI)."""
    from agent.node import via_agent
    args = fast_args(argv)
    if args is None:
        return None
    try:
        if via_agent.mode() == "off":
            return None
        path = via_agent.agent_socket()
        if path is None:
            return None
        if args.summary_json and not os.path.isdir(os.path.dirname(os.path.abspath(args.summary_json))):
            return None
        spec = AgentSpec(args)
        create, wait_export = via_agent.request(spec, args)
    except ReportedError:
        return None                     # the ordinary way says it, in its words

    def go():
        result = via_agent.run_socket(path, spec, create, wait_export)
        return None if result is None else _report(result, spec, args)
    from agent.errors import guarded
    return guarded("run", USAGE_EXIT, go)
