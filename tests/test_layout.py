"""The house's layout holds: imports run one way (README "Layout").

Built from the source with ast (every import, also those inside functions):
  - no cycle between the project's modules (files);
  - policies/, audit_schema/ and exporters/ import nothing from agent/;
  - audit_schema/ imports nothing of ours but itself;
  - replay/ reaches agent/ only through the client SDK (agent/node/client.py);
  - inside agent/: sandbox/ < sensors/ < node/ < cli.py and commands/ (a room
    imports only rooms below it; agent/errors.py is below them all).
  - no file over ~800 lines without a reason in its opening comment.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("agent", "policies", "audit_schema", "exporters", "replay")
AGENT_ROOMS = ("agent.errors", "agent.sandbox", "agent.sensors", "agent.node", "agent.commands", "agent.cli")


def modules(root=ROOT) -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        for dp, dn, fn in os.walk(os.path.join(root, pkg)):
            dn[:] = [d for d in dn if d != "__pycache__"]
            for f in fn:
                if f.endswith(".py") and not f.endswith("_pb2.py") and not f.endswith("_pb2_grpc.py"):
                    path = os.path.join(dp, f)
                    name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                    out[name.removesuffix(".__init__")] = path
    return out


def import_graph(root=ROOT) -> dict[str, set[str]]:
    """module -> the project's modules it imports (anywhere in the file)."""
    mods = modules(root)
    graph = {}
    for name, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        pkg = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")
                    parts = parts[:len(parts) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                # the longest prefix that is one of our modules
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name and t.split(".")[0] in PACKAGES:
                    deps.add(t)
        # "from agent.x import y" where y is a module makes "agent.x" (a package) a
        # dependency too; packages' __init__ files are empty here, so drop them
        graph[name] = {d for d in deps if not (d in mods and mods[d].endswith("__init__.py")
                                               and os.path.getsize(mods[d]) == 0)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _room(mod: str) -> str | None:
    for r in AGENT_ROOMS:
        if mod == r or mod.startswith(r + "."):
            return r
    return None


def violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(graph.items()):
        top = mod.split(".")[0]
        for d in sorted(deps):
            dtop = d.split(".")[0]
            if top in ("policies", "audit_schema", "exporters") and dtop == "agent":
                bad.append(f"{mod} imports {d}: {top}/ must not import agent/")
            if top == "audit_schema" and dtop != "audit_schema":
                bad.append(f"{mod} imports {d}: audit_schema/ is a leaf")
            if top == "replay" and dtop == "agent" and d not in ("agent.node.client", "agent.node.proto"):
                bad.append(f"{mod} imports {d}: replay/ reaches agent/ only through the client SDK")
            if top == "agent" and dtop == "agent":
                rm, rd = _room(mod), _room(d)
                if rm and rd and AGENT_ROOMS.index(rd) > AGENT_ROOMS.index(rm):
                    bad.append(f"{mod} imports {d}: {rm} must not import {rd} (a room above it)")
    return bad


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles between files:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_imports_run_one_way():
    bad = violations(import_graph())
    assert not bad, "imports against the layout:\n" + "\n".join(bad)


def test_the_checks_see_a_cycle_and_an_upward_import():
    g = {"exporters.spool": {"agent.node.metrics"}, "agent.node.metrics": {"exporters.spool"},
         "agent.sandbox.launcher": {"agent.node.daemon"}, "audit_schema.events": {"policies.model"}}
    assert cycles(g) == [["agent.node.metrics", "exporters.spool"]]
    bad = violations(g)
    assert any("exporters/ must not import agent/" in b for b in bad)
    assert any("agent.sandbox must not import agent.node" in b for b in bad)
    assert any("audit_schema/ is a leaf" in b for b in bad)


def test_long_files_say_why():
    long = []
    for top in PACKAGES + ("bench", "tests", "bpf"):
        for dp, dn, fn in os.walk(os.path.join(ROOT, top)):
            dn[:] = [d for d in dn if d != "__pycache__"]
            for f in fn:
                if not f.endswith((".py", ".c", ".h")) or f.endswith(("_pb2.py", "_pb2_grpc.py")):
                    continue
                path = os.path.join(dp, f)
                with open(path, encoding="utf-8") as fh:
                    lines = fh.readlines()
                if len(lines) > 850:
                    head = "".join(lines[:40])
                    if "Why this file is long" not in head:
                        long.append(f"{os.path.relpath(path, ROOT)}: {len(lines)} lines")
    assert not long, ("files over ~800 lines without a reason ('Why this file is long: ...') "
                      "in their opening comment:\n" + "\n".join(long))
