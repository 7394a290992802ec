"""Derive a policy from observed runs: live sandboxes in learn mode, or strace logs.

examples:
  dsec learn -o tool.yaml -- python3 tool.py               # one learn-mode run of CMD
  dsec learn --runs 5 --base no-network -o tool.yaml -- python3 tool.py
  dsec learn --until-stable 2 --max-runs 8 -o tool.yaml -- python3 -m pytest -q   # until 2 runs add nothing
  dsec learn --from-strace trace.log -o tool.yaml          # from `strace -f -o trace.log CMD`
  dsec learn --from-strace a.log b.log --name tool -o tool.yaml
  dsec learn --from-strace trace.log --cwd /work -o tool.yaml   # where CMD started (relative paths)

The derived policy is in audit mode: run it (`dsec run --policy tool.yaml`),
review it (`dsec policy diff OLD tool.yaml`), then promote it once the audit
window is clean (`dsec policy promote tool.yaml --to enforce`). It allows:
  syscalls  every call a run made, plus the runtime's own (execve, exit_group);
  egress    each destination connected to (address or hostname, port,
            protocol; port 53 as dns resolvers), loopback included;
  exec      the exact paths successfully executed;
  files     the written paths generalised into a few directories.
Each entry carries a comment (and metadata.annotations) saying which runs it
came from and how often; the header shows how written paths were generalised
and what was seen but not learned. `--base POLICY` unites a policy of yours
with the derived one. See docs/learning.md.

strace logs: `strace -f` output with or without -tt/-ttt/-T/-y/-yy/-s/-x, with
`-o FILE` (pid first) or stderr (`[pid N]`); `strace -ff -o PREFIX` files
(PREFIX.PID) given together form one run; every other file is one run.
Lines that cannot be parsed are counted and reported, never fatal.

Convergence: after the runs, each run's line says what it added, per rule
kind, that the runs before it had not ("nothing new" once learning has
converged). `--until-stable N` keeps running CMD until N consecutive runs add
nothing, at most --max-runs times (default 10), and says whether it got there.

Exit status: 0 written; 1 learning failed (a run could not be made); 2 bad
usage or input (missing/unreadable log, a log without system calls, bad
--base policy, invalid --name).
"""
from __future__ import annotations

import argparse
import os
import re
import sys

from agent.errors import DsecError, EXIT_USAGE

HELP = "derive a policy (audit mode) from learn-mode runs of CMD or from strace logs"
MAX_RUNS = 1000
DEFAULT_MAX_RUNS = 10


def register(p):
    p.add_argument("-o", "--output", metavar="OUT.yaml", help="where to write the policy ('-' = stdout)")
    p.add_argument("--from-strace", nargs="+", metavar="LOG", help="learn from these strace -f logs")
    p.add_argument("--runs", metavar="N", help="live form: run CMD N times (default 1)")
    p.add_argument("--until-stable", metavar="N",
                   help="live form: run CMD until N consecutive runs add nothing to the policy "
                        "(at most --max-runs runs)")
    p.add_argument("--max-runs", metavar="M", help=f"the cap of --until-stable (default {DEFAULT_MAX_RUNS})")
    p.add_argument("--base", metavar="POLICY", help="a policy (file or built-in) to unite with the derived one")
    p.add_argument("--name", metavar="NAME", help="metadata.name of the policy (default: from CMD or the log)")
    p.add_argument("--env", action="append", default=[], metavar="K=V",
                   help="live form: set an environment variable in the sandbox (repeatable)")
    p.add_argument("--cwd", metavar="DIR", help="strace form: the directory the traced command started in "
                                                 "(resolves relative paths the log cannot)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]")


def _usage(msg: str) -> DsecError:
    return DsecError(msg, EXIT_USAGE)


def _disp(s: str) -> str:
    return s.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def default_name(hint: str) -> str:
    base = os.path.basename(hint.rstrip("/")) or "learned"
    base = re.sub(r"\.(log|txt|strace|trace|out)$", "", base, flags=re.I)
    s = re.sub(r"[^a-z0-9._-]+", "-", base.lower()).strip("._-")
    s = ("learned-" + s)[:63].rstrip("._-") if s else "learned"
    return s or "learned"


def _learn_runs():
    try:
        from agent.sensors.inprocess import learn_runs
    except ImportError as e:
        raise DsecError("live learning is not available in this dsec (agent.sensors.inprocess.learn_runs is missing: "
                        f"{e}); learn from a trace instead: dsec learn --from-strace LOG -o OUT.yaml", 1) from None
    return learn_runs


def _runs_count(text, opt: str = "--runs", default: int = 1) -> int:
    if text is None:
        return default
    try:
        n = int(text)
    except ValueError:
        raise _usage(f"{opt} {text!r}: not a whole number") from None
    if not 1 <= n <= MAX_RUNS:
        raise _usage(f"{opt} {text!r}: must be between 1 and {MAX_RUNS}")
    return n


def _added_text(a: dict, limit: int = 6) -> str:
    if not a["total"]:
        return "nothing new"
    parts = []
    for kind, items in a["added"].items():
        shown = ", ".join(_disp(str(x)) for x in items[:limit]) + (f", ... (+{len(items) - limit})"
                                                                  if len(items) > limit else "")
        parts.append(f"{len(items)} {kind} ({shown})")
    return "; ".join(parts)


def _layout_check():
    """Writable entries the default root filesystem cannot hold are not learned."""
    from agent.sandbox import rootfs
    if os.geteuid() != 0 and not os.path.isdir(rootfs.BASE_ROOT):
        return None
    return rootfs.writable_conflicts


def report_convergence(runs: list[dict], out=sys.stderr) -> list[dict]:
    """Per run: what it added, per rule kind, that the runs before it had not."""
    from policies.learn import additions
    adds = additions(runs)
    for i, a in enumerate(adds):
        out.write(_disp(f"dsec learn: run {i + 1} ({a['run_id']}) added: {_added_text(a)}") + "\n")
    return adds


def _strace_runs(args) -> list[dict]:
    from policies.strace import parse_strace_files
    if args.cwd is not None and not args.cwd.startswith("/"):
        raise _usage(f"--cwd {_disp(args.cwd)!r}: must be an absolute path")
    runs = parse_strace_files(args.from_strace, cwd=args.cwd)
    for r in runs:
        st = r["stats"]
        src = r["source"].removeprefix("strace:")
        if not r["syscall_counts"]:
            first = st["bad_samples"][0] if st["bad_samples"] else None
            hint = f" (line {first[0]}: {first[1]}: {first[2]!r})" if first else " (the file is empty)"
            raise _usage(f"{src}: no system calls found: is it `strace -f` output?{hint}")
        line = (f"{src}: {st['lines']} lines, {st['syscalls']} calls, {st['records']} records"
                + (f", {len({k for k in r['syscall_counts']})} distinct calls"))
        sys.stderr.write(_disp(line) + "\n")
        if st["bad"]:
            sys.stderr.write(_disp(f"warning: {src}: {st['bad']} line(s) could not be parsed and were skipped") + "\n")
            for ln, why, text in st["bad_samples"][:5]:
                sys.stderr.write(_disp(f"  {src}:{ln}: {why}: {text}") + "\n")
        for n in st.get("notes", [])[:5]:
            sys.stderr.write(_disp(f"note: {src}: {n}") + "\n")
        if st.get("summary_counts"):
            mism = {k for k in set(st["summary_counts"]) | set(r["syscall_counts"])
                    if k != "exit_group" and st["summary_counts"].get(k, 0) != r["syscall_counts"].get(k, 0)}
            if mism:
                sys.stderr.write(_disp(f"warning: {src}: counts differ from strace's own summary for "
                                       f"{', '.join(sorted(mism)[:10])}") + "\n")
    return runs


def run(args) -> int:
    from agent.commands.policy import _write
    from policies.learn import derive_policy, provenance, render
    from policies.load import load_policy
    cmd = list(args.cmd or [])
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not args.output:
        raise _usage("-o OUT.yaml is required (use -o - for stdout)")
    if args.from_strace and cmd:
        raise _usage("give either --from-strace LOG... or -- CMD [ARGS...], not both")
    if not args.from_strace and not cmd:
        raise _usage("nothing to learn from: give -- CMD [ARGS...] or --from-strace LOG...")
    if args.from_strace and (args.runs is not None or args.until_stable is not None):
        raise _usage("--runs applies to the live form (-- CMD), and so does --until-stable; with "
                     "--from-strace every log is one run")
    if args.runs is not None and args.until_stable is not None:
        raise _usage("give --runs N or --until-stable N, not both")
    if args.max_runs is not None and args.until_stable is None:
        raise _usage("--max-runs is the cap of --until-stable")
    if args.from_strace and args.env:
        raise _usage("--env applies to the live form (-- CMD)")
    if cmd and args.cwd is not None:
        raise _usage("--cwd applies to --from-strace")
    name = args.name or default_name(args.from_strace[0] if args.from_strace else cmd[0])
    from policies import model as m
    if not m.NAME_RE.match(name):
        raise _usage(f"--name {_disp(name)!r}: use 1-63 of [a-z0-9._-], starting and ending alphanumeric")
    base = None
    if args.base:
        base = load_policy(args.base)
        for w in base.warnings:
            sys.stderr.write(_disp(f"warning: {w}") + "\n")
    if args.from_strace:
        runs = _strace_runs(args)
        how = "dsec learn --from-strace " + " ".join(args.from_strace)
    else:
        learn_runs = _learn_runs()
        kw = {}
        if args.env:
            from agent.commands.run import _env
            kw["env"] = _env(args.env)
        if args.until_stable is not None:
            stable = _runs_count(args.until_stable, "--until-stable")
            cap = _runs_count(args.max_runs, "--max-runs", max(DEFAULT_MAX_RUNS, stable + 1))
            if cap <= stable:
                raise _usage(f"--max-runs {cap} must exceed --until-stable {stable} (the first run always adds)")
            from policies.learn import additions, stable_tail
            runs = learn_runs(cmd, cap, base, until=lambda rs: stable_tail(additions(rs)) >= stable, **kw)
            how = f"dsec learn --until-stable {stable} --max-runs {cap} -- " + " ".join(cmd)
        else:
            n = _runs_count(args.runs)
            runs = learn_runs(cmd, n, base, **kw)
            how = f"dsec learn --runs {n} -- " + " ".join(cmd)
        if not isinstance(runs, list) or not runs:
            raise DsecError("learning produced no runs", 1)
        adds = report_convergence(runs)
        if args.until_stable is not None:
            from policies.learn import stable_tail
            tail = stable_tail(adds)
            if tail >= stable:
                sys.stderr.write(f"dsec learn: stable: the last {tail} run(s) added nothing "
                                 f"({len(runs)} runs in all)\n")
            else:
                sys.stderr.write(f"dsec learn: NOT stable after {len(runs)} runs (the cap): run {len(runs)} still "
                                 f"added {adds[-1]['total']} entr{'y' if adds[-1]['total'] == 1 else 'ies'}; "
                                 "the policy is written, but learn longer or review what keeps changing\n")
    policy = derive_policy(runs, base=base, name=name, layout_check=_layout_check())
    for w in policy.warnings:
        sys.stderr.write(_disp(f"warning: {w}") + "\n")
    header = [f"Derived by `{how[:300]}`" + (f" with --base {args.base}" if args.base else ""),
              f"sha256:{policy.hash}  (mode {policy.mode}; promote: dsec policy promote FILE --to enforce)"]
    text = render(policy, header)
    _write(args.output, text)
    d = policy.to_dict()["spec"]
    prov = provenance(policy) or {}
    def marked(tag):
        return [k for k, e in prov.get("syscalls", {}).items() if any(w.startswith(tag) for w in e.get("why", []))]
    runtime, timing = marked("runtime"), marked("timing")
    sysc = d["syscalls"]
    nsys = len(sysc.get("allow", [])) if sysc["default"] == "deny" else f"all but {len(sysc.get('deny', []))}"
    eg = d.get("egress") or {}
    files = (d.get("files") or {}).get("writable")
    observed = sum(len(e.get("seen") or {}) for e in prov.get("files", {}).values())
    where = "stdout" if args.output == "-" else args.output
    sys.stderr.write(_disp(
        f"wrote {where}: policy {policy.name}, mode {policy.mode}, sha256:{policy.hash[:16]}: "
        f"{nsys} syscalls ({len(runtime)} runtime, {len(timing)} timing), {len(eg.get('allow', []))} egress rules, "
        f"{len(eg.get('dns', []))} dns resolvers, "
        f"{len((d.get('exec') or {}).get('allow', [])) if d.get('exec') else 'any'} exec paths, "
        f"{len(files) if files is not None else 'default'} writable paths (from {observed} written)") + "\n")
    for note in prov.get("notes", [])[:10]:
        sys.stderr.write(_disp(f"note: {note}") + "\n")
    return 0
