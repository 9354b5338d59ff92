"""The commands of README.md and docs/*.md, read from their fenced blocks (tests/test_docs_run.py runs them).

A fenced block (indented in a list item or not) holds commands when its lines start with a ``$ `` prompt (then only those lines are
commands; the rest is output), or, without prompts, when it is tagged ``bash``/``sh``/``shell``/``console``
or a line starts with ``place `` or ``make ``: then every line is a command. ``\\``-continued lines are
joined, ``#`` comments dropped. Any other block (output, tables, diagrams, JSON, ``python``) holds none.

A block whose commands the default suite cannot run carries a marker in the doc, an HTML comment at most
five lines above its fence (above a ``<!-- figure: NAME -->`` line when the block is a generated figure,
so that ``bench/figures.py`` keeps it): ``<!-- doc-test: KIND [why] -->``, KIND one of

- ``slow``: runs verbatim in the slow test (``make test-slow``); the default suite parses it;
- ``hardware``: needs a GPU, a serving engine or a cluster (or files they wrote): parsed only;
- ``external``: reads a data set from outside the repository: parsed only;
- ``server``: starts a server that runs until stopped: parsed only;
- ``synopsis``: a usage pattern (``[--flag V]``), not a command: every ``--flag`` it names must be an
  option of that subcommand.

"Parsed" is the ``place`` parser's own ``parse_args`` (a renamed or removed flag fails); a ``python -m
sglang.launch_server`` / ``vllm serve`` line of a marked block is checked against the engine release's
recorded options (``placement.export.engines``); ``make T`` is checked with ``make -n T``. The expected
exit code of a command: 2 when its shown output is ``place: error: ...`` (and the error must match), ``N``
when its comment or output says ``exit code N``, else 0.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KINDS = ("slow", "hardware", "external", "server", "synopsis")
SHELL_TAGS = ("bash", "sh", "shell", "console", "zsh")
MARK_REACH = 5  # lines between a marker and the fence it marks, at most
WRITE_FLAGS = ("--out", "--save-all", "--report", "--launch-out")

_MARK = re.compile(r"<!-- doc-test: (\S+)(?: (.*?))? -->")
_EXIT = re.compile(r"exit code (\d+)")


@dataclass
class Command:
    doc: str            # "docs/export.md"
    line: int           # 1-based line of the command's first line
    text: str           # the command as written (continuations joined, prompt dropped, comment kept)
    argv: list[str]     # shell words, comment dropped
    mark: str | None    # the block's marker kind (None: the default suite runs it)
    rc: int = 0         # the exit code the doc shows
    error: str | None = None  # the shown ``place: error:`` text
    output: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"

    @property
    def program(self) -> str:
        return self.argv[0] if self.argv else ""

    def writes(self) -> list[str]:
        """The paths the command names as outputs (the value after ``--out`` and the like)."""
        return [self.argv[i + 1] for i, a in enumerate(self.argv[:-1]) if a in WRITE_FLAGS]


@dataclass
class Block:
    doc: str
    line: int                 # the opening fence's line
    tag: str
    lines: list[str]
    mark: str | None
    why: str | None


def doc_name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path``, with the marker above it. A marker that marks no block within
    ``MARK_REACH`` lines, or an unknown kind, is an error."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    pending: tuple[int, str, str | None] | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _MARK.fullmatch(line.strip())
        if m:
            if m.group(1) not in KINDS:
                raise ValueError(f"{doc_name(path)}:{i + 1}: unknown doc-test kind {m.group(1)!r} (known: {KINDS})")
            if pending:
                raise ValueError(f"{doc_name(path)}:{pending[0] + 1}: doc-test marker marks no block")
            pending = (i, m.group(1), m.group(2))
        elif line.lstrip().startswith("```"):  # a fence, indented in a list item or not
            if pending and i - pending[0] > MARK_REACH:
                raise ValueError(f"{doc_name(path)}:{pending[0] + 1}: doc-test marker is {i - pending[0]} lines "
                                 f"above the next block (at most {MARK_REACH})")
            indent = len(line) - len(line.lstrip())
            j = i + 1
            while j < len(lines) and not lines[j].lstrip().startswith("```"):
                j += 1
            body = [ln[indent:] if not ln[:indent].strip() else ln.lstrip() for ln in lines[i + 1:j]]
            out.append(Block(doc_name(path), i + 1, line.strip()[3:].strip(), body,
                             pending[1] if pending else None, pending[2] if pending else None))
            pending = None
            i = j
        i += 1
    if pending:
        raise ValueError(f"{doc_name(path)}:{pending[0] + 1}: doc-test marker marks no block")
    return out


def _is_command_block(b: Block) -> bool:
    if b.tag in SHELL_TAGS:
        return True
    if b.tag:
        return False
    return any(ln.startswith(("$ ", "place ", "make ")) for ln in b.lines)


def _expected(cmd: Command) -> None:
    first = cmd.output[0] if cmd.output else ""
    if first.startswith("place: error: "):
        cmd.rc, cmd.error = 2, first[len("place: error: "):]
        return
    for text in [cmd.text, *cmd.output]:
        m = _EXIT.search(text)
        if m:
            cmd.rc = int(m.group(1))
            return


def commands(path: Path) -> list[Command]:
    """The commands of ``path``'s command blocks, in document order."""
    out: list[Command] = []
    for b in blocks(path):
        if not _is_command_block(b):
            continue
        prompted = any(ln.startswith("$ ") for ln in b.lines)
        i, cur = 0, None
        while i < len(b.lines):
            line, start = b.lines[i], i
            if prompted and not line.startswith("$ "):
                if cur is not None:
                    cur.output.append(line)
                i += 1
                continue
            text = line[2:] if prompted else line
            if not text.strip() or text.lstrip().startswith("#"):
                i += 1
                continue
            while i + 1 < len(b.lines) and (text.endswith("\\") or (
                    b.mark == "synopsis" and b.lines[i + 1][:1].isspace())):  # a synopsis' indented lines
                i += 1
                text = text.removesuffix("\\").rstrip() + " " + b.lines[i].strip()
            text = text.strip()
            cur = Command(b.doc, b.line + 1 + start, text, shlex.split(text, comments=True), b.mark)
            out.append(cur)
            i += 1
    for c in out:
        _expected(c)
    return out


def stray_command_lines(path: Path) -> list[str]:
    """Lines of non-``python`` blocks that look like a ``place`` command but are not one of
    :func:`commands` (a block the rules above would miss)."""
    found = {(c.doc, c.line) for c in commands(path)}
    stray = []
    for b in blocks(path):
        if b.tag == "python":
            continue
        for k, ln in enumerate(b.lines):
            continued = k > 0 and b.lines[k - 1].endswith("\\")
            if ln.startswith(("$ place ", "place ")) and (b.doc, b.line + 1 + k) not in found and not continued:
                stray.append(f"{b.doc}:{b.line + 1 + k}: {ln}")
    return stray


# ------------------------------------------------------------------------------------ checking commands
@cache
def _parser() -> argparse.ArgumentParser:
    """``place``'s parser, taking flags only as spelled in full (a doc's ``--max-trace-token`` would pass
    the CLI as an abbreviation, and keep passing after a rename to ``--max-trace-tokens-x``)."""
    from moeplace.cli.main import build_parser
    todo = [build_parser()]
    for p in todo:
        p.allow_abbrev = False
        todo += [c for a in p._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices.values()]
    return todo[0]


def parse_problem(argv: list[str]) -> str | None:
    """What ``place``'s parser says about ``argv`` (None when it parses)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            _parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            return err.getvalue().strip() or f"exit {exc.code}"
    return None


def subparser(words: list[str]) -> argparse.ArgumentParser:
    p = _parser()
    for w in words:
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        p = sub.choices[w]
    return p


def synopsis_problems(cmd: Command) -> list[str]:
    """The ``--flags`` a synopsis names that its subcommand does not have."""
    words = []
    for a in cmd.argv[1:]:
        if a.startswith(("-", "[")):
            break
        words.append(a)
    try:
        p = subparser(words)
    except (StopIteration, KeyError):
        return [f"no subcommand 'place {' '.join(words)}'"]
    return [f"'place {' '.join(words)}' has no option {f}"
            for f in re.findall(r"--[a-z][a-z0-9-]*", cmd.text) if f not in p._option_string_actions]


def engine_problems(cmd: Command) -> list[str] | None:
    """Problems of an SGLang or vLLM launch line against the newest checked release's recorded options;
    None for any other program."""
    from moeplace.placement.export.engines import check_args, resolve_version
    argv = [a for a in cmd.argv if a != "..."]
    if argv[:3] == ["python", "-m", "sglang.launch_server"]:
        engine, rest = "sglang", argv[3:]
    elif argv[:2] == ["vllm", "serve"]:
        engine, rest = "vllm", argv[2:]
    else:
        return None
    return check_args(engine, resolve_version(engine, None), rest)


def make_problem(cmd: Command) -> str | None:
    """``make -n TARGET`` in the repository: None when make knows every target."""
    r = subprocess.run(["make", "-n", *cmd.argv[1:]], check=False, cwd=ROOT, capture_output=True, text=True, timeout=60)
    return None if r.returncode == 0 else r.stderr.strip()


def run_place(cmd: Command, capsys) -> None:
    """Run a ``place`` command with the CLI's ``main`` in the working directory; assert the exit code
    (and the error) the doc shows. A command the doc shows succeeding must also parse with its flags
    spelled in full."""
    from moeplace.cli.main import main
    if cmd.error is None:
        problem = parse_problem(cmd.argv[1:])
        assert problem is None, f"{cmd.where}\n{problem}"
    capsys.readouterr()
    rc = main(list(cmd.argv[1:]))
    err = capsys.readouterr().err
    if cmd.error is None:
        assert rc == cmd.rc, f"{cmd.where}\nexited {rc}, the doc shows {cmd.rc}: {err.strip()[-2000:]}"
    else:
        assert rc == 2, f"{cmd.where}\nexited {rc}, the doc shows an error"
        assert cmd.error[:60] in err, f"{cmd.where}\nthe doc shows {cmd.error[:60]!r}, got: {err.strip()}"
