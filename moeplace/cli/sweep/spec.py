"""The sweep spec (YAML or TOML) and its expansion into points.

A spec names the model, one or more workloads, the axes of the design space and the settings every
point shares; :func:`load_spec` validates it (errors name the spec file and the field) and
:func:`expand_points` turns it into the list of points (the cartesian product of the axes, then the
explicit ``points``). Every point has a stable hash (:func:`point_hash`) over everything its result
depends on, which is what a resumed sweep keys finished points by, and an optimize key
(:func:`optimize_key`) shared by the points that need the same placement.

Example (``examples/sweep-k3.yaml`` is the full one)::

    model: kimi-k3
    workloads:
      - name: chat
        synth: {num_tokens: 20000, seed: 0}   # traces.synth.SynthConfig fields; or trace: DIR
        concurrency: 64                        # closed loop; or rate: 4.0 (+ arrival: poisson|gamma|ramp)
        context_mix: "2k:1.0"                  # prompt lengths (default: the trace's own)
        output_len: 128
    axes:                                      # a scalar is a one-value axis
      gpu: h200
      gpus: [16, 32, 64]
      tp: 8                                    # attention TP; DP = gpus / tp
      redundant: ["1/gpu"]                     # R, or N/gpu = N slots per GPU
      policy: [eplb, moeplace]
      rebalance: [static, "every=25,window=25,moves=32,policy=eplb"]
      kv_dtype: fp8
    points:                                    # extra points; unnamed axes take the axis' first value
      - {gpus: 32, kv_dtype: bf16}
    plan: {context: 128k, min_seqs: 1}         # foundation.memory.config.MemoryConfig knobs (see PLAN_KEYS)
    engine: {max_batched_tokens: 8192, max_seqs: 256}  # cli.sim_settings.SimSettings fields (ENGINE_FIELDS)
    optimize: {plan_fraction: 0.5, window_tokens: 4096, options: {lns_rounds: 0}}
    simulate: {duration: 3.0, mode: stat, max_trace_tokens: 20000}
    objective: {tpot_p99_ms: 100}              # service-level limits for the recommendation
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import tomllib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from moeplace.cli.sim_settings import SimSettings, build_sim_config
from moeplace.foundation import limits, reading
from moeplace.foundation.cluster import gpu_preset_names
from moeplace.foundation.errors import InputError
from moeplace.foundation.limits import check_sim_duration
from moeplace.foundation.memory.config import MemoryConfig
from moeplace.foundation.memory.inputs import parse_context_mix, parse_pool_split, parse_tokens
from moeplace.foundation.model import DEFAULT_MODEL, KV_DTYPE_BYTES, ModelSpec, load_model
from moeplace.foundation.reading import quote
from moeplace.foundation.settings import build, field_types, nearest, parse_keys
from moeplace.placement.dispatch import ENGINE_RULES
from moeplace.placement.policies import check_options, policy_names
from moeplace.sim.runner import RunInputs
from moeplace.traces.synth import SYNTH_VERSION, SynthConfig

SWEEP_VERSION = 1  # part of every point hash: bump when a stage's meaning changes

# Axis name -> the type of one value. ``redundant`` also takes "N/gpu"; ``rebalance`` is "static" or a
# ``place simulate --rebalance`` string; ``tp``/``ep``/``gpus_per_node`` accept null (= derived).
AXES: dict[str, tuple[type, ...]] = {
    "workload": (str,),
    "gpu": (str,),
    "gpus": (int,),
    "gpus_per_node": (int, type(None)),
    "tp": (int, type(None)),
    "ep": (int, type(None)),
    "redundant": (int, str),
    "policy": (str,),
    "rebalance": (str,),
    "kv_dtype": (str,),
    "engine": (str,),
}
AXIS_DEFAULTS: dict[str, Any] = {"gpu": "h200", "gpus": 32, "gpus_per_node": None, "tp": 8, "ep": None,
                                 "redundant": "1/gpu", "policy": "eplb", "rebalance": "static",
                                 "kv_dtype": "fp8", "engine": "vllm"}

# spec section -> allowed keys and their default values (the sweep's own sections)
PLAN_KEYS: dict[str, Any] = {"context": "128k", "context_mix": None, "min_seqs": 1, "dense_tp": None,
                             "dcp": 1, "state_slots": 1, "page_size": 64, "other_reserve_gib": 1.0}
OPTIMIZE_KEYS: dict[str, Any] = {"plan_fraction": 0.5, "window_tokens": 4096, "time_limit": None,
                                 "options": {}}
OBJECTIVE_KEYS: dict[str, Any] = {"tpot_p99_ms": None, "ttft_p99_ms": None, "min_output_tok_s": None}

# The engine, simulate and workload sections are settings of one simulation: fields of
# cli.sim_settings.SimSettings (what `place simulate` takes as flags), checked against its types, choices
# and ranges and built into it, with its defaults unless SWEEP_DEFAULTS says otherwise. The axes set
# attention_tp (tp), engine, kv_dtype and rebalance; the spec's seed is the run's. A disaggregated run
# needs a prefill pool placement per point, which a sweep does not make.
_SETTINGS = field_types(SimSettings)
_BY_AXIS = {"attention_tp", "engine", "kv_dtype", "rebalance", "seed"}
WORKLOAD_FIELDS = ("arrival", "concurrency", "rate", "rate_end", "burstiness", "context_mix", "output_len",
                   "max_requests")
SIMULATE_FIELDS = ("duration", "mode", "max_trace_tokens")  # max_trace_tokens: sim.runner.RunInputs'
_NOT_ENGINE = {*_BY_AXIS, *WORKLOAD_FIELDS, "duration", "mode", "disaggregated", "prefill_gpus", "isl", "osl",
               "random_range_ratio", "cost_model", "cost_engine"}
ENGINE_FIELDS = tuple(f for f in _SETTINGS if f not in _NOT_ENGINE)  # warmup included
# engine fields a sweep spec takes since this release: in a point's hash only when given, so that a sweep
# written before resumes
_NEW_ENGINE_FIELDS = ("kernel_build", "admission", "phase", "prefill_batches")
SWEEP_DEFAULTS: dict[str, Any] = {"duration": 5.0, "max_trace_tokens": 20000, "concurrency": 64}
_SIMULATE_TYPES = {k: _SETTINGS.get(k) or field_types(RunInputs)[k] for k in SIMULATE_FIELDS}
TOP_KEYS = {"name", "model", "seed", "workloads", "axes", "points", "plan", "engine", "optimize", "simulate",
            "objective"}

_PER_GPU = re.compile(r"^\s*(\d+)\s*/\s*gpu\s*$")
_REBALANCE = re.compile(r"[a-z_]+=[^,]+(,[a-z_]+=[^,]+)*")  # the full check is sim.config.parse_rebalance


@dataclass(frozen=True)
class Workload:
    """One workload: a trace directory/file (``trace``) or synthetic-trace parameters (``synth``, the
    fields of :class:`traces.synth.SynthConfig`), and how requests arrive at the simulated cluster
    (``settings``: every :data:`WORKLOAD_FIELDS` field of :class:`SimSettings`)."""

    name: str
    trace: str | None = None
    synth: dict[str, Any] | None = None
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Point:
    """One deployment x workload to evaluate. ``index``: position in the spec's expansion."""

    index: int
    workload: str
    gpu: str
    gpus: int
    gpus_per_node: int | None
    tp: int | None
    ep: int | None
    redundant: int | str
    policy: str
    rebalance: str
    kv_dtype: str
    engine: str

    @property
    def num_redundant(self) -> int:
        """``redundant`` resolved: ``"N/gpu"`` -> N x the EP size (all GPUs unless ``ep`` is set)."""
        if isinstance(self.redundant, int):
            return self.redundant
        m = _PER_GPU.match(self.redundant)
        return int(m.group(1)) * (self.ep or self.gpus)

    def axes(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("index")
        return d

    def label(self) -> str:
        tp = f" TP{self.tp}" if self.tp else ""
        ep = f" EP{self.ep}" if self.ep and self.ep != self.gpus else ""
        return (f"{self.workload}: {self.gpus}x{self.gpu}{tp}{ep} R={self.num_redundant} {self.policy} "
                f"{'static' if self.rebalance == 'static' else 'online'} KV {self.kv_dtype} {self.engine}")


@dataclass(frozen=True)
class SweepSpec:
    """A validated spec. ``path``: the spec file (relative trace paths were resolved against it).
    ``settings``: the :class:`SimSettings` every point shares (engine and simulate sections, seed); the
    ``engine`` / ``simulate`` mappings are those sections as given over their defaults (what a point's
    hash holds)."""

    path: str
    name: str
    model: ModelSpec
    seed: int
    workloads: tuple[Workload, ...]
    axes: dict[str, tuple[Any, ...]]
    extra_points: tuple[dict[str, Any], ...]
    plan: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    optimize: dict[str, Any] = field(default_factory=dict)
    simulate: dict[str, Any] = field(default_factory=dict)
    objective: dict[str, Any] = field(default_factory=dict)
    settings: SimSettings = field(default_factory=SimSettings)
    # cost-model constants of a ``place calibrate`` file (``--calibration``: the event simulation's, its
    # weighted median member), none: the shipped ones
    cost: dict[str, Any] = field(default_factory=dict)
    # the calibrated members that price every point (sim.calibrate.calibrated_ensemble), None: the shipped ones
    ensemble: Any = None

    def workload(self, name: str) -> Workload:
        return next(w for w in self.workloads if w.name == name)


# ---------------------------------------------------------------------------- reading
def _err(path: str, fld: str, msg: str) -> InputError:
    return InputError(f"{path}: field '{fld}': {msg}")


def _unknown(path: str, parent: str, key: str, choices, what: str = "key") -> InputError:
    """An unknown key of the mapping at ``parent``, with the nearest valid one (or the list)."""
    key = key if isinstance(key, str) and len(key) <= 80 else quote(key)
    near = nearest(key, choices)
    hint = f"; did you mean '{near}'?" if near else f" (expected one of {', '.join(sorted(choices))})"
    return _err(path, f"{parent}.{key}" if parent else key, f"unknown {what}{hint}")


def read_spec_file(path: str | Path) -> dict[str, Any]:
    """The raw mapping of a ``.yaml``/``.yml`` or ``.toml`` spec (syntax errors name file and line; a
    FIFO or device, nesting, huge integers and duplicate YAML keys are refused: ``foundation.reading``)."""
    p = Path(path)
    if p.suffix not in (".yaml", ".yml", ".toml"):
        if not p.exists():
            raise InputError(f"{p}: no such sweep spec file")
        raise InputError(f"{p}: a sweep spec must be .yaml, .yml or .toml")
    try:
        text = reading.read_text(p, "a sweep spec")
    except FileNotFoundError:
        raise InputError(f"{p}: no such sweep spec file") from None
    if p.suffix in (".yaml", ".yml"):
        raw = reading.parse_yaml(text, str(p))
    else:
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise InputError(f"{p}: not valid TOML ({exc})") from None
        except (RecursionError, ValueError) as exc:  # tomllib recurses; int() of 5,000 digits
            raise InputError(f"{p}: not a usable TOML spec: "
                             f"{'nested too deeply' if isinstance(exc, RecursionError) else exc}") from None
        if reading.too_deep(raw):
            raise InputError(f"{p}: arrays/tables nested more than {reading.MAX_DEPTH} levels deep")
    if not isinstance(raw, dict):
        raise InputError(f"{p}: expected a mapping at the top level (keys {', '.join(sorted(TOP_KEYS))})")
    return raw


def _section(path: str, raw: dict, name: str, keys: dict[str, Any]) -> dict[str, Any]:
    sec = raw.get(name) or {}
    if not isinstance(sec, dict):
        raise _err(path, name, "expected a mapping")
    unknown = sorted(set(sec) - set(keys))
    if unknown:
        raise _unknown(path, name, unknown[0], keys)
    return {**keys, **sec}


def _in_spec(path: str, exc: InputError) -> InputError:
    """``"engine.max_seqs: must be >= 1"`` (:mod:`foundation.settings`) as this module words it."""
    fld, _, msg = str(exc).partition(": ")
    return _err(path, fld, msg)


def _settings_section(path: str, raw: dict, name: str, types: dict[str, Any]
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
    """A section of :class:`SimSettings` fields, checked (unknown key -> nearest; type, choice, range).
    Returns the values as typed and as given (what point hashes hold), each over the defaults (the
    spec's own where :data:`SWEEP_DEFAULTS` has one)."""
    sec = raw.get(name) or {}
    try:
        typed = parse_keys(name, sec, types)
    except InputError as exc:
        raise _in_spec(path, exc) from None
    defaults = {k: SWEEP_DEFAULTS.get(k, getattr(SimSettings, k, None)) for k in types}
    return {**defaults, **typed}, {**defaults, **sec}


def _num(path: str, fld: str, v: Any, kind: type, lo: float | None = None, allow_none: bool = False) -> Any:
    if v is None and allow_none:
        return None
    ok = isinstance(v, kind) and not isinstance(v, bool) or (kind is float and isinstance(v, int)
                                                              and not isinstance(v, bool))
    if not ok:
        raise _err(path, fld, f"expected {'a whole number' if kind is int else 'a number'}, got {quote(v)}")
    if not math.isfinite(v):  # .inf / .nan: "no limit" is null, and a NaN limit is met by nothing
        raise _err(path, fld, f"expected a finite number, got {v!r}")
    if lo is not None and v < lo:
        raise _err(path, fld, f"must be >= {lo}, got {v}")
    return kind(v)


def _workloads(path: str, raw: dict, base: Path, max_context: int | None = None) -> tuple[Workload, ...]:
    items = raw.get("workloads")
    if not isinstance(items, list) or not items:
        raise _err(path, "workloads", "expected a non-empty list of workloads (each with trace: or synth:)")
    out = []
    for i, w in enumerate(items):
        f = f"workloads[{i}]"
        if not isinstance(w, dict):
            raise _err(path, f, "expected a mapping")
        unknown = sorted(set(w) - {"name", "trace", "synth", *WORKLOAD_FIELDS})
        if unknown:
            raise _unknown(path, f, unknown[0], {"name", "trace", "synth", *WORKLOAD_FIELDS})
        name = w.get("name", f"w{i}")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise _err(path, f"{f}.name", f"expected a name of letters, digits, '-', '_', '.', got {quote(name)}")
        if ("trace" in w) == ("synth" in w):
            raise _err(path, f, "give exactly one of trace: (a trace file/directory) or synth: (parameters)")
        trace = synth = None
        if "trace" in w:
            t = Path(str(w["trace"]))
            t = t if t.is_absolute() else (base / t)
            if not t.exists():
                raise _err(path, f"{f}.trace", f"{t}: no such trace file or directory")
            trace = str(t.resolve())
        else:
            synth = w["synth"] or {}
            if not isinstance(synth, dict):
                raise _err(path, f"{f}.synth", "expected a mapping of traces.synth.SynthConfig fields")
            try:
                build(SynthConfig, f"{f}.synth", synth)  # the generator's own fields, types and ceilings
            except InputError as exc:
                msg = str(exc)  # a key or type error names its field; the config's own range checks do not
                raise InputError(f"{path}: {msg}" if msg.startswith(f"{f}.synth") else
                                 f"{path}: {f}.synth: {msg}") from None
        settings, _ = _settings_section(path, {f: {k: v for k, v in w.items() if k in WORKLOAD_FIELDS}}, f,
                                        {k: _SETTINGS[k] for k in WORKLOAD_FIELDS})
        if "arrival" not in w:
            settings["arrival"] = "poisson" if "rate" in w else "closed"
        if settings["arrival"] != "closed" and "rate" not in w:
            raise _err(path, f"{f}.rate", f"arrival '{settings['arrival']}' needs rate: requests per second")
        mix = settings["context_mix"]
        if mix is not None:
            try:
                parse_context_mix(mix, max_context, "context_mix")
            except InputError as exc:
                raise _err(path, f"{f}.context_mix", str(exc)) from None
        out.append(Workload(name=name, trace=trace, synth=synth, settings=settings))
    names = [w.name for w in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise _err(path, "workloads", f"workload name '{dup}' appears twice")
    return tuple(out)


def _check_trace_models(path: str, workloads: tuple[Workload, ...], model: ModelSpec) -> None:
    """Each workload trace routes the spec's model: a trace of another model would make every point fail
    or plan the wrong model (it used to end as a sweep of infeasible points and exit 0). Read from the
    trace's footers only (the gate's file-level checks)."""
    from moeplace.traces.validate import read_trace_meta  # pyarrow: only specs with a trace pay for it

    for i, w in enumerate(workloads):
        if w.trace is None:
            continue
        tm, _ = read_trace_meta(w.trace)
        shape = (tuple(tm.moe_layers), tm.num_experts, tm.top_k)
        if shape != (tuple(model.moe_layers), model.num_experts, model.top_k):
            raise _err(path, f"workloads[{i}].trace",
                       f"{w.trace} routes model '{tm.name}' ({tm.num_moe_layers} MoE layers x {tm.num_experts} "
                       f"experts, top-{tm.top_k}), but the spec's model is '{model.name}' ({model.num_moe_layers} "
                       f"x {model.num_experts}, top-{model.top_k}): set field 'model' to the trace's model")


def _check_axis_value(path: str, fld: str, axis: str, v: Any, workloads: tuple[str, ...]) -> Any:
    kinds = AXES[axis]
    if isinstance(v, bool) or not isinstance(v, kinds):
        want = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise _err(path, fld, f"expected {want}, got {quote(v)}")
    if axis == "workload" and v not in workloads:
        raise _err(path, fld, f"no workload named {quote(v)} (workloads: {', '.join(workloads)})")
    if axis == "gpu" and v not in gpu_preset_names():
        raise _err(path, fld, f"GPU {quote(v)} unknown (expected one of {', '.join(gpu_preset_names())})")
    if axis in ("gpus", "gpus_per_node", "tp", "ep") and v is not None and v < 1:
        raise _err(path, fld, f"must be >= 1, got {v}")
    if axis == "redundant":
        if isinstance(v, int) and v < 0:
            raise _err(path, fld, f"must be >= 0, got {v}")
        if isinstance(v, str) and not _PER_GPU.match(v):
            raise _err(path, fld, f"expected a slot count or 'N/gpu' (N slots per GPU), got {quote(v)}")
    if axis == "policy" and v not in policy_names():
        raise _err(path, fld, f"unknown policy {quote(v)} (expected one of {', '.join(policy_names())})")
    if axis == "kv_dtype" and v not in KV_DTYPE_BYTES:
        raise _err(path, fld, f"expected one of {', '.join(KV_DTYPE_BYTES)}, got {quote(v)}")
    if axis == "engine" and v not in ENGINE_RULES:
        raise _err(path, fld, f"expected one of {', '.join(ENGINE_RULES)} (the simulator's replica rules), "
                              f"got {quote(v)}")
    if axis == "rebalance" and v != "static" and not _REBALANCE.fullmatch(v.strip()):
        raise _err(path, fld, f"expected 'static' or every=N,window=W,moves=K[,policy=P], got {quote(v)}")
    return v


def _check_redundant(sp: str, axes: dict[str, tuple[Any, ...]], extra: list, num_experts: int) -> None:
    """Redundant slots within reason for the model: ``N/gpu`` at most one copy of every expert per GPU
    (N <= E), a count at most that on the largest cluster of the spec. A larger value only makes arrays
    that overflow (a point file of 4e9 slots was written before it failed)."""
    most_gpus = max([g for g in axes["gpus"] if g is not None]
                    + [pt["gpus"] for pt in extra if isinstance(pt.get("gpus"), int)] or [1])
    values = [(f"axes.redundant[{i}]", v) for i, v in enumerate(axes["redundant"])]
    values += [(f"points[{i}].redundant", pt["redundant"]) for i, pt in enumerate(extra) if "redundant" in pt]
    for fld, v in values:
        if isinstance(v, str):
            n = int(_PER_GPU.match(v).group(1))
            if n > num_experts:
                raise _err(sp, fld, f"{quote(v)}: more redundant slots per GPU than the model's {num_experts} "
                                    "experts (at most one extra copy of every expert per GPU)")
        elif v > num_experts * most_gpus:
            raise _err(sp, fld, f"{v}: more redundant slots than {num_experts} experts x {most_gpus} GPUs (the "
                                "spec's largest cluster)")


def load_spec(path: str | Path) -> SweepSpec:
    """Read and validate a sweep spec; see the module docstring for the keys."""
    p = Path(path)
    raw = read_spec_file(p)
    sp = str(p)
    unknown = sorted(set(raw) - TOP_KEYS)
    if unknown:
        raise _unknown(sp, "", unknown[0], TOP_KEYS)
    try:
        model = load_model(raw.get("model") or DEFAULT_MODEL)
    except InputError as exc:
        raise _err(sp, "model", str(exc)) from None
    seed = _num(sp, "seed", raw.get("seed", 0), int, 0)
    workloads = _workloads(sp, raw, p.resolve().parent, model.max_context)
    _check_trace_models(sp, workloads, model)
    wnames = tuple(w.name for w in workloads)
    axes_raw = raw.get("axes") or {}
    if not isinstance(axes_raw, dict):
        raise _err(sp, "axes", "expected a mapping of axis -> value or list of values")
    bad = sorted(set(axes_raw) - set(AXES))
    if bad:
        raise _unknown(sp, "axes", bad[0], AXES, "axis")
    axes: dict[str, tuple[Any, ...]] = {}
    for axis in AXES:
        v = axes_raw.get(axis, list(wnames) if axis == "workload" else AXIS_DEFAULTS[axis])
        vals = v if isinstance(v, list) else [v]
        if not vals:
            raise _err(sp, f"axes.{axis}", "an axis needs at least one value")
        axes[axis] = tuple(_check_axis_value(sp, f"axes.{axis}[{i}]", axis, x, wnames)
                           for i, x in enumerate(vals))
        if len(set(axes[axis])) != len(axes[axis]):
            raise _err(sp, f"axes.{axis}", "a value appears twice")
    extra = raw.get("points") or []
    if not isinstance(extra, list):
        raise _err(sp, "points", "expected a list of mappings axis -> value")
    for i, pt in enumerate(extra):
        if not isinstance(pt, dict):
            raise _err(sp, f"points[{i}]", "expected a mapping axis -> value")
        bad = sorted(set(pt) - set(AXES))
        if bad:
            raise _unknown(sp, f"points[{i}]", bad[0], AXES, "axis")
        for k, v in pt.items():
            _check_axis_value(sp, f"points[{i}].{k}", k, v, wnames)
    _check_redundant(sp, axes, extra, model.num_experts)
    plan = _section(sp, raw, "plan", PLAN_KEYS)
    engine_typed, engine = _settings_section(sp, raw, "engine", {k: _SETTINGS[k] for k in ENGINE_FIELDS})
    given = raw.get("engine") or {}
    engine = {k: v for k, v in engine.items() if k in given or k not in _NEW_ENGINE_FIELDS}
    optimize = _section(sp, raw, "optimize", OPTIMIZE_KEYS)
    sim_typed, simulate = _settings_section(sp, raw, "simulate", _SIMULATE_TYPES)
    try:
        check_sim_duration(sim_typed["duration"], "simulate.duration")  # the ceiling --duration meets
    except InputError as exc:
        raise InputError(f"{sp}: {exc}") from None
    if sim_typed["max_trace_tokens"] is None:
        raise _err(sp, "simulate.max_trace_tokens", "expected a whole number (tokens of the trace to route)")
    objective = _section(sp, raw, "objective", OBJECTIVE_KEYS)
    settings = SimSettings(seed=seed, duration=sim_typed["duration"], mode=sim_typed["mode"], **engine_typed)
    _check_settings(sp, plan, settings, optimize, objective, model.max_context)
    for i, w in enumerate(workloads):  # every simulation setting through SimConfig's checks, before any work
        try:
            build_sim_config(replace(settings, **w.settings), model.max_context,
                             mix_what=f"workloads[{i}].context_mix")
        except InputError as exc:
            raise InputError(f"{sp}: workload '{w.name}': {exc}") from None
    name = raw.get("name") or p.stem
    # the name becomes runs/sweep-<name>: one path component, so it can never reach outside runs/
    if "name" in raw and not (isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9_.-]+", name)
                              and name not in (".", "..")):
        raise _err(sp, "name", f"expected a name of letters, digits, '-', '_', '.' (it names the output "
                               f"directory runs/sweep-<name>), got {quote(name, 60)}")
    return SweepSpec(path=sp, name=str(name), model=model, seed=seed, workloads=workloads, axes=axes,
                     extra_points=tuple(dict(x) for x in extra), plan=plan, engine=engine, optimize=optimize,
                     simulate=simulate, objective=objective, settings=settings)


def _check_settings(sp: str, plan: dict, settings: SimSettings, optimize: dict, objective: dict,
                    max_context: int | None = None) -> None:
    """Type and range checks of the sweep's own sections (the simulation settings were checked against
    :class:`SimSettings` as they were read), and the memory plan's knobs every point shares."""
    for k in ("min_seqs", "dcp", "state_slots", "page_size"):
        _num(sp, f"plan.{k}", plan[k], int, 1)
    _num(sp, "plan.dense_tp", plan["dense_tp"], int, 1, allow_none=True)
    _num(sp, "plan.other_reserve_gib", plan["other_reserve_gib"], float, 0)
    try:
        if plan["context"] is not None:
            parse_tokens(plan["context"], "plan.context")
        if plan["context_mix"] is not None:
            parse_context_mix(str(plan["context_mix"]), max_context, "plan.context_mix")
        parse_pool_split(settings.pool_split)
        base_memory_config(plan, settings)
    except InputError as exc:
        raise InputError(f"{sp}: {exc}") from None
    f = _num(sp, "optimize.plan_fraction", optimize["plan_fraction"], float, 0)
    if not 0 < f <= 1:
        raise _err(sp, "optimize.plan_fraction", f"must be in (0, 1], got {f}")
    _num(sp, "optimize.window_tokens", optimize["window_tokens"], int, 1)
    _num(sp, "optimize.time_limit", optimize["time_limit"], float, 0, allow_none=True)
    try:
        check_options("optimize.options", optimize["options"])  # the policies' own option table
    except InputError as exc:
        raise InputError(f"{sp}: {exc}") from None
    for k in OBJECTIVE_KEYS:
        _num(sp, f"objective.{k}", objective[k], float, 0, allow_none=True)


def base_memory_config(plan: dict[str, Any], settings: SimSettings) -> MemoryConfig:
    """The :class:`MemoryConfig` knobs every point shares (layout, R and KV dtype come from the point)."""
    rule, param = parse_pool_split(settings.pool_split)
    return MemoryConfig(
        dense_tp=plan["dense_tp"], dcp=plan["dcp"],
        context=None if plan["context"] is None else parse_tokens(plan["context"], "plan.context"),
        context_mix=parse_context_mix(str(plan["context_mix"])) if plan["context_mix"] else None,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        max_batched_tokens=settings.max_batched_tokens, max_num_seqs=settings.max_seqs,
        state_slots_per_seq=plan["state_slots"], pool_split=rule, pool_param=param,
        page_size=plan["page_size"],
        other_reserve_bytes=float(plan["other_reserve_gib"]) * 2**30, min_concurrency=plan["min_seqs"])


# ---------------------------------------------------------------------------- points
def count_points(spec: SweepSpec) -> int:
    """Points :func:`expand_points` yields at most (the grid's product plus the explicit points, before
    duplicates are dropped), computed without expanding anything."""
    return math.prod(len(spec.axes[a]) for a in AXES) + len(spec.extra_points)


def points_seconds(n: int, workers: int) -> float:
    """Wall seconds ``n`` points take on ``workers`` workers, estimated from the measured
    :data:`limits.SWEEP_POINT_SECONDS` per point and worker (points that share a placement cost less,
    infeasible ones almost nothing: an estimate, not a bound)."""
    return n * limits.SWEEP_POINT_SECONDS / max(1, workers)


def check_points(spec: SweepSpec, max_points: int | None = None, workers: int = 1) -> int:
    """Refuse a spec of more than ``max_points`` points (default :data:`limits.MAX_SWEEP_POINTS`) before
    any is expanded or run, naming the axes that make the grid; returns the count. Each point is a full
    plan + optimize + simulation (seconds to minutes), and the expansion itself holds every point in
    memory (a grid of 2.5 x 10^8 points took gigabytes before the first ran)."""
    ceiling = limits.MAX_SWEEP_POINTS if max_points is None else max_points
    n = count_points(spec)
    if n <= ceiling:
        return n
    sizes = " x ".join(f"{len(spec.axes[a]):,} {a}" for a in AXES if len(spec.axes[a]) > 1)
    grid = f"axes {sizes}" if sizes else "a grid of 1 point"
    extra = f" plus {len(spec.extra_points):,} explicit points" if spec.extra_points else ""
    took = limits.fmt_seconds(points_seconds(n, workers))
    raise InputError(f"{spec.path}: {n:,} points ({grid}{extra}), more than the ceiling of {ceiling:,}: "
                     f"each point is a full plan, optimize and simulation, about {took} in all on {workers} "
                     f"worker(s) (an estimate: {limits.SWEEP_POINT_SECONDS} s per point and worker measured); "
                     "shrink the axes, or pass --max-points N to run that many")


def expand_points(spec: SweepSpec) -> list[Point]:
    """The grid (cartesian product of the axes, in ``AXES`` order, the last axis varying fastest), then
    the explicit points (axes they do not name take the axis' first value); duplicates are dropped
    keeping the first."""
    names = list(AXES)
    grid = itertools.product(*(spec.axes[a] for a in names))
    combos = [dict(zip(names, vals, strict=True)) for vals in grid]
    first = {a: spec.axes[a][0] for a in names}
    combos += [{**first, **x} for x in spec.extra_points]
    out, seen = [], set()
    for c in combos:
        key = tuple(c[a] for a in names)
        if key in seen:
            continue
        seen.add(key)
        out.append(Point(index=len(out), **c))
    return out


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


def workload_fingerprint(spec: SweepSpec, w: Workload) -> str:
    """What the workload's routing is: the synth parameters, generator version and model, or the trace
    files' names, sizes and modification times (a changed trace is a new workload)."""
    if w.synth is not None:
        return _digest({"synth": w.synth, "generator": SYNTH_VERSION, "model": spec.model.to_dict()})
    root = Path(w.trace)
    files = sorted(root.rglob("*.parquet")) if root.is_dir() else [root]
    return _digest({"trace": [(str(f.relative_to(root) if root.is_dir() else f.name), f.stat().st_size,
                               f.stat().st_mtime_ns) for f in files]})


def optimize_key(spec: SweepSpec, point: Point, workload_fp: str) -> str:
    """Points with the same key need the same placement (it does not depend on TP, KV dtype or the
    rebalancing setting): one optimize per key."""
    return _digest({"v": SWEEP_VERSION, "model": spec.model.to_dict(), "workload": workload_fp,
                    "gpu": point.gpu, "gpus": point.gpus, "gpus_per_node": point.gpus_per_node,
                    "num_redundant": point.num_redundant, "policy": point.policy, "engine": point.engine,
                    "seed": spec.seed, "optimize": spec.optimize})


def point_hash(spec: SweepSpec, point: Point, workload_fp: str) -> str:
    """Everything the point's row depends on (not its index, not the spec's name or path)."""
    wl = spec.workload(point.workload)
    w = {"synth": wl.synth, **wl.settings}
    return _digest({"v": SWEEP_VERSION, "model": spec.model.to_dict(), "seed": spec.seed,
                    "axes": point.axes(),
                    "workload": {**w, "fingerprint": workload_fp}, "plan": spec.plan, "engine": spec.engine,
                    "optimize": spec.optimize, "simulate": spec.simulate,
                    **({"cost": spec.cost} if spec.cost else {}),
                    **({"ensemble": ensemble_digest(spec.ensemble)} if spec.ensemble is not None else {})})


def ensemble_digest(ens) -> dict[str, Any]:
    """What of a calibrated ensemble a point's figures depend on: its members, weights and residuals."""
    return {"names": list(ens.names), "members": ens.members.tolist(), "weights": ens.weights.tolist(),
            "within": list(ens.within or ()), "level": ens.level}
