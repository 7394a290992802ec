"""Promotion evidence from ClickHouse, and the promotion's own audit record.

    store = AuditStore()                                   # replay.store
    ev = collect_evidence(store, policy.hash, window_s=7 * 86400)
    # {"runs": [...], "violations": [...], "violations_total": n, "since_ns", "until_ns"}
    rec = record_promotion(store, decision)                # writes a policy_promotion event

Runs: the sandboxes whose `sandbox_start` event carries this policy hash and
mode audit and started in the window, with whether they ended (a
`sandbox_exit` is recorded) and how many events they lost (`events_lost`).
Violations: events of this policy hash in the window whose decision is
`would-deny`, grouped by sandbox, kind and what (syscall_*: the syscall name;
rename: old -> new; connect/egress_*: addr:port; exec/open_write/unlink: the
path), largest first.

The promotion record is one row of `events` with kind `policy_promotion`:
node, pid, uid and comm of the promoting process, policy_name, policy_hash
(the promoted hash), mode (the new mode), decision `allowed`, argv (the
command line), path (the policy file), path2 (where the promoted file was
written) and `extra` = {user, sudo_user, uid, from_mode, to_mode, from_hash,
to_hash, window_s, min_runs, runs, violations}. Query it like any event:

    SELECT ts, node, policy_name, visitParamExtractString(extra, 'user') AS who,
           visitParamExtractString(extra, 'from_mode') AS from_mode, mode AS to_mode
    FROM dsec.events FINAL WHERE kind = 'policy_promotion' ORDER BY ts_ns

The SQL is built by plain functions (runs_sql, violations_sql, ...) and runs
unchanged on ClickHouse 18.16 and current releases (tests/test_learn.py runs
it on both: the real 18.16 server and chdb). Only functions both know:
minIf/argMinIf/countIf/sumIf, multiIf, concat (and visitParamExtractString for
reading the promotion's compact JSON `extra`).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid

from replay.errors import ReplayError
from audit_schema.errors import ReportedError
from replay.store import AuditStore, decode_row, sql_int, sql_string
from audit_schema.migrations import EVENTS_TABLE, quote_ident

VIOLATIONS_LIMIT = 1000
RUN_COLUMNS = ("sandbox_id", "node", "started", "policy_hash", "mode", "exited", "events_lost")
VIOLATION_COLUMNS = ("sandbox_id", "kind", "what", "count", "first_ns", "last_ns")
WHAT_SQL = ("multiIf("
            "syscall != '', toString(syscall), "
            "kind = 'rename', concat(path, ' -> ', path2), "
            "toString(family) = 'ipv6', concat('[', addr, ']:', toString(port)), "
            "toString(family) = 'ipv4', concat(addr, ':', toString(port)), "
            "path != '', path, "
            "addr)")


def _hash_literal(policy_hash: str) -> str:
    if not isinstance(policy_hash, str) or len(policy_hash) != 64 or any(c not in "0123456789abcdef"
                                                                          for c in policy_hash):
        raise ReplayError(f"invalid policy hash {policy_hash!r}: expected 64 lowercase hex digits", 2)
    return sql_string(policy_hash)


def runs_sql(db: str, policy_hash: str, since_ns: int, until_ns: int) -> str:
    """Audit-mode runs of this policy hash started in [since_ns, until_ns)."""
    db = quote_ident(db)
    h = _hash_literal(policy_hash)
    starts = (f"SELECT sandbox_id FROM {db}.{EVENTS_TABLE} FINAL\n"
              f"  WHERE kind = 'sandbox_start' AND policy_hash = {h} AND mode = 'audit'\n"
              f"    AND ts_ns >= {sql_int(since_ns)} AND ts_ns < {sql_int(until_ns)} AND sandbox_id != ''")
    return ("SELECT sandbox_id,\n"
            "  any(node) AS node,\n"
            "  minIf(ts_ns, kind = 'sandbox_start') AS started,\n"
            "  toString(argMinIf(policy_hash, ts_ns, kind = 'sandbox_start')) AS policy_hash,\n"
            "  toString(argMinIf(mode, ts_ns, kind = 'sandbox_start')) AS mode,\n"
            "  countIf(kind = 'sandbox_exit') > 0 AS exited,\n"
            "  sumIf(count, kind = 'events_lost') AS events_lost\n"
            f"FROM {db}.{EVENTS_TABLE} FINAL\n"
            "WHERE kind IN ('sandbox_start', 'sandbox_exit', 'events_lost')\n"
            f"  AND sandbox_id IN ({starts})\n"
            "GROUP BY sandbox_id\n"
            "ORDER BY started, sandbox_id")


def _violations_where(db: str, policy_hash: str, since_ns: int, until_ns: int) -> str:
    return (f"FROM {quote_ident(db)}.{EVENTS_TABLE} FINAL\n"
            f"WHERE policy_hash = {_hash_literal(policy_hash)} AND decision = 'would-deny'\n"
            f"  AND ts_ns >= {sql_int(since_ns)} AND ts_ns < {sql_int(until_ns)}")


def violations_sql(db: str, policy_hash: str, since_ns: int, until_ns: int, limit: int = VIOLATIONS_LIMIT) -> str:
    """would-deny events of this policy hash, grouped by (sandbox, kind, what), largest first."""
    return (f"SELECT sandbox_id, toString(kind) AS k, {WHAT_SQL} AS what, count() AS n, "
            "min(ts_ns) AS first_ns, max(ts_ns) AS last_ns\n"
            + _violations_where(db, policy_hash, since_ns, until_ns) + "\n"
            "GROUP BY sandbox_id, k, what\n"
            "ORDER BY n DESC, sandbox_id, k, what\n"
            f"LIMIT {sql_int(limit)}")


def violations_total_sql(db: str, policy_hash: str, since_ns: int, until_ns: int) -> str:
    return "SELECT count() " + _violations_where(db, policy_hash, since_ns, until_ns)


def promotions_sql(db: str, policy_hash: str | None = None, limit: int = 100) -> str:
    """Recorded promotions (newest first), optionally of one policy hash."""
    where = "kind = 'policy_promotion'"
    if policy_hash is not None:
        where += f" AND policy_hash = {_hash_literal(policy_hash)}"
    return ("SELECT event_id, ts_ns, node, uid, toString(policy_name) AS policy_name, "
            "toString(policy_hash) AS policy_hash, toString(mode) AS mode, path, path2, extra\n"
            f"FROM {quote_ident(db)}.{EVENTS_TABLE} FINAL\n"
            f"WHERE {where}\n"
            f"ORDER BY ts_ns DESC, event_id\nLIMIT {sql_int(limit)}")


# ---------------------------------------------------------------- running them

def _query(store: AuditStore, sql: str, names) -> list[dict]:
    client = store.client()
    if not store.version:
        return []                       # no dsec schema in that database yet: nothing recorded
    try:
        rows = client.execute(sql, settings={"strings_as_bytes": True})
    except Exception as e:
        raise ReplayError(f"ClickHouse query failed: {_first_line(e)}") from None
    return [decode_row(names, r) for r in rows]


def collect_evidence(store: AuditStore, policy_hash: str, window_s: int, *, now_ns: int | None = None) -> dict:
    """The evidence policies.promote.promotion_decision needs, for one policy hash."""
    until = (time.time_ns() if now_ns is None else now_ns) + 1
    since = until - 1 - int(window_s) * 1_000_000_000
    store.client()
    runs = _query(store, runs_sql(store.db, policy_hash, since, until), RUN_COLUMNS)
    for r in runs:
        r["exited"] = bool(r["exited"])
        r["events_lost"] = int(r["events_lost"])
        r["started"] = int(r["started"])
    viols = _query(store, violations_sql(store.db, policy_hash, since, until), VIOLATION_COLUMNS)
    for v in viols:
        v["count"] = int(v["count"])
    total = 0
    if viols:
        total = int(_query(store, violations_total_sql(store.db, policy_hash, since, until), ("n",))[0]["n"])
    return {"runs": runs, "violations": viols, "violations_total": total, "since_ns": since, "until_ns": until}


def _who() -> dict:
    uid = os.getuid()
    try:
        import pwd
        user = pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        user = str(uid)
    out = {"user": user, "uid": uid}
    if os.environ.get("SUDO_USER"):
        out["sudo_user"] = os.environ["SUDO_USER"]
    return out


def promotion_record(decision, *, policy_file: str = "", output: str = "", argv=None,
                     now_ns: int | None = None) -> dict:
    """The policy_promotion event for a decision (pure apart from who/where/when)."""
    who = _who()
    extra = {**who, "from_mode": decision.from_mode, "to_mode": decision.to_mode,
             "from_hash": decision.from_hash, "to_hash": decision.to_hash,
             "window_s": decision.window_s, "min_runs": decision.min_runs,
             "runs": len(decision.runs), "run_ids": [r.get("sandbox_id") for r in decision.runs][:100],
             "violations": sum(v["count"] for v in decision.violations)}
    pol = decision.policy or decision.source
    return {
        "event_id": uuid.uuid4().hex,
        "ts_ns": time.time_ns() if now_ns is None else now_ns,
        "node": socket.gethostname(),
        "sandbox_id": "",
        "step": 0,
        "kind": "policy_promotion",
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "uid": who["uid"],
        "comm": "dsec",
        "policy_name": pol.name,
        "policy_hash": decision.to_hash,
        "mode": decision.to_mode,
        "decision": "allowed" if decision.allowed else "denied",
        "path": os.path.abspath(policy_file) if policy_file and not policy_file.startswith("builtin:") else policy_file,
        "path2": os.path.abspath(output) if output and output != "-" else output,
        "argv": list(argv if argv is not None else sys.argv),
        # compact JSON: visitParamExtract* (on every ClickHouse version) reads "key":value without spaces
        "extra": json.dumps(extra, sort_keys=True, ensure_ascii=True, separators=(",", ":")),
    }


def record_promotion(store: AuditStore, decision, **kw) -> dict:
    """Write the promotion as an event row (creating/migrating the schema if needed).
    Raises ReplayError when it cannot be written: a promotion is never left unrecorded."""
    from audit_schema.events import normalize
    from audit_schema.migrations import migrate
    from audit_schema.events import FIELD_NAMES
    from exporters.clickhouse import columns_for
    rec = normalize(promotion_record(decision, **kw))
    client = store.client()
    try:
        migrate(client, store.db)
        store.version = store.version or 1
        # in cluster mode `events` is the Distributed table: the insert returns once the shard has the row
        client.execute(f"INSERT INTO {quote_ident(store.db)}.{EVENTS_TABLE} ({', '.join(FIELD_NAMES)}) VALUES",
                       columns_for([rec]), columnar=True, types_check=False,
                       settings={"strings_as_bytes": True, "insert_distributed_sync": 1})
    except ReportedError:
        raise
    except Exception as e:
        raise ReplayError(f"cannot record the promotion in ClickHouse: {_first_line(e)}") from None
    return rec


def promotions(store: AuditStore, policy_hash: str | None = None, limit: int = 100) -> list[dict]:
    store.client()
    names = ("event_id", "ts_ns", "node", "uid", "policy_name", "policy_hash", "mode", "path", "path2", "extra")
    rows = _query(store, promotions_sql(store.db, policy_hash, limit), names)
    for r in rows:
        try:
            r["extra"] = json.loads(r["extra"]) if r["extra"] else {}
        except ValueError:
            pass
    return rows


def _first_line(e: BaseException) -> str:
    text = str(e).strip().split("Stack trace")[0]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[:2])[:300] if lines else type(e).__name__


__all__ = ["collect_evidence", "record_promotion", "promotion_record", "promotions", "runs_sql",
           "violations_sql", "violations_total_sql", "promotions_sql"]
