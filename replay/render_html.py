"""The incident report: one self-contained HTML file (no network fetch when opened).

    html = render(trajectory, unattributed_lost=[])

Sections: a header (sandbox, policy, resources, how it ended, counts, a red
banner when the record has holes), a timeline chart (inline SVG drawn by the
inline script from the embedded JSON: steps as bands, events as marks in one
lane per kind, colored by kind, ringed by decision; lost-event markers as red
lines across every lane; click a band to zoom to that step), the steps, the
process tree of every step, the denials table, the file-change manifest and
the full event list.

Everything from the sandbox is escaped (html.escape on the server side,
textContent in the script); the embedded JSON has '<', '>' and '&' escaped,
so no path or argv can close the script element. The page sets
<html data-rendered="1"> and fills #chart-stats once the chart is drawn (the
browser test reads both).
"""
from __future__ import annotations

import html
import json
from audit_schema.describe import argv_text, line as describe, printable
from replay.report import to_dict
from replay.trajectory import Proc, Trajectory

LANES = (
    ("exec", ("exec", "exec_denied", "exec_violation")),
    ("connect", ("connect", "egress_denied", "egress_violation")),
    ("write", ("open_write", "unlink", "rename")),
    ("syscall", ("syscall_denied", "syscall_violation")),
    ("exit", ("exit",)),
)
MARK_KINDS = tuple(k for _, ks in LANES for k in ks)
EVENT_LIST_MAX = 20000


def mark_count(t: Trajectory) -> int:
    """How many marks the chart draws (the browser test compares)."""
    return sum(1 for r in t.records if r["kind"] in MARK_KINDS)


def _e(s) -> str:
    return html.escape(printable(s, 400), quote=True)


def _argv(argv, limit=160) -> str:
    return _e(argv_text(argv, limit))


def _ts(t: Trajectory, ns) -> str:
    return f"+{(ns - t.t0) / 1e9:.6f}s" if ns else ""


MAX_NEST = 40        # levels nested as lists; deeper ones are listed flat at that level, their depth said


def _proc_html(root: Proc, step: int, out: list):
    """root's process tree as nested lists. Not recursive: a workload's fork chain can be
    thousands of levels deep (each process forks the next and exits)."""
    stack: list = [(root, 0)]            # a process to render, or the markup that closes one
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            out.append(item)
            continue
        p, depth = item
        if p.execs:
            e = p.execs[-1]
            what = f"<code>{_argv(e.get('argv') or [e.get('path', '')])}</code>"
            meta = []
            if e.get("path"):
                meta.append(f"path {_e(e['path'])}")
            if e.get("sha256"):
                meta.append(f"sha256 <span class='hash'>{_e(e['sha256'])}</span>")
            if e.get("build_id"):
                meta.append(f"build-id <span class='hash'>{_e(e['build_id'])}</span>")
            if e.get("shebang"):
                meta.append(f"#!{_e(e['shebang'])}")
            if e.get("decision") in ("denied", "would-deny"):
                meta.append(f"<span class='dec {e['decision']}'>{e['decision']}</span>")
            if len(p.execs) > 1:
                meta.append(f"{len(p.execs)} execs")
        else:
            what = f"<code>({_e(p.comm) or '?'})</code>"
            meta = []
        end = f"signal {p.signal}" if p.signal else (f"exit {p.exit_code}" if p.exit_code is not None
                                                     else "still running / exit not recorded")
        deep = f"<span class='depth'>depth {depth}</span> " if depth > MAX_NEST else ""
        out.append(f"<li class='proc' data-pid='{p.pid}'>{deep}<span class='pid'>[{p.pid}]</span> {what} "
                   f"<span class='end'>→ {_e(end)}</span>")
        if meta:
            out.append(f"<div class='meta'>{' · '.join(meta)}</div>")
        kids = [c for c in p.children if c.step == step]
        if kids and depth < MAX_NEST:
            out.append("<ul>")
            stack.append("</ul></li>")
        else:
            out.append("</li>")              # (past MAX_NEST its children follow as siblings)
        stack.extend((c, depth + 1) for c in reversed(kids))


def _tree(t: Trajectory, n: int) -> str:
    roots = t.step_roots(n)
    if not roots:
        return "<p class='none'>no processes recorded</p>"
    out = ["<ul class='tree'>"]
    for r in roots:
        _proc_html(r, n, out)
    out.append("</ul>")
    return "".join(out)


def _status_class(s) -> str:
    if not s.ended:
        return "unknown"
    return "ok" if s.code == 0 else "bad"


def render(t: Trajectory, unattributed_lost: list | None = None, title: str | None = None) -> str:
    data = to_dict(t, unattributed_lost=unattributed_lost)
    # the chart needs only these fields of each record
    keep = ("ts_ns", "kind", "step", "pid", "decision", "path", "path2", "addr", "port", "family", "syscall",
            "count", "ret", "exit_code", "signal", "comm", "argv", "event_id")
    # times relative to the first record (ns since the epoch do not fit a JS number exactly)
    t0 = t.t0
    marks = []
    for r in t.records:
        if r["kind"] not in MARK_KINDS:
            continue
        m = {k: r.get(k) for k in keep if r.get(k) not in (None, "", [], 0)}
        m["ts_ns"] = r["ts_ns"] - t0
        m["step"] = r.get("step", 0)
        m["label"] = printable(describe(r), 200)
        if m.get("argv"):
            m["argv"] = m["argv"][:8]
        marks.append(m)
    chart = {"t0": 0, "t_end": max([r["ts_ns"] for r in t.records] or [t0]) - t0,
             "steps": [{"n": s.n, "start": s.start_ns - t0 if s.start_ns else 0,
                        "end": (s.end_ns or s.start_ns) - t0 if (s.end_ns or s.start_ns) else 0, "status": s.status(),
                        "argv": argv_text(s.argv, 120)} for s in t.steps],
             "marks": marks, "expected_marks": len(marks),
             "lost": [{"ts_ns": r["ts_ns"] - t0, "count": r.get("count"), "step": r.get("step", 0)}
                      for r in t.lost_markers],
             "lanes": [name for name, _ in LANES], "lane_of": {k: name for name, ks in LANES for k in ks}}
    blob = json.dumps(chart, ensure_ascii=True, separators=(",", ":"))
    blob = blob.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    full = json.dumps(data, ensure_ascii=True, separators=(",", ":"))
    full = full.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")

    pol = t.policy
    s = t.summary
    counts = t.counts()
    rows = t.denial_rows()
    ch = t.changes
    h: list[str] = []
    a = h.append
    a("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>")
    a("<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; style-src 'unsafe-inline'; "
      "script-src 'unsafe-inline'; img-src data:\">")
    a(f"<title>{_e(title or 'dsec replay ' + t.sandbox_id)}</title><style>{CSS}</style></head><body>")
    a(f"<header><h1>sandbox <code>{_e(t.sandbox_id)}</code></h1><div class='sub'>")
    if t.node:
        a(f"node <b>{_e(t.node)}</b> · ")
    if pol:
        a(f"policy <b>{_e(pol['name'])}</b> ({_e(pol['mode'])}, <span class='hash'>{_e(pol['hash'][:16])}</span>)")
    else:
        a("no policy")
    i = t.info
    if i:
        mem = i.get("memory")
        a(f" · network {_e(i.get('network') or '-')} · memory {f'{mem >> 20}M' if isinstance(mem, int) and mem else '-'} · "
          f"cpus {_e(i.get('cpus') or '-')} · pids {_e(i.get('pids') or '-')} · user {_e(i.get('user') or '-')} · "
          f"rootfs {_e(i.get('rootfs') or '-')}")
        img = i.get("image") or {}
        if img:
            a(f" · image <b id='image'>{_e(img.get('name'))}</b> <span class='hash' title='"
              f"{_e(' '.join(img.get('layers') or []))}'>{_e(img.get('digest'))}</span> "
              f"({len(img.get('layers') or [])} layers)")
        for v in i.get("volumes") or []:
            a(f" · volume {_e(v.get('host'))}:{_e(v.get('sandbox'))}:{_e(v.get('mode'))}")
    a("</div>")
    if s:
        st = "timed out" if s.get("timed_out") else (f"signal {s['signal']}" if s.get("signal") else f"exit {s.get('exit_code')}")
        a(f"<div class='sub'>ended: <b>{_e(st)}</b> · wall {_e(s.get('wall_ms'))} ms · cpu {_e(s.get('cpu_ms'))} ms"
          + (" · <b class='bad'>OOM-killed</b>" if s.get("oom_killed") else "") + "</div>")
    a("<dl id='counts' class='counts'>")
    for key, val in (("events", len(t.records)), ("steps", len(t.steps)), ("processes", len(t.procs)),
                     ("denials", len(rows)), ("changes", len(ch)), ("lost", t.lost)):
        a(f"<div><dt>{key}</dt><dd id='count-{key}' data-count='{val}'>{val}</dd></div>")
    a("</dl></header>")
    if t.lost:
        a(f"<div id='lost-banner' class='lost-banner'>The record has holes: {t.lost} events were lost "
          f"({len(t.lost_markers)} gap(s), red lines in the chart, LOST rows below). What happened in them is "
          f"not shown anywhere in this report.</div>")
    for r in unattributed_lost or ():
        a(f"<div class='lost-banner unattributed'>{_e(r.get('count'))} events of unknown sandboxes were lost "
          f"while this sandbox ran ({_e(r.get('extra', ''))}): some of them may be this sandbox's.</div>")

    a("<section><h2>Timeline</h2><div class='legend' id='legend'></div>"
      "<div class='chart-tools'><button id='reset' type='button'>show all steps</button> "
      "<span id='chart-stats'></span></div><div id='chart'></div>"
      "<div id='tip' class='tip' hidden></div></section>")

    a("<section><h2>Steps</h2><table id='steps'><thead><tr><th>step</th><th>command</th><th>status</th>"
      "<th>duration</th><th>notes</th></tr></thead><tbody>")
    for st in t.steps:
        notes = []
        if st.stdin is not None:
            notes.append(f"stdin {st.stdin_bytes} bytes" + (" (truncated)" if st.stdin_truncated else ""))
        if st.redacted:
            notes.append("env redacted: " + ", ".join(st.redacted))
        notes += [m for m in st.missing if not m.startswith("stdin")]
        d = st.duration_ms
        a(f"<tr data-step='{st.n}'><td>{st.n}</td><td><code>{_argv(st.argv)}</code></td>"
          f"<td class='{_status_class(st)}'>{_e(st.status())}</td><td>{'' if d is None else f'{d:.0f} ms'}</td>"
          f"<td>{_e('; '.join(notes))}</td></tr>")
    a("</tbody></table></section>")

    a(f"<section><h2>Denials <small>({len(rows)})</small></h2>")
    a("<table id='denials'><thead><tr><th>time</th><th>step</th><th>pid</th><th>process</th><th>action</th>"
      "<th>subject</th><th>decision</th><th>count</th><th>records</th></tr></thead><tbody>")
    for d in rows:
        a(f"<tr class='{d['decision']}'><td>{_ts(t, d['ts_ns'])}</td><td>{d['step']}</td><td>{d['pid']}</td>"
          f"<td><code>{_argv(d['process'], 80)}</code></td><td>{_e(d['action'])}</td>"
          f"<td><code>{_e(d['subject'])}</code></td><td><span class='dec {d['decision']}'>{d['decision']}</span></td>"
          f"<td>{d['count']}</td><td>{_e(', '.join(d['kinds']))}</td></tr>")
    if not rows:
        a("<tr class='none'><td colspan='9'>no denied or would-deny action in the record</td></tr>")
    a("</tbody></table></section>")

    a("<section><h2>Process trees</h2>")
    for n in [0] + [st.n for st in t.steps]:
        st = t.step(n)
        label = "launch (step 0)" if n == 0 else f"step {n}: <code>{_argv(st.argv if st else [], 100)}</code>"
        a(f"<div class='step-tree' data-step='{n}'><h3>{label}</h3>{_tree(t, n)}</div>")
    a("</section>")

    a(f"<section><h2>Files changed <small>({len(ch)})</small></h2>")
    if t.changes_note:
        a(f"<p class='note'>{_e(t.changes_note)}</p>")
    a("<table id='changes'><thead><tr><th>change</th><th>kind</th><th>path</th><th>size</th><th>mode</th>"
      "<th>sha256 / target</th></tr></thead><tbody>")
    for c in ch:
        a(f"<tr class='{_e(c.get('change'))}'><td>{_e(c.get('change'))}</td><td>{_e(c.get('kind'))}</td>"
          f"<td><code>{_e(c.get('path'))}</code></td><td>{_e(c.get('size', ''))}</td>"
          f"<td>{_e(oct(c['mode']) if isinstance(c.get('mode'), int) else c.get('mode', ''))}</td>"
          f"<td class='hash'>{_e(c.get('sha256') or c.get('target') or '')}</td></tr>")
    if not ch:
        a("<tr class='none'><td colspan='6'>no change recorded in the upper layer</td></tr>")
    a("</tbody></table></section>")

    a("<section><h2>All events</h2><details><summary>"
      f"{len(t.records)} events, time-ordered</summary><table id='events'><thead><tr><th>time</th><th>step</th>"
      "<th>pid</th><th>event</th><th>decision</th></tr></thead><tbody>")
    for r in t.records[:EVENT_LIST_MAX]:
        if r["kind"] == "fork":
            continue
        cls = "lost" if r["kind"] == "events_lost" else (r.get("decision") or "")
        a(f"<tr class='{_e(cls)}'><td>{_ts(t, r['ts_ns'])}</td><td>{r.get('step', 0)}</td>"
          f"<td>{r.get('pid') or ''}</td><td><code>{_e(describe(r))}</code></td><td>{_e(r.get('decision') or '')}</td></tr>")
    a("</tbody></table>")
    if len(t.records) > EVENT_LIST_MAX:
        a(f"<p class='note'>first {EVENT_LIST_MAX} of {len(t.records)} events; `dsec events` has all.</p>")
    a("</details></section>")
    a("<footer>dsec replay · generated from the audit record in ClickHouse · self-contained, no network</footer>")
    a(f"<script type='application/json' id='chart-data'>{blob}</script>")
    a(f"<script type='application/json' id='trajectory'>{full}</script>")
    a(f"<script>{JS}</script></body></html>")
    return "".join(h)


CSS = """
body{font:14px/1.4 system-ui,-apple-system,'DejaVu Sans',sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:16px 24px}header h1{margin:0 0 4px;font-size:20px}
header .sub{color:#c9d1e0;margin:2px 0}header code{color:#fff}
.counts{display:flex;gap:18px;margin:10px 0 0;padding:0}.counts div{background:#2c3446;padding:6px 12px;border-radius:6px}
.counts dt{font-size:11px;text-transform:uppercase;color:#9fb0cc}.counts dd{margin:0;font-size:18px;font-weight:600}
section{background:#fff;margin:16px 24px;padding:12px 16px;border-radius:8px;box-shadow:0 1px 2px rgba(0,0,0,.08)}
h2{font-size:16px;margin:4px 0 10px}h3{font-size:14px;margin:10px 0 4px}
table{border-collapse:collapse;width:100%;font-size:13px}th,td{text-align:left;padding:4px 8px;border-bottom:1px solid #eceef2;vertical-align:top}
th{background:#f0f2f6;font-weight:600}code{font:12px ui-monospace,'DejaVu Sans Mono',monospace;word-break:break-all}
.hash{font:11px ui-monospace,'DejaVu Sans Mono',monospace;color:#5a6478;word-break:break-all}
.ok{color:#1a7f37}.bad{color:#c62828;font-weight:600}.unknown{color:#8a6d00}
.dec{padding:1px 6px;border-radius:4px;font-size:12px;font-weight:600}
.dec.denied{background:#fde2e2;color:#b71c1c}.dec.would-deny{background:#fff1d6;color:#9a5b00}
tr.denied td{background:#fff6f6}tr.would-deny td{background:#fffaf0}tr.lost td{background:#ffe9e9;color:#b71c1c;font-weight:600}
.lost-banner{background:#c62828;color:#fff;margin:16px 24px;padding:10px 16px;border-radius:8px;font-weight:600}
.tree,.tree ul{list-style:none;padding-left:18px;margin:2px 0}.tree{padding-left:4px}
.tree li{margin:2px 0;border-left:1px dashed #c7ccd6;padding-left:8px}.pid{color:#5a6478}.end{color:#5a6478}
.meta{font-size:12px;color:#5a6478;margin-left:4px}.none,.note{color:#6b7280;font-style:italic}
#chart{overflow-x:auto}#chart svg{display:block}.band{cursor:zoom-in}.band-label{font-size:11px;fill:#3b4252}
.lane-label{font-size:11px;fill:#5a6478}.axis{font-size:10px;fill:#6b7280}.mark{cursor:pointer}
.legend span{display:inline-block;margin-right:14px;font-size:12px}.legend i{display:inline-block;width:10px;height:10px;border-radius:50%;margin-right:4px;vertical-align:middle}
.chart-tools{margin:6px 0;font-size:12px;color:#5a6478}
.tip{position:fixed;background:#1d2330;color:#fff;padding:6px 8px;border-radius:4px;font:12px ui-monospace,monospace;max-width:640px;pointer-events:none;z-index:9}
footer{color:#8a93a6;font-size:11px;margin:16px 24px 32px}
"""

JS = r"""
"use strict";
(function () {
  var SVG = "http://www.w3.org/2000/svg";
  var data = JSON.parse(document.getElementById("chart-data").textContent);
  var COLORS = {exec: "#1565c0", connect: "#6a1b9a", write: "#2e7d32", syscall: "#ef6c00", exit: "#9e9e9e"};
  var DEC = {"denied": "#d50000", "would-deny": "#ff9100"};
  var chart = document.getElementById("chart");
  var tip = document.getElementById("tip");
  function el(name, attrs, parent) {
    var e = document.createElementNS(SVG, name);
    for (var k in attrs) { if (Object.prototype.hasOwnProperty.call(attrs, k)) e.setAttribute(k, attrs[k]); }
    if (parent) parent.appendChild(e);
    return e;
  }
  function legend() {
    var lg = document.getElementById("legend");
    data.lanes.forEach(function (l) {
      var s = document.createElement("span"); var i = document.createElement("i");
      i.style.background = COLORS[l] || "#777"; s.appendChild(i); s.appendChild(document.createTextNode(l)); lg.appendChild(s);
    });
    [["denied", DEC.denied], ["would-deny", DEC["would-deny"]]].forEach(function (d) {
      var s = document.createElement("span"); var i = document.createElement("i");
      i.style.border = "2px solid " + d[1]; i.style.background = "#fff"; s.appendChild(i);
      s.appendChild(document.createTextNode(d[0] + " (ring)")); lg.appendChild(s);
    });
    var s = document.createElement("span"); var i = document.createElement("i");
    i.style.background = "#c62828"; i.style.borderRadius = "0"; i.style.width = "3px";
    s.appendChild(i); s.appendChild(document.createTextNode("lost events")); lg.appendChild(s);
  }
  function showTip(evt, text) {
    tip.textContent = text; tip.hidden = false;
    tip.style.left = Math.min(evt.clientX + 12, window.innerWidth - 660) + "px"; tip.style.top = (evt.clientY + 12) + "px";
  }
  function hideTip() { tip.hidden = true; }
  var cur = null;
  function draw(lo, hi) {
    cur = [lo, hi];
    while (chart.firstChild) chart.removeChild(chart.firstChild);
    var W = Math.max(900, chart.clientWidth || 1100), left = 90, right = 20, top = 34, laneH = 34;
    var H = top + laneH * data.lanes.length + 30;
    var svg = el("svg", {width: W, height: H, viewBox: "0 0 " + W + " " + H, role: "img",
                         "aria-label": "timeline of the sandbox's events"}, chart);
    var span = Math.max(hi - lo, 1);
    function x(ns) { return left + (W - left - right) * (ns - lo) / span; }
    var bands = el("g", {"class": "bands"}, svg);
    data.steps.forEach(function (s, i) {
      var x0 = Math.max(x(s.start), left), x1 = Math.min(x(Math.max(s.end, s.start)), W - right);
      if (x1 < left || x0 > W - right) return;
      var r = el("rect", {x: x0, y: top - 22, width: Math.max(x1 - x0, 2), height: H - top - 8,
                          fill: i % 2 ? "#eef3fb" : "#f4f8ee", "class": "band", "data-step": s.n}, bands);
      var t = el("title", {}, r); t.textContent = "step " + s.n + ": " + s.argv + " (" + s.status + ")";
      r.addEventListener("click", function () { var pad = Math.max((s.end - s.start) * 0.05, 1e6); draw(s.start - pad, s.end + pad); });
      var lab = el("text", {x: x0 + 3, y: top - 10, "class": "band-label"}, bands);
      lab.textContent = "step " + s.n;
    });
    data.lanes.forEach(function (l, i) {
      var y = top + laneH * i + laneH / 2;
      el("line", {x1: left, x2: W - right, y1: y, y2: y, stroke: "#e3e6ec"}, svg);
      var t = el("text", {x: 8, y: y + 4, "class": "lane-label"}, svg); t.textContent = l;
    });
    for (var k = 0; k <= 5; k++) {
      var ns = lo + span * k / 5, ax = el("text", {x: x(ns), y: H - 8, "class": "axis", "text-anchor": "middle"}, svg);
      var sec = (ns - data.t0) / 1e9;
      ax.textContent = (sec < -0.0005 ? "-" : "+") + Math.abs(sec).toFixed(3) + "s";
    }
    var g = el("g", {"class": "marks"}, svg), drawn = 0;
    data.marks.forEach(function (m) {
      if (m.ts_ns < lo || m.ts_ns > hi) return;
      var lane = data.lanes.indexOf(data.lane_of[m.kind]);
      var y = top + laneH * lane + laneH / 2;
      var dec = DEC[m.decision];
      var c = el("circle", {cx: x(m.ts_ns), cy: y, r: dec ? 6 : 4, fill: COLORS[data.lane_of[m.kind]] || "#777",
                            stroke: dec || "#fff", "stroke-width": dec ? 3 : 1, "class": "mark",
                            "data-kind": m.kind, "data-decision": m.decision || "allowed", "data-step": m.step}, g);
      var label = "+" + ((m.ts_ns - data.t0) / 1e9).toFixed(6) + "s step " + m.step + " [" + (m.pid || "") + "] " +
                  m.label + (dec ? "  [" + m.decision + "]" : "");
      var t = el("title", {}, c); t.textContent = label;
      c.addEventListener("mousemove", function (evt) { showTip(evt, label); });
      c.addEventListener("mouseleave", hideTip);
      drawn++;
    });
    var lost = el("g", {"class": "lost"}, svg), nlost = 0;
    data.lost.forEach(function (m) {
      if (m.ts_ns < lo || m.ts_ns > hi) return;
      var ln = el("line", {x1: x(m.ts_ns), x2: x(m.ts_ns), y1: top - 22, y2: H - 20, stroke: "#c62828",
                           "stroke-width": 3, "stroke-dasharray": "6 3", "class": "lost-marker"}, lost);
      var t = el("title", {}, ln); t.textContent = "LOST: " + m.count + " events not recorded (step " + m.step + ")";
      var lab = el("text", {x: x(m.ts_ns) + 4, y: H - 22, fill: "#c62828", "font-size": 11, "font-weight": "bold"}, lost);
      lab.textContent = "LOST " + m.count;
      nlost++;
    });
    document.getElementById("chart-stats").textContent =
      drawn + " of " + data.marks.length + " events shown, " + data.steps.length + " steps" +
      (data.lost.length ? ", " + nlost + " lost-event gap(s)" : "");
    chart.setAttribute("data-marks", String(drawn));
  }
  var lo = data.t0, hi = Math.max(data.t_end, data.t0 + 1);
  var pad = (hi - lo) * 0.02;
  legend();
  draw(lo - pad, hi + pad);
  document.getElementById("reset").addEventListener("click", function () { draw(lo - pad, hi + pad); });
  var timer = null;
  window.addEventListener("resize", function () {
    if (timer) clearTimeout(timer);
    timer = setTimeout(function () { draw(cur[0], cur[1]); }, 100);
  });
  document.documentElement.setAttribute("data-rendered", "1");
})();
"""
