"""Errors dsec reports as one clear line, with a documented exit code.

Exit codes (see README "Exit codes"):
  dsec run:        CMD's own status; 124 timeout; 125 dsec failed (including bad
                   usage and missing prerequisites); 126 CMD not executable;
                   127 CMD not found; 128+N killed by signal N.
  other commands:  0 ok; 1 failure or finding; 2 bad usage or bad input.
"""

EXIT_USAGE = 2
EXIT_TIMEOUT = 124
EXIT_DSEC = 125
EXIT_NOEXEC = 126
EXIT_NOTFOUND = 127


class DsecError(Exception):
    """A failure with a one-line message and an exit code; never shown as a traceback."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.message = message
        self.code = code

    def __str__(self) -> str:
        return self.message


class UsageError(DsecError):
    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message, code)
