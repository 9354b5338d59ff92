"""The ``place`` command line: parse, build a config, call one library function, print.

Every user error (:class:`foundation.errors.MoeplaceError`) becomes one line on stderr and its exit code;
no traceback reaches the user for bad input. So do the failures of the surroundings a command cannot
help: standard output closed, full or unable to encode a character, the current directory deleted, the
open-file limit reached, a stop signal (SIGINT, SIGTERM, SIGHUP). With ``--json`` a failure also prints
one JSON object on stdout, ``{"ok": false, "error": ..., "exit_code": ...}`` (added to the command's own
object when it had printed one: results printed before an output could not be written).
"""
from __future__ import annotations

import argparse
import errno
import importlib
import json
import os
import pkgutil
import signal
import sys

from moeplace.cli import commands, paths
from moeplace.cli.run_config import apply_config
from moeplace.foundation import limits, progress
from moeplace.foundation.errors import MoeplaceError
from moeplace.foundation.files import Terminated, display, raise_on_sigterm

_PARSE_ERROR: list[str] = []  # the last argparse error line (for --json)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: a bad flag prints ``place: error: argument --x: ...`` and exits
    2, like every other input error (argparse's default prints the whole usage block first)."""

    def error(self, message: str):
        _PARSE_ERROR[:] = [f"{message} (see '{self.prog} --help')"]
        self.exit(2, f"place: error: {_PARSE_ERROR[0]}\n")


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


class _Stdout:
    """``sys.stdout`` during a command. It remembers whether a write to it failed (then the failure is
    standard output's, and nothing more can be printed there). With ``--json`` it holds what the command
    prints until the end: on success that is printed as it was; on failure the command's object (results
    printed before an output could not be written) gets ``ok``, ``error`` and ``exit_code`` added, so
    stdout still holds exactly one JSON object."""

    def __init__(self, stream, hold: bool = False) -> None:
        self._stream = stream
        self._held: list[str] | None = [] if hold else None
        self.failed: OSError | None = None

    def write(self, text: str) -> int:
        if self._held is not None:
            self._held.append(text)
            return len(text)
        try:
            return self._stream.write(text)
        except OSError as exc:
            self.failed = exc
            raise

    def flush(self) -> None:
        if self._held is not None:
            return
        try:
            self._stream.flush()
        except OSError as exc:
            self.failed = exc
            raise

    def release(self) -> None:
        """Print what was held (the command succeeded)."""
        text, self._held = "".join(self._held or ()), None
        if text:
            self.write(text)
        self.flush()

    def take_object(self) -> dict:
        """The JSON object the command printed so far (``{}`` if none, or not one object); nothing is held
        any more."""
        text, self._held = "".join(self._held or ()), None
        try:
            doc = json.loads(text) if text.strip() else {}
        except ValueError:
            return {}
        return doc if isinstance(doc, dict) else {}

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _safe_encoding(stream) -> None:
    """A character the stream's encoding cannot hold (``PYTHONIOENCODING=ascii`` and a '—' or a path in
    another script) is written as ``\\u2014`` instead of failing the command after its work."""
    reconfigure = getattr(stream, "reconfigure", None)
    if reconfigure is not None and getattr(stream, "errors", "strict") == "strict":
        try:
            reconfigure(errors="backslashreplace")
        except (ValueError, OSError, AttributeError):
            pass


def _discard_stdout(stream) -> None:
    """After a write to standard output failed (full device, closed pipe): point file descriptor 1 at
    /dev/null, so that the text still buffered is dropped quietly instead of failing again at exit."""
    try:
        if stream.fileno() == 1:
            fd = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd, 1)
            os.close(fd)
        stream.flush()
    except (OSError, ValueError, AttributeError):
        pass


_ENVIRONMENT_ERRNOS = {errno.EMFILE: "raise the limit (ulimit -n 4096) or use fewer --workers",
                       errno.ENFILE: "the system's open-file table is full; close other programs or retry",
                       errno.ENOSPC: "free space and run it again", errno.EDQUOT: "free space and run it again",
                       errno.EROFS: "write somewhere writable", errno.EIO: "check the device",
                       errno.ENOMEM: "free memory or give the command less to do",
                       # a path inside a file the command read (the command line's are checked by cli.paths)
                       errno.ENAMETOOLONG: "a name in the path is longer than the file system allows; shorten it"}


def _environment_error(exc: OSError) -> str | None:
    """One line for an ``OSError`` of the surroundings (too many open files, disk full...), or ``None`` for
    one that is not (a bug: it keeps its traceback)."""
    hint = _ENVIRONMENT_ERRNOS.get(exc.errno)
    if hint is None:
        return None
    where = f" ({display(exc.filename)})" if exc.filename is not None else ""
    extra = ""
    if exc.errno == errno.EMFILE:
        try:
            import resource
            extra = f"; the limit is {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}"
        except (ImportError, OSError, ValueError):
            pass
    return f"{exc.strerror or exc}{where}{extra}: {hint}"


def main(argv: list[str] | None = None) -> int:
    wants_json = "--json" in (sys.argv[1:] if argv is None else argv)
    stderr = sys.stderr
    if stderr is not None:
        _safe_encoding(stderr)

    def fail(message: str, code: int, out: _Stdout | None = None, line: bool = True) -> int:
        message = " ".join(message.split("\n"))
        if line and stderr is not None:
            try:
                print("place: error: " + message, file=stderr)
            except OSError:
                pass
        if wants_json and (out is None or out.failed is None) and sys.stdout is not None:
            doc = out.take_object() if out is not None else {}
            doc.update({"ok": False, "error": message, "exit_code": code})
            try:
                print(json.dumps(doc, indent=1 if len(doc) > 3 else None, default=str),
                      file=out._stream if out is not None else sys.stdout)
            except OSError:
                pass
        return code

    if sys.stdout is None:  # `place ... >&-`: every command prints its result there
        return fail("standard output is closed (>&-); redirect it to /dev/null to discard what the command "
                    "prints", 2)
    _safe_encoding(sys.stdout)
    try:
        os.getcwd()
    except FileNotFoundError:
        return fail("the current directory no longer exists (deleted while the shell was in it?); cd to an "
                    "existing directory", 2)
    # SIGTERM and SIGHUP unwind like Ctrl-C, so temporaries and child processes are cleaned up on every exit
    # path (start-up included: a signal while the commands are imported is one line too)
    raise_on_sigterm()
    _PARSE_ERROR.clear()
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        paths.check_args(parser, args, only={"config"})  # the one path read before the others are known
        args = apply_config(parser, argv, args)  # --config FILE: the file's flags, the command line's win
        paths.check_args(parser, args)  # every path the command reads: length, kind, presence
    except SystemExit as exc:  # --help (0) or a bad flag (2, its one line already printed)
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 2
        if code and wants_json and _PARSE_ERROR:
            print(json.dumps({"ok": False, "error": _PARSE_ERROR[0], "exit_code": code}))
        return code
    except MoeplaceError as exc:
        return fail(str(exc), exc.exit_code)
    except KeyboardInterrupt as exc:
        return _stopped(exc, fail, None)
    wants_json = bool(getattr(args, "json", False))
    real = sys.stdout
    out = _Stdout(real, hold=wants_json)
    sys.stdout = out
    try:
        # commands with --no-progress draw bars on stderr for their long steps (foundation.progress)
        with progress.enabled(hasattr(args, "no_progress") and progress.wanted(args.no_progress)):
            code = int(args.func(args) or 0)
        out.release()  # a full standard output fails here, inside the command, not at exit
        return code
    except MoeplaceError as exc:
        return fail(str(exc), exc.exit_code, out)
    except MemoryError as exc:  # an allocation no estimate foresaw (the estimates refuse what they know of)
        return fail(limits.out_of_memory_line(exc), 1, out)
    except KeyboardInterrupt as exc:  # Terminated (SIGTERM, SIGHUP) included
        return _stopped(exc, fail, out)
    except BrokenPipeError:  # `place ... | head`: the reader has what it wanted
        _discard_stdout(real)
        return 0
    except OSError as exc:
        if out.failed is not None:
            _discard_stdout(real)
            return fail(f"could not write to standard output ({exc.strerror or exc}); what the command printed "
                        "there is lost", 1, out)
        line = _environment_error(exc)
        if line is None:
            raise
        return fail(line, 1, out)
    finally:
        sys.stdout = real


def _stopped(exc: KeyboardInterrupt, fail, out: _Stdout | None) -> int:
    """A stop signal is not an error of the input: ``place: interrupted`` / ``place: terminated
    (SIGHUP)`` on stderr, no ``error:``; exit 128 + the signal, as a shell reports it."""
    what, code = "interrupted", 130
    if isinstance(exc, Terminated):
        hup = exc.signum == getattr(signal, "SIGHUP", None)
        what, code = "terminated" + (" (SIGHUP)" if hup else ""), 128 + exc.signum
    try:
        print(f"place: {what}", file=sys.stderr)
    except (OSError, AttributeError):
        pass
    return fail(what, code, out, line=False)


if __name__ == "__main__":
    sys.exit(main())
