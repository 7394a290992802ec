"""The node agent's configuration: a YAML file validated with pydantic, then
environment overrides.

Why this file is long: it is the one schema of the agent's config file, a
section per subsystem, each field with its bounds and description.

    cfg = load_config("/etc/dsec/agent.yaml")    # None: defaults + environment only
    cfg.socket, cfg.capacity.cpu_oversubscription, cfg.warm_pool[0].count ...

Every field has a default: an empty file (or none) is a valid configuration.
Errors name the file, the line and the field (`agent.yaml:7: capacity.cpus:
must be > 0`) and raise ConfigError (a DsecError, exit 2).

Environment overrides (applied after the file, before validation):

    DSEC_AGENT_SOCKET=/run/dsec/agent.sock        the unix socket (also read by clients)
    DSEC_AGENT__SECTION__FIELD=value              any field, e.g.
    DSEC_AGENT__CAPACITY__RESERVE_CPUS=1          (values are YAML scalars: 1, 2.5, true, 1G)
    DSEC_AGENT__TCP__ALLOWED_CLIENTS='[trainer-1, trainer-2]'

The full reference with an example file is docs/agent.md.
"""
from __future__ import annotations

import ipaddress
import os
import re
from typing import Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agent.errors import DsecError, EXIT_USAGE

from agent.node.client import DEFAULT_SOCKET, ENV_SOCKET  # noqa: E402 - one definition, light module
ENV_PREFIX = "DSEC_AGENT__"
MAX_CONFIG_BYTES = 1 << 20

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*$")
_MULT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_PROFILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class ConfigError(DsecError):
    def __init__(self, message: str):
        super().__init__(message, EXIT_USAGE)


def parse_size(v, what: str = "size") -> int:
    """512M, 1G, 1.5GiB, 1048576 -> bytes."""
    if isinstance(v, bool):
        raise ValueError(f"{what}: expected a size like 512M or 1G, got {v!r}")
    if isinstance(v, int):
        n = v
    elif isinstance(v, float):
        n = int(v)
    elif isinstance(v, str):
        m = _SIZE_RE.match(v)
        if not m:
            raise ValueError(f"expected a size like 512M, 1G or a number of bytes, got {v!r}")
        n = int(float(m.group(1)) * _MULT[m.group(2).lower()])
    else:
        raise ValueError(f"expected a size like 512M or 1G, got {type(v).__name__}")
    if n < 0:
        raise ValueError(f"must not be negative, got {v!r}")
    return n


Size = int   # validated by the field validators below


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class TCPConfig(_Base):
    """Optional TCP listener; always mutual TLS."""
    listen: str = Field(description="HOST:PORT, e.g. 127.0.0.1:7443 or [::1]:7443")
    cert: str = Field(description="server certificate chain (PEM)")
    key: str = Field(description="server private key (PEM)")
    client_ca: str = Field(description="CA bundle (PEM) that client certificates must chain to")
    allowed_clients: list[str] = Field(
        description="client identities (certificate CN or SAN DNS/URI) allowed to call; '*' = any "
                    "certificate signed by client_ca")

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:7443), got {v!r}")
        h = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if h not in ("localhost", "0.0.0.0", "::"):
            try:
                ipaddress.ip_address(h)
            except ValueError:
                raise ValueError(f"host {host!r} must be an IP address, [IPv6] or localhost") from None
        return v

    @field_validator("cert", "key", "client_ca")
    @classmethod
    def _file(cls, v: str) -> str:
        if not v:
            raise ValueError("a file path is required")
        return v

    @field_validator("allowed_clients")
    @classmethod
    def _allowed(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("list at least one client identity (or '*' for any certificate of client_ca)")
        return v


class CapacityConfig(_Base):
    cpus: Union[float, Literal["auto"]] = Field("auto", description="node CPUs ('auto': os.cpu_count())")
    memory: Union[int, str] = Field("auto", description="node memory ('auto': MemTotal), e.g. 64G")
    reserve_cpus: float = Field(0.0, ge=0, description="CPUs kept for the host and the agent")
    reserve_memory: Union[int, str] = Field("512M", description="memory kept for the host and the agent")
    cpu_oversubscription: float = Field(2.0, ge=1.0, le=64.0,
                                        description="CPU may be committed up to this x allocatable")
    max_pids: Optional[int] = Field(None, gt=0, description="sum of pids limits (None: unbounded)")

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, v):
        if v != "auto" and not v > 0:
            raise ValueError("must be > 0 or 'auto'")
        return v

    @field_validator("memory")
    @classmethod
    def _memory(cls, v):
        if v == "auto":
            return v
        n = parse_size(v)
        if n < 64 << 20:
            raise ValueError(f"{v!r} is less than 64M")
        return n

    @field_validator("reserve_memory")
    @classmethod
    def _reserve(cls, v):
        return parse_size(v)

    def totals(self) -> tuple[float, int]:
        cpus = float(os.cpu_count() or 1) if self.cpus == "auto" else float(self.cpus)
        if self.memory == "auto":
            mem = 0
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemTotal:"):
                        mem = int(line.split()[1]) * 1024
                        break
        else:
            mem = int(self.memory)
        return cpus, mem


class SchedulingConfig(_Base):
    aging_seconds: Optional[float] = Field(60.0, gt=0, description="waiting worth one priority class "
                                                                   "(null: strict class order)")
    preemption_grace: float = Field(5.0, ge=0, le=600, description="SIGTERM -> SIGKILL for preempted sandboxes")
    tick_seconds: float = Field(0.5, gt=0, le=10, description="how often the queue, aging and the warm pool are served")
    max_parallel_starts: int = Field(8, ge=1, le=256, description="sandbox starts/teardowns in flight")
    concurrent_peaks: int = Field(1, ge=0, le=4096, description="resource windows: the admission keeps room "
                                                                "for this many peaks at once")


class DefaultsConfig(_Base):
    cpus: float = Field(1.0, gt=0, description="CPUs accounted for a request that names none (no CPU quota then)")
    memory: Union[int, str] = Field("1G", description="memory of a request that names none")
    pids: int = Field(1024, gt=0, le=1 << 22)
    priority: Literal["reserved", "standard", "preemptible"] = "standard"
    lifetime_seconds: float = Field(3600.0, gt=0, description="a sandbox is killed after this long")
    grace_seconds: float = Field(3.0, ge=0, le=600, description="SIGTERM -> SIGKILL for timeouts and Kill")
    policy: str = Field("default", description="policy of a request that names none")

    @field_validator("memory")
    @classmethod
    def _memory(cls, v):
        n = parse_size(v)
        if n < 4 << 20:
            raise ValueError(f"{v!r} is less than 4M")
        return n


class WarmProfile(_Base):
    """N pre-started sandboxes of one shape. A CreateSandbox request takes one
    when it names no sandbox id and its resources, policy, network, rootfs,
    user, workdir, env and audit settings equal the profile's."""
    name: str
    count: int = Field(1, ge=0, le=256)
    cpus: Optional[float] = Field(None, gt=0, description="CPU quota (null: none; accounted as defaults.cpus)")
    memory: Union[int, str] = "1G"
    pids: int = Field(1024, gt=0, le=1 << 22)
    policy: str = "default"
    mode: Optional[Literal["learn", "audit", "enforce"]] = None
    network: Literal["none", "egress"] = "none"
    rootfs: Optional[str] = None
    image: Optional[str] = Field(None, description="an imported image (NAME[:TAG] or digest): the pool's "
                                                   "sandboxes run on it; its layers are unpacked at start")
    user: Optional[str] = Field(None, description="default: sandbox (uid 1000), or the image's non-root user")
    workdir: Optional[str] = Field(None, description="default: /workspace, or the image's WorkingDir")
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _PROFILE_RE.match(v):
            raise ValueError(f"{v!r}: use 1-63 of [A-Za-z0-9_.-], starting alphanumeric")
        return v

    @field_validator("memory")
    @classmethod
    def _memory(cls, v):
        n = parse_size(v)
        if n < 4 << 20:
            raise ValueError(f"{v!r} is less than 4M")
        return n

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v):
        if v is not None and not v.startswith("/"):
            raise ValueError("must be an absolute path")
        return v

    @model_validator(mode="after")
    def _image_or_rootfs(self):
        if self.image and self.rootfs:
            raise ValueError("give image or rootfs, not both")
        return self


class ImagesConfig(_Base):
    """The node's image store (docs/images.md)."""
    store: Optional[str] = Field(None, description="directory (default: DSEC_IMAGE_STORE or /var/lib/dsec/images)")
    budget: Optional[Union[int, str]] = Field(None, description="bytes of unpacked layers kept (e.g. 50G); the "
                                                                "least recently used unused ones are evicted")
    prewarm: list[str] = Field(default_factory=list, description="images whose layers are unpacked at agent start")

    @field_validator("budget")
    @classmethod
    def _budget(cls, v):
        if v is None:
            return v
        n = parse_size(v)
        if n < 16 << 20:
            raise ValueError(f"{v!r} is less than 16M")
        return n

    @field_validator("store")
    @classmethod
    def _store(cls, v):
        if v is not None and not v.startswith("/"):
            raise ValueError("must be an absolute path")
        return v


class SnapshotsConfig(_Base):
    """Automatic snapshots and the store's disk budget (docs/snapshots.md "Automatic snapshots")."""
    every_steps: int = Field(0, ge=0, le=1 << 20, description="snapshot a sandbox on an image or rootfs after "
                                                              "every k-th step (0: only on request)")
    retention: int = Field(0, ge=0, le=1 << 20, description="automatic snapshots kept per sandbox, newest first "
                                                            "(0: all); older ones are removed unless in use")
    disk_budget: Optional[Union[int, str]] = Field(None, description="bytes of files the snapshot store may hold "
                                                                     "(e.g. 20G); a snapshot past it is refused")

    @field_validator("disk_budget")
    @classmethod
    def _budget(cls, v):
        return None if v is None else parse_size(v)


class VolumesConfig(_Base):
    allowed_roots: list[str] = Field(default_factory=list, description="host directories volumes may come from "
                                                                      "(none: no volumes)")

    @field_validator("allowed_roots")
    @classmethod
    def _roots(cls, v):
        for r in v:
            if not r.startswith("/") or r.rstrip("/") == "":
                raise ValueError(f"{r!r}: an absolute directory other than /")
        return v


class LimitsConfig(_Base):
    max_message_bytes: Union[int, str] = Field("16M", description="largest gRPC message accepted or sent")
    max_sandboxes: int = Field(4096, ge=1, le=4096, description="live sandboxes (queued + running); "
                                                                "more are refused")
    history: int = Field(2000, ge=0, description="ended sandboxes kept for Get/List")
    max_stream_subscribers: int = Field(64, ge=1, le=4096)
    stream_buffer: int = Field(10000, ge=100, description="events buffered per StreamEvents subscriber")
    max_concurrent_rpcs: int = Field(512, ge=8, le=8192)
    max_lifetime_seconds: float = Field(7 * 86400.0, gt=0)

    @field_validator("max_message_bytes")
    @classmethod
    def _msg(cls, v):
        n = parse_size(v)
        if not (1 << 20) <= n <= (256 << 20):
            raise ValueError("must be between 1M and 256M")
        return n


class AuditConfig(_Base):
    required: bool = Field(True, description="refuse to start when the eBPF audit cannot load "
                                             "(false: run degraded, say so in Capabilities and the audit)")
    over_budget: Literal["summarise", "stop"] = "summarise"
    aggregate_repeats: bool = Field(True, description="the kernel counts repeats of a record the policy can only "
                                                      "allow (one record, then summaries with counts and first/last "
                                                      "times) instead of emitting each; false: one record per event "
                                                      "(docs/audit.md \"Repeats counted in the kernel\")")


class IdentityConfig(_Base):
    """What one API identity (a TCP client's certificate CN/SAN) may do."""
    tenant: Optional[str] = Field(None, description="the tenant label its sandboxes carry and that scopes what it "
                                                    "sees (default: the identity itself)")
    admin: bool = Field(False, description="everything, every tenant (like the unix socket)")
    allow: list[Literal["root", "keep", "rootfs", "no_audit", "policy_yaml", "volumes"]] = Field(
        default_factory=list, description="privileges: root (uid 0 inside), keep (upper layer kept on the node), "
                                          "rootfs (a custom rootfs under rootfs_roots), no_audit, policy_yaml "
                                          "(a policy sent inline), volumes (host directories from "
                                          "volumes.allowed_roots)")

    @field_validator("tenant")
    @classmethod
    def _tenant(cls, v):
        if v is not None and (not v or len(v) > 256 or not v.isprintable()):
            raise ValueError("1-256 printable characters")
        return v


class AuthorizationConfig(_Base):
    """Per-identity authorisation of TCP clients (the unix socket is admin)."""
    tenant_label: str = Field("tenant", description="label key naming a sandbox's tenant")
    identities: dict[str, IdentityConfig] = Field(default_factory=dict)
    default: IdentityConfig = Field(default_factory=IdentityConfig,
                                    description="an allowed client that identities does not list")

    @field_validator("tenant_label")
    @classmethod
    def _label(cls, v):
        if not v or len(v) > 128 or not v.isprintable() or " " in v:
            raise ValueError("1-128 printable characters without spaces")
        return v


class ExporterConfig(_Base):
    clickhouse: bool = Field(True, description="run the ClickHouse exporter: a supervised child process "
                                               "of the agent (DSEC_CLICKHOUSE_URL or the private server)")
    interval_seconds: float = Field(0.5, gt=0, le=60)


class HostConfig(_Base):
    """What two agents on one host must not share (docs/cluster.md). Unset fields
    keep the environment's value (DSEC_STATE_DIR, DSEC_SPOOL_DIR,
    DSEC_CGROUP_PARENT, DSEC_EGRESS_POOL) or the default."""
    node_name: Optional[str] = Field(None, description="this node's name in the audit record and Capabilities "
                                                       "(default: the hostname)")
    state_dir: Optional[str] = Field(None, description="sandbox state, base rootfs, kept upper layers "
                                                       "(DSEC_STATE_DIR, default /var/lib/dsec)")
    spool_dir: Optional[str] = Field(None, description="the durable spool (DSEC_SPOOL_DIR, default STATE_DIR/spool)")
    cgroup_parent: Optional[str] = Field(None, description="parent cgroup of this agent's sandboxes in every "
                                                           "hierarchy (DSEC_CGROUP_PARENT, default dsec)")
    egress_pool: Optional[str] = Field(None, description="IPv4 network the egress veths' /30s come from "
                                                         "(DSEC_EGRESS_POOL, default 10.213.0.0/16)")
    scratch: Literal["disk", "memory"] = Field("disk", description="where the sandboxes' writable layers live: "
                                               "disk (under STATE_DIR/sandboxes), or memory (a tmpfs the agent "
                                               "mounts there: a sandbox's writes count against its memory limit; "
                                               "agent/sandbox/scratch.py)")

    @field_validator("node_name")
    @classmethod
    def _node(cls, v):
        if v is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}", v):
            raise ValueError(f"{v!r}: 1-128 of [A-Za-z0-9_.:-], starting alphanumeric")
        return v

    @field_validator("state_dir", "spool_dir")
    @classmethod
    def _abs(cls, v):
        if v is not None and not v.startswith("/"):
            raise ValueError("must be an absolute path")
        return v

    @field_validator("cgroup_parent")
    @classmethod
    def _parent(cls, v):
        from agent.sandbox.cgroups import check_parent
        if v is not None:
            try:
                check_parent(v, "value")
            except DsecError as e:
                raise ValueError(e.message.removeprefix("value=")) from None
        return v

    @field_validator("egress_pool")
    @classmethod
    def _pool(cls, v):
        from agent.sandbox.netns import parse_pool
        if v is None:
            return v
        try:
            return str(parse_pool(v, "value"))
        except DsecError as e:
            raise ValueError(e.message.removeprefix("value=")) from None


class ClickHouseSection(_Base):
    """Where the agent's audit trail goes, and how (docs/cluster.md for cluster mode)."""
    url: Optional[str] = Field(None, description="clickhouse://user:pass@host:port/db (default: sinks.clickhouse.url, "
                                                 "DSEC_CLICKHOUSE_URL, or the private server)")
    cluster: Optional[str] = Field(None, description="a ClickHouse cluster (<remote_servers>): the events table local "
                                                     "on every shard plus a Distributed table over them")
    insert: Literal["local", "distributed"] = Field("local", description="cluster mode: insert into this server's "
                                                                         "shard, or through the Distributed table")
    ddl: Literal["auto", "on_cluster", "each_host"] = Field("auto", description="cluster mode: ON CLUSTER "
                                                            "(distributed DDL), each host directly, or find out")

    @field_validator("url")
    @classmethod
    def _url(cls, v):
        if v is not None:
            from exporters.clickhouse_server import parse_url
            from exporters.errors import ExportError
            try:
                parse_url(v, "url")
            except ExportError as e:
                raise ValueError(e.message.removeprefix("url=")) from None
        return v

    @field_validator("cluster")
    @classmethod
    def _cluster(cls, v):
        if v is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,62}", v):
            raise ValueError(f"{v!r}: a cluster name of letters, digits and '_' (as in <remote_servers>)")
        return v
# ---------------------------------------------------------------- http (issue 19: trainers)
# The SandboxFusion-compatible HTTP API (agent/node/httpapi.py, docs/trainers.md).

def _check_listen(v: str) -> str:
    host, sep, port = v.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:8080), got {v!r}")
    h = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if h not in ("localhost", "0.0.0.0", "::"):
        try:
            ipaddress.ip_address(h)
        except ValueError:
            raise ValueError(f"host {host!r} must be an IP address, [IPv6] or localhost") from None
    return v


def listen_is_loopback(listen: str) -> bool:
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class HTTPTLSConfig(_Base):
    cert: str = Field(description="server certificate chain (PEM)")
    key: str = Field(description="server private key (PEM)")
    client_ca: Optional[str] = Field(None, description="require client certificates signed by this CA "
                                                        "(mutual TLS, as the tcp listener)")


class ListenerConfig(_Base):
    """An HTTP listener of the agent and its access control (the http and metrics sections)."""
    listen: str = Field(description="HOST:PORT, e.g. 127.0.0.1:8080")
    tls: Optional[HTTPTLSConfig] = None
    tokens_file: Optional[str] = Field(None, description="'NAME TOKEN' lines: callers authenticate with "
                                                          "Authorization: Bearer TOKEN or Basic NAME:TOKEN "
                                                          "(http://NAME:TOKEN@host/run_code)")
    allowed_clients: list[str] = Field(default_factory=lambda: ["*"],
                                       description="identities allowed (certificate CN/SAN, token NAME); "
                                                   "'*' = any authenticated caller")
    unauthenticated: bool = Field(False, description="no authentication at all (loopback listen only)")
    client_timeout_seconds: float = Field(30.0, gt=0, le=3600, description="idle/slow client connections "
                                                                           "are closed after this")
    max_inflight: int = Field(64, ge=1, le=4096, description="requests served at once; more get 429 at once")

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        return _check_listen(v)

    @model_validator(mode="after")
    def _access(self):
        mtls = self.tls is not None and self.tls.client_ca
        if self.unauthenticated:
            if not listen_is_loopback(self.listen):
                raise ValueError(f"unauthenticated: only with a loopback listen address (127.0.0.1, ::1), "
                                 f"not {self.listen}")
        elif not mtls and not self.tokens_file:
            raise ValueError("an HTTP listener needs access control: tls.client_ca (mutual TLS, as tcp), "
                             "tokens_file, or (loopback only) unauthenticated: true")
        if not self.allowed_clients:
            raise ValueError("allowed_clients: list at least one identity (or '*')")
        return self


class HTTPConfig(ListenerConfig):
    """The SandboxFusion-compatible /run_code listener (off unless configured)."""
    profile: Optional[str] = Field(None, description="warm_pool profile every language runs on (default: a "
                                                     "profile 'http' is added: 2 x 1G)")
    languages: dict[str, str] = Field(default_factory=dict, description="language -> warm_pool profile")
    labels: dict[str, str] = Field(default_factory=dict, description="labels added to every request's sandbox")
    queue_timeout_seconds: float = Field(5.0, ge=0, le=600, description="how long a request waits for node "
                                                                        "capacity before 429")
    max_body_bytes: Union[int, str] = Field("64M", description="largest request body (413 above)")
    max_code_bytes: Union[int, str] = Field("1M", description="largest `code` (400 above)")
    max_files_bytes: Union[int, str] = Field("32M", description="sum of the decoded `files` and `stdin` (400 above)")
    max_files: int = Field(256, ge=0, le=65536, description="entries in `files` / `fetch_files`")
    max_output_bytes: Union[int, str] = Field("8M", description="stdout/stderr kept per stream (truncated above)")
    max_fetch_bytes: Union[int, str] = Field("32M", description="sum of the files returned by `fetch_files`")
    max_timeout_seconds: float = Field(600.0, gt=0, le=86400, description="largest compile/run timeout")
    max_memory_mb: int = Field(16384, ge=4, description="largest memory_limit_MB a request may ask for")

    @field_validator("max_body_bytes", "max_code_bytes", "max_files_bytes", "max_output_bytes", "max_fetch_bytes")
    @classmethod
    def _sizes(cls, v):
        n = parse_size(v)
        if n < 1024:
            raise ValueError(f"{v!r} is less than 1K")
        return n


# ---------------------------------------------------------------- metrics, breaker (issue 20)

class MetricsConfig(ListenerConfig):
    """The Prometheus text-format /metrics listener (off unless configured)."""
    max_sandbox_series: int = Field(200, ge=0, le=10000, description="per-sandbox CPU/memory series at most "
                                                                      "(the largest by memory)")
    max_inflight: int = Field(8, ge=1, le=256, description="scrapes served at once")


class BreakerOOM(_Base):
    kills: int = Field(3, ge=1, le=1000, description="OOM kills ...")
    window_seconds: float = Field(60.0, gt=0, le=86400, description="... within this long")
    action: Literal["freeze", "stop"] = "stop"


class BreakerCPU(_Base):
    throttled_percent: float = Field(90.0, gt=0, le=100, description="throttled in more than this share of "
                                                                     "its quota's periods ...")
    for_seconds: float = Field(60.0, gt=0, le=86400, description="... for this long")
    action: Literal["cut_quota", "freeze", "stop"] = "cut_quota"
    cut_to: float = Field(0.5, gt=0, lt=1, description="cut_quota: the new quota as a share of the old")


class BreakerConfig(_Base):
    """Per-sandbox circuit breaker (docs/agent.md "Live resources"); null disables a trigger."""
    interval_seconds: float = Field(1.0, gt=0, le=60, description="how often sandboxes are sampled")
    oom: Optional[BreakerOOM] = Field(default_factory=BreakerOOM)
    cpu: Optional[BreakerCPU] = None


class AgentConfig(_Base):
    socket: str = Field(DEFAULT_SOCKET, description="unix socket; its directory is made 0700, the socket 0600")
    state_dir: Optional[str] = Field(None, description="agent lock and pid file (default: the socket's directory)")
    tcp: Optional[TCPConfig] = None
    sinks: Optional[dict] = Field(None, description="sink name -> settings (docs/exporters.md); validated by exporters.configure")
    capacity: CapacityConfig = Field(default_factory=CapacityConfig)
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)
    defaults: DefaultsConfig = Field(default_factory=DefaultsConfig)
    warm_pool: list[WarmProfile] = Field(default_factory=list)
    images: ImagesConfig = Field(default_factory=ImagesConfig)
    volumes: VolumesConfig = Field(default_factory=VolumesConfig)
    snapshots: SnapshotsConfig = Field(default_factory=SnapshotsConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    audit: AuditConfig = Field(default_factory=AuditConfig)
    exporter: ExporterConfig = Field(default_factory=ExporterConfig)
    clickhouse: ClickHouseSection = Field(default_factory=ClickHouseSection)
    host: HostConfig = Field(default_factory=HostConfig)
    http: Optional[HTTPConfig] = Field(None, description="SandboxFusion-compatible /run_code API "
                                                         "(docs/trainers.md); off unless set")
    metrics: Optional[MetricsConfig] = Field(None, description="Prometheus /metrics listener; off unless set")
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    policy_dirs: list[str] = Field(default_factory=list,
                                   description="directories searched for policy NAME.yaml before the built-ins")
    authorization: AuthorizationConfig = Field(default_factory=AuthorizationConfig)
    rootfs_roots: list[str] = Field(default_factory=list,
                                    description="directories under which a TCP client's custom rootfs must lie "
                                                "(the unix socket may name any directory but /, /proc, /sys, "
                                                "/dev, /run and dsec's state)")
    sandbox_uids: str = Field("1879048192-1879113727",
                              description="host uids (FIRST-LAST) leased one per sandbox to its default user")
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("socket")
    @classmethod
    def _socket(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("must be an absolute path")
        if len(v.encode()) > 107:
            raise ValueError("longer than a unix socket path may be (107 bytes)")
        return v

    @model_validator(mode="after")
    def _profiles(self):
        seen = set()
        for p in self.warm_pool:
            if p.name in seen:
                raise ValueError(f"warm_pool: profile name {p.name!r} is used twice")
            seen.add(p.name)
        return self

    @model_validator(mode="after")
    def _http_profiles(self):
        """http: the profile every language runs on must be a warm_pool profile; without
        one named, a profile 'http' (2 sandboxes of 1G) is added."""
        h = self.http
        if h is None:
            return self
        names = {p.name for p in self.warm_pool}
        if h.profile is None:
            if "http" not in names:
                self.warm_pool.append(WarmProfile(name="http", count=2, memory="1G", pids=512))
            h.profile = "http"
        elif h.profile not in names:
            raise ValueError(f"http.profile: {h.profile!r} is not a warm_pool profile "
                             f"({', '.join(sorted(names)) or 'none defined'})")
        for lang, prof in h.languages.items():
            if prof not in names | {h.profile}:
                raise ValueError(f"http.languages.{lang}: {prof!r} is not a warm_pool profile")
        return self

    @property
    def run_dir(self) -> str:
        return self.state_dir or os.path.dirname(self.socket)

    @property
    def clickhouse_url(self) -> str | None:
        """clickhouse.url, else the sinks section's clickhouse url (None: the environment's)."""
        if self.clickhouse.url:
            return self.clickhouse.url
        for name, settings in (self.sinks or {}).items():
            if isinstance(settings, dict) and (settings.get("type") or name) == "clickhouse" and settings.get("url"):
                return settings["url"]
        return None


# ---------------------------------------------------------------- loading

def _format_loc(loc) -> str:
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out


def _env_overrides(data: dict, environ) -> list[str]:
    applied = []
    sock = environ.get(ENV_SOCKET)
    if sock:
        data["socket"] = sock
        applied.append(ENV_SOCKET)
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX):
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX):].split("__") if p]
        if not path:
            continue
        try:
            value = yaml.safe_load(environ[name]) if environ[name] != "" else None
        except yaml.YAMLError:
            raise ConfigError(f"{name}: not a YAML value: {environ[name]!r}") from None
        d = data
        for p in path[:-1]:
            nxt = d.get(p)
            if nxt is None:
                nxt = d[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"{name}: {'.'.join(path)}: {p} is not a section")
            d = nxt
        d[path[-1]] = value
        applied.append(name)
    return applied


def load_config(path: str | None = None, environ=None) -> AgentConfig:
    """Read, override from the environment, validate. Raises ConfigError."""
    environ = os.environ if environ is None else environ
    data: dict = {}
    lines = None
    source = path or "<defaults>"
    if path:
        from policies.load import parse_yaml
        from policies.model import PolicyError
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 (byte offset {e.start})") from None
        if text.strip():
            try:
                data, lines = parse_yaml(text, path)
            except PolicyError as e:
                msg = e.message.replace("empty policy (expected a mapping with apiVersion, kind, metadata, spec)",
                                        "empty configuration")
                raise ConfigError(msg) from None
            if lines.errors:
                ln, msg = sorted(lines.errors)[0]
                raise ConfigError(f"{path}:{ln}: {msg}")
    from_env = _env_overrides(data, environ)
    try:
        cfg = AgentConfig.model_validate(data)
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            loc = tuple(err.get("loc") or ())
            where = source
            if lines is not None:
                ln = lines.line(loc)
                if ln:
                    where = f"{path}:{ln}"
            env_hint = ""
            key = ENV_PREFIX + "__".join(str(p).upper() for p in loc if not isinstance(p, int))
            if key in from_env:
                env_hint = f" (from {key})"
            msg = err.get("msg", "invalid").removeprefix("Value error, ")
            if err.get("type") == "extra_forbidden":
                msg = "unknown field"
            msgs.append(f"{where}: {_format_loc(loc) or 'document'}: {msg}{env_hint}")
        raise ConfigError(msgs[0] + (f" (and {len(msgs) - 1} more)" if len(msgs) > 1 else "")) from None
    if cfg.tcp is not None:
        for what in ("cert", "key", "client_ca"):
            p = getattr(cfg.tcp, what)
            if not os.path.isfile(p):
                raise ConfigError(f"{source}: tcp.{what}: {p}: no such file")
    if cfg.http is not None:
        _check_http_files(cfg.http, source)
    if cfg.metrics is not None:
        _check_http_files(cfg.metrics, source, "metrics")
        if cfg.http is not None and cfg.metrics.listen == cfg.http.listen:
            raise ConfigError(f"{source}: metrics.listen: {cfg.metrics.listen} is http.listen too; give /metrics "
                              f"its own port")
    for d in cfg.policy_dirs:
        if not os.path.isdir(d):
            raise ConfigError(f"{source}: policy_dirs: {d}: no such directory")
    for d in cfg.volumes.allowed_roots:
        if not os.path.isdir(d):
            raise ConfigError(f"{source}: volumes.allowed_roots: {d}: no such directory")
    for d in cfg.rootfs_roots:
        if not d.startswith("/") or not os.path.isdir(d):
            raise ConfigError(f"{source}: rootfs_roots: {d}: not an absolute path of a directory")
    from agent.sandbox.uids import parse_range
    try:
        parse_range(cfg.sandbox_uids)
    except DsecError as e:
        raise ConfigError(f"{source}: sandbox_uids: {e.message}") from None
    return cfg


def _check_http_files(h: ListenerConfig, source: str, section: str = "http"):
    if h.tls is not None:
        for what in ("cert", "key", "client_ca"):
            p = getattr(h.tls, what)
            if p and not os.path.isfile(p):
                raise ConfigError(f"{source}: {section}.tls.{what}: {p}: no such file")
    if h.tokens_file:
        try:
            st = os.stat(h.tokens_file)
        except OSError as e:
            raise ConfigError(f"{source}: {section}.tokens_file: {h.tokens_file}: {e.strerror}") from None
        if st.st_mode & 0o077:
            raise ConfigError(f"{source}: {section}.tokens_file: {h.tokens_file}: readable by group or others "
                              f"(mode {oct(st.st_mode & 0o777)}); chmod 600 it")
        load_tokens(h.tokens_file)


def load_tokens(path: str) -> dict[str, str]:
    """'NAME TOKEN' per line (# comments) -> {token: name}. Raises ConfigError naming the line."""
    out: dict[str, str] = {}
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"http.tokens_file: {path}: {e.strerror}") from None
    for n, line in enumerate(raw.decode("utf-8", "replace").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ConfigError(f"{path}:{n}: expected NAME TOKEN")
        name, token = parts
        if not _PROFILE_RE.match(name):
            raise ConfigError(f"{path}:{n}: name {name[:40]!r}: use 1-63 of [A-Za-z0-9_.-]")
        if len(token) < 16 or not token.isprintable() or ":" in token:
            raise ConfigError(f"{path}:{n}: the token of {name!r} must be at least 16 printable characters "
                              f"without ':'")
        if token in out:
            raise ConfigError(f"{path}:{n}: the token of {name!r} is also {out[token]!r}'s")
        out[token] = name
    if not out:
        raise ConfigError(f"http.tokens_file: {path}: no NAME TOKEN line")
    return out


__all__ = ["AgentConfig", "ClickHouseSection", "ConfigError", "DEFAULT_SOCKET", "ENV_SOCKET", "HostConfig", "WarmProfile",
           "load_config", "parse_size"]
