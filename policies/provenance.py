"""Provenance of learned policies: which runs, how often, why.

Kept in a policy's metadata.annotations (`dsec.learn/provenance`, JSON, one
entry per line, split over `.2`, `.3` ... keys when long) so it survives
loading, merging and promotion (annotations are not part of the content
hash). Written by policies/learn.py, combined by policies/merge.py, rendered
as YAML comments by learn.render(). Pure.
"""
from __future__ import annotations

import json

from policies.errors import USAGE, PoliciesError
from policies.model import Policy

PROV_KEY = "dsec.learn/provenance"
SUMMARY_KEY = "dsec.learn/summary"
PROV_VERSION = 1
CHUNK = 4000                      # < model.ANNOTATION_VALUE_MAX
MAX_CHUNKS = 40                   # < model.ANNOTATIONS_MAX, leaving room for the user's own
NOTES_MAX = 60                    # notes kept in the provenance
SEEN_MAX = 20                     # observed examples kept per entry in the provenance


def _valid(check, value) -> str | None:
    """The model's own value check: the canonical value, or None when it is invalid."""
    try:
        return check(value)
    except Exception:
        return None


def under(path: str, root: str) -> bool:
    return root == "/" or path == root or path.startswith(root.rstrip("/") + "/")


# ---------------------------------------------------------------- provenance

def _entry() -> dict:
    return {"runs": {}}


def new_provenance() -> dict:
    return {"v": PROV_VERSION, "runs": [], "syscalls": {}, "egress": {}, "dns": {}, "exec": {}, "files": {},
            "notes": []}


SECTIONS = ("syscalls", "egress", "dns", "exec", "files")


def _encode(prov: dict, seen_max: int, compact: bool = False, omit: tuple = ()) -> str:
    """JSON, one entry per line, runs referenced by their index (1-based). `compact`:
    per-run counts become a total ("*") and a number of runs ("nruns")."""
    idx = {r["id"]: str(i + 1) for i, r in enumerate(prov["runs"])}

    def runs(d):
        return {idx.get(k, k): v for k, v in d.items()}

    def ent(e):
        o = {}
        if e.get("runs") and compact:
            o["runs"] = {"*": sum(e["runs"].values())}
            o["nruns"] = max(len([k for k in e["runs"] if k != "*"]), int(e.get("nruns", 0)))
        elif e.get("runs"):
            o["runs"] = runs(e["runs"])
            if e.get("nruns"):
                o["nruns"] = e["nruns"]
        for k in ("why", "from"):
            if e.get(k):
                o[k] = sorted(set(e[k]))
        if e.get("loopback"):
            o["loopback"] = True
        if e.get("addrs"):
            o["addrs"] = sorted(set(e["addrs"]))[:seen_max]
        seen = e.get("seen") or {}
        if seen:
            items = sorted(seen.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))
            o["seen"] = {k: runs(v) for k, v in items[:seen_max]}
            more = len(items) - len(o["seen"]) + int(e.get("more", 0))
            if more:
                o["more"] = more
        elif e.get("more"):
            o["more"] = e["more"]
        return o

    lines = ['{"v": %d,' % PROV_VERSION,
             '"runs": [' + ",\n".join(json.dumps(r, sort_keys=True) for r in prov["runs"]) + "],"]
    for sec in SECTIONS:
        items = [] if sec in omit else sorted(prov.get(sec, {}).items())
        body = ",\n".join(f"{json.dumps(k)}: {json.dumps(ent(e), sort_keys=True)}" for k, e in items)
        lines.append(f'"{sec}": {{' + ("\n" + body + "\n" if body else "") + "},")
    lines.append('"notes": [' + ",\n".join(json.dumps(n) for n in prov.get("notes", [])[:NOTES_MAX]) + "]}")
    return "\n".join(lines)


def _chunks(text: str) -> list[str]:
    out, cur = [], ""
    for line in text.split("\n"):
        piece = line + "\n"
        while len(piece) > CHUNK:               # a single over-long line
            if cur:
                out.append(cur)
                cur = ""
            out.append(piece[:CHUNK])
            piece = piece[CHUNK:]
        if len(cur) + len(piece) > CHUNK:
            out.append(cur)
            cur = ""
        cur += piece
    if cur:
        out.append(cur)
    out[-1] = out[-1].rstrip("\n")
    return out


def _prov_keys(n: int) -> list[str]:
    return [PROV_KEY] + [f"{PROV_KEY}.{i}" for i in range(2, n + 1)]


def provenance_annotations(prov: dict, room: int = MAX_CHUNKS) -> dict[str, str]:
    """The annotations that carry `prov`; less detail when it would not fit: fewer
    observed examples, then totals instead of per-run counts, then whole sections
    left out (largest first, with a note saying so)."""
    levels = [(SEEN_MAX, False), (5, False), (1, False), (0, False), (0, True)]
    for seen_max, compact in levels:
        p = prov
        if compact:
            p = dict(prov)
            p["notes"] = prov.get("notes", [])[:10]
        chunks = _chunks(_encode(p, seen_max, compact))
        if len(chunks) <= room:
            return dict(zip(_prov_keys(len(chunks)), chunks))
    omit: list[str] = []
    for sec in sorted(SECTIONS, key=lambda x: -len(prov.get(x, {}))):
        omit.append(sec)
        p = dict(prov)
        p["notes"] = [f"provenance of {', '.join(omit)} left out: too large for the policy's annotations"] + \
            prov.get("notes", [])[:9]
        chunks = _chunks(_encode(p, 0, True, tuple(omit)))
        if len(chunks) <= room:
            return dict(zip(_prov_keys(len(chunks)), chunks))
    raise PoliciesError(f"the provenance of this policy does not fit in {room} annotations", USAGE)


def provenance(policy: Policy) -> dict | None:
    """The provenance stored in a policy's annotations (run ids resolved), or None."""
    ann = policy.metadata.annotations
    if PROV_KEY not in ann:
        return None
    parts = [ann[PROV_KEY]]
    i = 2
    while f"{PROV_KEY}.{i}" in ann:
        parts.append(ann[f"{PROV_KEY}.{i}"])
        i += 1
    try:
        raw = json.loads("\n".join(parts))
    except ValueError:
        try:
            raw = json.loads("".join(parts))
        except ValueError:
            return None
    if not isinstance(raw, dict):
        return None
    runs = [r for r in raw.get("runs", []) if isinstance(r, dict) and isinstance(r.get("id"), str)]
    ids = {str(i + 1): r["id"] for i, r in enumerate(runs)}
    prov = new_provenance()
    prov["runs"] = runs

    def counts(d):
        if not isinstance(d, dict):
            return {}
        return {ids.get(k, k): int(v) for k, v in d.items() if isinstance(v, int) and not isinstance(v, bool)}

    for sec in SECTIONS:
        sec_d = raw.get(sec)
        if not isinstance(sec_d, dict):
            continue
        for key, e in sec_d.items():
            if not isinstance(e, dict):
                continue
            o = {"runs": counts(e.get("runs"))}
            for k in ("why", "from", "addrs"):
                if isinstance(e.get(k), list):
                    o[k] = [str(x) for x in e[k]]
            if e.get("loopback"):
                o["loopback"] = True
            if isinstance(e.get("seen"), dict):
                o["seen"] = {str(k): counts(v) for k, v in e["seen"].items()}
            if isinstance(e.get("more"), int):
                o["more"] = e["more"]
            if isinstance(e.get("nruns"), int):
                o["nruns"] = e["nruns"]
            prov[sec][key] = o
    prov["notes"] = [str(n) for n in raw.get("notes", []) if isinstance(n, str)]
    return prov


def strip_provenance(annotations: dict) -> dict:
    return {k: v for k, v in annotations.items() if not (k == PROV_KEY or k.startswith(PROV_KEY + "."))}


def egress_key(rule: dict) -> str:
    """The provenance key of an egress rule: 'PROTOCOL TARGET' (ports merge into it)."""
    return f"{rule.get('protocol', 'any')} {rule.get('cidr') or rule.get('host')}"


def merge_entry(into: dict, e: dict):
    """Fold entry `e` into `into`: per-run counts take the max (the same run seen
    twice is one observation), reasons and sources are united."""
    for r, n in (e.get("runs") or {}).items():
        into.setdefault("runs", {})
        into["runs"][r] = max(into["runs"].get(r, 0), n)
    for k in ("why", "from", "addrs"):
        if e.get(k):
            into[k] = sorted(set(into.get(k, [])) | set(e[k]))
    if e.get("loopback"):
        into["loopback"] = True
    for obs, d in (e.get("seen") or {}).items():
        tgt = into.setdefault("seen", {}).setdefault(obs, {})
        for r, n in d.items():
            tgt[r] = max(tgt.get(r, 0), n)
    if e.get("more"):
        into["more"] = max(into.get("more", 0), e["more"])
    if e.get("nruns"):
        into["nruns"] = max(into.get("nruns", 0), e["nruns"])


def _summary(prov: dict) -> str:
    runs = prov["runs"]
    ids = ", ".join(r["id"] for r in runs[:5]) + (f", ... ({len(runs) - 5} more)" if len(runs) > 5 else "")
    return f"derived by dsec learn from {len(runs)} run{'s' if len(runs) != 1 else ''}: {ids}"[:1000]
