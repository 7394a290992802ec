"""Replay what one sandbox did; evaluate a policy against it; re-run it.

examples:
  dsec replay sbx-1a2b3c4d5e6f                          # steps, denials, per step process tree + timeline
  dsec replay sbx-1a2b3c4d5e6f --step 2                 # one step
  dsec replay sbx-1a2b3c4d5e6f --format json > t.json   # everything, for machines
  dsec replay sbx-1a2b3c4d5e6f --format html -o incident.html   # one self-contained page
  dsec replay sbx-1a2b3c4d5e6f --against hardened.yaml  # would hardened.yaml have blocked it? (exit 1 = yes)
  dsec replay sbx-1a2b3c4d5e6f --rerun                  # re-execute the steps under the recorded policy
  dsec replay sbx-1a2b3c4d5e6f --rerun --policy hardened.yaml --format json

Reconstruct (default): the sandbox's steps (command, exit status, duration),
then for each step its process tree (fork/exec/exit, argv, binary sha256 and
ELF build-id) and a time-ordered timeline of execs, connects, file writes,
unlinks, renames and every denial or would-deny; the denials table and the
file-change manifest. Holes in the record are never hidden: lost events are
announced at the top and marked "!! LOST" where they happened.

--against POLICY (a file or a built-in name): offline what-if. Every exec,
connect and file write of the record that POLICY would deny, with its step,
process and time, and the syscalls the record shows the run used that POLICY
does not allow. Exit 0 when nothing would be denied, 1 otherwise: a CI gate
for a rollout.

--rerun: a fresh sandbox with the recorded rootfs, resources and policy
(--policy overrides it; --mode overrides its mode), the recorded steps in
order with their recorded argv, environment, workdir, timeout and stdin, then
a diff per step: exit status, and the execs, connects, writes and denials
that appeared (+) or disappeared (-). Environment values redacted at record
time stay "<redacted>" unless given with --env K=V. Goes through the node
agent when one runs, else runs in this process (as root, like dsec run).

Reads from DSEC_CLICKHOUSE_URL or dsec's private server.
exit status: 0 ok (--against: nothing would be denied; --rerun: the re-run
did the same); 1 --against: something would be denied; --rerun: the re-run
differs; or nothing recorded for that sandbox / ClickHouse failed; 2 bad
usage or policy; 125 the re-run sandbox could not be run.
"""
from __future__ import annotations

import os
import sys
import time

from agent.errors import DsecError, EXIT_USAGE, ReportedError

HELP = "replay a sandbox: steps, process tree, timeline; what-if a policy; re-run it"


def register(p):
    p.add_argument("sandbox_id", metavar="ID", help="sandbox id")
    p.add_argument("--step", type=int, metavar="N", help="only this step (reconstruct)")
    p.add_argument("--format", choices=("text", "json", "html"), default="text",
                   help="output format (default: text; html: reconstruct only)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the output here instead of stdout")
    p.add_argument("--against", metavar="POLICY", help="what-if: evaluate this policy (file or built-in) offline")
    p.add_argument("--rerun", action="store_true", help="re-execute the recorded steps in a fresh sandbox and compare")
    p.add_argument("--policy", metavar="POLICY", help="--rerun: run under this policy instead of the recorded one")
    p.add_argument("--mode", choices=("learn", "audit", "enforce"), help="--rerun: override the policy's mode")
    p.add_argument("--env", action="append", default=[], metavar="K=V",
                   help="--rerun: value for an environment variable (e.g. one redacted in the record); repeatable")
    p.add_argument("--step-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="--rerun: timeout for steps recorded without one (default 600)")
    p.add_argument("--in-process", action="store_true", help="--rerun: do not use a running node agent")
    p.add_argument("--from-step", type=int, metavar="K",
                   help="--rerun: start at step K, from the snapshot taken after step K-1 when there is one "
                        "(docs/snapshots.md)")


def _policy(ref: str, what: str):
    from policies.load import load_policy
    try:
        return load_policy(ref)
    except ReportedError as e:
        raise DsecError(f"{what} {ref}: {e.message}" if ref not in e.message else e.message, EXIT_USAGE)


def _env(items) -> dict:
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k or "\0" in item:
            raise DsecError(f"--env {item!r}: expected K=V", EXIT_USAGE)
        out[k] = v
    return out


def load(store, sandbox_id: str):
    """(trajectory, unattributed lost records in its time window) from an AuditStore."""
    from replay.queries import Search
    from replay.trajectory import reconstruct
    records = Search(store).sandbox_events(sandbox_id)
    if not records:
        raise DsecError(f"no events recorded for sandbox {sandbox_id}", 1)
    t = reconstruct(sandbox_id, records)
    unattributed = Search(store).unattributed_lost(t.t0, records[-1]["ts_ns"] + 1) if records else []
    return t, unattributed


def _emit(text: str, args):
    if args.output:
        d = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(d):
            raise DsecError(f"-o {args.output}: directory {d} does not exist", EXIT_USAGE)
        with open(args.output, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


def run(args) -> int:
    from replay.store import AuditStore
    if args.against and args.rerun:
        raise DsecError("--against and --rerun are separate questions: give one", EXIT_USAGE)
    if (args.policy or args.mode or args.env or args.in_process or args.from_step) and not args.rerun:
        raise DsecError("--policy, --mode, --env, --in-process and --from-step go with --rerun "
                        "(for a what-if use --against POLICY)", EXIT_USAGE)
    if args.format == "html" and (args.against or args.rerun):
        raise DsecError("--format html is the incident report of a recording: use text or json with "
                        "--against / --rerun", EXIT_USAGE)
    if args.format == "html" and not args.output and sys.stdout.isatty():
        raise DsecError("--format html writes a whole page: give -o FILE (or redirect stdout)", EXIT_USAGE)
    against = _policy(args.against, "--against") if args.against else None
    override = _policy(args.policy, "--policy") if args.policy else None
    env = _env(args.env)

    with AuditStore() as store:
        t, unattributed = load(store, args.sandbox_id)
        if args.step is not None and args.step not in [0] + t.step_numbers:
            raise DsecError(f"sandbox {args.sandbox_id} has no step {args.step} (steps: "
                            f"{', '.join(map(str, t.step_numbers)) or 'none'})", EXIT_USAGE)

        if against is not None:
            from replay.whatif import evaluate
            res = evaluate(t, against)
            _emit(_whatif_json(res) if args.format == "json" else _whatif_text(res, t), args)
            return 1 if res.would_deny else 0

        if args.rerun:
            return _rerun(args, store, t, override, env)

    if args.format == "json":
        from audit_schema.describe import to_json_line
        from replay.report import to_dict
        _emit(to_json_line(to_dict(t, step=args.step, unattributed_lost=unattributed)) + "\n", args)
    elif args.format == "html":
        from replay.render_html import render
        _emit(render(t, unattributed_lost=unattributed), args)
        if args.output:
            sys.stderr.write(f"dsec replay: wrote {args.output}\n")
    else:
        from replay.render_text import render
        _emit(render(t, step=args.step, unattributed_lost=unattributed), args)
    return 0


def _rerun(args, store, t, override, env) -> int:
    from replay.rerun import compare, plan_rerun, render_diff, run_via_agent
    from replay.trajectory import reconstruct
    plan = plan_rerun(t, override, mode=args.mode, env=env, step_timeout=args.step_timeout,
                      from_step=args.from_step)
    try:
        # through the node agent when one answers, else in this process
        client = None
        if not args.in_process:
            from agent.node import via_agent
            path = via_agent.agent_socket()
            client = via_agent.connect(path, "replay") if path else None
        if client is not None:
            try:
                sid, results, summary = run_via_agent(plan, client)
            finally:
                client.close()
            how = "agent"
        else:
            from agent.sensors.inprocess import rerun
            sid, results, summary = rerun(plan, url=store.url)
            how = "in-process"
    except ReportedError as e:
        raise DsecError(f"re-run of {t.sandbox_id}: {e.message}", 125 if e.code != 1 else 1)
    from replay.queries import Search
    records = Search(store).sandbox_events(sid)
    deadline = time.monotonic() + 30
    while how == "agent" and not any(r["kind"] == "sandbox_exit" for r in records) and time.monotonic() < deadline:
        time.sleep(0.5)        # the agent exports continuously: wait for the end of the record
        records = Search(store).sandbox_events(sid)
    new = reconstruct(sid, records)
    diff = compare(t, new, plan, results, how)
    if args.format == "json":
        from audit_schema.describe import to_json_line
        _emit(to_json_line(diff) + "\n", args)
    else:
        _emit(render_diff(diff), args)
    return 1 if diff["changed"] else 0


def _whatif_json(res) -> str:
    from audit_schema.describe import to_json_line
    return to_json_line(res.to_dict()) + "\n"


def _whatif_text(res, t) -> str:
    from replay.render_text import _argv, _show
    p = res.policy
    rp = res.recorded_policy
    out = [f"what-if: sandbox {res.sandbox_id} against policy {p['name']} ({p['hash'][:12]}, from {p['source']})",
           f"  recorded under: " + (f"{rp['name']} ({rp['mode']}, {rp['hash'][:12]})" if rp else "no policy"),
           "  checked: " + ", ".join(f"{v} {k}{'s' if v != 1 else ''}" for k, v in res.checked.items())]
    for n in res.notes:
        out.append(f"  note: {n}")
    out.append("")
    if not res.would_deny:
        out.append(f"nothing would be denied by {p['name']}")
        return "\n".join(out) + "\n"
    if res.items:
        out.append(f"would deny ({len(res.items)} action{'s' if len(res.items) != 1 else ''}):")
    else:
        out.append("no exec, connect or file write would be denied")
    for i in res.items:
        was = i["recorded_decision"] or "-"
        ret = ""
        if i["ret"] == -115 and i["action"] == "connect":
            ret = " (non-blocking: outcome not recorded)"
        elif i["ret"] < 0:
            ret = f" (failed: {_errname(i['ret'])})"
        out.append(f"  +{i['t_s']:9.6f}s step {i['step']} [{i['pid']}] {i['action']:<8} {_show(i['subject'], 90)}{ret}")
        out.append(f"      by {_argv(i['process'], 80)}; {i['why']}; recorded: {was}")
    if res.syscalls:
        out.append("")
        out.append(f"syscalls the run used that {p['name']} does not allow ({len(res.syscalls)}):")
        for s in res.syscalls:
            where = f"first at step {s['step']} [{s['pid']}] {_argv(s['process'], 60)}" if s["step"] is not None else \
                "from learn-mode counts"
            out.append(f"  {s['syscall']:<20} x{s['count']:<6} {where}; recorded: {s['recorded_decision']}")
    return "\n".join(out) + "\n"


def _errname(ret: int) -> str:
    import errno
    return errno.errorcode.get(-ret, str(ret))


__all__ = ["register", "run", "load"]
