"""Helpers the dashboard pages share: the run directory, error boxes instead of tracebacks, small
chart builders over the frames the pages make from library results."""
from __future__ import annotations

import contextlib
from pathlib import Path

import altair as alt
import polars as pl
import streamlit as st

from moeplace.dashboard import data
from moeplace.foundation.errors import MoeplaceError

RUN_DIR_KEY = "run_dir"


def run_dir() -> Path:
    """The run directory chosen in the sidebar (set by app.py)."""
    return Path(st.session_state.get(RUN_DIR_KEY) or data.default_run_dir()).expanduser()


def error_text(exc: BaseException) -> str:
    """A user error prints as the CLI prints it; anything else names its type (no traceback)."""
    if isinstance(exc, MoeplaceError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


@contextlib.contextmanager
def shown_errors(what: str | None = None):
    """Run a block; an exception becomes one st.error line (Streamlit's own stop/rerun signals are
    BaseExceptions and pass through)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001  the dashboard shows every failure as a message
        st.error((f"{what}: " if what else "") + error_text(exc))


def load(fn, *args, what: str | None = None, stop: bool = True, **kwargs):
    """``fn(*args)``; on failure show the error and stop the page (``stop``) or return None."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001
        st.error((f"{what}: " if what else "") + error_text(exc))
        if stop:
            st.stop()
        return None


def run_index() -> data.RunIndex:
    """The artifacts of the chosen run directory; stops the page with an error when it is unusable."""
    return load(data.scan_run_dir, run_dir())


def pick_path(label: str, paths, root: Path, *, key: str, allow_other: bool = True, help: str | None = None):
    """A selectbox over the discovered ``paths`` plus a free path; returns the chosen path or None."""
    options = [data.rel(p, root) for p in paths]
    other = "other path..."
    if allow_other:
        options.append(other)
    if not options:
        return None
    choice = st.selectbox(label, options, key=key, help=help)
    if choice == other:
        text = st.text_input(f"{label}: path", key=f"{key}_other", placeholder="a path on this machine")
        return Path(text).expanduser() if text else None
    return paths[options.index(choice)]


def missing(what: str, command: str, demo: bool = True) -> None:
    """The hint on a page with nothing to show: the command that makes ``what`` (and ``place demo``, when
    the demo makes it too: ``demo``)."""
    alt_ = f" (or `place demo --out {run_dir()}`)" if demo else ""
    st.info(f"No {what} in `{run_dir()}`. Make one with `{command}`{alt_}.")


ACCURACY = "Simulated figures"


def accuracy_note(note: str | None = None) -> None:
    """The simulator's accuracy note under simulated figures, as ``place simulate`` prints it (``note``:
    the one a sweep recorded in its frontier.json; default the installed simulator's)."""
    st.info(f"**{ACCURACY}** — {note or data.fidelity_note()}")


def line(df: pl.DataFrame, x: str, y: str, color: str | None = None, *, x_title: str | None = None,
         y_title: str | None = None, log_x: bool = False, height: int = 260, y_zero: bool = True,
         points: bool = False, x_type: str = "Q") -> alt.Chart:
    enc = {
        "x": alt.X(f"{x}:{x_type}", title=x_title or x, scale=alt.Scale(type="log") if log_x else alt.Undefined),
        "y": alt.Y(f"{y}:Q", title=y_title or y, scale=alt.Scale(zero=y_zero)),
        "tooltip": [c for c in (x, y, color) if c],
    }
    if color:
        enc["color"] = alt.Color(f"{color}:N", title=color)
    return alt.Chart(df.to_pandas()).mark_line(point=points).encode(**enc).properties(height=height)


def show(chart: alt.Chart) -> None:
    st.altair_chart(chart, width="stretch")
