"""Output safety, in one place: every path a command writes is checked before any work, replaced only when
it is this tool's own output of the same kind and the user asked for it, and written through a
temporary sibling with one recognisable name that is removed on every exit path, SIGTERM included.

The rules (README "Outputs"):

- an output equal to, inside, or containing an input is refused;
- an existing output is replaced only when it is recognisably moeplace's own output of the same kind
  (:class:`OutputKind`) and the command was given ``--force`` (or documents that it replaces its own
  kind by default); an empty directory holds nothing to lose and may be replaced; anything else is
  refused with one line and left untouched;
- temporaries are ``.<name>.moeplace-tmp-<pid>-<hex>`` next to the destination; one left by a killed
  run (its process no longer exists) is removed, with a note, by the next run writing there;
- a write that fails after the work (disk full, permissions changed meanwhile) does not lose the
  results: the command prints them and then says which outputs could not be written (exit 1).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from moeplace.foundation import formats, reading
from moeplace.foundation.errors import InputError, MoeplaceError

TEMP_MARK = ".moeplace-tmp-"
# Long names are cut in temporaries so that the temporary's name stays within the 255-byte name limit.
_NAME_KEEP = 120


# ---------------------------------------------------------------------------- SIGTERM -> exception
class Terminated(KeyboardInterrupt):
    """SIGTERM turned into an exception in the main thread, so that every ``finally`` and
    ``except BaseException`` cleanup (temporaries, child processes) runs as it does for Ctrl-C."""


def raise_on_sigterm() -> None:
    """Make SIGTERM raise :class:`Terminated` in this process (a no-op outside the main thread).

    A process forked later inherits the handler but not the promise: there it restores the default and
    re-sends the signal, so a pool worker that the pool terminates dies as before; a child that cleans up
    after itself (the synthetic trace writer) calls this function again in the child."""
    if threading.current_thread() is not threading.main_thread():
        return
    owner = os.getpid()
    fired = []

    def handler(signum, frame):
        if os.getpid() != owner:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if fired:  # a second SIGTERM while cleaning up: let the cleanup finish
            return
        fired.append(True)
        raise Terminated()

    signal.signal(signal.SIGTERM, handler)


# ---------------------------------------------------------------------------- temporaries
def _temp_prefix(dest: Path) -> str:
    return f".{dest.name[:_NAME_KEEP]}{TEMP_MARK}"


def temp_sibling(dest: str | os.PathLike, suffix: str = "") -> Path:
    """A fresh temporary name next to ``dest``: ``.<name>.moeplace-tmp-<pid>-<hex><suffix>``."""
    dest = Path(dest)
    return dest.with_name(f"{_temp_prefix(dest)}{os.getpid()}-{secrets.token_hex(4)}{suffix}")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def remove_path(p: Path) -> None:
    """Delete a file or a directory tree (callers own it: a temporary, a run directory they made)."""
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def clean_stale_temps(dest: str | os.PathLike, *, report: bool = True) -> list[Path]:
    """Remove the temporaries that a killed run left next to ``dest``: exactly our pattern for this
    destination, and only those whose process is gone (a concurrent run's temporary is left alone).
    Returns the removed paths; with ``report`` a note per path goes to stderr."""
    dest = Path(dest)
    pat = re.compile(re.escape(_temp_prefix(dest)) + r"(\d+)-[0-9a-f]{8}(?:-old|-probe)?$")
    # what versions before this scheme left (tempfile's 8 characters, and the set-aside old directory):
    # their owner cannot be told, so they are only reported
    legacy = re.compile(re.escape(f".{dest.name}.") + r"(?:[a-z0-9_]{8}\.tmp|old)$")
    removed = []
    try:
        entries = list(os.scandir(dest.parent))
    except OSError:
        return removed
    for e in entries:
        if report and legacy.match(e.name):
            print(f"place: note: {Path(e.path)} looks like a temporary of an interrupted run of an earlier "
                  "moeplace version; remove it if no run is writing there", file=sys.stderr)
            continue
        m = pat.match(e.name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        p = Path(e.path)
        remove_path(p)
        removed.append(p)
        if report:
            print(f"place: note: removed {p}, left by an interrupted run (process {m.group(1)})", file=sys.stderr)
    return removed


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, directory: bool = False):
    """Yield a temporary sibling of ``path`` (:func:`temp_sibling`); on success rename it onto ``path``,
    on any exit by exception (SIGTERM included, see :func:`raise_on_sigterm`) delete it.

    With ``directory=True`` the temporary is a directory and an existing directory at ``path`` is
    replaced as a whole (the old one is removed only after the new one is in place). Whether ``path``
    may be replaced at all is the caller's decision (:func:`check_output`); this function only makes
    the replacement atomic.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(path)
    tmp = temp_sibling(path)
    try:
        if directory:
            tmp.mkdir()
        else:
            tmp.touch(exist_ok=False)
        yield tmp
        # outputs are read by engines running as other users: the permissions a plain open() gives
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod((0o777 if directory else 0o666) & ~umask)
        if directory and path.is_dir() and not path.is_symlink():
            old = tmp.with_name(tmp.name + "-old")
            path.rename(old)
            try:
                tmp.rename(path)
            except BaseException:
                old.rename(path)
                raise
            remove_path(old)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists() or tmp.is_symlink():
            remove_path(tmp)


# ---------------------------------------------------------------------------- what is our own output
# JSON outputs are recognised by their format tag (foundation.formats); an untagged file is recognised
# only as the one kind expected, by the keys the previous release wrote (the readers' legacy rule). The
# other recognisers read the formats' marker keys directly: this module sits below the packages that
# write them (and may import none of them), so the few literal keys are repeated here, each next to its
# writer's name.
@dataclass(frozen=True)
class OutputKind:
    """A kind of output: what messages call it, whether it is a directory, and how an existing path is
    recognised as moeplace's own output of this kind (``recognise(path) -> bool``; it may raise, which
    counts as not recognised)."""

    name: str
    directory: bool
    recognise: Callable[[Path], bool]


def _json(path: Path, max_bytes: int = 1 << 30):
    if reading.require_regular(path).st_size > max_bytes:  # a FIFO is never opened (it would block)
        return None
    return reading.read_json(path)


def _artifact(kind: str, *legacy_keys: str) -> Callable[[Path], bool]:
    """A JSON file tagged ``kind``; or, untagged, one holding all ``legacy_keys`` (what the previous
    release wrote for this kind; none: an untagged file is not recognised)."""
    def rec(p: Path) -> bool:
        d = _json(p)
        if not isinstance(d, dict):
            return False
        if formats.FIELD in d:
            return formats.kind_of(d) == kind
        return bool(legacy_keys) and formats.FORMATS[kind].legacy and all(k in d for k in legacy_keys)
    return rec


def _is_trace_part(p: Path) -> bool:
    import pyarrow.parquet as pq  # ~0.4 s to import; every command imports this module, few read a trace

    return b"moeplace.model" in (pq.read_schema(p).metadata or {})  # traces.format.META_MODEL


_PART = re.compile(r"part-\d+\.parquet$")  # traces.format.TraceWriter's file names


def _holds_trace_parts(d: Path) -> bool:
    """``d`` directly holds a part file of a moeplace trace directory (one listing, no recursion; a
    single-file trace next to other files does not make its directory a trace)."""
    try:
        with os.scandir(d) as it:
            parts = [Path(e.path) for e in it if _PART.match(e.name) and e.is_file()]
    except OSError:
        return False
    return any(_recognised_part(f) for f in parts[:1])


def _recognised_part(f: Path) -> bool:
    try:
        return _is_trace_part(f)
    except Exception:  # noqa: BLE001  (unreadable: not a trace part)
        return False


def _is_trace_dir(p: Path) -> bool:
    """A directory whose every file (recursively) is a Parquet file of a moeplace trace."""
    files = [f for f in p.rglob("*") if not f.is_dir()]
    return bool(files) and all(f.suffix == ".parquet" and _is_trace_part(f) for f in files)


def _is_loads(p: Path) -> bool:
    import numpy as np  # ~0.5 s to import; every command imports this module, few read a Loads file

    with np.load(p, allow_pickle=False) as z:
        return "counts" in z and formats.kind_of(json.loads(str(z["meta"]))) == "loads"  # traces.loads


def _is_sim_run(p: Path) -> bool:
    """What ``sim.results.write_outputs`` writes: config.json, summary.json, <label>.{requests,timeseries}
    .parquet, and nothing else."""
    names = {f.name for f in p.iterdir()}
    rest = {n for n in names if n.endswith((".requests.parquet", ".timeseries.parquet"))}
    return {"config.json", "summary.json"} <= names and names - rest == {"config.json", "summary.json"}


_CHROME_HEAD = b'{"otherData": {"format": "moeplace.chrome-trace/'


def _is_chrome_trace(p: Path) -> bool:
    """``sim.results.write_chrome_trace``: its tag leads the file (read at the start only: the file can be
    large); untagged, the previous release's ``{"traceEvents": [...], "displayTimeUnit": "ms"}`` (read at
    both ends)."""
    with open(p, "rb") as fh:
        head = fh.read(len(_CHROME_HEAD))
        fh.seek(max(0, p.stat().st_size - 64))
        tail = fh.read()
    if head == _CHROME_HEAD:
        return True
    return head.startswith(b'{"traceEvents":') and tail.rstrip().endswith(b'"displayTimeUnit": "ms"}')


RUN_MARKER = ".moeplace-run"


def _is_run_dir(p: Path) -> bool:
    """A directory ``place demo`` made: its marker file is tagged ``run`` (untagged, the previous release's
    ``{"written_by": "place demo"}``)."""
    return _artifact("run", "written_by")(p / RUN_MARKER)


SWEEP_ENTRIES = ("points", "cache", "recommended", "sweep.parquet", "frontier.json")  # moeplace.sweep layout


def _is_sweep_dir(p: Path) -> bool:
    names = {f.name for f in p.iterdir() if not f.name.startswith(".")}
    return bool(names) and names <= set(SWEEP_ENTRIES)


KINDS: dict[str, OutputKind] = {k.name: k for k in (
    OutputKind("trace directory", True, _is_trace_dir),
    OutputKind("placement JSON", False, _artifact("placement")),  # placement.record
    OutputKind("Loads .npz", False, _is_loads),
    OutputKind("trace statistics JSON", False,
               _artifact("trace-stats", "path", "model", "tokens", "window_tokens", "skew_median")),
    OutputKind("comparison report", False, _artifact("comparison", "engine", "cluster", "rows", "written")),
    OutputKind("plan report", False, _artifact("memory-plan", "model", "cluster", "per_gpu", "pools")),
    OutputKind("calibration profile", False, _artifact("calibration")),  # sim.calibration
    OutputKind("kernel bench report", False, _artifact("kernel-report", "validation", "raw")),
    OutputKind("simulation output directory", True, _is_sim_run),
    OutputKind("Chrome trace", False, _is_chrome_trace),
    OutputKind("demo run directory", True, _is_run_dir),
    OutputKind("sweep directory", True, _is_sweep_dir),
)}


def kind(name: str) -> OutputKind:
    return KINDS[name]


# ---------------------------------------------------------------------------- the check before any work
class OutputError(MoeplaceError):
    """Outputs that could not be written after the work was done (the results were printed)."""

    exit_code = 1


def _recognised(kind: OutputKind, p: Path) -> bool:
    try:
        return bool(kind.recognise(p))
    except Exception:  # noqa: BLE001  (anything unreadable is not recognisably ours)
        return False


def _inside(a: Path, b: Path) -> bool:
    """``a`` is ``b`` or lies under it (both resolved)."""
    return a == b or b in a.parents


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _writable_ancestor(p: Path, what: str) -> None:
    """The nearest existing ancestor of ``p`` must be a directory we can create entries in (probed with a
    file of our temporary pattern: permission bits alone say nothing for root or read-only mounts)."""
    a = p.parent
    while not a.exists() and a != a.parent:
        if a.is_symlink():  # a dangling link: mkdir would fail later
            raise InputError(f"{what}: {a} is a broken symbolic link")
        a = a.parent
    if not a.is_dir():
        raise InputError(f"{what}: {a} is not a directory")
    probe = temp_sibling(a / p.name, "-probe")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as exc:
        raise InputError(f"{what}: cannot write in {a} ({exc.strerror or exc})") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        probe.unlink()


def check_output(path: str | os.PathLike, *, kind: OutputKind | str, inputs: Iterable = (), force: bool = False,
                 flag: str = "--out", replace_own: bool = False) -> Path:
    """Check one output path before any work; return it as a :class:`Path` or raise :class:`InputError`
    (one line, starting ``<flag> <path>:``), touching nothing.

    ``kind``: an :class:`OutputKind` or a name in :data:`KINDS`. ``inputs``: every path the command reads
    (``None`` entries and preset names that are not paths are ignored). ``force``: the user asked to
    replace an existing output of this kind. ``replace_own``: the command documents that it replaces its
    own output of this kind by default (``place demo``'s run directory, ``place sweep``'s resumable one).
    Refused: an empty path; the current directory or one containing it; a path equal to, inside or
    containing an input; a symbolic link; a file where a directory goes and the reverse; an existing path
    that is not moeplace's own output of ``kind`` (an empty directory excepted, when a directory goes
    there); one that is, without ``force``/``replace_own``; a parent that is not a writable directory.
    """
    k = KINDS[kind] if isinstance(kind, str) else kind
    text = os.fspath(path)
    what = f"{flag} {text}"
    if not text.strip():
        raise InputError(f"{flag}: empty path")
    p = Path(text)
    real = p.resolve()
    cwd = Path.cwd().resolve()
    if _inside(cwd, real):
        raise InputError(f"{what}: is the current directory{' or contains it' if real != cwd else ''}; "
                         f"give a new {k.name} path")
    for i in inputs:
        if i is None or not os.fspath(i):
            continue
        ip = Path(os.fspath(i))
        if not ip.exists():  # a preset or policy name, not a file
            continue
        ir = ip.resolve()
        if ir == real or _same_file(ip, p):
            raise InputError(f"{what}: is the input {ip}; write to another path")
        if _inside(real, ir):
            raise InputError(f"{what}: lies inside the input {ip}; write somewhere else")
        if _inside(ir, real):
            raise InputError(f"{what}: contains the input {ip}; it would be replaced")
    for a in real.parents:
        if _holds_trace_parts(a):  # a trace's readers take every Parquet file under its directory
            raise InputError(f"{what}: lies inside the trace directory {a}, which it would change")
    if p.is_symlink():
        raise InputError(f"{what}: is a symbolic link; refusing to replace it (give the real path)")
    if p.exists():
        if k.directory and not p.is_dir():
            raise InputError(f"{what}: is an existing file, not a {k.name}; refusing to replace it")
        if not k.directory and p.is_dir():
            raise InputError(f"{what}: is an existing directory; give a file name for the {k.name}")
        empty_dir = k.directory and not any(p.iterdir())
        if not empty_dir:
            if not _recognised(k, p):
                raise InputError(f"{what}: exists and is not a {k.name} written by moeplace; refusing to "
                                 "replace it (choose another path)")
            if not (force or replace_own):
                raise InputError(f"{what}: exists (a {k.name} from an earlier run); pass --force to replace it")
    _writable_ancestor(p.absolute(), what)
    return p


def _names_output(filename, path) -> bool:
    """``filename`` is ``path``, lies inside it, or is (inside) one of its temporaries."""
    d = Path(os.path.abspath(path))
    f = Path(os.path.abspath(os.fspath(filename)))
    prefix = _temp_prefix(d)
    return any(a.parent == d.parent and (a.name == d.name or a.name.startswith(prefix)) for a in (f, *f.parents))


class Outputs:
    """The outputs of one command run. :meth:`add` checks each before any work (and that no two coincide or
    nest under a directory output); after the work, :meth:`write` writes each, turning a failed write
    (``OSError``: disk full, permissions) into a recorded failure, so the command can print its results
    first; :meth:`finish` then raises :class:`OutputError` naming what could not be written."""

    def __init__(self, *, inputs: Iterable = (), force: bool = False) -> None:
        self.inputs = [i for i in inputs if i is not None]
        self.force = force
        self.planned: list[tuple[str, Path, OutputKind]] = []
        self.failed: list[tuple[Path, str]] = []

    def add(self, path: str | os.PathLike | None, kind: OutputKind | str, flag: str = "--out",
            replace_own: bool = False) -> Path | None:
        if path is None:
            return None
        k = KINDS[kind] if isinstance(kind, str) else kind
        p = check_output(path, kind=k, inputs=self.inputs, force=self.force, flag=flag, replace_own=replace_own)
        real = p.resolve()
        for f, q, qk in self.planned:
            qr = q.resolve()
            if qr == real:
                raise InputError(f"{flag} {path}: is also {f}; give each output its own path")
            if qk.directory and _inside(real, qr):
                raise InputError(f"{flag} {path}: lies inside {f} {q}, which is replaced as a whole")
            if k.directory and _inside(qr, real):
                raise InputError(f"{flag} {path}: contains {f} {q}, and is replaced as a whole")
        self.planned.append((flag, p, k))
        clean_stale_temps(p)  # here, in the command's process, so that the note reaches the user
        return p

    def write(self, path: str | os.PathLike, fn: Callable[[], object]) -> bool:
        """Run ``fn`` (which writes ``path``); ``False`` and a recorded failure if it raised ``OSError``
        while writing ``path`` (an error naming another file, e.g. an input, is not a write failure and
        propagates)."""
        try:
            fn()
        except OSError as exc:
            if exc.filename is not None and not _names_output(exc.filename, path):
                raise
            self.failed.append((Path(path), exc.strerror or str(exc)))
            return False
        return True

    def finish(self) -> None:
        if self.failed:
            where_ = "; ".join(f"{p} ({why})" for p, why in self.failed)
            raise OutputError(f"could not write {where_}; the results above were not saved there")


def read_json(path: str | os.PathLike, missing: str = "no such file", unreadable: str = "not readable JSON"):
    """Parse a JSON file; a missing or unreadable file is an :class:`InputError` naming it, with the
    caller's wording (``"<path>: <missing>"``, ``"<path>: <unreadable> (<parser error>)"``). A FIFO,
    device or socket, nesting past :data:`~moeplace.foundation.reading.MAX_DEPTH` and huge integers are
    refused too (:func:`moeplace.foundation.reading.read_json`)."""
    return reading.read_json(path, missing, unreadable)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
