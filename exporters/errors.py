"""The error type of exporters (the spool, the sinks, the private ClickHouse).

One clear line and a suggested exit code (audit_schema/errors.py); the
command line maps it to an exit code (agent/cli.py).
"""
from audit_schema.errors import USAGE, ReportedError

__all__ = ["ExportError", "USAGE"]


class ExportError(ReportedError):
    pass
