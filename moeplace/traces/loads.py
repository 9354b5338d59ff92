"""Loads: ``[windows, L, E]`` token counts per expert — the common input of every placement policy
(docs/design.md "Contracts"). Traces (via ``place trace stats``) and engine load dumps (SGLang
``logical_count``, vLLM EPLB load records) all reduce to it.

On disk: one ``.npz`` with ``counts`` (int64 ``[W, L, E]``) and ``meta`` (a JSON string: model spec,
window size, per-window labels and provenance). ``L`` counts MoE layers only, in ``model.moe_layers``
order.
"""
from __future__ import annotations

import json
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moeplace.foundation import formats, limits, reading
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import OutputKind, atomic_path, register_kind
from moeplace.foundation.formats import check, tag
from moeplace.foundation.model import ModelSpec

LOADS_FORMAT = tag("loads")
# Expert selections one window of one MoE layer may hold: 2^53 (9.0e15), the largest count float64 (in which
# the planners compute) holds exactly, and thousands of times a year of a 1,000-GPU deployment at a million
# tokens per second, top-16 (5e14); a larger count is corruption (a 2^62 count used to be taken as traffic).
MAX_WINDOW_SELECTIONS = 1 << 53


@dataclass(frozen=True, eq=False)
class Loads:
    """Token counts per (window, MoE layer, logical expert).

    ``counts``: int64 ``[W, L, E]``; ``L == model.num_moe_layers``, ``E == model.num_experts``.
    ``window_tokens``: tokens per window (0 when windows are not token-sized, e.g. engine dumps).
    ``labels``: one string per window (e.g. a domain name or ``"tokens 0-4096"``).
    ``samples``: optional int32 ``[N, L, k]``: the expert ids of a seeded sample of N tokens (``-1`` where
    a token has no row for a layer), kept for co-activation objectives (``place trace stats`` writes it).
    ``sample_windows``: optional int64 ``[N]``: the window each sampled token belongs to, so a planner can
    take its sample from the planning windows only and score traffic on held-out tokens only (None for
    samples of older files, whose tokens cannot be told apart by window).
    """

    counts: np.ndarray
    model: ModelSpec
    window_tokens: int = 0
    labels: tuple[str, ...] = ()
    provenance: dict[str, Any] = field(default_factory=dict)
    samples: np.ndarray | None = None
    sample_windows: np.ndarray | None = None

    def __post_init__(self) -> None:
        c = self.counts
        if c.ndim != 3:
            raise InputError(f"field 'counts' has shape {list(c.shape)}, expected [windows, layers, experts]")
        if c.shape[1:] != (self.model.num_moe_layers, self.model.num_experts):
            raise InputError(
                f"field 'counts' has shape {list(c.shape)}, but model '{self.model.name}' has "
                f"{self.model.num_moe_layers} MoE layers x {self.model.num_experts} experts")
        if c.shape[0] == 0:
            raise InputError("field 'counts' has no windows")
        if np.any(c < 0):
            w, li, e = (int(x[0]) for x in np.nonzero(c < 0))
            raise InputError(f"field 'counts' is {int(c[w, li, e])} at window {w}, MoE layer {li}, expert {e}: "
                             "counts must be non-negative")
        self._check_possible()
        if self.labels and len(self.labels) != c.shape[0]:
            raise InputError(f"field 'labels' has {len(self.labels)} labels for {c.shape[0]} windows")
        s = self.samples
        if s is not None:
            if s.ndim != 3 or s.shape[1:] != (self.model.num_moe_layers, self.model.top_k):
                raise InputError(f"field 'samples' has shape {list(s.shape)}, expected [N, "
                                 f"{self.model.num_moe_layers}, {self.model.top_k}] (tokens, MoE layers, top-k)")
            if s.size and (s.min() < -1 or s.max() >= self.model.num_experts):
                raise InputError(f"field 'samples' must hold expert ids in [0, {self.model.num_experts}) or -1")
        sw = self.sample_windows
        if sw is not None:
            if s is None or sw.shape != (s.shape[0],):
                raise InputError("field 'sample_windows' must have one entry per sampled token")
            if sw.size and (sw.min() < 0 or sw.max() >= c.shape[0]):
                raise InputError(f"field 'sample_windows' must hold window indices in [0, {c.shape[0]})")

    def _check_possible(self) -> None:
        """Counts no routing can produce are refused: in one window and MoE layer the experts' counts sum to
        the selections made there, at most :data:`MAX_WINDOW_SELECTIONS`."""
        c = self.counts
        if not c.size:
            return
        sums = c.sum(axis=2, dtype=np.float64)  # [W, L]; float: int64 sums of corrupt counts would wrap
        over = sums > MAX_WINDOW_SELECTIONS
        if over.any():
            w, li = (int(x[0]) for x in np.nonzero(over))
            raise InputError(f"field 'counts': window {w}, MoE layer {self.model.moe_layers[li]} counts "
                             f"{sums[w, li]:.4g} expert selections, more than the ceiling of 2^53 per window and "
                             "layer (corrupt or mis-typed counts?)")

    def check_window_tokens(self) -> None:
        """A file that says its windows hold ``window_tokens`` tokens holds at most ``window_tokens x top_k``
        selections per window and MoE layer (a token cut by the window boundary counted once more): more is
        impossible, so the file is corrupt (the Loads gate runs this on every file it reads)."""
        if self.window_tokens <= 0 or not self.counts.size:
            return
        k = self.model.top_k
        cap = (self.window_tokens + 1) * k
        sums = self.counts.sum(axis=2, dtype=np.float64)
        over = sums > cap
        if over.any():
            w, li = (int(x[0]) for x in np.nonzero(over))
            raise InputError(f"field 'counts': window {w}, MoE layer {self.model.moe_layers[li]} counts "
                             f"{sums[w, li]:.4g} expert selections, more than {self.window_tokens:,} tokens per "
                             f"window x top-{k} allow ({cap:,}); corrupt or mis-typed counts?")

    @property
    def num_windows(self) -> int:
        return int(self.counts.shape[0])

    def total(self) -> np.ndarray:
        """Counts summed over windows: ``[L, E]``."""
        return self.counts.sum(axis=0)

    def samples_in(self, windows) -> np.ndarray | None:
        """The sampled tokens of the given windows (index array or slice): ``[n, L, k]``; None when
        the sample's windows are unknown (then no subset of it is known to avoid other windows)."""
        if self.samples is None or self.sample_windows is None:
            return None
        idx = np.arange(self.num_windows)[windows]
        return self.samples[np.isin(self.sample_windows, idx)]

    def select(self, windows) -> Loads:
        """A Loads over a subset of windows (a slice or index array); the sample keeps only those
        windows' tokens (it is dropped when its windows are unknown)."""
        idx = np.arange(self.num_windows)[windows]
        labels = tuple(self.labels[i] for i in idx) if self.labels else ()
        samples = sw = None
        if self.samples is not None and self.sample_windows is not None:
            keep = np.isin(self.sample_windows, idx)
            remap = np.full(self.num_windows, -1, np.int64)
            remap[idx] = np.arange(idx.size)
            samples, sw = self.samples[keep], remap[self.sample_windows[keep]]
        # per-window provenance lists (window_domains, window_inputs, ...) follow the windows
        prov = {k: ([v[i] for i in idx] if k.startswith("window_") and isinstance(v, list)
                    and len(v) == self.num_windows else v) for k, v in self.provenance.items()}
        return Loads(self.counts[idx], self.model, self.window_tokens, labels, prov, samples, sw)

    def save(self, path: str | Path) -> None:
        meta = {"format": LOADS_FORMAT, "model": self.model.to_dict(), "window_tokens": self.window_tokens,
                "labels": list(self.labels), "provenance": self.provenance}
        with atomic_path(path) as tmp, open(tmp, "wb") as fh:
            arrays = {"counts": self.counts.astype(np.int64), "meta": np.array(json.dumps(meta))}
            if self.samples is not None:
                arrays["samples"] = self.samples.astype(np.int32)
            if self.sample_windows is not None:
                arrays["sample_windows"] = self.sample_windows.astype(np.int64)
            np.savez_compressed(fh, **arrays)


def is_loads_file(path: str | Path) -> bool:
    p = Path(path)  # a FIFO or device named x.npz counts, so that load_loads refuses it in one line
    return p.suffix == ".npz" and p.exists() and not p.is_dir()


def load_loads(path: str | Path) -> Loads:
    """The Loads gate: read a Loads ``.npz`` and check every field (``counts`` non-negative integers of the
    shape ``meta.model`` declares, ``meta`` a JSON object of this format with a valid model spec, labels,
    provenance, ``samples`` expert ids or -1). The only way a Loads file enters a command; any problem is
    an :class:`InputError` naming the file and the field."""
    p = Path(path)
    try:
        reading.require_regular(p)  # np.load would block on a FIFO named like a Loads file
    except FileNotFoundError:
        raise InputError(f"{p}: no such Loads file") from None
    # the shapes the headers declare, checked before any array is read: a compressed file of a few MB
    # can declare hundreds of GiB (the counts are also copied once, to int64)
    declared = reading.npz_declared(p, "Loads .npz file")
    need = reading.npz_bytes(declared)
    if "counts" in declared:
        shape, _dtype = declared["counts"]
        if len(shape) != 3:
            raise InputError(f"{p}: field 'counts' declares shape {_short_shape(shape)}, expected 3 dimensions "
                             "(windows, layers, experts)")
        need += 8.0 * float(np.prod([float(d) for d in shape]))
    limits.require_memory(limits.Estimate(
        str(p), need, "the arrays its .npy headers declare: "
        + ", ".join(f"'{k[:40]}' {_short_shape(v[0])}" for k, v in list(declared.items())[:6])),
        advice="refusing to load it (a corrupt or hostile header?)")
    try:
        with np.load(p, allow_pickle=False) as z:
            if not hasattr(z, "files") or "counts" not in z.files or "meta" not in z.files:
                raise InputError(f"{p}: not a moeplace Loads file (expected arrays 'counts' and 'meta')")
            counts = z["counts"]
            meta_arr = z["meta"]
            samples = z["samples"] if "samples" in z.files else None
            sample_windows = z["sample_windows"] if "sample_windows" in z.files else None
    except (OSError, ValueError, zipfile.BadZipFile, zlib.error, EOFError, KeyError, TypeError) as exc:
        raise InputError(f"{p}: not a readable Loads .npz file ({exc})") from None
    if meta_arr.shape != () or meta_arr.dtype.kind not in "US":
        raise InputError(f"{p}: field 'meta' is a {meta_arr.dtype} array of shape {list(meta_arr.shape)}, "
                         "expected one JSON string")
    try:
        meta = reading.loads(str(meta_arr))  # a key given twice refused too
    except json.JSONDecodeError as exc:
        raise InputError(f"{p}: field 'meta' is not valid JSON ({exc})") from None
    except (RecursionError, ValueError):  # nesting, or an integer past Python's int-string limit
        meta = reading.parse_json(str(meta_arr), f"{p}: field 'meta'")  # raises, worded
    reading.check_depth(meta, f"{p}: field 'meta'")
    if not isinstance(meta, dict):
        raise InputError(f"{p}: field 'meta' is a JSON {type(meta).__name__}, expected an object")
    check(meta, "loads", str(p))
    if not isinstance(meta.get("model"), dict):
        raise InputError(f"{p}: field 'meta.model' is {json.dumps(meta.get('model'))[:60]}, expected a model "
                         "spec object")
    try:
        model = ModelSpec.from_dict(meta["model"])
    except InputError as exc:
        raise InputError(f"{p}: field 'meta.model': {exc}") from None
    if counts.dtype.kind not in "iu":
        raise InputError(f"{p}: field 'counts' has dtype {counts.dtype}, expected integers")
    if counts.size and counts.dtype.kind == "u" and int(counts.max()) > np.iinfo(np.int64).max:
        raise InputError(f"{p}: field 'counts' holds {int(counts.max())}, beyond int64")
    wt = meta.get("window_tokens", 0)
    if isinstance(wt, bool) or not isinstance(wt, int) or wt < 0:
        raise InputError(f"{p}: field 'meta.window_tokens' is {json.dumps(wt)[:40]}, expected an integer >= 0")
    labels = meta.get("labels", [])
    if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
        raise InputError(f"{p}: field 'meta.labels' is not a list of strings")
    prov = meta.get("provenance", {})
    if not isinstance(prov, dict):
        raise InputError(f"{p}: field 'meta.provenance' is a JSON {type(prov).__name__}, expected an object")
    if samples is not None:
        if samples.dtype.kind not in "iu":
            raise InputError(f"{p}: field 'samples' has dtype {samples.dtype}, expected integers")
        if samples.size and (int(samples.min()) < -1 or int(samples.max()) >= model.num_experts):
            raise InputError(f"{p}: field 'samples' holds {int(samples.min())}..{int(samples.max())}, expected "
                             f"expert ids in [0, {model.num_experts}) or -1")
    if sample_windows is not None and sample_windows.dtype.kind not in "iu":
        raise InputError(f"{p}: field 'sample_windows' has dtype {sample_windows.dtype}, expected integers")
    try:
        loads = Loads(counts.astype(np.int64), model, wt, tuple(labels), prov,
                      None if samples is None else samples.astype(np.int32),
                      None if samples is None or sample_windows is None else sample_windows.astype(np.int64))
        loads.check_window_tokens()
        return loads
    except InputError as exc:
        raise InputError(f"{p}: {exc}") from None


def _short_shape(shape: tuple[int, ...]) -> str:
    """A declared shape for a message, at most 8 dimensions shown (a header may declare thousands)."""
    dims = ", ".join(f"{d:,}" for d in shape[:8])
    return f"({dims}{', ...' if len(shape) > 8 else ''})"


def _is_loads(p: Path) -> bool:
    with np.load(p, allow_pickle=False) as z:
        return "counts" in z and formats.kind_of(json.loads(str(z["meta"]))) == "loads"


LOADS_FILE = register_kind(OutputKind("Loads .npz", False, _is_loads))
