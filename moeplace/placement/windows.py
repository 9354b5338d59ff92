"""Routing inputs as Loads windows for planning and scoring: traces and Loads files reduced to windows
(:func:`routing_windows`; several inputs concatenated window-wise, labels prefixed with the input's name),
the planning / held-out split of windows and token samples, and the record of what a placement was
planned on."""
from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.foundation.model import ModelSpec
from moeplace.traces.loads import Loads, is_loads_file, load_loads
from moeplace.traces.stats import compute_stats

DEFAULT_WINDOW_TOKENS = 4096


def default_redundant(num_experts: int, num_gpus: int) -> int:
    """Smallest R making E + R divisible by G; one extra slot per GPU when E already divides."""
    r = (-num_experts) % num_gpus
    return r if r else num_gpus


# ---------------------------------------------------------------------------- inputs -> Loads
def trace_to_loads(path: str | Path, window_tokens: int) -> Loads:
    """A trace's Loads with its token sample (each sampled token tagged with its window) and, in the
    provenance, each window's dominant domain tag (``window_domains``) when the trace has a domain column
    — the scenarios of the shift estimate. One streaming pass; the trace statistics are not computed."""
    return compute_stats(path, window_tokens, loads_only=True)


def routing_windows(inputs: list[str | Path], *, model: ModelSpec | None = None,
                    window_tokens: int = DEFAULT_WINDOW_TOKENS,
                    read: Callable[[Path, int], Loads] | None = None,
                    tags: dict[str, dict[str, str]] | None = None) -> Loads:
    """Read traces and/or Loads files into one Loads (windows concatenated in input order).
    ``model`` overrides the model recorded in the inputs (it must have the same shape). The provenance
    records each window's input (``window_inputs``) and, where every input has them, domain tags
    (``window_domains``); the token sample keeps each token's window. ``read(path, window_tokens)``: how
    an input becomes Loads (default: a Loads file as it is, a trace by :func:`trace_to_loads`; ``place
    optimize --phase`` reads one phase's tokens). ``tags``: ``{path: {key: value}}`` given on the command
    line (``--tag``), over the same keys of that input's own metadata."""
    if not inputs:
        raise InputError("no traces or Loads files given")
    parts: list[Loads] = []
    seen: dict[Path, str] = {}
    for src in inputs:
        p = Path(src)
        if not p.exists():
            raise InputError(f"{p}: no such file or directory")
        # The same routing twice would put planning windows among the "held-out" ones.
        rp = p.resolve()
        for q, first in seen.items():
            if rp == q or q in rp.parents or rp in q.parents:
                raise InputError(f"{src}: the same routing as {first} (given twice); held-out windows would "
                                 "repeat planning windows")
        seen[rp] = str(src)
        if read is not None:
            ld = read(p, window_tokens)
        else:
            ld = load_loads(p) if is_loads_file(p) else trace_to_loads(p, window_tokens)
        if model is not None:
            if ld.model.is_partial and model.moe_layers == ld.model.model_moe_layers:
                model = model.restrict(ld.model.moe_layers)  # a log of some layers of this very model
            if (model.num_moe_layers, model.num_experts) != ld.counts.shape[1:]:
                raise InputError(f"{p}: has {ld.counts.shape[1]} MoE layers x {ld.counts.shape[2]} experts "
                                 "but "
                                 f"--model '{model.name}' has {model.num_moe_layers} x {model.num_experts}")
            ld = Loads(ld.counts, model, ld.window_tokens, ld.labels, ld.provenance, ld.samples, ld.sample_windows)
        if ld.counts.sum() == 0:
            raise InputError(f"{p}: no tokens (all expert counts are zero)")
        for other, prev in zip(inputs, parts):  # a copy under another name is the same routing too
            if prev.counts.shape == ld.counts.shape and np.array_equal(prev.counts, ld.counts):
                raise InputError(f"{src}: the same expert counts as {other} (a copy?); held-out windows would "
                                 "repeat planning windows")
        parts.append(ld)
    first = parts[0].model
    for src, ld in zip(inputs[1:], parts[1:]):
        if ld.model != first:
            raise InputError(f"{src}: model '{ld.model.name}' differs from {inputs[0]} ('{first.name}'); "
                             "inputs of one comparison must be of one model")
    multi = len(parts) > 1
    labels = []
    for src, ld in zip(inputs, parts):
        own = ld.labels or tuple(f"window {i}" for i in range(ld.num_windows))
        labels += [f"{Path(src).name}: {lb}" if multi else lb for lb in own]
    counts = np.concatenate([ld.counts for ld in parts])
    wt = parts[0].window_tokens if all(ld.window_tokens == parts[0].window_tokens for ld in parts) else 0
    # the token samples travel along (traffic objective and sample-based traffic in evaluate), each token
    # with its window in the concatenation
    have = [ld for ld in parts if ld.samples is not None and len(ld.samples)]
    samples = sample_windows = None
    if len(have) == len(parts):
        samples = np.concatenate([ld.samples for ld in parts])
        if all(ld.sample_windows is not None for ld in parts):
            offsets = np.cumsum([0] + [ld.num_windows for ld in parts[:-1]])
            sample_windows = np.concatenate([ld.sample_windows + o for ld, o in zip(parts, offsets)])
    prov: dict[str, Any] = {"inputs": [str(s) for s in inputs],
                            "window_inputs": [i for i, ld in enumerate(parts) for _ in range(ld.num_windows)]}
    given = {Path(q).resolve(): t for q, t in (tags or {}).items()}
    own = [{**input_tags(ld, src), **given.get(Path(src).resolve(), {})} for src, ld in zip(inputs, parts)]
    if any(own):
        prov["input_tags"] = own
    for key in ("window_domains", "window_domain_share"):
        if all(key in ld.provenance for ld in parts):
            prov[key] = [d for ld in parts for d in ld.provenance[key]]
        elif len(parts) == 1 and parts[0].provenance.get(key):
            prov[key] = list(parts[0].provenance[key])
    return Loads(counts, first, wt, tuple(labels), prov, samples, sample_windows)


def input_tags(loads: Loads, src: str | Path) -> dict[str, str]:
    """An input's tags (what the shift estimate leaves out together: ``{"dataset": "gsm", "lang": "he"}``)
    from its metadata: a Loads file's ``provenance.tags``, a trace's ``moeplace.provenance`` ``tags``
    (kept under ``provenance.trace`` when read). Empty when it has none; a malformed one is an error
    naming the file."""
    prov = loads.provenance
    raw = prov.get("tags")
    if raw is None and isinstance(prov.get("trace"), dict):
        raw = prov["trace"].get("tags")
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, (str, int)) and str(v).strip()
                                            for k, v in raw.items()):
        raise InputError(f"{src}: metadata field 'tags' must be an object of tag names to non-empty values "
                         f"(e.g. {{\"dataset\": \"gsm\", \"lang\": \"he\"}}), got {raw!r:.80}")
    return {k: str(v) for k, v in raw.items()}


def split_windows(num_windows: int, plan_fraction: float) -> tuple[np.ndarray, np.ndarray, bool]:
    """Plan on the first ``ceil(F * W)`` windows (at least one), score held-out on the rest. ``F = 1``
    plans on every window (nothing held out: the shift estimate stands in). With one window and
    ``F < 1`` there is nothing to hold out either: both parts are that window (flag returned True)."""
    if not 0 < plan_fraction <= 1:
        raise InputError(f"--plan-fraction must be in (0, 1], got {plan_fraction}")
    if plan_fraction == 1:
        return np.arange(num_windows), np.zeros(0, np.int64), False
    if num_windows == 1:
        return np.array([0]), np.array([0]), True
    n_planning = min(max(1, math.ceil(plan_fraction * num_windows)), num_windows - 1)
    return np.arange(n_planning), np.arange(n_planning, num_windows), False


def split_samples(loads: Loads, planning_idx: np.ndarray, held_idx: np.ndarray
                  ) -> tuple[np.ndarray | None, np.ndarray | None, str | None]:
    """The token sample of the planning windows and that of the held-out windows (disjoint tokens), plus
    a note when the sample cannot be split (a Loads file whose sample carries no windows: then it is not
    used at all, since any part of it may be a held-out token)."""
    s = loads.samples
    if s is None or not len(s):
        return None, None, None
    if loads.sample_windows is None:
        if held_idx.size == 0 or np.array_equal(planning_idx, held_idx):
            return s, s, None
        return None, None, ("the token sample records no windows (an older Loads file): not used, since "
                            "any of its tokens may be held out; traffic columns are estimates")
    planning = loads.samples_in(planning_idx)
    held = loads.samples_in(held_idx) if held_idx.size else None
    return (planning if len(planning) else None), (held if held is not None and len(held) else None), None


def planned_on(loads: Loads, planning_idx: np.ndarray) -> dict[str, Any]:
    """What a placement was planned on, for whoever scores it later (``place simulate`` routes on the
    rest of the trace): the inputs, the planning windows and, for one token-windowed trace, the first
    token (in file order) that planning did not see."""
    d: dict[str, Any] = {"inputs": list(loads.provenance.get("inputs", [])),
                         "windows": [int(planning_idx[0]), int(planning_idx[-1]) + 1],
                         "window_tokens": int(loads.window_tokens)}
    contiguous = np.array_equal(planning_idx, np.arange(planning_idx.size))
    if len(d["inputs"]) == 1 and loads.window_tokens > 0 and contiguous and planning_idx.size < loads.num_windows:
        d["held_out_from_token"] = int(planning_idx.size * loads.window_tokens)
    return d


def loads_tokens(loads: Loads) -> int:
    """Tokens behind a Loads: selections of its fullest layer / top-k (what ``place trace import`` and
    ``place trace stats`` count as tokens)."""
    return int(loads.counts.sum(axis=(0, 2)).max() // loads.model.top_k)


def window_span(idx: np.ndarray, noun: str = "") -> str:
    """``"3"`` / ``"0-12"`` (``"window 3"`` / ``"windows 0-12"`` with a noun); ``"none"`` when empty."""
    if idx.size == 0:
        return "none"
    if idx.size == 1:
        return f"{noun} {int(idx[0])}".strip()
    return f"{noun}s {int(idx[0])}-{int(idx[-1])}" if noun else f"{int(idx[0])}-{int(idx[-1])}"
