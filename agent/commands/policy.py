"""Check, show, list, export and import sandbox policies.

examples:
  dsec policy check tool.yaml             # OK + content hash + warnings, or every error (file:line: field: what)
  dsec policy check --strict tool.yaml    # warnings fail too (exit 1)
  dsec policy show python-tool            # the normalized policy as YAML, with its hash
  dsec policy show --mode audit tool.yaml # the same rules in another mode (same hash)
  dsec policy list                        # the built-in policies
  dsec policy export --format oci-seccomp tool.yaml -o tool.json
  dsec policy export --format k8s-seccompprofile tool.yaml -o tool-sp.yaml
  dsec policy import --from oci-seccomp /usr/share/containers/seccomp.json -o podman.yaml
  dsec policy merge learned-a.yaml learned-b.yaml -o tool.yaml   # union of what each allows
  dsec policy diff old.yaml tool.yaml                  # what changed (and why, from provenance)
  dsec policy diff --format json old.yaml tool.yaml
  dsec policy promote tool.yaml --to audit             # always allowed
  dsec policy promote tool.yaml --to enforce --window 7d --min-runs 5
  dsec policy promote python-tool --to audit -o tool-audit.yaml

A policy is a file path or a built-in name (a NAME without '/' and without a
.yaml/.yml/.json suffix). The format is documented in policies/README.md; the
learn -> review -> audit -> enforce workflow in docs/learning.md.

merge: the union (syscalls, egress rules, exec patterns, writable paths), in
the least strict mode of the inputs unless --mode; provenance is kept.
diff: per section (mode, syscalls, egress, exec, files): added/removed.
promote: rewrites only spec.mode (the content hash does not change), in place
unless -o (a built-in needs -o). To enforce it needs, from ClickHouse
(DSEC_CLICKHOUSE_URL or dsec's private server), at least --min-runs (default
5) complete audit-mode runs of this exact policy hash in the --window
(default 7d; 90m, 24h, 2w ...) and no would-deny event of that hash there;
otherwise it refuses and lists the violations (sandbox, kind, what, count).
Each promotion is recorded in ClickHouse as a `policy_promotion` event (who,
when, from/to mode and hash).

Exit status: 0 ok (warnings are printed on stderr); 1 `check --strict` found
warnings, `diff` found differences, `promote` refused (or could not reach
ClickHouse); 2 bad usage or invalid input (a policy or profile that does not
load, a bad --window or --min-runs).
Errors name the file, the line and the field; notes on export/import (what a
seccomp profile cannot carry, or what dsec cannot express exactly) go to
stderr, and into the imported YAML as comments.
"""
from __future__ import annotations

import json
import os
import sys

from agent.errors import DsecError, EXIT_USAGE

HELP = "check, show, list, export and import sandbox policies"


def register(p):
    sub = p.add_subparsers(dest="action", metavar="ACTION", parser_class=type(p))
    sub.required = True
    c = sub.add_parser("check", help="validate policies: OK + hash + warnings, or errors")
    c.add_argument("policies", nargs="+", metavar="FILE|NAME")
    c.add_argument("--strict", action="store_true", help="exit 1 when there are warnings")
    s = sub.add_parser("show", help="print a policy normalized, with its content hash")
    s.add_argument("policy", metavar="NAME|FILE")
    s.add_argument("--mode", choices=["learn", "audit", "enforce"], help="show it in another mode")
    s.add_argument("--json", action="store_true", help="JSON instead of YAML")
    sub.add_parser("list", help="list the built-in policies")
    e = sub.add_parser("export", help="write the syscall rules as an OCI seccomp profile or a SeccompProfile")
    e.add_argument("--format", required=True, choices=["oci-seccomp", "k8s-seccompprofile"])
    e.add_argument("policy", metavar="FILE|NAME")
    e.add_argument("-o", "--output", metavar="OUT", help="write here instead of stdout")
    e.add_argument("--mode", choices=["learn", "audit", "enforce"], help="export as if in this mode")
    e.add_argument("--name", help="metadata.name of the SeccompProfile (default: the policy's name)")
    e.add_argument("--namespace", help="metadata.namespace of the SeccompProfile")
    i = sub.add_parser("import", help="make a policy from an OCI/Docker seccomp profile")
    i.add_argument("--from", dest="source_format", required=True, choices=["oci-seccomp"])
    i.add_argument("profile", metavar="PROFILE.json")
    i.add_argument("-o", "--output", metavar="OUT.yaml", help="write here instead of stdout")
    i.add_argument("--name", help="policy name (default: from the file name)")
    i.add_argument("--conditional", choices=["allow", "deny"], default="allow",
                   help="calls the profile allows only for some arguments: allow them (default) or deny them")
    mg = sub.add_parser("merge", help="unite policies: what any of them allows (provenance kept)")
    mg.add_argument("policies", nargs="+", metavar="FILE|NAME")
    mg.add_argument("-o", "--output", metavar="OUT", help="write here instead of stdout")
    mg.add_argument("--name", help="metadata.name of the result (default: the first policy's)")
    mg.add_argument("--mode", choices=["learn", "audit", "enforce"],
                    help="mode of the result (default: the least strict of the inputs)")
    df = sub.add_parser("diff", help="what changed between two policies, per section")
    df.add_argument("a", metavar="A")
    df.add_argument("b", metavar="B")
    df.add_argument("--format", choices=["text", "json"], default="text")
    pr = sub.add_parser("promote", help="change a policy's mode to audit or enforce, gated on audit evidence")
    pr.add_argument("policy", metavar="FILE|NAME")
    pr.add_argument("--to", required=True, choices=["audit", "enforce"], dest="target")
    pr.add_argument("--window", default="7d", metavar="DURATION",
                    help="how far back audit evidence counts: 90m, 24h, 7d, 2w (default 7d)")
    pr.add_argument("--min-runs", default=None, metavar="N",
                    help="complete audit-mode runs of this policy needed for enforce (default 5)")
    pr.add_argument("-o", "--output", metavar="OUT", help="write the promoted policy here (default: in place; "
                                                          "'-' = stdout)")


def _write(path: str | None, text: str):
    if not path or path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise DsecError(f"cannot write {_disp(path)}: {e.strerror}", 1) from None


def _disp(s: str) -> str:
    return s.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _err(line: str):
    sys.stderr.write(_disp(line) + "\n")


def _layout_errors(p) -> list[str]:
    """files.writable entries the default root filesystem cannot make writable
    (a path under a regular file: /etc/group/x), as file:line: field: what."""
    from policies.compile import writable_paths
    from agent.sandbox import rootfs
    w = writable_paths(p) or []
    if not w or os.geteuid() != 0 and not os.path.isdir(rootfs.BASE_ROOT):
        return []
    lines = _writable_lines(p.source)
    out = []
    for _, path, why in rootfs.writable_conflicts(w):
        where = f"{p.source}:{lines[path]}" if path in lines else p.source
        out.append(f"{where}: spec.files.writable: {path!r} cannot be made writable: {why}")
    return out


def _writable_lines(source: str) -> dict:
    """path -> line number of its files.writable entry in the file (best effort)."""
    out: dict = {}
    try:
        with open(source, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                t = line.split("#", 1)[0].strip()
                if t.startswith("- "):
                    v = t[2:].strip().strip("'\"")
                    if v.startswith("/"):
                        out.setdefault(v, n)
    except OSError:
        pass
    return out


def _check(args) -> int:
    from policies.load import check, load_policy
    rc = 0
    for ref in args.policies:
        errors, warnings = check(ref)
        for w in warnings:
            _err(f"warning: {w}")
        if errors:
            for e in errors:
                _err(e)
            rc = EXIT_USAGE
            continue
        p = load_policy(ref)
        bad = _layout_errors(p)
        if bad:
            for e in bad:
                _err(e)
            rc = EXIT_USAGE
            continue
        print(_disp(f"OK {p.source} name={p.name} mode={p.mode} hash=sha256:{p.hash}"
                    + (f" ({len(warnings)} warning{'s' if len(warnings) != 1 else ''})" if warnings else "")))
        if warnings and args.strict and rc == 0:
            rc = 1
    return rc


def _load(ref: str, mode: str | None):
    from policies.load import load_policy
    p = load_policy(ref)
    for w in p.warnings:
        _err(f"warning: {w}")
    if mode and mode != p.mode:
        p = p.with_mode(mode)
    return p


def _show(args) -> int:
    from policies.load import dump_yaml
    p = _load(args.policy, args.mode)
    if args.json:
        sys.stdout.write(json.dumps(p.to_dict(), indent=2) + "\n")
    else:
        from policies.compile import implied_defaults
        sys.stdout.write(dump_yaml(p, [f"{p.name} ({p.source}), mode {p.mode}", f"sha256:{p.hash}"]
                                   + implied_defaults(p)))
    return 0


def _list(args) -> int:
    from policies.load import builtin_names, load_policy
    rows = []
    for n in builtin_names():
        p = load_policy(n)
        rows.append((n, p.mode, p.hash[:12], p.metadata.annotations.get("description", "")))
    w = max([len(r[0]) for r in rows] + [4])
    print(f"{'NAME':<{w}}  {'MODE':<7}  {'HASH':<12}  DESCRIPTION")
    for n, mode, h, d in rows:
        print(f"{n:<{w}}  {mode:<7}  {h}  {d}")
    return 0


def _export(args) -> int:
    from policies import oci
    from policies.load import to_yaml
    p = _load(args.policy, None)
    mode = args.mode or p.mode
    for n in oci.export_notes(p, args.format, mode):
        _err(f"note: {n}")
    if args.format == "oci-seccomp":
        text = json.dumps(oci.export_oci(p, mode), indent=2) + "\n"
    else:
        obj = oci.export_k8s_seccompprofile(p, mode, name=args.name, namespace=args.namespace)
        text = to_yaml(obj)
    _write(args.output, text)
    return 0


def _import(args) -> int:
    from policies import oci
    from policies.load import dump_yaml
    src = _disp(args.profile)
    profile = oci.load_oci_file(args.profile)
    policy, notes = oci.import_oci(profile, src, name=args.name, conditional=args.conditional)
    for n in notes:
        _err(f"note: {n}")
    for w in policy.warnings:
        _err(f"warning: {w}")
    header = [f"Imported by `dsec policy import --from oci-seccomp` from {src}",
              f"sha256:{policy.hash}"]
    header += [f"note: {n}" for n in notes]
    _write(args.output, dump_yaml(policy, header))
    return 0


def _merge(args) -> int:
    from policies.learn import render
    from policies.merge import merge_with_notes
    if len(args.policies) < 2:
        raise DsecError("merge needs at least two policies", EXIT_USAGE)
    pols = [_load(ref, None) for ref in args.policies]
    merged, notes = merge_with_notes(pols, name=args.name, mode=args.mode)
    for n in notes:
        _err(f"note: {n}")
    for w in merged.warnings:
        _err(f"warning: {w}")
    header = [f"Merged by `dsec policy merge {' '.join(args.policies)}`"[:400],
              f"sha256:{merged.hash}  (mode {merged.mode})"]
    _write(args.output, render(merged, header))
    _err(f"merged {len(pols)} policies into {merged.name} (mode {merged.mode}, sha256:{merged.hash[:16]})"
         + (f": wrote {args.output}" if args.output and args.output != "-" else ""))
    return 0


def _diff(args) -> int:
    from policies.diff import diff, render_json, render_text
    a = _load(args.a, None)
    b = _load(args.b, None)
    d = diff(a, b)
    sys.stdout.write(render_json(d) if args.format == "json" else _disp(render_text(d)))
    sys.stdout.flush()
    return 0 if d["empty"] else 1


def _promote(args) -> int:
    from policies.load import decode_utf8, read_bounded, resolve
    from policies.promote import DEFAULT_MIN_RUNS, parse_duration, promoted_text, promotion_decision
    window = parse_duration(args.window)
    min_runs = DEFAULT_MIN_RUNS
    if args.min_runs is not None:
        try:
            min_runs = int(args.min_runs)
        except ValueError:
            raise DsecError(f"--min-runs {args.min_runs!r}: not a whole number", EXIT_USAGE) from None
        if min_runs < 1:
            raise DsecError(f"--min-runs {args.min_runs!r}: must be at least 1", EXIT_USAGE)
    path, source = resolve(args.policy)
    builtin = source.startswith("builtin:")
    if builtin and not args.output:
        raise DsecError(f"{args.policy!r} is a built-in policy: give -o OUT for the promoted copy", EXIT_USAGE)
    original = decode_utf8(read_bounded(path, source), source)
    p = _load(args.policy, None)
    from replay.store import AuditStore
    store = AuditStore()
    try:
        evidence = None
        if args.target == "enforce":
            from replay.evidence import collect_evidence
            evidence = collect_evidence(store, p.hash, window)
        d = promotion_decision(p, args.target, evidence, min_runs=min_runs, window=window)
        if evidence and evidence.get("violations_total", 0) > sum(v["count"] for v in d.violations):
            d.notes.append(f"{evidence['violations_total']} violations in all; the {len(d.violations)} largest "
                           "groups are listed")
        if not d.allowed:
            sys.stderr.write(_disp(d.report()))
            return 1
        header = [f"Promoted by `dsec policy promote --to {args.target}`", f"sha256:{d.to_hash}"]
        text = promoted_text(None if builtin else original, d.policy, header)
        out = args.output or args.policy
        from replay.evidence import record_promotion
        rec = record_promotion(store, d, policy_file=path, output=out)
    finally:
        store.close()
    _write(out, text)
    sys.stderr.write(_disp(d.report()))
    _err(f"recorded in ClickHouse (event {rec['event_id']}, kind policy_promotion); "
         + ("wrote the policy to stdout" if out == "-" else f"wrote {out}"))
    return 0


def run(args) -> int:
    return {"check": _check, "show": _show, "list": _list, "export": _export, "import": _import,
            "merge": _merge, "diff": _diff, "promote": _promote}[args.action](args)
