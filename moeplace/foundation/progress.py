"""Progress bars on stderr for the steps that can take more than a few seconds (trace synthesis, a stats
pass, an import, optimize's policies and layer solves, the simulator's clock).

One mechanism for every command: a tqdm bar on stderr (the one ``place simulate`` has always shown). The
CLI decides once per command whether bars are wanted (:func:`wanted`: not with ``--no-progress``, not when
stderr is not a terminal; ``MOEPLACE_PROGRESS=1`` forces them on, ``=0`` off) and runs the command inside
:func:`enabled`; library code asks for a :func:`bar` around its long loops and gets a disabled one (which
prints nothing and costs nothing) outside such a context: in tests, in the dashboard, in library use.
The switch is a :class:`contextvars.ContextVar`, so a bar is only drawn by the thread that runs the
command; worker processes and threads never draw.
"""

from __future__ import annotations

import contextvars
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm

ENV = "MOEPLACE_PROGRESS"
_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("moeplace_progress", default=False)


def wanted(no_progress: bool = False, stream=None) -> bool:
    """Whether a command should draw bars: never with ``--no-progress``; else ``MOEPLACE_PROGRESS`` (``1``
    on, ``0`` off) when set; else only when ``stream`` (default stderr) is a terminal."""
    if no_progress:
        return False
    env = os.environ.get(ENV, "").strip().lower()
    if env in ("1", "on", "yes", "true"):
        return True
    if env in ("0", "off", "no", "false"):
        return False
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


@contextmanager
def enabled(on: bool) -> Iterator[None]:
    """Run the body with bars on (``on``) or off, restoring the previous setting after."""
    token = _ON.set(bool(on))
    try:
        yield
    finally:
        _ON.reset(token)


def is_enabled() -> bool:
    """Whether bars asked for now would be drawn."""
    return _ON.get()


def bar(total: float | None = None, desc: str = "", unit: str = "it", on: bool | None = None,
        iterable=None) -> tqdm:
    """A tqdm bar on stderr (drawn when ``on``, default :func:`is_enabled`; otherwise disabled: updates
    are no-ops). Use as a context manager or ``close()`` it; it leaves no line behind when done. With
    ``iterable`` it wraps it and advances one per item (see :func:`track`)."""
    show = is_enabled() if on is None else on
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=False, disable=not show, file=sys.stderr,
                mininterval=0.25, dynamic_ncols=True)


def track(iterable, desc: str, unit: str = "it", total: int | None = None):
    """``iterable``, advancing a bar (:func:`bar`) one step per item."""
    return bar(total if total is not None else _len(iterable), desc, unit, iterable=iterable)


def _len(iterable) -> int | None:
    try:
        return len(iterable)
    except TypeError:
        return None
