"""The error type of policies (model, load, learn, merge, promote, strace, oci); PolicyError and the others derive from it.

One clear line and a suggested exit code (audit_schema/errors.py); the
command line maps it to an exit code (agent/cli.py).
"""
from audit_schema.errors import USAGE, ReportedError

__all__ = ["PoliciesError", "USAGE"]


class PoliciesError(ReportedError):
    pass
