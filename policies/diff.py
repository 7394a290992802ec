"""What changed between two policies, section by section.

    d = diff(a, b)            # a dict (JSON-ready): {"a": ..., "b": ..., "same_hash", "changes", "empty"}
    print(render_text(d))     # for people: one line per change, provenance of what was added

Compared on the normalized policies, by meaning:
  mode, name                 from -> to
  syscalls                   default/action/errno/namespaces changes; the calls
                             allowed (effective sets, so an allowlist and a
                             denylist compare correctly): added / removed;
                             errnos added / removed / changed
  egress                     section added/removed, default, rules added/removed
                             (per list: allow / deny), dns resolvers added/removed
  exec                       section added/removed, patterns added/removed
  files                      section added/removed, writable paths added/removed
`same_hash` is true when the rules are identical (only mode or metadata differ).
Added entries carry the provenance B's policy file has for them (runs, counts,
observed paths), so a reviewer sees why each one is there. Pure: no I/O.
"""
from __future__ import annotations

import json

from policies import learn as L
from policies import model as m
from policies.merge import allowed_syscalls
from policies.model import Policy


def _side(p: Policy) -> dict:
    return {"name": p.name, "source": p.source, "mode": p.mode, "hash": p.hash}


def _listdiff(a, b) -> dict:
    sa, sb = set(a), set(b)
    out = {}
    if sb - sa:
        out["added"] = sorted(sb - sa)
    if sa - sb:
        out["removed"] = sorted(sa - sb)
    return out


def _rules_diff(a: list, b: list) -> dict:
    ka = {json.dumps(r, sort_keys=True): r for r in a}
    kb = {json.dumps(r, sort_keys=True): r for r in b}
    out = {}
    added = [kb[k] for k in kb if k not in ka]
    removed = [ka[k] for k in ka if k not in kb]
    if added:
        out["added"] = added
    if removed:
        out["removed"] = removed
    return out


def _section_presence(a, b) -> dict | None:
    if (a is None) != (b is None):
        return {"from": "present" if a is not None else "absent", "to": "present" if b is not None else "absent"}
    return None


def diff(a: Policy, b: Policy) -> dict:
    da, db = m.canonical(a), m.canonical(b)
    sa, sb = da["spec"], db["spec"]
    ch: dict = {}
    if a.name != b.name:
        ch["name"] = {"from": a.name, "to": b.name}
    if sa["mode"] != sb["mode"]:
        ch["mode"] = {"from": sa["mode"], "to": sb["mode"]}
    # syscalls
    ya, yb = sa["syscalls"], sb["syscalls"]
    sy: dict = {}
    for k in ("default", "action", "errno", "namespaces"):
        if ya.get(k) != yb.get(k):
            sy[k] = {"from": ya.get(k), "to": yb.get(k)}
    al = _listdiff(allowed_syscalls(ya), allowed_syscalls(yb))
    if al:
        sy["allowed"] = al
    ea, eb = ya.get("errnos") or {}, yb.get("errnos") or {}
    er = {}
    for n in sorted(set(ea) | set(eb)):
        if ea.get(n) != eb.get(n):
            er[n] = {"from": ea.get(n), "to": eb.get(n)}
    if er:
        sy["errnos"] = er
    if sy:
        ch["syscalls"] = sy
    # egress
    ga, gb = sa.get("egress"), sb.get("egress")
    eg: dict = {}
    pres = _section_presence(ga, gb)
    if pres:
        eg["section"] = pres
    ga_, gb_ = ga or {}, gb or {}
    if ga and gb and ga["default"] != gb["default"]:
        eg["default"] = {"from": ga["default"], "to": gb["default"]}
    for lst in ("allow", "deny"):
        d = _rules_diff(ga_.get(lst, []), gb_.get(lst, []))
        if d:
            eg[lst] = d
    d = _listdiff(ga_.get("dns", []), gb_.get("dns", []))
    if d:
        eg["dns"] = d
    elif ga_.get("dns", []) != gb_.get("dns", []):
        eg["dns"] = {"order": {"from": ga_.get("dns", []), "to": gb_.get("dns", [])}}
    if eg:
        ch["egress"] = eg
    # exec, files
    for sec, keys in (("exec", ("allow", "allow_written_under")), ("files", ("writable",))):
        xa, xb = sa.get(sec), sb.get(sec)
        xd: dict = {}
        pres = _section_presence(xa, xb)
        if pres:
            xd["section"] = pres
        for key in keys:
            d = _listdiff((xa or {}).get(key, []), (xb or {}).get(key, []))
            if d:
                xd[key] = d
        if xd:
            ch[sec] = xd
    prov_b = L.provenance(b)
    why = {}
    if prov_b:
        total = len(prov_b["runs"])
        for n in ch.get("syscalls", {}).get("allowed", {}).get("added", []):
            c = L._entry_comment(prov_b["syscalls"].get(n), total, "call")
            if c:
                why.setdefault("syscalls", {})[n] = c
        for r in ch.get("egress", {}).get("allow", {}).get("added", []):
            e = prov_b["egress"].get(L.egress_key(r))
            c = L._entry_comment(e, total, "connect")
            if e and e.get("seen"):
                c = (c + "; " if c else "") + "seen " + L._seen_phrase(e, total)
            if c:
                why.setdefault("egress", {})[L.egress_key(r)] = c
        for a_ in ch.get("egress", {}).get("dns", {}).get("added", []):
            c = L._entry_comment(prov_b["dns"].get(a_), total, "connect")
            if c:
                why.setdefault("dns", {})[a_] = c
        for p in ch.get("exec", {}).get("allow", {}).get("added", []):
            c = L._entry_comment(prov_b["exec"].get(p), total, "exec")
            if c:
                why.setdefault("exec", {})[p] = c
        for p in ch.get("files", {}).get("writable", {}).get("added", []):
            e = prov_b["files"].get(p) or {}
            c = L._entry_comment({k: v for k, v in e.items() if k != "seen"}, total, "write")
            if e.get("seen"):
                c = (c + "; " if c else "") + "from " + L._seen_phrase(e, total)
            if c:
                why.setdefault("files", {})[p] = c
    out = {"a": _side(a), "b": _side(b), "same_hash": a.hash == b.hash, "empty": not ch, "changes": ch}
    if why:
        out["provenance"] = why
    return out


def _rule_text(r: dict) -> str:
    ports = ",".join(str(p) for p in r.get("ports", [])) or "all ports"
    return f"{r['protocol']} {r.get('cidr') or r.get('host')} {ports}"


def render_text(d: dict) -> str:
    """diff() for people."""
    a, b = d["a"], d["b"]
    out = [f"--- {a['source']}  name={a['name']} mode={a['mode']} sha256:{a['hash'][:16]}",
           f"+++ {b['source']}  name={b['name']} mode={b['mode']} sha256:{b['hash'][:16]}"]
    ch = d["changes"]
    if d["empty"]:
        out.append("no differences")
        return "\n".join(out) + "\n"
    if d["same_hash"]:
        out.append("same rules (same content hash): only the mode or metadata differ")
    why = d.get("provenance", {})

    def note(sec, key):
        w = why.get(sec, {}).get(key)
        return f"    # {L._show(w)}" if w else ""

    for k in ("name", "mode"):
        if k in ch:
            out.append(f"{k}: {ch[k]['from']} -> {ch[k]['to']}")
    sy = ch.get("syscalls")
    if sy:
        out.append("syscalls:")
        for k in ("default", "action", "errno", "namespaces"):
            if k in sy:
                out.append(f"  {k}: {sy[k]['from']} -> {sy[k]['to']}")
        al = sy.get("allowed", {})
        for n in al.get("added", []):
            out.append(f"  + {n}{note('syscalls', n)}")
        for n in al.get("removed", []):
            out.append(f"  - {n}")
        for n, e in sy.get("errnos", {}).items():
            out.append(f"  errnos.{n}: {e['from'] or '(none)'} -> {e['to'] or '(none)'}")
    eg = ch.get("egress")
    if eg:
        out.append("egress:")
        if "section" in eg:
            out.append(f"  section: {eg['section']['from']} -> {eg['section']['to']}")
        if "default" in eg:
            out.append(f"  default: {eg['default']['from']} -> {eg['default']['to']}")
        for lst in ("allow", "deny"):
            for r in eg.get(lst, {}).get("added", []):
                out.append(f"  + {lst} {_rule_text(r)}{note('egress', L.egress_key(r)) if lst == 'allow' else ''}")
            for r in eg.get(lst, {}).get("removed", []):
                out.append(f"  - {lst} {_rule_text(r)}")
        dn = eg.get("dns", {})
        for x in dn.get("added", []):
            out.append(f"  + dns {x}{note('dns', x)}")
        for x in dn.get("removed", []):
            out.append(f"  - dns {x}")
        if "order" in dn:
            out.append(f"  dns order: {', '.join(dn['order']['from'])} -> {', '.join(dn['order']['to'])}")
    for sec, key, title in (("exec", "allow", "exec.allow"), ("exec", "allow_written_under", "exec.allow_written_under"),
                            ("files", "writable", "files.writable")):
        x = ch.get(sec)
        if not x or (key not in x and ("section" not in x or key == "allow_written_under")):
            continue
        out.append(f"{title}:")
        if "section" in x and key != "allow_written_under":
            out.append(f"  section: {x['section']['from']} -> {x['section']['to']}")
        for p in x.get(key, {}).get("added", []):
            out.append(f"  + {L._show(p)}{note(sec, p)}")
        for p in x.get(key, {}).get("removed", []):
            out.append(f"  - {L._show(p)}")
    return "\n".join(out) + "\n"


def render_json(d: dict) -> str:
    return json.dumps(d, indent=2, ensure_ascii=True) + "\n"


__all__ = ["diff", "render_text", "render_json"]
