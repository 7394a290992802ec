"""dsec: the command-line entry point.

Each subcommand lives in agent/commands/<name>.py and provides
  HELP: str                      one-line summary
  register(parser)               add its arguments to an argparse parser
  run(args) -> int               do the work, return the exit code
  USAGE_EXIT: int (optional)     exit code for bad usage (default 2)

Errors are one line on stderr ("dsec <cmd>: error: ..."), never a traceback
(agent/errors.py guarded: the one place errors become exit codes).
"""
from __future__ import annotations

import argparse
import importlib
import sys

from agent.errors import EXIT_USAGE, guarded

COMMANDS = ["run", "image", "snapshot", "events", "replay", "search", "learn", "policy", "export", "agent", "resize", "cluster", "clickhouse", "gc"]


class _Parser(argparse.ArgumentParser):
    usage_exit = EXIT_USAGE

    def error(self, message):  # one line, documented exit code
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(self.usage_exit)


def _load(name):
    try:
        return importlib.import_module(f"agent.commands.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"agent.commands.{name}":
            return None
        raise


def build_parser(only: str | None = None):
    top = _Parser(prog="dsec", description="eBPF security and observability agent for untrusted-code sandboxes")
    sub = top.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    mods = {}
    for name in COMMANDS:
        if only and name != only:
            continue
        mod = _load(name)
        if mod is None:
            continue
        p = sub.add_parser(name, help=mod.HELP, description=(mod.__doc__ or mod.HELP),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.usage_exit = getattr(mod, "USAGE_EXIT", EXIT_USAGE)
        mod.register(p)
        p.set_defaults(_mod=mod)
        mods[name] = mod
    return top, mods


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Import only the chosen subcommand: `dsec run` must start fast.
    first = argv[0] if argv else None
    top, mods = build_parser(first if first in COMMANDS else None)
    if first in mods:
        # parse with the subcommand's own parser so its errors name it and use its exit code
        sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
        args = sub.choices[first].parse_args(argv[1:])
        args.command = first
    else:
        args = top.parse_args(argv)
    if not getattr(args, "_mod", None):
        top.print_help(sys.stderr)
        return EXIT_USAGE
    usage_exit = getattr(args._mod, "USAGE_EXIT", EXIT_USAGE)
    return guarded(args.command, usage_exit, lambda: int(args._mod.run(args) or 0))


if __name__ == "__main__":
    sys.exit(main())
