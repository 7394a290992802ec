"""The error type of replay (the audit store, trajectories, what-if, re-runs, search).

One clear line and a suggested exit code (audit_schema/errors.py); the
command line maps it to an exit code (agent/cli.py).
"""
from audit_schema.errors import USAGE, ReportedError

__all__ = ["ReplayError", "USAGE"]


class ReplayError(ReportedError):
    pass
