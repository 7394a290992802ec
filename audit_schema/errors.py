"""Errors dsec reports as one clear line with a suggested exit code.

ReportedError is the base every package's own error type derives from
(policies.errors.PoliciesError, exporters.errors.ExportError,
replay.errors.ReplayError, SchemaError here, agent.errors.DsecError): a
message naming the file, line, field or value at fault where there is one,
and `code`, USAGE (2) for bad input or 1 for a failure. The command line
maps them to exit codes in one place (agent/cli.py). It lives in this leaf
package because every other package may import it.
"""

USAGE = 2


class ReportedError(Exception):
    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.message = message
        self.code = code

    def __str__(self) -> str:
        return self.message


class SchemaError(ReportedError):
    """The audit schema or a ClickHouse migration cannot be used."""
