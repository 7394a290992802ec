"""Search every sandbox's audit record: which sandboxes did X?

examples:
  dsec search exec --sha256 58824afa640f512e07e895c0f2d1e1fe2c3fd1456acab689b6e4c1c75cef2593
  dsec search exec --path curl                     # basename: any .../curl
  dsec search exec --path '/tmp/*'                 # glob (* and ?)
  dsec search connect --cidr 169.254.169.254/32    # cloud metadata, anyone?
  dsec search connect --cidr 10.0.0.0/8 --port 443 --since 24h
  dsec search write --under /etc                   # opened for writing, unlinked or renamed under /etc
  dsec search denials --policy-hash 5bf9bb52f383 --since 2026-11-29T00:00Z --until 2026-11-30T00:00Z
  dsec search denials --policy hardened.yaml --since 7d --format json | jq -r .sandbox_id | sort -u
  dsec search image --image app:1                  # which sandboxes ran this image (name or digest)

exec       sandboxes that exec'd a binary with this sha256 (of the file, as
           recorded at exec), or a path: an absolute path matches exactly, a
           name without '/' matches any path ending in /NAME, a glob matches
           with * and ?; for a path, exec_denied / exec_violation attempts count
connect    sandboxes whose connect records (whatever the result) or egress
           denials / violations (incl. UDP sendmsg) hit an address in the CIDR
           (an IPv4 CIDR also matches IPv4-mapped IPv6 addresses); --port filters
write      sandboxes that opened a path for writing, unlinked or renamed (from
           or to) a path at or under the given directory; failed attempts
           included (the `failed` column)
image      sandboxes that ran an image: a digest (sha256:..., matched on the
           image_digest column), or NAME[:TAG] (resolved to its digest through this
           node's image store; a name the store does not know matches the name the
           sandbox_start records give)
denials    every denied / would-deny record stamped with a policy's content
           hash (or a prefix of at least 8 hex digits; --policy FILE|NAME
           computes it), time-ordered, one row per event, with totals by kind;
           policy denials first, then forbidden actions that failed on their
           own (decision `failed`: ENOENT ... -- the kernel refused them anyway).
           Identical repeats are one record plus a summary: "(+N identical)"

One row per sandbox (exec, connect, write): first and last time, events,
steps, a sample of paths / destinations, decisions. --since / --until take
2026-11-29T22:00:00Z, '2026-11-29 22:00' (UTC), 2026-11-29, 24h, 7d (ago) or
epoch seconds; they prune ClickHouse's monthly partitions. Answers come from
ClickHouse (DSEC_CLICKHOUSE_URL or dsec's private server); each event
counts once even if it was delivered twice. Use `dsec replay ID` on a hit.

exit status: 0 something found; 1 nothing found, or ClickHouse failed; 2 bad usage.
"""
from __future__ import annotations

import sys
import time

from agent.errors import DsecError, EXIT_USAGE

HELP = "which sandboxes exec'd X, connected to a CIDR, wrote under a path; a policy's denials"


def register(p):
    p.add_argument("question", choices=("exec", "connect", "write", "image", "denials"), help="what to search for")
    p.add_argument("--image", metavar="NAME[:TAG]|DIGEST", help="image: the image's name or manifest digest")
    p.add_argument("--sha256", metavar="HEX", help="exec: the binary's sha256")
    p.add_argument("--path", metavar="PATTERN", help="exec: absolute path, basename, or glob (* ?)")
    p.add_argument("--cidr", metavar="CIDR", help="connect: an IPv4/IPv6 network (a bare address is /32 or /128)")
    p.add_argument("--port", type=int, metavar="N", help="connect: only this destination port")
    p.add_argument("--under", metavar="DIR", help="write: this path or anything below it")
    p.add_argument("--policy-hash", metavar="HEX", help="denials: the policy's content hash (or >= 8-digit prefix)")
    p.add_argument("--policy", metavar="FILE|NAME", help="denials: compute the hash from this policy")
    p.add_argument("--since", metavar="TIME", help="only events at or after TIME")
    p.add_argument("--until", metavar="TIME", help="only events before TIME")
    p.add_argument("--limit", type=int, default=1000, metavar="N", help="at most N rows (default 1000)")
    p.add_argument("--format", choices=("table", "json"), default="table", help="output format (default: table)")
    p.add_argument("--sql", action="store_true", help="print the SQL instead of running it (a query recipe)")


def _args_for(args) -> tuple[str, dict]:
    from replay.queries import parse_time
    window = {"since_ns": parse_time(args.since, "--since") if args.since else None,
              "until_ns": parse_time(args.until, "--until") if args.until else None}
    if args.limit is not None and args.limit <= 0:
        raise DsecError("--limit must be positive", EXIT_USAGE)

    def only(allowed):
        for name in ("sha256", "path", "cidr", "port", "under", "policy_hash", "policy", "image"):
            if getattr(args, name) is not None and name not in allowed:
                raise DsecError(f"--{name.replace('_', '-')} does not go with `dsec search {args.question}`", EXIT_USAGE)

    if args.question == "exec":
        only(("sha256", "path"))
        if bool(args.sha256) == bool(args.path):
            raise DsecError("dsec search exec: give exactly one of --sha256 or --path", EXIT_USAGE)
        return "execs", {"sha256": args.sha256, "path": args.path, "limit": args.limit, **window}
    if args.question == "connect":
        only(("cidr", "port"))
        if not args.cidr:
            raise DsecError("dsec search connect: give --cidr", EXIT_USAGE)
        return "connects", {"cidr": args.cidr, "port": args.port, "limit": args.limit, **window}
    if args.question == "write":
        only(("under",))
        if not args.under:
            raise DsecError("dsec search write: give --under DIR", EXIT_USAGE)
        return "writes", {"under": args.under, "limit": args.limit, **window}
    if args.question == "image":
        only(("image",))
        if not args.image:
            raise DsecError("dsec search image: give --image NAME[:TAG] or a digest", EXIT_USAGE)
        return "images", {**_image_key(args.image), "limit": args.limit, **window}
    only(("policy_hash", "policy"))
    if bool(args.policy_hash) == bool(args.policy):
        raise DsecError("dsec search denials: give exactly one of --policy-hash or --policy", EXIT_USAGE)
    h = args.policy_hash
    if args.policy:
        from policies.load import load_policy
        h = load_policy(args.policy).hash
    return "denials", {"policy_hash": h, "limit": args.limit, **window}


def _image_key(text: str) -> dict:
    """A digest as given; a name through this node's image store when it knows it."""
    import re
    t = text.strip()
    if t.startswith("sha256:") or re.fullmatch(r"[0-9a-f]{64}", t):
        return {"digest": t}
    try:
        from agent.sandbox import images
        return {"digest": images.open_store().resolve(t).digest}
    except Exception:  # noqa: BLE001 - no store here, or it does not know the name: match the recorded name
        try:
            from agent.sandbox.images import parse_name
            return {"name": parse_name("@" not in t and t or t.split("@")[0], "--image")}
        except Exception:  # noqa: BLE001
            return {"name": t}


def _ts(ns) -> str:
    if not ns:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ns / 1e9)) + f".{int(ns % 1_000_000_000) // 1000:06d}"


def _denial_line(r: dict, printable) -> str:
    subj = r["path"] or (f"{r['addr']}:{r['port']}" if r["addr"] else r["syscall"])
    if r["kind"] == "rename":
        subj += f" -> {r['path2']}"
    more = ""
    if r["decision"] == "failed" and r.get("ret"):
        import errno
        more += f" ({errno.errorcode.get(-int(r['ret']), r['ret'])})"
    if r.get("count") and not r["kind"].startswith("syscall_"):
        more += f" (+{r['count']} identical)"
    return (f"{_ts(r['ts_ns']):26} {printable(r['sandbox_id'])[:20]:20} {r['step']:>4} {r['kind']:17} "
            f"{r['pid']:>7} {r['decision']:10} {printable(subj)}{more}")


def run(args) -> int:
    from audit_schema.describe import printable, to_json_line
    from replay.store import AuditStore
    from replay.queries import Search
    question, kw = _args_for(args)
    with AuditStore() as store:
        s = Search(store)
        if args.sql:
            sys.stdout.write(s.sql(question, **dict(kw))[0] + ";\n")
            return 0
        t0 = time.monotonic()
        rows = s.run(question, **dict(kw))
        totals = s.run("denial_totals", **dict(kw)) if question == "denials" else []
        took = time.monotonic() - t0
    if args.format == "json":
        for r in rows:
            sys.stdout.write(to_json_line(r) + "\n")
        return 0 if rows else 1
    if question == "denials":
        print(f"{'TIME (UTC)':26} {'SANDBOX':20} {'STEP':>4} {'KIND':17} {'PID':>7} {'DECISION':10} SUBJECT")
        policy_rows = [r for r in rows if r["decision"] != "failed"]
        failed = [r for r in rows if r["decision"] == "failed"]
        for r in policy_rows:
            print(_denial_line(r, printable))
        if failed:
            print(f"-- {len(failed)} record(s) of forbidden actions that failed on their own (the kernel refused "
                  "them: ENOENT ...), not policy denials:")
            for r in failed:
                print(_denial_line(r, printable))
        if totals:
            print("totals: " + ", ".join(f"{t['kind']} {t['decision']} {t['events']} in {t['sandboxes']} sandbox(es)"
                                         for t in totals))
    else:
        detail = {"execs": "paths", "connects": "destinations", "writes": "paths", "images": "images"}[question]
        print(f"{'SANDBOX':24} {'NODE':12} {'FIRST (UTC)':26} {'EVENTS':>6} {'STEPS':10} {'DECISIONS':18} {detail.upper()}")
        for r in rows:
            steps = ",".join(map(str, r["steps"]))[:10]
            extra = ""
            if question == "connects":
                extra = f"  (connected {r['connected']}, failed {r['failed']})"
            elif question == "writes" and r["failed"]:
                extra = f"  ({r['failed']} failed)"
            print(f"{printable(r['sandbox_id'])[:24]:24} {printable(r['node'])[:12]:12} {_ts(r['first_ns']):26} "
                  f"{r['events']:>6} {steps:10} {','.join(r['decisions'])[:18]:18} "
                  f"{printable(' '.join(r[detail]))[:100]}{extra}")
    sys.stderr.write(f"dsec search: {len(rows)} row(s) in {took * 1000:.0f} ms"
                     + (f" (limit {args.limit} reached)" if len(rows) >= args.limit else "") + "\n")
    return 0 if rows else 1
