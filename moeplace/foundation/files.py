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
  results: the command prints them and then says which outputs could not be written (exit 1); a failed
  write leaves neither its temporary nor a partial output (:class:`WriteFailed`: one line, also for the
  file-system errors that Parquet writers report as their own exceptions);
- a path that did not exist when it was checked and may not be replaced (no ``--force``) is claimed in
  one atomic step when written (:func:`atomic_path`): of two runs writing it at once, exactly one
  succeeds and the other says so, instead of the later silently replacing the earlier;
- a path the file system cannot hold (a name over its length limit) or that is not UTF-8 (the Parquet
  and JSON writers need UTF-8 names) is refused before any work.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
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
# The signals that end a run politely: SIGTERM (a service manager, kill) and SIGHUP (the terminal or the
# ssh session closed). Both unwind like Ctrl-C, so no temporary survives either.
STOP_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP turned into an exception in the main thread, so that every ``finally`` and
    ``except BaseException`` cleanup (temporaries, child processes) runs as it does for Ctrl-C.
    ``signum`` is the signal (the CLI exits 128 + it, as a shell reports a process it ended)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signum


def raise_on_sigterm() -> None:
    """Make SIGTERM and SIGHUP (:data:`STOP_SIGNALS`) raise :class:`Terminated` in this process (a no-op
    outside the main thread). A SIGHUP that was ignored when the process started (``nohup``) stays ignored.

    A process forked later inherits the handler but not the promise: there it restores the default and
    re-sends the signal, so a pool worker that the pool terminates dies as before; a child that cleans up
    after itself (the synthetic trace writer) calls this function again in the child."""
    if threading.current_thread() is not threading.main_thread():
        return
    owner = os.getpid()
    fired = []

    def handler(signum, frame):
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if fired:  # a second signal while cleaning up: let the cleanup finish
            return
        fired.append(True)
        raise Terminated(signum)

    for sig in STOP_SIGNALS:
        if sig != signal.SIGTERM and signal.getsignal(sig) is signal.SIG_IGN:
            continue  # nohup: the user asked for the run to survive the hang-up
        signal.signal(sig, handler)


def worker_signals() -> None:
    """The ``initializer`` of a process pool whose workers only compute (no file of theirs to clean up):
    SIGTERM and SIGHUP end a worker at once, even inside a long C++ call (a CP-SAT solve) where a Python
    handler would wait for the call to return, and SIGINT is left to the parent, which stops its pool (a
    Ctrl-C reaches the whole process group; the parent's unwinding terminates the workers)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


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


def remove_empty_tree(p: Path) -> bool:
    """Remove ``p`` if it holds nothing but empty directories (what a run that failed before writing
    anything leaves); ``True`` when it is gone. A file anywhere under it keeps it."""
    try:
        for d, _dirs, files in os.walk(p, topdown=False):
            if files:
                return False
            os.rmdir(d)
    except OSError:
        return False
    return not p.exists()


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


# ---------------------------------------------------------------------------- write failures
class WriteFailed(OSError, MoeplaceError):
    """Writing an output failed (disk full, file system read-only, a name too long...): nothing was left
    at ``filename``, and the temporary is gone. An ``OSError`` (callers that collect failed writes keep
    doing so, :class:`Outputs`) and a user error (one line, exit 1, where nothing collects it)."""

    exit_code = 1

    def __str__(self) -> str:
        return f"could not write {display(self.filename)} ({self.strerror}); nothing was written there"


class OutputExists(WriteFailed):
    """The output appeared while this run worked (another run wrote it): it is left as it is."""


_CLAIMED_BY_OTHER = "created by another run while this one worked, left as it is: pass --force to replace it"
# what file systems say when the disk or the quota is full, or writing is no longer possible
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO, errno.ENAMETOOLONG}
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust libraries (polars) quote an errno


def _write_failure(exc: BaseException, path: Path) -> OSError | None:
    """``exc`` as the OSError of a failed write of ``path``, or ``None`` when it is something else (an
    error naming another file, e.g. an input; a bug). Polars reports I/O errors as its own exceptions
    that quote the errno."""
    if isinstance(exc, WriteFailed):
        return None
    if isinstance(exc, OSError) and exc.errno is None:  # a library's IOError quoting the errno, or nothing
        m = _OS_ERROR.search(str(exc))
        if m and int(m.group(1)) in _WRITE_ERRNOS:
            return OSError(int(m.group(1)), os.strerror(int(m.group(1))))
        return None
    if isinstance(exc, OSError):
        if exc.filename is not None:
            return exc if _names_output(exc.filename, path) else None
        return exc if exc.errno in _WRITE_ERRNOS else None
    m = _OS_ERROR.search(str(exc)) if type(exc).__module__.split(".")[0] in ("polars", "pyarrow") else None
    if m and int(m.group(1)) in _WRITE_ERRNOS:
        n = int(m.group(1))
        return OSError(n, os.strerror(n))
    return None


def display(path) -> str:
    """A path as text that any terminal and log can take: a byte that is not UTF-8 shown as ``\\xff``."""
    text = os.fspath(path) if path is not None else "?"
    if isinstance(text, bytes):
        return text.decode("utf-8", "backslashreplace")
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


# ---------------------------------------------------------------------------- claiming a new path
# Paths check_output found absent and may not replace (no --force): they are claimed atomically when
# written. Absolute path -> checks not yet followed by their write, in this process (a command is one
# process; the count keeps two writers in one process, e.g. threads, from releasing each other's claim).
_MUST_BE_NEW: dict[str, int] = {}
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def _renameat2():
    """glibc's ``renameat2`` (Linux >= 3.15, glibc >= 2.28), or ``None``."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _claim_file(tmp: Path, path: Path) -> None:
    """Move the finished temporary ``tmp`` to ``path`` only if ``path`` does not exist, in one step:
    ``link(2)`` fails with EEXIST when it does (then the temporary is unlinked). On a file system without
    hard links, ``renameat2(RENAME_NOREPLACE)``; where neither exists, an existence check right before
    ``rename(2)`` (a window of microseconds instead of the whole run)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise OutputExists(errno.EEXIST, _CLAIMED_BY_OTHER, str(path)) from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            raise
        fn = _renameat2()
        if fn is not None:
            if fn(_AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(path), _RENAME_NOREPLACE) == 0:
                return
            e = ctypes.get_errno()
            if e == errno.EEXIST:
                raise OutputExists(errno.EEXIST, _CLAIMED_BY_OTHER, str(path)) from None
            if e not in (errno.EINVAL, errno.ENOSYS):
                raise OSError(e, os.strerror(e), str(path)) from None
        if os.path.lexists(path):
            raise OutputExists(errno.EEXIST, _CLAIMED_BY_OTHER, str(path)) from None
        os.rename(tmp, path)
        return
    tmp.unlink()


def _claim_dir(tmp: Path, path: Path) -> None:
    """``rename(2)`` of a directory onto an existing one fails unless that one is empty (ENOTEMPTY or
    EEXIST), and an empty directory holds nothing to lose: the rename itself is the atomic claim."""
    try:
        os.rename(tmp, path)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise OutputExists(errno.EEXIST, _CLAIMED_BY_OTHER, str(path)) from None
        raise


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, directory: bool = False):
    """Yield a temporary sibling of ``path`` (:func:`temp_sibling`); on success rename it onto ``path``,
    on any exit by exception (SIGTERM included, see :func:`raise_on_sigterm`) delete it.

    With ``directory=True`` the temporary is a directory and an existing directory at ``path`` is
    replaced as a whole (the old one is removed only after the new one is in place). Whether ``path``
    may be replaced at all is the caller's decision (:func:`check_output`); this function only makes
    the replacement atomic. A path :func:`check_output` found absent and may not replace is claimed
    atomically instead (:func:`_claim_file`, :func:`_claim_dir`): if another run wrote it meanwhile,
    :class:`OutputExists` and that run's output stays. A write that fails for want of space (or of a
    writable file system) raises :class:`WriteFailed`, naming ``path``.
    """
    path = Path(path)
    # the directories made for it are removed again if the write fails (deepest first, only when empty)
    made = [a for a in (path.parent, *path.parent.parents) if not os.path.lexists(a)]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _remove_made(made)
        if exc.errno not in _WRITE_ERRNOS:  # e.g. a file in the way: the caller's error, as it is
            raise
        raise WriteFailed(exc.errno, exc.strerror or str(exc), str(path)) from None
    clean_stale_temps(path)
    tmp = temp_sibling(path)
    done = False
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
        key = os.path.abspath(path)
        if _MUST_BE_NEW.get(key):
            try:
                (_claim_dir if directory else _claim_file)(tmp, path)
            finally:  # claimed (ours now: a later write in this run replaces it) or lost: the check is used
                _MUST_BE_NEW[key] -= 1
                if not _MUST_BE_NEW[key]:
                    del _MUST_BE_NEW[key]
        elif directory and path.is_dir() and not path.is_symlink():
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
        done = True
    except Exception as exc:
        err = _write_failure(exc, path)
        if err is None:
            raise
        raise WriteFailed(err.errno, err.strerror or str(err), str(path)) from exc
    finally:
        if tmp.exists() or tmp.is_symlink():
            remove_path(tmp)
        if not done:
            _remove_made(made)


def _remove_made(made: list[Path]) -> None:
    """``rmdir`` the directories in ``made`` (deepest first) while they are empty: what a failed write made
    for its output and nothing else put there."""
    for d in made:
        try:
            os.rmdir(d)
        except OSError:
            return


# ---------------------------------------------------------------------------- one writer per directory
LOCK_NAME = ".moeplace-lock"


class LockHeld(MoeplaceError):
    """Another live run holds the directory's lock (exit 1: nothing is wrong with the input)."""

    exit_code = 1


@contextlib.contextmanager
def exclusive_lock(directory: str | os.PathLike, what: str = "--out"):
    """Hold ``directory/.moeplace-lock`` for the block: one run at a time writes a directory that runs
    resume into (a sweep's ``--out``). The directory is created when absent (and removed again on exit
    if the block left it empty).

    The lock is ``flock(2)`` on that file, which the kernel releases when its holder dies however it dies,
    so a lock left by a killed run is simply taken (with a note naming the dead process); the file holds
    the holder's pid and start time, which the refusal quotes. After locking, the file is checked to be the
    one at the path (a holder that finished unlinks it; a run that opened it before then retries)."""
    import fcntl
    import time

    d = Path(directory)
    made = False
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        d.mkdir()
        made = True
    except FileExistsError:
        pass
    except OSError as exc:
        raise WriteFailed(exc.errno, exc.strerror or str(exc), str(d)) from None
    lock = d / LOCK_NAME
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise InputError(f"{what} {display(d)}: cannot create its lock file ({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            held = os.read(fd, 200).decode("utf-8", "replace").split()
            os.close(fd)
            who = (f"process {held[0]}" + (f", started {held[1]}" if len(held) > 1 else "")) if held else "another run"
            raise LockHeld(f"{what} {display(d)}: another run ({who}) is writing there; wait for it to finish "
                           f"or give another {what}") from None
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder finished and removed it meanwhile: lock the new one
    try:
        before = os.read(fd, 200).decode("utf-8", "replace").split()
        if before and before[0].isdigit() and int(before[0]) != os.getpid() and not _pid_alive(int(before[0])):
            print(f"place: note: {display(d)}: took over the lock left by process {before[0]}, which is no longer "
                  "running", file=sys.stderr)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {time.strftime('%Y-%m-%dT%H:%M:%S')}\n".encode(), 0)
        yield d
    finally:
        with contextlib.suppress(OSError):
            lock.unlink()
        os.close(fd)
        if made:
            remove_empty_tree(d)


# ---------------------------------------------------------------------------- what is our own output
# Every layer registers the kinds of output it writes (:func:`register_kind`, next to its writer): what
# messages call it, whether it is a directory and how an existing path is recognised as moeplace's own.
# JSON outputs are recognised by their format tag (foundation.formats; :func:`tagged_artifact`); an untagged
# file only as the one kind expected, by the keys the previous release wrote (the readers' legacy rule).
# This module holds the registry and the safety rules, and knows no other layer's files.
@dataclass(frozen=True)
class OutputKind:
    """A kind of output: what messages call it, whether it is a directory, and how an existing path is
    recognised as moeplace's own output of this kind (``recognise(path) -> bool``; it may raise, which
    counts as not recognised). ``guards_tree``: for a directory kind whose readers take every file under it
    (a trace): ``guards_tree(dir) -> bool`` says ``dir`` is one, so no output may be written inside it."""

    name: str
    directory: bool
    recognise: Callable[[Path], bool]
    guards_tree: Callable[[Path], bool] | None = None


KINDS: dict[str, OutputKind] = {}


def register_kind(k: OutputKind) -> OutputKind:
    """Make ``k`` known by its name (the writer's module calls this once, at import)."""
    if KINDS.get(k.name, k) is not k:
        raise RuntimeError(f"output kind '{k.name}' registered twice")
    KINDS[k.name] = k
    return k


def output_kind(name: str) -> OutputKind:
    """The registered kind called ``name``."""
    if name not in KINDS:
        raise KeyError(f"output kind '{name}' is not registered (its writer's module registers it; "
                       f"known: {', '.join(sorted(KINDS))})")
    return KINDS[name]


def _json(path: Path, max_bytes: int = 1 << 30):
    if reading.require_regular(path).st_size > max_bytes:  # a FIFO is never opened (it would block)
        return None
    return reading.read_json(path)


def tagged_artifact(kind: str, *legacy_keys: str) -> Callable[[Path], bool]:
    """A recogniser: a JSON file tagged ``kind``; or, untagged, one holding all ``legacy_keys`` (what the
    previous release wrote for this kind; none: an untagged file is not recognised)."""
    def rec(p: Path) -> bool:
        d = _json(p)
        if not isinstance(d, dict):
            return False
        if formats.FIELD in d:
            return formats.kind_of(d) == kind
        return bool(legacy_keys) and formats.FORMATS[kind].legacy and all(k in d for k in legacy_keys)
    return rec


# ---------------------------------------------------------------------------- the check before any work
class OutputError(MoeplaceError):
    """Outputs that could not be written after the work was done (the results were printed)."""

    exit_code = 1


def _recognised_tree(k: OutputKind, d: Path) -> bool:
    try:
        return bool(k.guards_tree(d))
    except Exception:  # noqa: BLE001  (unreadable: not recognisably ours)
        return False


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
    k = output_kind(kind) if isinstance(kind, str) else kind
    text = os.fspath(path)
    what = f"{flag} {display(text)}"
    if not text.strip():
        raise InputError(f"{flag}: empty path")
    _check_name(text, what)
    if not k.directory and text.endswith((os.sep, "/")):  # Path() drops the slash: p.json/ would write p.json
        raise InputError(f"{what}: ends with '/', which names a directory, but the {k.name} is a file; drop the "
                         "'/'")
    try:
        return _check_output(Path(text), text, what, k, inputs, force, flag, replace_own)
    except OSError as exc:  # a path the file system refuses to look up (a loop of links, permissions)
        raise InputError(f"{what}: cannot be used ({exc.strerror or exc})") from None
    except RuntimeError:  # Path.resolve on a loop of symbolic links (Python < 3.13)
        raise InputError(f"{what}: cannot be used (a loop of symbolic links)") from None


def _check_name(text: str, what: str) -> None:
    """The path is UTF-8 (Parquet and JSON writers need it: a byte that is not would fail after the
    work) and each of its names fits the file system's limit (``NAME_MAX``, 255 bytes on Linux file
    systems; ``PATH_MAX`` for the whole)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start].encode("utf-8", "surrogateescape")
        raise InputError(f"{what}: the path is not UTF-8 (byte 0x{bad[0]:02x}); the Parquet and JSON "
                         "writers need UTF-8 names, choose another") from None
    check_path_length(text, what)


def check_path_length(text: str, what: str) -> None:
    """Each name in the path ``text`` fits the file system's ``NAME_MAX`` (255 bytes on Linux file systems)
    and the whole its ``PATH_MAX``, and it holds no NUL byte: what every lookup needs, checked before one
    fails with ``ENAMETOOLONG`` (an input's as much as an output's). ``what`` names it in the message."""
    if "\x00" in text:
        raise InputError(f"{what}: the path holds a NUL byte, which no file name can")
    full = os.path.abspath(text)
    if len(os.fsencode(full)) >= 4096:  # Linux's PATH_MAX: the lookups below fail past it (ENAMETOOLONG)
        raise InputError(f"{what}: the path is {len(os.fsencode(full))} bytes long, more than the 4095 the "
                         "file system allows; choose a shorter one")
    base = Path(full).parent
    while not os.path.lexists(base) and base != base.parent:
        base = base.parent
    try:
        name_max = os.pathconf(base, "PC_NAME_MAX")
        path_max = os.pathconf(base, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    for name in Path(full).parts[1:]:
        n = len(os.fsencode(name))
        if n > name_max:
            raise InputError(f"{what}: a name in it is {n} bytes long, more than the {name_max} the file "
                             "system allows; choose a shorter one")
    if len(os.fsencode(full)) >= path_max:
        raise InputError(f"{what}: the path is {len(os.fsencode(full))} bytes long, more than the "
                         f"{path_max - 1} the file system allows; choose a shorter one")


def _check_output(p: Path, text: str, what: str, k: OutputKind, inputs: Iterable, force: bool, flag: str,
                  replace_own: bool) -> Path:
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
    guards = [g for g in KINDS.values() if g.guards_tree is not None]
    for a in real.parents:
        for g in guards:  # e.g. a trace: its readers take every Parquet file under its directory
            if _recognised_tree(g, a):
                raise InputError(f"{what}: lies inside the {g.name} {a}, which it would change")
    if p.is_symlink():
        raise InputError(f"{what}: is a symbolic link; refusing to replace it (give the real path)")
    if p.exists():
        if k.directory and not p.is_dir():
            raise InputError(f"{what}: is an existing file, not a {k.name}; refusing to replace it")
        if not k.directory and p.is_dir():
            raise InputError(f"{what}: is an existing directory; give a file name for the {k.name}")
        # a directory holding only a run's lock (exclusive_lock: that run is starting) holds no output
        empty_dir = k.directory and not any(x.name != LOCK_NAME for x in p.iterdir())
        if not empty_dir:
            if not _recognised(k, p):
                raise InputError(f"{what}: exists and is not a {k.name} written by moeplace; refusing to "
                                 "replace it (choose another path)")
            if not (force or replace_own):
                raise InputError(f"{what}: exists (a {k.name} from an earlier run); pass --force to replace it")
    _writable_ancestor(p.absolute(), what)
    key = os.path.abspath(p)
    if not (force or replace_own):  # absent, or an empty directory: claimed atomically when written
        _MUST_BE_NEW[key] = _MUST_BE_NEW.get(key, 0) + 1
    else:  # this run may replace it (a claim an earlier command of this process left, e.g. in a forked
        _MUST_BE_NEW.pop(key, None)  # writer, is void)
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
        k = output_kind(kind) if isinstance(kind, str) else kind
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
            where_ = "; ".join(f"{display(p)} ({why})" for p, why in self.failed)
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
