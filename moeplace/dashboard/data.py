"""What the dashboard reads, and nothing else: it finds the artifacts of a run directory and loads them
through the same library functions the ``place`` CLI uses (``traces.format`` / ``traces.validate`` /
``traces.stats``, ``placement.record`` / ``placement.evaluate`` / ``placement.compare`` /
``foundation.memory`` / ``placement.export``, the files ``sim.results.write_outputs`` writes). No metric
is computed here; pages only reshape what these functions return into charts.

One file past 600 lines on purpose: it is the dashboard's whole read contract, one small loader per
artifact kind, and keeping them together is what lets a reader check that no page reads anything else.

A run directory (what ``place demo --out run/`` writes; any layout works, JSON files are recognized by
their format tag (``foundation.formats``), never by which keys they hold, and the rest by their content):

- trace directories (Parquet with ``moeplace.model`` metadata), e.g. ``traces/``;
- placement JSON files (``moeplace.placement``), e.g. ``placement.json``, ``placements/*.json``;
- ``place optimize --report``/``--json`` output (``moeplace.comparison``), e.g. ``comparison.json``;
- ``place plan --report``/``--json`` output (``moeplace.memory-plan``), e.g. ``plan.json``;
- ``place simulate --out DIR`` directories (``summary.json`` + ``<label>.timeseries.parquet``), e.g. ``sim/``;
- Loads ``.npz`` files (``place trace stats --out``), e.g. ``loads.npz``;
- ``place sweep --out DIR`` directories (a ``moeplace.frontier`` ``frontier.json``, or a ``sweep.parquet``
  result table), e.g. ``runs/sweep-small/``; their ``cache/`` is not searched further.

An untagged JSON file (an engine file, or a report of a release before the tags) is not classified.

Loaders are cached with ``st.cache_data`` keyed by the path and a stamp of its files (size and mtime),
so an artifact rewritten on disk is re-read, and a large trace is summarized once by the streaming
statistics, never loaded whole.
"""
from __future__ import annotations

import json
import os
import stat
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import streamlit as st

from moeplace.foundation import reading
from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.errors import InputError
from moeplace.foundation.formats import check, kind_of
from moeplace.foundation.memory.config import MemoryConfig
from moeplace.foundation.memory.planner import plan_memory
from moeplace.foundation.model import load_model, preset_names
from moeplace.foundation.reading import is_regular
from moeplace.placement.compare import compare_policies
from moeplace.placement.evaluate import evaluate
from moeplace.placement.export import export_placement, format_names, get_format
from moeplace.placement.export.flags import TARGET_OF_FORMAT, FlagOptions, build_launch, matching_plan
from moeplace.placement.record import load_placement
from moeplace.placement.windows import routing_windows
from moeplace.sim.fidelity import fidelity_doc
from moeplace.sim.frontier import FRONTIER_FILE, LEGACY_VERSION, SWEEP_TABLE
from moeplace.sim.results import (
    CONFIG_FILE,
    POOL_ROWS,
    ROWS,
    SUMMARY_FILE,
    TIMESERIES_SUFFIX,
    read_outputs,
    read_sim_config,
)
from moeplace.traces.format import META_MODEL, PART_PREFIX, trace_files
from moeplace.traces.loads import is_loads_file, load_loads
from moeplace.traces.stats import compute_stats
from moeplace.traces.validate import read_trace_meta, trace_num_rows, validate_report

RUN_DIR_ENV = "MOEPLACE_RUN_DIR"
DEFAULT_RUN_DIR = "run"
# Directories never worth descending into while looking for artifacts.
_SKIP_DIRS = {".git", ".venv", "__pycache__", "node_modules", ".pytest_cache"}
_MAX_JSON_PEEK = 64 << 20  # JSON files larger than this are not classified (no run artifact is that big)
# artifact kind (foundation.formats) -> the RunIndex group it is shown in; other kinds are not shown
_SHOWN = {"placement": "placement", "comparison": "comparison", "memory-plan": "plan", "frontier": "frontier"}


# ---------------------------------------------------------------------------- run directory
def default_run_dir() -> str:
    """The run directory the app opens with: ``place dashboard RUN_DIR`` passes it in the environment."""
    return os.environ.get(RUN_DIR_ENV, DEFAULT_RUN_DIR)


@dataclass(frozen=True)
class RunIndex:
    """The artifacts found under a run directory, by kind (paths sorted; ``notes``: files skipped and why)."""

    root: Path
    traces: tuple[Path, ...] = ()
    placements: tuple[Path, ...] = ()
    comparisons: tuple[Path, ...] = ()
    plans: tuple[Path, ...] = ()
    sims: tuple[Path, ...] = ()
    loads: tuple[Path, ...] = ()
    sweeps: tuple[Path, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def empty(self) -> bool:
        return not (self.traces or self.placements or self.comparisons or self.plans or self.sims or self.loads
                    or self.sweeps)


def _special(p: Path) -> str | None:
    """What a non-regular file is (``"a FIFO (named pipe)"``...), None for a regular file, a directory
    (os.walk lists a link to one among the files) or a path that vanished."""
    try:
        mode = os.stat(p).st_mode
    except OSError:
        return None
    return None if stat.S_ISDIR(mode) else reading.special_kind(mode)


def stamp(path: str | Path) -> tuple:
    """A cache key for the current contents of a file or directory tree: (relative name, size, mtime)
    of every file, so a rewritten artifact invalidates its cached load."""
    p = Path(path)
    if p.is_file():
        s = p.stat()
        return ((p.name, s.st_size, s.st_mtime_ns),)
    if not p.is_dir():
        return ()
    out = []
    for dirpath, dirnames, filenames in os.walk(p):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS)
        for f in sorted(filenames):
            if f.startswith("."):
                continue
            fp = Path(dirpath, f)
            try:
                s = fp.stat()
            except OSError:
                continue
            out.append((str(fp.relative_to(p)), s.st_size, s.st_mtime_ns))
    return tuple(out)


def _is_trace_parquet(path: Path) -> bool:
    if not is_regular(path):  # a FIFO named part-00000.parquet would block the scan forever
        return False
    try:
        meta = pq.read_schema(path).metadata or {}
    except (pa.ArrowException, OSError):
        # A damaged file named like a trace part still belongs to a trace: the Traces page reports it.
        return path.name.startswith(PART_PREFIX)
    return META_MODEL in meta


def _json_kind(path: Path) -> str | None:
    return _json_peek(path)[0]


def _json_peek(path: Path) -> tuple[str | None, str | None]:
    """``(group, problem)`` of a JSON file: its :data:`_SHOWN` group (None: not shown), or
    ``("unreadable", the one-line problem)``; a FIFO, device or socket is never opened."""
    try:
        s = reading.require_regular(path)
    except (OSError, InputError) as exc:
        return "unreadable", str(exc) if isinstance(exc, InputError) else f"{path}: {exc.strerror or exc}"
    return _json_kind_of(str(path), s.st_size, s.st_mtime_ns)


@st.cache_data(show_spinner=False, max_entries=512)
def _json_kind_of(path: str, size: int, mtime_ns: int) -> tuple[str | None, str | None]:
    """Group of a JSON artifact by its format tag (cached per size and mtime: pages rescan on every rerun)."""
    if size > _MAX_JSON_PEEK:
        return None, None
    try:
        d = reading.read_json(path)
    except InputError as exc:
        return "unreadable", str(exc)
    return _SHOWN.get(kind_of(d)), None


def _is_sweep_table(path: Path) -> bool:
    """A ``place sweep`` result table (``moeplace.sweep.store.SCHEMA``: a point hash and a status per row)."""
    if not is_regular(path):
        return False
    try:
        names = set(pq.read_schema(path).names)
    except (pa.ArrowException, OSError):
        return True  # a damaged sweep.parquet still marks a sweep directory: the Sweep page reports it
    return {"point_hash", "status", "reason"} <= names


def _is_sweep_dir(d: Path, files: list[str]) -> bool:
    """What ``place sweep --out`` writes: its ``frontier.json`` (by its tag) or ``sweep.parquet`` table."""
    if FRONTIER_FILE in files and _json_kind(d / FRONTIER_FILE) == "frontier":
        return True
    return SWEEP_TABLE in files and _is_sweep_table(d / SWEEP_TABLE)


def scan_run_dir(root: str | Path) -> RunIndex:
    """Classify the artifacts under ``root`` by content. Raises :class:`InputError` when ``root`` is not
    a directory."""
    root = Path(root).expanduser()
    if not root.exists():
        raise InputError(f"{root}: no such directory (make one with `place demo --out {root}`)")
    if not root.is_dir():
        raise InputError(f"{root}: not a directory (give the directory `place demo --out` wrote)")
    found: dict[str, list[Path]] = {k: [] for k in ("traces", "placements", "comparisons", "plans", "sims", "loads",
                                                    "sweeps")}
    notes: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        dirnames[:] = sorted(x for x in dirnames if not x.startswith(".") and x not in _SKIP_DIRS)
        files = []
        for f in sorted(f for f in filenames if not f.startswith(".")):
            kind = _special(d / f)
            if kind is None:
                files.append(f)
            else:  # never opened: a FIFO would block the scan until a writer appears
                notes.append(f"{d / f}: is {kind}, not a regular file; skipped")
        if SUMMARY_FILE in files and any(f.endswith(TIMESERIES_SUFFIX) for f in files):
            found["sims"].append(d)
            dirnames[:] = []
            continue
        if _is_sweep_dir(d, files):
            # its cache/ holds the sweep's own traces and placements: part of the sweep, not of the run
            found["sweeps"].append(d)
            dirnames[:] = []
            continue
        parquet = [d / f for f in files if f.endswith(".parquet")]
        if parquet and d != root and any(_is_trace_parquet(f) for f in parquet):
            found["traces"].append(d)  # a trace directory: all of its parquet files are one trace
            dirnames[:] = []
            continue
        for f in parquet:
            if _is_trace_parquet(f):
                found["traces"].append(f)
        for f in files:
            p = d / f
            if f.endswith(".npz"):
                found["loads"].append(p)
            elif f.endswith(".json"):
                kind, problem = _json_peek(p)
                if kind == "unreadable":
                    notes.append(f"{problem}; skipped")
                elif kind is not None and kind != "frontier":  # a frontier outside its sweep directory
                    found[kind + "s"].append(p)
    # place simulate records the trace it replayed; the demo may keep the trace outside the run dir.
    for s in found["sims"]:
        try:
            tp = read_sim_config(s / CONFIG_FILE).get("trace", {}).get("path")
        except (InputError, AttributeError):
            continue
        if tp:
            # relative to where the run was made: most often the run directory's parent (`place demo --out run`)
            cand = [Path(tp)] if Path(tp).is_absolute() else [root.parent / tp, Path(tp), root / tp]
            for c in cand:
                if c.exists() and c.resolve() not in {t.resolve() for t in found["traces"]}:
                    found["traces"].append(c)
                    break
    return RunIndex(root, **{k: tuple(v) for k, v in found.items()}, notes=tuple(notes))


def rel(path: Path, root: Path) -> str:
    """``path`` relative to the run directory when it lies inside it (for labels)."""
    try:
        return str(Path(path).relative_to(root))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------------------- traces
def _stamped(fn):
    """Wrap a cached loader so callers pass a path; the stamp is added as part of the cache key."""
    def call(path, *args, **kwargs):
        return fn(str(path), stamp(path), *args, **kwargs)
    call.__name__ = fn.__name__
    call.__doc__ = fn.__doc__
    return call


@dataclass(frozen=True)
class TraceInfo:
    path: str
    model_name: str
    num_moe_layers: int
    num_experts: int
    top_k: int
    num_files: int
    num_rows: int
    provenance: dict[str, Any]
    moe_layers: tuple[int, ...]


@st.cache_data(show_spinner=False, max_entries=32)
def _trace_info(path: str, stamp_: tuple) -> TraceInfo:
    """Model, size and provenance of a trace, from its Parquet footers only."""
    model, prov = read_trace_meta(path)
    return TraceInfo(path, model.name, model.num_moe_layers, model.num_experts, model.top_k,
                     len(trace_files(path)), trace_num_rows(path), prov, tuple(model.moe_layers))


@st.cache_data(show_spinner=False, max_entries=16)
def _trace_validation(path: str, stamp_: tuple):
    """``traces.validate.validate_report`` (streams the trace row group by row group)."""
    return validate_report(path)


trace_info = _stamped(_trace_info)
trace_validation = _stamped(_trace_validation)


@st.cache_data(show_spinner=False, max_entries=16)
def _trace_stats(path: str, stamp_: tuple, window_tokens: int):
    return compute_stats(path, window_tokens=window_tokens)


trace_stats = _stamped(_trace_stats)


@st.cache_data(show_spinner=False, max_entries=16)
def _routing_loads(path: str, stamp_: tuple, window_tokens: int):
    """Per-window expert counts of a Loads ``.npz`` (``placement.windows.routing_windows``, the reader
    ``place optimize`` uses)."""
    return routing_windows([path], window_tokens=window_tokens)


def trace_loads(path, window_tokens: int):
    """Loads of a trace (from its cached streaming statistics, the same reduction ``place optimize``
    uses) or of a Loads ``.npz`` file."""
    if is_loads_file(path):
        return _routing_loads(str(path), stamp(path), window_tokens)
    return trace_stats(path, window_tokens).loads


# ---------------------------------------------------------------------------- placements
@st.cache_data(show_spinner=False, max_entries=64)
def _placement(path: str, stamp_: tuple):
    return load_placement(path)


placement = _stamped(_placement)


@dataclass(frozen=True)
class PlacementFile:
    """One distinct placement of a run: its first file and the other files holding the same placement
    (``place demo`` writes the chosen policy twice: ``placement.json`` and ``placements/placement-<policy>.json``)."""

    path: Path
    same: tuple[Path, ...] = ()


def distinct_placements(paths) -> tuple[list[PlacementFile], list[tuple[Path, Exception]]]:
    """``paths`` grouped by content: two files are the same placement when their model and
    ``Placement.fingerprint`` (the slot map and GPU layout) are equal, whatever their provenance says.
    Returns the groups in path order and the files that could not be read (with the error)."""
    groups: dict[tuple, list[Path]] = {}
    bad: list[tuple[Path, Exception]] = []
    for p in paths:
        try:
            pl_ = placement(p)
        except Exception as exc:  # noqa: BLE001  the page shows each unreadable file as a message
            bad.append((Path(p), exc))
            continue
        groups.setdefault((pl_.model_name, pl_.fingerprint()), []).append(Path(p))
    return [PlacementFile(ps[0], tuple(ps[1:])) for ps in groups.values()], bad


@st.cache_data(show_spinner=False, max_entries=64)
def _json(path: str, stamp_: tuple) -> Any:
    return reading.read_json(path)


def read_artifact(path, kind: str) -> Any:
    """A moeplace JSON artifact of ``kind`` (a ``foundation.formats`` kind: ``memory-plan``,
    ``comparison``): its tag is checked, so a file of another kind is an error naming it."""
    stamp_ = stamp(path)
    d = _json(str(path), stamp_)
    check(d, kind, str(path))
    return d


def read_comparison(path) -> dict:
    """A ``place optimize --report`` comparison, its table checked: ``rows`` a list of objects, each with
    a ``policy`` and a ``plan`` object (what the Placement page shows); anything else is an
    :class:`InputError` naming the file and the field, shown on the page (never a silently hidden file)."""
    d = read_artifact(path, "comparison")
    if not isinstance(d, dict):
        raise InputError(f"{path}: expected a JSON object")
    rows = d.get("rows")
    if not isinstance(rows, list):
        raise InputError(f"{path}: field 'rows' is {type(rows).__name__ if rows is not None else 'missing'}, "
                         "expected a list of policy rows")
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise InputError(f"{path}: field 'rows[{i}]' is a {type(r).__name__}, expected an object")
        if not isinstance(r.get("policy"), str):
            raise InputError(f"{path}: field 'rows[{i}].policy' missing or not a string")
        for key in ("plan", "held_out"):
            if r.get(key) is not None and not isinstance(r[key], dict):
                raise InputError(f"{path}: field 'rows[{i}].{key}' is a {type(r[key]).__name__}, expected an "
                                 "object")
    for key in ("shift",):
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise InputError(f"{path}: field '{key}' is a {type(d[key]).__name__}, expected an object")
    return d


@dataclass(frozen=True)
class Unseen:
    """The windows of a routing a placement was not planned on. ``kind``: ``held-out`` (planned on the
    first part of this routing: ``windows`` are the rest), ``unseen input`` (planned on other inputs:
    every window), ``in-sample`` (planned on all of it: none) or ``unknown`` (no record of what it was
    planned on, or an input that cannot be found: none, since any window may have been seen)."""

    kind: str
    windows: tuple[int, ...]
    why: str


def _resolve(name: str, root: Path) -> Path | None:
    """An input path as ``place optimize`` recorded it (relative to where it ran): against the run
    directory's parent, the working directory, then the run directory (as the simulated trace is found)."""
    p = Path(name)
    for base in ([p] if p.is_absolute() else [root.parent / p, Path.cwd() / p, root / p]):
        if base.exists():
            return base.resolve()
    return None


def _trace_key(path: Path) -> str | None:
    """What identifies a trace's routing wherever it lies: its model, provenance and row count (a copy
    elsewhere has the same); ``None`` when it is not a readable trace."""
    try:
        model, prov = read_trace_meta(path)
        return json.dumps([model.name, prov, trace_num_rows(path)], sort_keys=True, default=str)
    except Exception:  # noqa: BLE001  not a trace (a Loads file, a missing path): no key
        return None


def _routing_sources(path: Path, root: Path, loads=None) -> tuple[set, bool]:
    """The routing a path stands for: itself, the trace's identity (:func:`_trace_key`, so a copy of
    the trace elsewhere is the same routing) and, for a Loads ``.npz``, the trace it summarizes (its
    provenance's ``path``); the flag is False for a Loads file that does not record one."""
    out: set = {path.resolve()}
    src: Path | None = path
    known = True
    if is_loads_file(path):
        prov = load_loads(path).provenance if loads is None or "path" not in loads.provenance else loads.provenance
        name = prov.get("path") if prov.get("kind") == "trace" else None
        src = (_resolve(str(name), root) or Path(name).resolve()) if name else None
        known = name is not None
        if src is not None:
            out.add(src)
    key = _trace_key(src) if src is not None else None
    if key is not None:
        out.add(key)
    return out, known


def unseen_windows(placement_, loads, routing_path, root) -> Unseen:
    """Which windows of ``loads`` (read from ``routing_path``) ``placement_`` never saw while planning,
    from its ``planned_on`` provenance (``place optimize`` records the inputs and the first token of each
    input it did not plan on)."""
    on = placement_.provenance.get("planned_on")
    W = loads.num_windows
    if not isinstance(on, dict) or not on.get("inputs"):
        return Unseen("unknown", (), "its provenance does not say what it was planned on")
    resolved = [_resolve(str(i), Path(root)) for i in on["inputs"]]
    if any(r is None for r in resolved):
        return Unseen("unknown", (), f"an input it was planned on ({', '.join(map(str, on['inputs']))}) is not found")
    here, known = _routing_sources(Path(routing_path), Path(root), loads)
    planned, known_p = set(), True
    for r in resolved:
        srcs, k = _routing_sources(r, Path(root))
        planned |= srcs
        known_p &= k
    if not here & planned:
        if not (known and known_p):  # a Loads file that does not say which trace it summarizes
            return Unseen("unknown", (), "cannot tell whether it was planned on this routing")
        return Unseen("unseen input", tuple(range(W)), "planned on other inputs")
    start = on.get("held_out_from_token")
    wt = loads.window_tokens
    if start is None or not wt:
        return Unseen("in-sample", (), "planned on all of this routing")
    first = -(-int(start) // wt)  # windows starting at or after the first token planning did not see
    held = tuple(range(first, W))
    if not held:
        return Unseen("in-sample", (), "planned on all of this routing")
    return Unseen("held-out", held, f"planned on tokens 0-{int(start) - 1}")


@st.cache_data(show_spinner=False, max_entries=64,
               hash_funcs={"moeplace.placement.record.Placement": lambda p: (p.fingerprint(), p.model_name)})
def evaluate_placement(placement_, routing_key: tuple, _loads, rule: str):
    """``placement.evaluate.evaluate`` of one placement on Loads (``routing_key`` identifies ``_loads``
    in the cache: trace path, stamp, window size and window selection)."""
    return evaluate(placement_, _loads, rule, model=_loads.model)


def run_comparison(loads, *, gpus: int, gpu: str, gpus_per_node: int | None, num_redundant: int,
                   policies: list[str], rule: str, plan_fraction: float, seed: int, time_limit: float | None,
                   options: dict[str, Any] | None = None, progress=None):
    """``placement.compare.compare_policies`` — what ``place optimize`` runs — one policy at a time so
    the page can show progress (``progress(i, n, name)`` is called before each policy). Returns the
    :class:`~placement.compare.PolicyResult` list and the comparison of the last call (its windows)."""
    cluster = make_cluster(gpus, gpu, gpus_per_node)
    results, last = [], None
    for i, name in enumerate(policies):
        if progress is not None:
            progress(i, len(policies), name)
        last = compare_policies(loads, cluster, num_redundant=num_redundant, policies=[name], rule=rule,
                                plan_fraction=plan_fraction, seed=seed, time_limit=time_limit,
                                options=options)
        results += last.results
    if progress is not None:
        progress(len(policies), len(policies), None)
    return results, last


def export_name(placement_, fmt: str) -> str:
    """The file name the dashboard gives a placement's export in ``fmt``."""
    return f"{placement_.provenance.get('policy') or 'placement'}.{fmt}{get_format(fmt).suffixes[0]}"


def export_bytes(placement_, model, fmt: str, loads=None, extra: dict | None = None) -> tuple[bytes, str, list[str]]:
    """One export format of a placement as bytes (written by ``placement.export.export_placement`` to a
    temporary file). ``extra``: format options (TensorRT-LLM's layout keys, :func:`launch_for`). Returns
    (bytes, file name, warnings); raises InputError when the engine's checks reject the placement."""
    name = export_name(placement_, fmt)
    with tempfile.TemporaryDirectory(prefix="moeplace-dash-") as tmp:
        out = Path(tmp) / name
        # as place export calls it: the formats that take the routing's loads use them, the others ignore them
        warnings = export_placement(placement_, model, fmt, out, loads=loads, **(extra or {}))
        return out.read_bytes(), name, list(warnings or [])


@st.cache_data(show_spinner=False, max_entries=64,
               hash_funcs={"moeplace.placement.record.Placement": lambda p: (p.fingerprint(), p.model_name)})
def export_file(placement_, model, fmt: str, routing_key: tuple, _loads,
                extra: tuple = ()) -> tuple[bytes, str, list[str]]:
    """:func:`export_bytes`, cached per placement, format and routing (``routing_key`` names ``_loads``);
    ``extra``: format options as sorted (key, value) pairs."""
    return export_bytes(placement_, model, fmt, _loads, dict(extra))


@dataclass(frozen=True)
class Launch:
    """What ``place export --flags --plan PLAN`` prints for one format: the launch command that loads the
    exported file from ``file_path``, the memory plan's verdict line, and the format options the export
    needs for that layout (TensorRT-LLM's ``extra`` keys). ``error``: why there is no command (no plan of
    the run is for this placement, or the plan or the engine refuses the layout)."""

    fmt: str
    engine: str
    file_path: str
    command: str | None = None
    plan_line: str | None = None
    extra: tuple = ()
    error: str | None = None


@st.cache_data(show_spinner=False, max_entries=64,
               hash_funcs={"moeplace.placement.record.Placement": lambda p: (p.fingerprint(), p.model_name)})
def launch_for(placement_, model, fmt: str, file_path: str, plans: tuple[str, ...], placement_path: str,
               stamps: tuple = ()) -> Launch:
    """The launch command of ``placement_`` exported in ``fmt`` to ``file_path``, as ``place export --flags
    --plan PLAN`` makes it (``placement.export.flags.build_launch``: the memory plan, the capability table,
    the engine release's recorded parser): the layout is the one of the run's ``place plan --report`` file
    made for this placement (``plans``, first match), never a default. ``placement_path``: where the
    placement JSON is read from (the vLLM plugin's ``MOEPLACE_PLACEMENT``). ``stamps``: the plan files'
    stamps, so a rewritten plan is re-read."""
    engine = TARGET_OF_FORMAT.get(fmt)
    if engine is None:
        return Launch(fmt, get_format(fmt).engine, file_path, error=f"no launch command for format {fmt}")
    plan_path, passed = matching_plan(placement_, list(plans))
    if plan_path is None:
        why = f" ({'; '.join(passed)})" if passed else ""
        return Launch(fmt, engine, file_path,
                      error=(f"no memory plan of this run is for this placement{why}: the command realizes a planned "
                             f"layout, so plan one: place plan --gpus {placement_.num_gpus} --redundant "
                             f"{placement_.num_redundant} --tp T --dp D --report PLAN.json in the run directory"))
    try:
        built = build_launch(placement_, model, fmt, file_path, FlagOptions(placement_path=placement_path), plan_path)
    except InputError as exc:
        return Launch(fmt, engine, file_path, error=str(exc))
    return Launch(fmt, engine, file_path, built.launch.text(), f"{built.memory_line()} ({plan_path.name})",
                  tuple(sorted(built.extra.items())))


def placement_json_bytes(placement_) -> bytes:
    """The placement as ``Placement.save`` writes it."""
    with tempfile.TemporaryDirectory(prefix="moeplace-dash-") as tmp:
        out = Path(tmp) / "placement.json"
        placement_.save(out)
        return out.read_bytes()


def export_formats() -> list[tuple[str, str, str, str]]:
    """(name, engine, kind, summary) of every registered export format."""
    return [(n, get_format(n).engine, get_format(n).kind, get_format(n).summary) for n in format_names()]


# ---------------------------------------------------------------------------- plan
def plan_inputs(plan_dict: dict[str, Any]) -> tuple[str, int, str, int, Any]:
    """(model name, GPUs, GPU kind, GPUs per node, MemoryConfig) recorded in a ``place plan --json`` file."""
    where_ = "plan JSON"
    try:
        cfg = dict(plan_dict["config"])
        cl = plan_dict["cluster"]
        if cfg.get("context_mix"):
            cfg["context_mix"] = tuple((int(n), float(w)) for n, w in cfg["context_mix"])
        config = MemoryConfig(**cfg)
        return (str(plan_dict["model"]), int(cl["num_gpus"]), str(cl["gpu"]), int(cl["gpus_per_node"]), config)
    except KeyError as exc:
        raise InputError(f"{where_}: field {exc} missing") from None
    except (TypeError, ValueError) as exc:
        raise InputError(f"{where_}: field 'config' is not a plan config ({exc})") from None


def resolve_model(name: str, traces=()):
    """The model called ``name``: a preset, or the model recorded in one of the ``traces`` (a plan file
    names its model; a run of a non-preset model carries the spec in its trace)."""
    if name in preset_names():
        return load_model(name)
    for t in traces:
        try:
            m, _ = read_trace_meta(t)
        except InputError:
            continue
        if m.name == name:
            return m
    return load_model(name)  # a config.json path, or the preset loader's own error


@st.cache_data(show_spinner=False, max_entries=64)
def memory_plan(model, gpus: int, gpu: str, gpus_per_node: int | None, config):
    """``foundation.memory.plan_memory`` of ``model`` (a ModelSpec) — what ``place plan`` prints."""
    return plan_memory(model, make_cluster(gpus, gpu, gpus_per_node), config)


def concurrency_curve(plan, lengths: list[int]) -> pl.DataFrame:
    """Concurrent sequences (whole instance) and the pool that limits them, per single-length context:
    ``CachePools.concurrency`` — the planner's own admission model — at each length."""
    rows = []
    for n in lengths:
        per_rank, ceiling = plan.pools.concurrency(((int(n), 1.0),))
        rows.append({"context_tokens": int(n), "concurrency": int(per_rank) * plan.layout.dp, "ceiling": ceiling})
    return pl.DataFrame(rows)


def with_changes(config, **changes):
    return replace(config, **changes)


# ---------------------------------------------------------------------------- simulation
@dataclass(frozen=True)
class SimRun:
    """One ``place simulate --out`` directory: the resolved config, one summary per placement and its
    per-request and time-series frames (keyed by label)."""

    path: str
    config: dict[str, Any]
    summaries: list[dict[str, Any]]
    requests: dict[str, pl.DataFrame]
    timeseries: dict[str, pl.DataFrame]

    @property
    def labels(self) -> list[str]:
        return [s["label"] for s in self.summaries]


@st.cache_data(show_spinner=False, max_entries=8)
def _sim_run(path: str, stamp_: tuple) -> SimRun:
    return SimRun(path, *read_outputs(path))  # what place simulate --out wrote, read by its writer's module


sim_run = _stamped(_sim_run)


def sim_table_rows(summaries: list[dict[str, Any]] | None = None) -> list[tuple[str, str, str]]:
    """(name, summary key, unit) of the rows ``place simulate`` prints; the per-pool rows only when one of
    ``summaries`` is a deployment's (``place simulate --pools``), as the command prints them."""
    pools = summaries is None or any("pool_figures" in s for s in summaries)
    return [r for r in ROWS if pools or r[1] not in POOL_ROWS]


# (row, prefill pool key, decode pool key, unit) of the pools side by side; None: not that pool's figure
POOL_SIDE_BY_SIDE = (
    ("GPUs", "gpus", "gpus", "int"),
    ("attention TP x DP", "layout", "layout", "text"),
    ("running sequences / tokens per DP rank", "limits", "limits", "text"),
    ("prefill tok/s", "prefill_pool_tok_s", None, "n"),
    ("prefill tok/s per GPU", "prefill_pool_tok_s_per_gpu", None, "n"),
    ("TTFT p50 (ms)", "ttft_p50_s", None, "ms"),
    ("TTFT p99 (ms)", "ttft_p99_s", None, "ms"),
    ("KV hand-off p50 / p99 (ms)", None, "handoff", "text"),
    ("TPOT p50 (ms)", None, "tpot_p50_s", "ms"),
    ("TPOT p99 (ms)", None, "tpot_p99_s", "ms"),
    ("decode tok/s per GPU", None, "decode_pool_tok_s_per_gpu", "n"),
    ("busy", "prefill_pool_busy", "decode_pool_busy", "%"),
)


def pool_side_by_side(summary: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A deployment run's pools side by side (``place simulate --pools``): one row per figure, a column per
    pool, the values as the summary holds them (``None``: not that pool's figure); ``None`` for a run without
    pools."""
    figs = summary.get("pool_figures")
    if not isinstance(figs, dict) or set(figs) != {"prefill", "decode"}:
        return None
    derived = {}
    for role, f in figs.items():
        derived[role] = {"gpus": f.get("gpus"), "layout": f"TP{f.get('attention_tp')} x DP{f.get('dp')}",
                         "limits": f"{f.get('max_seqs')} / {f.get('max_batched_tokens')}"}
    p50, p99 = summary.get("kv_transfer_p50_s"), summary.get("kv_transfer_p99_s")
    derived["decode"]["handoff"] = (f"{p50 * 1e3:.1f} / {p99 * 1e3:.1f} over {figs['decode'].get('kv_link')}"
                                    if p50 is not None and p99 is not None else None)
    rows = []
    for name, pre_key, dec_key, unit in POOL_SIDE_BY_SIDE:
        row: dict[str, Any] = {"figure": name, "unit": unit}
        for role, key in (("prefill", pre_key), ("decode", dec_key)):
            row[role] = None if key is None else derived[role].get(key, summary.get(key))
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------- sweep
def _require(cond: bool, where_: str, what: str) -> None:
    if not cond:
        raise InputError(f"{where_}: expected {what} (written by `place sweep --out`)")


@st.cache_data(show_spinner=False, max_entries=16)
def _sweep_frontier(path: str, stamp_: tuple) -> dict[str, Any]:
    """``OUT/frontier.json`` of a sweep directory (``sim.frontier.frontier_report`` plus the
    run's ``recommended_launch``), checked against that schema; raises :class:`InputError` naming the
    file and field when it is missing or does not match."""
    f = Path(path) / FRONTIER_FILE
    if not f.exists():
        raise InputError(f"{f}: missing (the sweep has not finished; rerun `place sweep SPEC --out {path}` "
                         "to resume it)")
    rep = _json(str(f), stamp(f))
    if check(rep, "frontier", str(f)) == 0:  # untagged: the previous release's file, versioned by a field
        _require(rep.get("version") == LEGACY_VERSION, f"{f}: field 'version'",
                 f"{LEGACY_VERSION}, found {rep.get('version')!r}")
    ws = rep.get("workloads")
    _require(isinstance(ws, dict), f"{f}: field 'workloads'", "an object of workloads")
    for name, w in ws.items():
        at = f"{f}: workloads.{name}"
        _require(isinstance(w, dict), at, "an object")
        for key in ("points", "frontier"):
            _require(isinstance(w.get(key), list) and all(isinstance(r, dict) for r in w[key]),
                     f"{at}.{key}", "a list of point objects")
        for key in ("points", "frontier"):
            for i, r in enumerate(w[key]):
                miss = [c for c in ("index", "label", "gpus", "output_tok_s", "tpot_p99_s", "on_frontier")
                        if c not in r]
                _require(not miss, f"{at}.{key}[{i}]", f"fields {', '.join(miss)}")
        _require(w.get("recommended") is None or isinstance(w["recommended"], dict), f"{at}.recommended",
                 "a point object or null")
    launch = rep.get("recommended_launch", {})
    _require(isinstance(launch, dict), f"{f}: field 'recommended_launch'", "an object per workload")
    return rep


@st.cache_data(show_spinner=False, max_entries=16)
def _sweep_table(path: str, stamp_: tuple) -> pl.DataFrame:
    """``OUT/sweep.parquet``: every point of the sweep with its status, stage and reason."""
    f = Path(path) / SWEEP_TABLE
    if not f.exists():
        raise InputError(f"{f}: missing (the sweep has not finished; rerun `place sweep SPEC --out {path}` "
                         "to resume it)")
    try:
        df = pl.read_parquet(f)
    except Exception as exc:  # noqa: BLE001  polars raises several types for damaged files
        raise InputError(f"{f}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    miss = [c for c in ("index", "label", "workload", "status", "stage", "reason") if c not in df.columns]
    if miss:
        raise InputError(f"{f}: columns {', '.join(miss)} missing (written by `place sweep --out`)")
    return df


def _sweep_stamp(path) -> tuple:
    d = Path(path)
    return stamp(d / FRONTIER_FILE) + stamp(d / SWEEP_TABLE)  # not the cache/: it only grows


def sweep_frontier(path) -> dict[str, Any]:
    return _sweep_frontier(str(path), _sweep_stamp(path))


def sweep_table(path) -> pl.DataFrame:
    return _sweep_table(str(path), _sweep_stamp(path))


# ---------------------------------------------------------------------------- simulator accuracy
@st.cache_data(show_spinner=False)
def fidelity_note() -> str:
    """The simulator's accuracy note, the line ``place simulate`` prints under its table
    (``sim.fidelity.fidelity_doc``)."""
    return fidelity_doc()["note"]


# ---------------------------------------------------------------------------- sweep cost
# Default on-demand price per GPU-hour (USD) of each GPU preset, for the Sweep page's cost frontier. They
# are assumptions, editable on the page; docs/dashboard.md states the source of each.
DEFAULT_GPU_PRICES: dict[str, float] = {
    "h100": 2.69, "h800": 2.69, "h200": 3.59, "b200": 5.98, "b300": 7.18, "gb200-nvl72": 4.54, "gb300-nvl72": 5.45,
}


def cost_points(points: list[dict], prices: dict[str, float]) -> list[dict]:
    """The sweep's simulated ``points`` priced: ``usd_per_hour`` = GPUs x the price of their GPU kind,
    ``usd_per_mtok`` = that hour's cost per million output tokens at the point's output tok/s, and
    ``on_cost_frontier``: no other point is at most as expensive per hour, at least as fast and at most
    as slow in p99 TPOT, and better in one of them (the sweep's own frontier with cost for GPU count).
    A point whose GPU kind has no price gets ``None`` costs and is left off. Pure arithmetic on the file's
    figures and the prices: nothing is simulated again."""
    out = []
    for r in points:
        price = prices.get(str(r.get("gpu", "")).lower())
        hour = None if price is None else float(price) * int(r["gpus"])
        tok = r.get("output_tok_s") or 0.0
        per_mtok = None if hour is None or tok <= 0 else hour / (tok * 3600.0) * 1e6
        out.append({**r, "usd_per_hour": hour, "usd_per_mtok": per_mtok, "on_cost_frontier": False})
    priced = [r for r in out if r["usd_per_hour"] is not None and r.get("tpot_p99_s") is not None]
    for r in priced:
        r["on_cost_frontier"] = not any(
            o is not r and o["usd_per_hour"] <= r["usd_per_hour"] and o["output_tok_s"] >= r["output_tok_s"]
            and o["tpot_p99_s"] <= r["tpot_p99_s"]
            and (o["usd_per_hour"] < r["usd_per_hour"] or o["output_tok_s"] > r["output_tok_s"]
                 or o["tpot_p99_s"] < r["tpot_p99_s"])
            for o in priced)
    return out
