"""Errors dsec reports as one clear line, with a documented exit code.

Exit codes (see README "Exit codes"):
  dsec run:        CMD's own status; 124 timeout; 125 dsec failed (including bad
                   usage and missing prerequisites); 126 CMD not executable;
                   127 CMD not found; 128+N killed by signal N.
  other commands:  0 ok; 1 failure or finding; 2 bad usage or bad input.
"""

from audit_schema.errors import ReportedError

EXIT_USAGE = 2
EXIT_TIMEOUT = 124
EXIT_DSEC = 125
EXIT_NOEXEC = 126
EXIT_NOTFOUND = 127


class DsecError(ReportedError):
    """A failure of the agent (launcher, sensors, node) with a one-line message and
    an exit code; never shown as a traceback. The other packages raise their own
    ReportedError subclasses (PoliciesError, SchemaError, ExportError, ReplayError);
    catch ReportedError where any of them may arrive."""


class UsageError(DsecError):
    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message, code)


def exit_code(e: ReportedError, usage_exit: int = EXIT_USAGE) -> int:
    """The one place an error becomes an exit code (agent/cli.py).

    A command whose exit statuses are its workload's (`dsec run`: usage_exit
    125) exits usage_exit for every error of dsec's own, so CMD's 1 and 2 stay
    unambiguous; the other commands exit the error's code (2 bad input or
    usage, 1 a failure)."""
    if usage_exit != EXIT_USAGE and e.code in (1, EXIT_USAGE):
        return usage_exit
    return e.code


def guarded(command: str, usage_exit: int, fn):
    """fn()'s result, with every error it raises as one line on stderr and its exit code: the one
    mapping of errors to exit codes (agent/cli.py, and `dsec run`'s fast path: agent/entry.py)."""
    import os
    import sys
    try:
        return fn()
    except ReportedError as e:          # every package's errors (audit_schema/errors.py)
        sys.stderr.write(f"dsec {command}: error: {e.message}\n")
        return exit_code(e, usage_exit)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 1
    except Exception as e:  # noqa: BLE001 - a bug of ours: still one line, unless asked
        if os.environ.get("DSEC_DEBUG"):
            raise
        import traceback
        where = traceback.extract_tb(e.__traceback__)[-1]
        sys.stderr.write(f"dsec {command}: internal error: {type(e).__name__}: {e} "
                         f"(at {os.path.basename(where.filename)}:{where.lineno}; DSEC_DEBUG=1 for a traceback)\n")
        return usage_exit if command == "run" else 1
