"""The Prometheus text exposition format (version 0.0.4) of the agent's metrics.

    text = render(metric_families(METRICS.snapshot()) + extra)     # what GET /metrics answers
    Family("dsec_scheduler_queue_depth", "gauge", "requests queued", [({"class": "standard"}, 3)])

metric_families() maps exporters/metrics.py's instruments to Prometheus names
the usual way (dots -> underscores, counters end in `_total`, the unit as a
suffix: `_seconds`, `_bytes`), histograms with cumulative `le` buckets, `_sum`
and `_count`. Extra families (the scheduler, per-sandbox figures) come from the
caller. Label values are escaped; names are fixed here, never from input.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from exporters.metrics import BUCKETS, COUNTER, GAUGE, HISTOGRAM, INSTRUMENTS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_UNIT = {"s": "_seconds", "By": "_bytes"}
# instruments without attributes: shown at 0 before their first value (rate() needs the start)
_UNLABELLED = ("dsec.sandbox.launch.duration", "dsec.scheduler.wait", "dsec.ringbuf.lag")


@dataclass
class Family:
    name: str
    type: str                      # counter | gauge | histogram
    help: str
    samples: list = field(default_factory=list)    # [(labels dict, value)]; histogram: value = hist dict


def prom_name(name: str, kind: str, unit: str = "") -> str:
    base = name.replace(".", "_").replace("-", "_")
    suffix = _UNIT.get(unit, "")
    if suffix and not base.endswith(suffix):
        base += suffix
    if kind == COUNTER and not base.endswith("_total"):
        base += "_total"
    return base


def metric_families(snapshot: dict) -> list[Family]:
    """exporters.metrics.METRICS.snapshot() as families (every instrument, even empty)."""
    out = []
    for name, (kind, unit, desc) in INSTRUMENTS.items():
        series = snapshot.get(name) or {}
        if not series and name in _UNLABELLED and kind == HISTOGRAM:
            series = {(): {"count": 0, "sum": 0.0, "buckets": {}}}
        fam = Family(prom_name(name, kind, unit), kind, desc)
        for key, v in sorted(series.items(), key=lambda kv: kv[0]):
            fam.samples.append((dict(key), v))
        out.append(fam)
    return out


def _escape(v) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(d: dict) -> str:
    if not d:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in d.items()) + "}"


def _num(v) -> str:
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(int(v)) if v.is_integer() and abs(v) < 1 << 53 else repr(v)


def render(families) -> str:
    lines = []
    for f in families:
        lines.append(f"# HELP {f.name} {_escape(f.help)}")
        lines.append(f"# TYPE {f.name} {f.type}")
        for labels, v in f.samples:
            if f.type == HISTOGRAM:
                acc = 0
                for b in BUCKETS:
                    acc += int(v["buckets"].get(str(b), 0))
                    le = "+Inf" if math.isinf(b) else repr(b)
                    lines.append(f"{f.name}_bucket{_labels({**labels, 'le': le})} {acc}")
                lines.append(f"{f.name}_sum{_labels(labels)} {_num(v['sum'])}")
                lines.append(f"{f.name}_count{_labels(labels)} {int(v['count'])}")
            else:
                lines.append(f"{f.name}{_labels(labels)} {_num(v)}")
    return "\n".join(lines) + "\n"


__all__ = ["CONTENT_TYPE", "Family", "metric_families", "prom_name", "render", "COUNTER", "GAUGE", "HISTOGRAM"]
