"""The OTLP mapping of an audit record (exporters/otel.py's module doc has
it in words): the attribute table, which defaults are kept, the UTF-8 rule
for byte strings, severities and the deterministic trace/span ids. One
module that both encoders use: the record path (exporters/otel.py) and the
column path (exporters/otlp_columns.py)."""
from __future__ import annotations

import hashlib

from audit_schema.events import BY_NAME

# --- the attribute mapping: ONE table, field -> where it goes ------------------------
#
#   ("attr", NAME)               a log record attribute
#   ("attr", {KIND: NAME, ...})  by kind ("*" = any other kind)
#   ("resource", NAME)           a resource attribute (records grouped per resource)
#   ("record", FIELD)            a field of the OTLP LogRecord itself
# Names outside dsec.* are OTel semantic-convention attributes (checked against
# the installed opentelemetry-semantic-conventions registry by the tests).

_EXEC_KINDS = ("exec", "exec_denied", "exec_violation")

ATTRIBUTES: dict[str, tuple] = {
    "event_id": ("attr", "log.record.uid"),
    "ts_ns": ("record", "time_unix_nano"),
    "node": ("resource", "host.name"),
    "sandbox_id": ("resource", "container.id"),          # + dsec.sandbox.id (same value)
    "step": ("attr", "dsec.step"),
    "kind": ("record", "event_name"),                     # "dsec.<kind>" + attribute dsec.kind
    "pid": ("attr", "process.pid"),
    "ppid": ("attr", "process.parent_pid"),
    "uid": ("attr", "process.real_user.id"),
    "comm": ("attr", "dsec.comm"),                        # task comm != process.executable.name (basename of exe)
    "policy_name": ("attr", "security_rule.ruleset.name"),
    "policy_hash": ("attr", "dsec.policy.hash"),
    "mode": ("attr", "dsec.policy.mode"),
    "decision": ("attr", "dsec.decision"),
    "path": ("attr", {**{k: "process.executable.path" for k in _EXEC_KINDS}, "*": "file.path"}),
    "path_raw": ("attr", "dsec.path_raw"),
    "path2": ("attr", "dsec.path2"),                      # rename target
    "argv": ("attr", "process.command_args"),
    "argv_truncated": ("attr", "dsec.argv_truncated"),
    "flags": ("attr", "dsec.flags"),
    "ret": ("attr", "dsec.ret"),
    "family": ("attr", "network.type"),                   # ipv4 | ipv6; unix -> network.transport = unix
    "addr": ("attr", "network.peer.address"),
    "port": ("attr", "network.peer.port"),
    "child_pid": ("attr", "dsec.child_pid"),
    "exit_code": ("attr", "process.exit.code"),
    "signal": ("attr", "dsec.signal"),
    "sha256": ("attr", "dsec.sha256"),
    "build_id": ("attr", "process.executable.build_id.gnu"),
    "interp": ("attr", "dsec.interp"),
    "is_static": ("attr", "dsec.is_static"),
    "shebang": ("attr", "dsec.shebang"),
    "count": ("attr", "dsec.count"),
    "extra": ("attr", "dsec.extra"),                      # the kind's JSON object, as a string
    "syscall": ("attr", "dsec.syscall"),
    "protocol": ("attr", "network.transport"),            # tcp | udp | ...
    "image_digest": ("attr", "oci.manifest.digest"),      # the sandbox's image (semconv oci.*)
    "dirfd": ("attr", "dsec.dirfd"),                      # AT_FDCWD or the fd a relative name was given with
    "path_resolution": ("attr", "dsec.path_resolution"),  # exact | best_effort | unresolved
}

# fields whose 0 / "" means something for these kinds (else defaults are left out)
_ZERO_MEANS = {
    "exit": ("exit_code", "signal"), "sandbox_exit": ("exit_code", "signal"), "step_end": ("exit_code", "signal"),
    "connect": ("ret", "port"), "open_write": ("ret",), "unlink": ("ret",), "rename": ("ret",),
    "egress_denied": ("port",), "egress_violation": ("port",),
}
_INT64_MAX = 2 ** 63 - 1
_SEV_WARN_KINDS = ("access_denied",)
_SAMPLED = 0x01          # opentelemetry.trace.TraceFlags.SAMPLED


def attribute_name(field: str, kind: str) -> str | None:
    """The attribute a field goes to for a kind (None: not a log attribute)."""
    where, name = ATTRIBUTES[field]
    if where != "attr":
        return None
    if isinstance(name, dict):
        return name.get(kind) or name["*"]
    return name


def _utf8(v: str):
    """(text, raw bytes or None): raw only when v holds undecodable bytes."""
    if v.isascii():
        return v, None
    try:
        v.encode("utf-8")
        return v, None
    except UnicodeEncodeError:
        raw = v.encode("utf-8", "surrogateescape")
        return raw.decode("utf-8", "replace"), raw


def attr_items(field: str, ch_type: str, name: str, v) -> list:
    """The (attribute, value) pairs of one field's (non-None) value: the text,
    and its exact bytes under dsec.raw.<field> when it is not UTF-8."""
    if ch_type == "Array(String)":
        texts, raws, bad = [], [], False
        for x in v:
            t, r = _utf8(x)
            texts.append(t)
            raws.append(r if r is not None else t.encode())
            bad = bad or r is not None
        return [(name, tuple(texts)), (f"dsec.raw.{field}", tuple(raws))] if bad else [(name, tuple(texts))]
    if ch_type == "String":
        t, r = _utf8(v)
        return [(name, t), (f"dsec.raw.{field}", r)] if r is not None else [(name, t)]
    return [(name, v if v <= _INT64_MAX else str(v))]


def attributes_for(rec: dict) -> dict:
    """The log attributes of one (sparse or normalized) record."""
    kind = rec.get("kind") or ""
    keep_zero = _ZERO_MEANS.get(kind, ())
    out = {"dsec.kind": kind}
    for field, v in rec.items():
        spec = ATTRIBUTES.get(field)
        if spec is None or spec[0] != "attr" or v is None:
            continue
        if not v and field not in keep_zero:
            continue
        name = spec[1] if not isinstance(spec[1], dict) else (spec[1].get(kind) or spec[1]["*"])
        out.update(attr_items(field, BY_NAME[field].ch_type, name, v))
    if rec.get("family") == "unix":
        out.pop("network.type", None)
        out["network.transport"] = "unix"
    return out


_SEVERITIES = []         # (ERROR, WARN, INFO) as (SeverityNumber, text), imported once


def _severity(rec):
    if not _SEVERITIES:
        from opentelemetry._logs import SeverityNumber
        _SEVERITIES[:] = [(SeverityNumber.ERROR, "ERROR"), (SeverityNumber.WARN, "WARN"),
                          (SeverityNumber.INFO, "INFO")]
    kind = rec.get("kind")
    if kind == "events_lost":
        return _SEVERITIES[0]
    d = rec.get("decision")
    if (d and d != "allowed") or kind in _SEV_WARN_KINDS or (kind or "").endswith(("_denied", "_violation")):
        return _SEVERITIES[1]
    return _SEVERITIES[2]


# --- ids ---------------------------------------------------------------------------

def _h(*parts) -> bytes:
    return hashlib.sha256("\0".join(str(p) for p in parts).encode("utf-8", "surrogateescape")).digest()


def trace_id_of(node: str, sandbox_id: str) -> int:
    return int.from_bytes(_h("dsec-trace", node, sandbox_id)[:16], "big") or 1


def span_id_of(node: str, sandbox_id: str, *what) -> int:
    return int.from_bytes(_h("dsec-span", node, sandbox_id, *what)[:8], "big") or 1
