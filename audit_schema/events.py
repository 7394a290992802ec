"""The one audit event schema.

Every output is derived from FIELDS: the ClickHouse columns (migrations),
the JSON lines of `dsec events --format json`, and (later) the OTel attributes.
This module is a leaf: it imports nothing of dsec's.

Records are plain dicts keyed by field name. Byte-string fields (paths, argv,
comm ...) hold `str` values decoded with the "surrogateescape" error handler
(PEP 383): valid UTF-8 reads as text, every other byte 0xHH becomes the lone
surrogate U+DCHH. The mapping is lossless: `os.fsencode(value)` gives back the
exact bytes. ClickHouse stores the exact bytes (String is a byte string);
JSON carries the surrogates as "\\udcHH" escapes.
"""
from __future__ import annotations

from dataclasses import dataclass

# kinds of audit events
KINDS = (
    "exec",            # a process exec'd a binary (path, argv, ELF enrichment)
    "fork",            # a process forked (pid = parent, child_pid = child)
    "exit",            # a process exited (exit_code or signal)
    "connect",         # connect(2): family, addr, port, ret
    "open_write",      # open/openat/openat2/creat with a write-ish flag
    "unlink",          # unlink/unlinkat/rmdir
    "rename",          # rename/renameat/renameat2 (path -> path2)
    "events_lost",     # a gap in the record: count events were not recorded
    "sandbox_start",   # the launcher started a sandbox
    "sandbox_exit",    # the sandbox ended (exit_code/signal, summary in extra)
    "file_changes",    # a page of the sandbox's change manifest: count, extra = {page, pages, changes}
    # policy enforcement (bpf/enforce.c): *_denied = blocked (enforce mode, decision
    # "denied"); *_violation = would have been blocked (audit mode, "would-deny")
    "egress_denied",   # connect/sendmsg refused with EPERM: family, addr, port, protocol
    "egress_violation",
    "exec_denied",     # exec'd binary killed (SIGKILL) before running: path
    "exec_violation",
    "syscall_denied",  # a call outside the allowlist (seccomp refused it): syscall, count, ret
    "syscall_violation",
    "policy_promotion",  # `dsec policy promote` changed a policy's mode: who/when/from/to in extra
    # the node agent (agent/node/daemon.py)
    "lifecycle",       # a sandbox (or agent) state transition: extra = {"state": queued|admitted|started|...}
    "access_denied",   # the agent refused a caller (TCP client outside the allowlist): peer in addr, extra
    # steps of a sandbox's trajectory (what replay --rerun re-executes)
    "step_start",      # argv, extra = {env (secrets redacted), workdir, timeout, stdin_b64 (bounded)}
    "step_end",        # exit_code / signal, extra = {timed_out, wall_ms, cpu_ms, error}
)


@dataclass(frozen=True)
class Field:
    name: str
    ch_type: str          # ClickHouse type (18.16-compatible spelling)
    doc: str
    bytes_like: bool = False   # surrogateescape-decoded byte string
    low_card: bool = False     # LowCardinality where the server supports it


FIELDS: tuple[Field, ...] = (
    Field("event_id", "String", "unique id, stable across retries (hex)"),
    Field("ts_ns", "UInt64", "wall-clock time, ns since the epoch"),
    Field("node", "String", "node (host) name", low_card=True),
    Field("sandbox_id", "String", "sandbox id"),
    Field("step", "UInt32", "step of the sandbox's trajectory (0 = launch)"),
    Field("kind", "String", "event kind, one of KINDS", low_card=True),
    Field("pid", "UInt32", "process id (host pid namespace)"),
    Field("ppid", "UInt32", "parent process id (host pid namespace)"),
    Field("uid", "UInt32", "real uid"),
    Field("comm", "String", "task comm (16 bytes max)", bytes_like=True),
    Field("policy_name", "String", "policy in force", low_card=True),
    Field("policy_hash", "String", "content hash of the policy", low_card=True),
    Field("mode", "String", "learn | audit | enforce", low_card=True),
    Field("decision", "String", "allowed | denied | would-deny", low_card=True),
    # kind-specific
    Field("path", "String", "exec binary / file path (resolved where possible: see path_resolution)",
          bytes_like=True),
    Field("path_raw", "String", "the path exactly as the process passed it", bytes_like=True),
    Field("path2", "String", "rename target", bytes_like=True),
    Field("argv", "Array(String)", "exec argv", bytes_like=True),
    Field("argv_truncated", "UInt8", "1 when argv exceeded the documented bound"),
    Field("flags", "UInt32", "open flags / rename flags"),
    Field("ret", "Int64", "syscall result (negative errno on failure)"),
    Field("family", "String", "ipv4 | ipv6 | unix | other", low_card=True),
    Field("addr", "String", "peer address (IPv4/IPv6 text or unix path)", bytes_like=True),
    Field("port", "UInt16", "peer port"),
    Field("child_pid", "UInt32", "fork: the child's pid"),
    Field("exit_code", "Int32", "exit: exit status (-1 when killed by a signal)"),
    Field("signal", "UInt8", "exit: terminating signal, 0 if none"),
    Field("sha256", "String", "exec: sha256 of the binary (hex)"),
    Field("build_id", "String", "exec: ELF build-id (hex)"),
    Field("interp", "String", "exec: ELF PT_INTERP", bytes_like=True),
    Field("is_static", "UInt8", "exec: 1 for a static ELF"),
    Field("shebang", "String", "exec: a script's #! line", bytes_like=True),
    Field("count", "UInt64", "events_lost: how many events are missing; syscall_* and summaries of repeats "
          "(extra.aggregated: identical denials, or allowed records counted in the kernel): occurrences since "
          "the last record"),
    Field("extra", "String", "JSON object with anything else (kind-specific)"),
    # added by schema migration 2 (enforcement); new fields go last, so a table
    # created fresh and one migrated have the same column order
    Field("syscall", "String", "syscall_denied/_violation: the x86_64 syscall name", low_card=True),
    Field("protocol", "String", "egress_*: tcp | udp | icmp | ... of the socket", low_card=True),
    # added by schema migration 3 (images)
    Field("image_digest", "String", "manifest digest of the sandbox's OCI image ('' = no image)", low_card=True),
    # added by schema migration 4 (what the kernel was given for a path, and how `path` was obtained)
    Field("dirfd", "String", "exec/file kinds: the dirfd the name was relative to, as given: 'AT_FDCWD' or "
          "the fd number ('' = no path)", low_card=True),
    Field("path_resolution", "String", "how `path` was obtained: exact (the name given was absolute) | "
          "best_effort (a relative name joined after the fact with the cwd/dirfd /proc showed then: it may "
          "have changed since) | verified (a relative exec joined to the cwd the agent verified at the "
          "process's chdir, from the kernel's record: what the exec check matches) | unresolved (the base "
          "was gone: `path` is the name as given) | '' (no path)",
          low_card=True),
)

FIELD_NAMES = tuple(f.name for f in FIELDS)
BY_NAME = {f.name: f for f in FIELDS}

_DEFAULTS = {"String": "", "Array(String)": ()}


def default(field: Field):
    return _DEFAULTS.get(field.ch_type, 0)


_FIELD_DEFAULTS = tuple((f.name, default(f)) for f in FIELDS)


def normalize(record: dict, check: bool = True) -> dict:
    """Return a record with every schema field present (defaults filled in), in
    FIELDS order. check=False skips the unknown-field check (the sinks read
    records the spool validated when it took them)."""
    if check and not record.keys() <= BY_NAME.keys():
        bad = next(k for k in record if k not in BY_NAME)
        raise KeyError(f"unknown audit field {bad!r}")
    g = record.get
    return {n: (v if (v := g(n)) is not None else d) for n, d in _FIELD_DEFAULTS}


def to_bytes(value: str) -> bytes:
    """Exact bytes of a byte-string field (inverse of from_bytes)."""
    return value.encode("utf-8", "surrogateescape")


def from_bytes(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")
