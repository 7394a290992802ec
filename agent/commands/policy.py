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

A policy is a file path or a built-in name (a NAME without '/' and without a
.yaml/.yml/.json suffix). The format is documented in policies/README.md.

Exit status: 0 ok (warnings are printed on stderr); 1 `check --strict` found
warnings; 2 bad usage or invalid input (a policy or profile that does not load).
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
        sys.stdout.write(dump_yaml(p, [f"{p.name} ({p.source}), mode {p.mode}", f"sha256:{p.hash}"]))
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


def run(args) -> int:
    return {"check": _check, "show": _show, "list": _list, "export": _export, "import": _import}[args.action](args)
