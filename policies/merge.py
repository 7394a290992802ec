"""Merging policies: the union of what each allows, provenance kept.

    merged = merge(a, b, c, name="team-tool")           # a Policy
    merged, notes = merge_with_notes([a, b], mode="audit")

Section by section (on the normalized policies):
  syscalls  allowed = the union of the calls each allows. All allowlists -> an
            allowlist; if any input is a denylist (default: allow) the result is a
            denylist of the calls no input allows. namespaces: allow if any input
            allows namespaces. action/errno: the first input's when they differ
            (a note says so); errnos kept for calls the result denies.
  egress    omitted in any input (unrestricted) -> omitted. All default deny: the
            allow rules united (rules for the same target and protocol merge their
            ports; a rule without ports means all ports), dns resolvers united in
            order. When some input is default allow the result is default allow with
            the deny rules every such input has and that no allow rule/resolver of
            the others overlaps (others are dropped, with a note: the union must
            allow what each allows).
  exec      omitted in any input -> omitted; else the union, patterns covered by
            a prefix pattern dropped.
  files     omitted in any input -> omitted; else the union, paths inside another
            listed path dropped.
  mode      `mode=` or the least strict of the inputs (learn < audit < enforce): a
            merged policy is new content (a new hash) that has not been trialed.
  metadata  `name=` or the first input's; annotations united (first wins);
            provenance (policies.learn) united: runs by id, per-run counts (the
            max, so merging a policy with itself changes nothing), reasons; an
            entry from an input without provenance says `from NAME`.
Pure: no I/O.
"""
from __future__ import annotations

import ipaddress
import json

from policies import provenance as P
from policies import model as m
from policies import syscalls as sc
from policies.model import Policy, PolicyError, port_range

_STRICT = {"learn": 0, "audit": 1, "enforce": 2}
MERGED_KEY = "dsec.learn/merged-from"


def _label(p: Policy) -> str:
    return p.name if p.source in ("", "<data>", f"learned:{p.name}") else f"{p.name} ({p.source})"


def allowed_syscalls(sd: dict) -> set[str]:
    """The calls a canonical syscalls section allows (namespace rules aside)."""
    if sd["default"] == "deny":
        return set(sd.get("allow", []))
    return set(sc.names()) - set(sd.get("deny", []))


# ---------------------------------------------------------------- sections

def _merge_syscalls(sds: list[dict], labels: list[str], notes: list[str]) -> dict:
    allowed = set()
    for sd in sds:
        allowed |= allowed_syscalls(sd)
    ns = "allow" if any(sd["namespaces"] == "allow" for sd in sds) else "deny"
    if ns == "deny":
        allowed -= {"setns", "clone3"}
    actions = [sd["action"] for sd in sds]
    action = actions[0]
    if len(set(actions)) > 1:
        notes.append(f"merge: syscalls.action differs ({', '.join(f'{lb}: {a}' for lb, a in zip(labels, actions))}); "
                     f"kept {action!r} from {labels[0]}")
    out: dict = {"default": "deny" if all(sd["default"] == "deny" for sd in sds) else "allow",
                 "action": action, "namespaces": ns}
    if action == "errno":
        errs = [(lb, sd.get("errno")) for lb, sd in zip(labels, sds) if sd.get("errno")]
        out["errno"] = errs[0][1] if errs else "EPERM"
        if len({e for _, e in errs}) > 1:
            notes.append(f"merge: syscalls.errno differs ({', '.join(f'{lb}: {e}' for lb, e in errs)}); "
                         f"kept {out['errno']}")
    if out["default"] == "deny":
        out["allow"] = sorted(allowed)
        denied = lambda n: n not in allowed          # noqa: E731
    else:
        out["deny"] = sorted(set(sc.names()) - allowed - ({"setns", "clone3"} if ns == "deny" else set()))
        deny = set(out["deny"])
        denied = lambda n: n in deny or (ns == "deny" and n in ("setns", "clone3"))   # noqa: E731
    errnos: dict = {}
    for lb, sd in zip(labels, sds):
        for n, e in (sd.get("errnos") or {}).items():
            if not denied(n):
                continue
            if n in errnos and errnos[n] != e:
                notes.append(f"merge: syscalls.errnos.{n} differs ({errnos[n]} vs {e} in {lb}); kept {errnos[n]}")
                continue
            errnos.setdefault(n, e)
    if errnos:
        out["errnos"] = dict(sorted(errnos.items()))
    return out


def _target(r: dict):
    return ("cidr", r["cidr"]) if "cidr" in r else ("host", r["host"])


def _ranges(r: dict) -> list[tuple[int, int]]:
    return [port_range(p) for p in r.get("ports", [])] or [(0, 65535)]


def _overlap(a: dict, b: dict) -> bool | None:
    """Do two rules match a common connection? None when it cannot be known (host vs cidr)."""
    if a["protocol"] != "any" and b["protocol"] != "any" and a["protocol"] != b["protocol"]:
        return False
    if not any(lo1 <= hi2 and lo2 <= hi1 for lo1, hi1 in _ranges(a) for lo2, hi2 in _ranges(b)):
        return False
    ta, tb = _target(a), _target(b)
    if ta[0] == tb[0] == "host":
        return ta[1] == tb[1]
    if ta[0] == tb[0] == "cidr":
        na, nb = ipaddress.ip_network(ta[1]), ipaddress.ip_network(tb[1])
        return na.version == nb.version and na.overlaps(nb)
    return None


def _merge_egress(eds: list[dict | None], labels: list[str], notes: list[str]) -> dict | None:
    if any(e is None for e in eds):
        missing = [lb for lb, e in zip(labels, eds) if e is None]
        if len(missing) < len(eds):
            notes.append(f"merge: {', '.join(missing)} ha{'s' if len(missing) == 1 else 've'} no egress section "
                         "(egress per dsec run --network): the union has none either")
        return None
    dns: list[str] = []
    for e in eds:
        for a in e.get("dns", []):
            if a not in dns:
                dns.append(a)
    if all(e["default"] == "deny" for e in eds):
        by: dict[tuple, dict] = {}
        for e in eds:
            for r in e.get("allow", []):
                k = (_target(r), r["protocol"])
                cur = by.get(k)
                if cur is None:
                    by[k] = {**dict([_target(r)]), "ports": list(r.get("ports", [])), "protocol": r["protocol"]}
                elif not cur["ports"] or not r.get("ports"):
                    cur["ports"] = []               # one of them allows every port
                else:
                    cur["ports"] = m._merge_ports(cur["ports"] + list(r["ports"]))
        rules = []
        for r in by.values():
            if not r["ports"]:
                del r["ports"]
            rules.append(r)
        out: dict = {"default": "deny", "allow": rules}
    else:
        allow_default = [e for e in eds if e["default"] == "allow"]
        deny_default = [e for e in eds if e["default"] == "deny"]
        others = [r for e in deny_default for r in e.get("allow", [])]
        others += [{"cidr": f"{a}/{ipaddress.ip_address(a).max_prefixlen}", "ports": [53], "protocol": "any"}
                   for e in deny_default for a in e.get("dns", [])]
        keys = [{json.dumps(r, sort_keys=True) for r in e.get("deny", [])} for e in allow_default]
        common = set.intersection(*keys) if keys else set()
        rules = []
        for e in allow_default:
            for r in e.get("deny", []):
                k = json.dumps(r, sort_keys=True)
                if k not in common:
                    notes.append(f"merge: egress deny rule {P.egress_key(r)} is not in every default-allow input: "
                                 "dropped (another input allows it)")
                    continue
                ov = [_overlap(r, o) for o in others]
                if any(ov):
                    notes.append(f"merge: egress deny rule {P.egress_key(r)} overlaps what a default-deny input "
                                 "allows: dropped")
                    continue
                if None in ov:
                    notes.append(f"merge: egress deny rule {P.egress_key(r)} may overlap a host rule of a "
                                 "default-deny input: dropped")
                    continue
                if r not in rules:
                    rules.append(r)
        out = {"default": "allow", "deny": rules}
    if dns:
        out["dns"] = dns
    return out


def covering_pattern(pat: str, pats: list[str]) -> str:
    """The pattern of `pats` that makes `pat` redundant (a prefix pattern), or pat itself."""
    for q in sorted(pats, key=len):
        if q != pat and q.endswith("*") and pat.startswith(q[:-1]):
            return q
    return pat


WRITTEN_KEY = "written-under:"     # as policies.learn.WRITTEN_KEY (learn imports merge lazily)


def _merge_exec(xs: list[dict | None], labels, notes) -> dict | None:
    if any(x is None for x in xs):
        return None
    pats = sorted({p for x in xs for p in x["allow"]})
    out = {"allow": sorted({covering_pattern(p, pats) for p in pats})}
    dirs = sorted({d for x in xs for d in x.get("allow_written_under", [])})
    if dirs:
        out["allow_written_under"] = sorted({covering_path(d, dirs) for d in dirs})
    return out


def covering_path(p: str, paths: list[str]) -> str:
    for q in sorted(paths, key=len):
        if q != p and P.under(p, q):
            return q
    return p


def _merge_files(fs: list[dict | None], labels, notes) -> dict | None:
    if any(f is None for f in fs):
        return None
    paths = sorted({p for f in fs for p in f["writable"]})
    return {"writable": sorted({covering_path(p, paths) for p in paths})}


# ---------------------------------------------------------------- provenance

def _merged_provenance(policies: list[Policy], cds: list[dict], labels: list[str], spec: dict) -> dict:
    prov = P.new_provenance()
    run_ids = set()
    parts: list[tuple[str, dict]] = []            # (section, {key: entry}) per input, before re-keying
    for p, cd, lb in zip(policies, cds, labels):
        pv = P.provenance(p) or P.new_provenance()
        for r in pv["runs"]:
            if r["id"] not in run_ids:
                run_ids.add(r["id"])
                prov["runs"].append(r)
        for n in pv["notes"]:
            if n not in prov["notes"]:
                prov["notes"].append(n)
        s = cd["spec"]
        own = {
            "syscalls": s["syscalls"].get("allow", []) if s["syscalls"]["default"] == "deny" else [],
            "egress": [P.egress_key(r) for r in (s.get("egress") or {}).get("allow", [])],
            "dns": list((s.get("egress") or {}).get("dns", [])),
            "exec": list((s.get("exec") or {}).get("allow", []))
            + [WRITTEN_KEY + d for d in (s.get("exec") or {}).get("allow_written_under", [])],
            "files": list((s.get("files") or {}).get("writable", [])),
        }
        for sec in P.SECTIONS:
            entries = dict(pv[sec])
            for k in own[sec]:
                if k not in entries:
                    entries[k] = {"runs": {}, "from": [lb]}
                    if sec == "files":
                        entries[k]["seen"] = {}
            parts.append((sec, entries))
    final_sys = spec["syscalls"]
    if final_sys["default"] == "deny":
        sys_ok = set(final_sys.get("allow", []))
    else:
        sys_ok = set(sc.names()) - set(final_sys.get("deny", []))
    egress_keys = {P.egress_key(r) for r in (spec.get("egress") or {}).get("allow", [])}
    dns = set((spec.get("egress") or {}).get("dns", []))
    pats = (spec.get("exec") or {}).get("allow", [])
    wdirs = (spec.get("exec") or {}).get("allow_written_under", [])
    paths = (spec.get("files") or {}).get("writable", [])
    for sec, entries in parts:
        for k, e in entries.items():
            if sec == "syscalls":
                if k not in sys_ok:
                    continue
                tgt = k
            elif sec == "egress":
                if k not in egress_keys:
                    continue
                tgt = k
            elif sec == "dns":
                if k not in dns:
                    continue
                tgt = k
            elif sec == "exec" and k.startswith(WRITTEN_KEY):
                tgt = WRITTEN_KEY + covering_path(k[len(WRITTEN_KEY):], wdirs)
                if tgt[len(WRITTEN_KEY):] not in wdirs:
                    continue
            elif sec == "exec":
                tgt = covering_pattern(k, pats)
                if tgt not in pats:
                    continue
            else:
                tgt = covering_path(k, paths)
                if tgt not in paths:
                    continue
                if tgt != k and not e.get("seen"):
                    e = {**e, "seen": {k: dict(e.get("runs") or {})}}
            P.merge_entry(prov[sec].setdefault(tgt, {"runs": {}}), e)
    return prov


# ---------------------------------------------------------------- entry points

def merge_with_notes(policies, *, name: str | None = None, mode: str | None = None) -> tuple[Policy, list[str]]:
    """(the union of `policies`, notes about what could not be united exactly)."""
    policies = list(policies)
    if not policies:
        raise PolicyError("nothing to merge: give at least one policy")
    for p in policies:
        if not isinstance(p, Policy):
            raise PolicyError(f"merge: expected policies, got {type(p).__name__}")
    if mode is not None and mode not in m.MODES:
        raise PolicyError(f"unknown mode {mode!r}: use one of {', '.join(m.MODES)}")
    if name is not None and P._valid(m._check_name, name) is None:
        raise PolicyError(f"invalid policy name {name!r}: use 1-63 of [a-z0-9._-], starting and ending alphanumeric")
    cds = [m.canonical(p) for p in policies]
    labels = [_label(p) for p in policies]
    notes: list[str] = []
    spec: dict = {"mode": mode or min((c["spec"]["mode"] for c in cds), key=_STRICT.get)}
    spec["syscalls"] = _merge_syscalls([c["spec"]["syscalls"] for c in cds], labels, notes)
    eg = _merge_egress([c["spec"].get("egress") for c in cds], labels, notes)
    if eg is not None:
        spec["egress"] = eg
    x = _merge_exec([c["spec"].get("exec") for c in cds], labels, notes)
    if x is not None:
        spec["exec"] = x
    f = _merge_files([c["spec"].get("files") for c in cds], labels, notes)
    if f is not None:
        spec["files"] = f
    prov = _merged_provenance(policies, cds, labels, spec)
    prov["notes"] += [n for n in notes if n not in prov["notes"]]
    ann: dict = {}
    for p in policies:
        for k, v in P.strip_provenance(p.metadata.annotations).items():
            if k in (MERGED_KEY,):
                continue
            ann.setdefault(k, v)
    if len(policies) > 1:
        merged_from = ", ".join(f"{lb} sha256:{p.hash[:16]}" for lb, p in zip(labels, policies))
        ann[MERGED_KEY] = merged_from[:m.ANNOTATION_VALUE_MAX]
    has_prov = len(policies) > 1 or any(P.provenance(p) for p in policies)
    if has_prov:
        ann[P.SUMMARY_KEY] = P._summary(prov) if prov["runs"] else ann.get(P.SUMMARY_KEY, "merged")
        room = m.ANNOTATIONS_MAX - len(ann)
        if room < 1:
            raise PolicyError(f"merge: the inputs carry {len(ann)} annotations, no room left for the provenance "
                              f"(at most {m.ANNOTATIONS_MAX})")
        ann.update(P.provenance_annotations(prov, room=min(room, P.MAX_CHUNKS)))
    if len(ann) > m.ANNOTATIONS_MAX:
        raise PolicyError(f"merge: the inputs carry {len(ann)} annotations together (at most {m.ANNOTATIONS_MAX})")
    data = {"apiVersion": m.API_VERSION, "kind": m.KIND,
            "metadata": {"name": name or policies[0].name, **({"annotations": ann} if ann else {})},
            "spec": spec}
    from policies.load import policy_from_data
    out = policy_from_data(data, source=f"merged:{name or policies[0].name}")
    return out, notes


def merge(*policies, name: str | None = None, mode: str | None = None) -> Policy:
    """The union of the policies (see the module docstring); merge(a, b) or merge([a, b])."""
    if len(policies) == 1 and isinstance(policies[0], (list, tuple)):
        policies = tuple(policies[0])
    return merge_with_notes(policies, name=name, mode=mode)[0]


__all__ = ["merge", "merge_with_notes", "allowed_syscalls", "covering_pattern", "covering_path"]
