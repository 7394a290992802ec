"""dsec's entry point, started without `site` (python -S).

scripts/setup.sh writes .venv/bin/dsec over pip's console script:

    #!<venv>/bin/python -S
    import sys; sys.path.insert(0, "<project>")
    from agent.entry import main; sys.exit(main())

Why: `site` is most of a bare interpreter's start-up here (measured: 30.6 ms with
it, 7.0 ms without; 23.5 ms of it is site itself, mostly the .pth files of the
system's dist-packages, which the venv includes for BCC and libseccomp's
bindings), and `dsec run` through the node agent needs the standard library
only (a test keeps it so). Nothing is given up: the first import that neither
the standard library nor the project can satisfy runs site.main() once -- the
venv's site-packages, the system's dist-packages, their .pth files, as an
ordinary start would have -- and is looked up again; every later import sees
the full path. A command that needs third-party packages pays site's cost at
its first such import instead of at start-up.

`dsec run [--option VALUE ...] -- CMD` goes to agent/commands/run.py fast() before
the CLI is built: through a running agent it needs neither argparse nor the
modules argparse, json and socket import (enum, re, ...), and the process ends
with os._exit once the run is over. fast() declines (None) before it sends
anything, and the ordinary CLI runs.
"""
from __future__ import annotations

import sys


class _SiteOnFirstMiss:
    """A last-resort finder on sys.meta_path: consulted only when every other
    finder failed for a top-level module."""

    def find_spec(self, name, path=None, target=None):
        if path is not None:             # a submodule: its package was found without site
            return None
        load_site()
        import importlib.util
        return importlib.util.find_spec(name)


_FINDER = _SiteOnFirstMiss()


def load_site() -> None:
    """What `site` does at an ordinary start-up, once: the finder leaves
    sys.meta_path first, so it never asks again."""
    sys.meta_path.remove(_FINDER)
    import site
    site.main()


def main() -> int:
    if sys.flags.no_site:
        sys.meta_path.append(_FINDER)
    if sys.argv[1:2] == ["run"]:
        # `dsec run ... -- CMD` through a running agent, without argparse & co. (agent/commands/run.py
        # fast); it declines (None) before sending anything when the ordinary way is needed
        from agent.commands.run import fast
        rc = fast(sys.argv[2:])
        if rc is not None:
            _exit_now(rc)
    from agent.cli import main as cli_main
    return cli_main()


def _exit_now(rc: int):
    """Exit without the interpreter's finalisation (~3-6 ms of module teardown after the run is
    over: its record is durable in the agent's spool, its output written with os.write)."""
    import os
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)
