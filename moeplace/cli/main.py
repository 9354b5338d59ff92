"""The ``place`` command line: parse, build a config, call one library function, print.

Every user error (:class:`foundation.errors.MoeplaceError`) becomes one line on stderr and its exit code;
no traceback reaches the user for bad input.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from moeplace.cli import commands
from moeplace.cli.run_config import apply_config
from moeplace.foundation import limits, progress
from moeplace.foundation.errors import MoeplaceError
from moeplace.foundation.files import Terminated, raise_on_sigterm


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: a bad flag prints ``place: error: argument --x: ...`` and exits
    2, like every other input error (argparse's default prints the whole usage block first)."""

    def error(self, message: str):
        self.exit(2, f"place: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="place", description="moeplace: routing traces, expert placement, cluster simulation for huge MoE models")
    # commands that run other commands (the demo) call ``args.place(argv)``: this very entry point, handed
    # down instead of imported, so no command module imports the dispatcher that imports it
    parser.set_defaults(place=main)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        mod = importlib.import_module(f"{commands.__name__}.{info.name}")
        group = getattr(mod, "GROUP", None)
        if group is None:
            mod.register(sub)
            continue
        if group not in groups:
            gp = sub.add_parser(group, help=commands.GROUP_HELP.get(group, f"{group} commands"))
            groups[group] = gp.add_subparsers(dest=f"{group}_command", metavar="SUBCOMMAND", required=True)
        mod.register(groups[group])
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a bad flag (2, its one line already printed)
        return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 2
    try:
        args = apply_config(parser, argv, args)  # --config FILE: the file's flags, the command line's win
    except SystemExit as exc:
        return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 2
    except MoeplaceError as exc:
        print("place: error: " + " ".join(str(exc).split("\n")), file=sys.stderr)
        return exc.exit_code
    # SIGTERM unwinds like Ctrl-C, so temporaries and child processes are cleaned up on every exit path
    raise_on_sigterm()
    try:
        # commands with --no-progress draw bars on stderr for their long steps (foundation.progress)
        with progress.enabled(hasattr(args, "no_progress") and progress.wanted(args.no_progress)):
            return int(args.func(args) or 0)
    except MoeplaceError as exc:
        print("place: error: " + " ".join(str(exc).split("\n")), file=sys.stderr)
        return exc.exit_code
    except MemoryError as exc:  # an allocation no estimate foresaw (the estimates refuse what they know of)
        print("place: error: " + limits.out_of_memory_line(exc), file=sys.stderr)
        return 1
    except Terminated:
        print("place: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("place: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
