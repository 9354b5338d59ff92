"""Atomic output: nothing half-written is ever left behind under the final name."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from foundation.errors import InputError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, directory: bool = False):
    """Yield a temporary sibling of ``path``; on success rename it onto ``path``, on error delete it.

    With ``directory=True`` the temporary is a directory and an existing directory at ``path`` is
    replaced as a whole (the old one is removed only after the new one is complete).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        raise
    # mkstemp/mkdtemp create 0600/0700; outputs are read by engines running as other users, so give them
    # the permissions a plain open() would (0666/0777 less the umask).
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod((0o777 if directory else 0o666) & ~umask)
    if directory and path.exists():
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


def read_json(path: str | os.PathLike, missing: str = "no such file", unreadable: str = "not readable JSON"):
    """Parse a JSON file; a missing or unreadable file is an :class:`InputError` naming it, with the
    caller's wording (``"<path>: <missing>"``, ``"<path>: <unreadable> (<parser error>)"``)."""
    import json

    p = Path(path)
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise InputError(f"{p}: {missing}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{p}: {unreadable} ({exc})") from None


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
