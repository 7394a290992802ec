"""Who may do what through the node agent's API (docs/agent.md "Authorisation").

    authz = Authorizer(cfg.authorization, cfg.rootfs_roots, audit_refusal)
    caller = authz.caller(peer, identities)        # ADMIN for the root-only unix socket
    authz.check_create(caller, req)                # ApiError(PERMISSION_DENIED) + an access_denied record
    authz.check_sandbox(caller, rec, "Exec")       # the sandbox's tenant label must be the caller's
    labels = authz.scope(caller, labels)           # List / StreamEvents filters of a tenant

The unix socket (root only: directory 0700, socket 0600) is the node's admin:
everything, every tenant. A TCP (mutual TLS) client is named by its
certificate identity: `authorization.identities` gives it a tenant (default:
its own identity) and privileges; identities not listed get `authorization.
default`. Privileges: root (run as uid 0 inside), keep (keep the upper layer
on the node), rootfs (a custom rootfs, also only under `rootfs_roots` for
every TCP client, admins included),
no_audit (a sandbox without the eBPF audit), policy_yaml (a policy sent
inline rather than named), volumes (host directories from volumes.allowed_roots).
Snapshots are the tenant's whose sandbox they were taken of: Snapshot,
Restore and CreateSandbox(from_snapshot) check the recorded labels. A tenant's sandboxes carry the label
`authorization.tenant_label` = its tenant (set by the agent at creation; a
request naming another tenant is refused); a tenant sees, execs in, kills,
closes, streams and queries only those. Every refusal is an access_denied
audit record (who, what, why).
"""
from __future__ import annotations

from agent.node.records import ApiError

PRIVILEGES = ("root", "keep", "rootfs", "no_audit", "policy_yaml", "volumes")


class Caller:
    def __init__(self, name: str, peer: str, identities=(), admin: bool = False, tenant: str | None = None,
                 privileges=()):
        self.name = name
        self.peer = peer
        self.identities = list(identities)
        self.admin = admin
        self.tenant = tenant
        self.privileges = frozenset(privileges)

    @property
    def local(self) -> bool:
        """The root-only unix socket (root on the node)."""
        return self.peer == "unix"

    def may(self, privilege: str) -> bool:
        return self.admin or privilege in self.privileges

    def __repr__(self):
        return f"Caller({self.name!r}, admin={self.admin}, tenant={self.tenant!r})"


ADMIN = Caller("admin", "unix", admin=True)


class Authorizer:
    def __init__(self, cfg, rootfs_roots, audit_refusal):
        self.cfg = cfg                      # agent.node.config.AuthorizationConfig
        self.label = cfg.tenant_label
        self.rootfs_roots = list(rootfs_roots)
        self._audit = audit_refusal         # (peer, identities, method, reason) -> None

    def caller(self, peer: str, identities) -> Caller:
        if peer.startswith("unix:"):
            return ADMIN
        ids = list(identities)
        for i in ids:
            entry = self.cfg.identities.get(i)
            if entry is not None:
                return Caller(i, peer, ids, entry.admin, entry.tenant or i, entry.allow)
        d = self.cfg.default
        name = ids[0] if ids else "(no identity)"
        return Caller(name, peer, ids, d.admin, d.tenant or name, d.allow)

    def refuse(self, caller: Caller, method: str, reason: str):
        try:
            self._audit(caller.peer, caller.identities or [caller.name], method, reason)
        finally:
            raise ApiError("PERMISSION_DENIED", reason)

    # -- requests -------------------------------------------------------------------
    def check_create(self, caller: Caller, req: dict, method: str = "CreateSandbox") -> None:
        """Privileges a CreateSandbox request needs; stamps the caller's tenant label."""
        labels = dict(req.get("labels") or {})
        if not caller.admin:
            have = labels.get(self.label)
            if have is not None and have != caller.tenant:
                self.refuse(caller, method, f"identity {caller.name!r} (tenant {caller.tenant!r}) may not create "
                                            f"sandboxes labelled {self.label}={have!r}")
            labels[self.label] = caller.tenant
            req["labels"] = labels
        user = (req.get("user") or "sandbox").strip()
        needs = []
        if user == "root" or user.split(":")[0] == "0":
            needs.append("root")
        if req.get("keep"):
            needs.append("keep")
        if req.get("rootfs"):
            needs.append("rootfs")
        if req.get("no_audit"):
            needs.append("no_audit")
        if (req.get("policy") or {}).get("yaml") is not None:
            needs.append("policy_yaml")
        if req.get("volumes"):
            needs.append("volumes")
        for n in needs:
            if not caller.may(n):
                self.refuse(caller, method, f"identity {caller.name!r} may not use {n} "
                                            f"(authorization.identities.*.allow in the agent config)")
        if req.get("rootfs") and not caller.local:            # every TCP client, admins too
            from agent.sandbox.rootfs import check_rootfs
            try:
                check_rootfs(req["rootfs"], self.rootfs_roots)
            except ValueError as e:
                self.refuse(caller, method, f"rootfs {str(req['rootfs'])[:200]!r}: {e}")

    def check_policy_update(self, caller: Caller, pol: dict) -> None:
        if pol.get("yaml") is not None and not caller.may("policy_yaml"):
            self.refuse(caller, "UpdatePolicy", f"identity {caller.name!r} may not use policy_yaml "
                                                f"(authorization.identities.*.allow in the agent config)")

    # -- sandboxes ------------------------------------------------------------------
    def visible(self, caller: Caller, labels: dict) -> bool:
        return caller.admin or (labels or {}).get(self.label) == caller.tenant

    def check_sandbox(self, caller: Caller, labels: dict, sid: str, method: str) -> None:
        if not self.visible(caller, labels):
            self.refuse(caller, method, f"identity {caller.name!r} (tenant {caller.tenant!r}) may not use "
                                        f"sandbox {sid[:80]!r} (another tenant's, or unknown)")

    def scope(self, caller: Caller, labels: dict) -> dict:
        """A List/StreamEvents label filter narrowed to the caller's tenant."""
        labels = dict(labels or {})
        if caller.admin:
            return labels
        want = labels.get(self.label)
        if want is not None and want != caller.tenant:
            self.refuse(caller, "List", f"identity {caller.name!r} (tenant {caller.tenant!r}) may not see "
                                        f"{self.label}={want!r}")
        labels[self.label] = caller.tenant
        return labels
