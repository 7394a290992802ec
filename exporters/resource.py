"""The OpenTelemetry resource of everything dsec exports (logs, traces, metrics).

Shared by exporters/otel.py (audit logs, lifecycle traces) and
exporters/metrics.py (the agent's own metrics), so both carry the same
service.name / service.version / OTEL_RESOURCE_ATTRIBUTES.
"""
from __future__ import annotations

import os

_BASE_RESOURCE: dict = {}


def base_resource():
    """Resource.create() (OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME) with
    service.name defaulting to "dsec" and service.version = dsec's."""
    key = (os.environ.get("OTEL_SERVICE_NAME"), os.environ.get("OTEL_RESOURCE_ATTRIBUTES"))
    r = _BASE_RESOURCE.get(key)
    if r is None:
        from opentelemetry.sdk.resources import Resource
        r = Resource.create()
        named = os.environ.get("OTEL_SERVICE_NAME") or any(
            p.strip().startswith("service.name=") for p in (os.environ.get("OTEL_RESOURCE_ATTRIBUTES") or "").split(","))
        extra = {"service.version": dsec_version()}
        if not named:
            extra["service.name"] = "dsec"
        r = _BASE_RESOURCE[key] = r.merge(Resource(extra))
    return r


def agent_resource(node: str | None = None):
    """The resource of the agent's own telemetry (metrics)."""
    from opentelemetry.sdk.resources import Resource
    return base_resource().merge(Resource({"host.name": node or os.uname().nodename}))


def dsec_version() -> str:
    try:
        from importlib.metadata import version
        return version("dsec")
    except Exception:  # noqa: BLE001
        return "0"
