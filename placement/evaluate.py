"""``evaluate()``: score any placement on any routing under a named engine's replica-choice rule.

One function used by everything (CLI tables, the optimizer's final check, the simulator, the
dashboard). Routing is either expert *loads* (a :class:`traces.loads.Loads`, a ``.npz`` Loads file,
or an array ``[W, L, E]`` / ``[L, E]``) or *token-level* routing (a trace path, or a
:class:`TokenRouting`). The rules live in :mod:`placement.dispatch`, the bounds in
:mod:`placement.bounds`.

Definitions (per window ``w`` and MoE layer ``l``; ``x_g`` = tokens routed to GPU ``g``, counting one
per (token, selected expert)):

- balancedness ``mean_g x / max_g x`` (1 = perfect; SGLang's form, averaged over layers);
  ``ratio_of_sums`` ``sum_l mean_l / sum_l max_l`` (the form vLLM's ``log_balancedness`` prints);
  ``max_over_mean`` ``max / mean`` (TensorRT-LLM's imbalance ratio + 1). Layers with no tokens count
  as perfectly balanced.
- bounds: ``bound_placement`` (this placement, this rule) and ``bound_budget`` (any placement with
  this slot budget) from :mod:`placement.bounds`; ``gap = max / bound - 1`` and the balancedness
  ceiling ``mean / bound``.
- traffic: a token on DP rank ``s`` whose expert replica is on GPU ``g``: *remote GPU* if ``g != s``,
  *remote node* if ``node(g) != node(s)``. ``cross_node_share`` = remote-node selections / all
  selections. Sends per token per layer in three dispatch styles:
  ``node``: one send per remote node touched (DeepEP normal / prefill: RDMA once per node, then NVLink
  forwarding), ``gpu``: one per remote GPU touched (a rank-deduplicated all-to-all), ``expert``: one per
  remote (token, expert) pair (DeepEP low-latency / decode writes per-expert receive buffers).
  Bytes per send = ``dispatch_width x dtype bytes``; the width is the width the routed experts run at
  (``model.expert_hidden_size``: K3's LatentMoE dispatches the 3584-wide latent, not the 7168 hidden
  state), the dtype a parameter (default bf16). With token-level routing these are exact; with Loads
  the share is exact under the assumption that every expert's tokens come evenly from all DP ranks,
  and the per-token counts use an *independence approximation* (the k selections of a token treated
  as independent draws from the layer's load distribution) — ``traffic_method`` says which.
- memory: expert-weight bytes per GPU = ``slots_per_gpu x bytes_per_routed_expert x L``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from foundation.cluster import ClusterSpec
from foundation.errors import InputError
from foundation.model import DTYPE_BYTES, ModelSpec, load_model, preset_names
from placement.bounds import budget_bound, placement_bound
from placement.dispatch import (
    SGLANG_VARIANTS,
    VLLM_RULES,
    batch_layout,
    batch_slots,
    check_engine,
    dp_ranks_round_robin,
    expected_gpu_loads,
    ideal_gpu_loads,
    sglang_dispatch_map,
    token_gpu_loads,
)
from placement.record import Placement, check_compatible
from traces.loads import Loads, is_loads_file, load_loads
from traces.validate import check_trace

TRAFFIC_MODES = ("node", "gpu", "expert")


@dataclass(frozen=True)
class TokenRouting:
    """Token-level routing: ``expert_ids`` int ``[n, L, k]`` (tokens in arrival/step order, L over MoE
    layers) and ``request_id`` int ``[n]`` (to assign tokens to DP ranks round-robin by request).
    ``present``: bool ``[L]``, the MoE layers the routing holds (a log of some layers only; the others'
    ``expert_ids`` are meaningless and every score skips them); None = all."""

    expert_ids: np.ndarray
    request_id: np.ndarray
    model: ModelSpec
    present: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.expert_ids.ndim != 3 or self.expert_ids.shape[1] != self.model.num_moe_layers:
            raise InputError(f"token routing must be [tokens, {self.model.num_moe_layers}, k], "
                             f"got {self.expert_ids.shape}")
        if self.request_id.shape != (self.expert_ids.shape[0],):
            raise InputError("token routing: request_id must have one entry per token")
        if self.expert_ids.shape[0] == 0:
            raise InputError("token routing has no tokens")

    @property
    def num_tokens(self) -> int:
        return int(self.expert_ids.shape[0])

    @property
    def layers(self) -> np.ndarray:
        """Indices of the MoE layers present."""
        L = self.model.num_moe_layers
        return np.arange(L) if self.present is None else np.flatnonzero(self.present)

    def loads(self) -> np.ndarray:
        """Expert counts float64 ``[L, E]`` (zero rows for absent layers)."""
        L, E = self.model.num_moe_layers, self.model.num_experts
        out = np.zeros((L, E))
        for l in self.layers:
            out[l] = np.bincount(self.expert_ids[:, l, :].ravel().astype(np.int64), minlength=E)
        return out


def index_trace(path: str | Path):
    """Read a trace's routing columns and put every row in its place: returns ``(model, provenance,
    expert_ids [rows, k] uint16, layer_idx [rows] (index into moe_layers), token [rows] (token index
    in (step, request_id, position) order), request_id [tokens])``.

    The token order comes from the rows of the first MoE layer the trace holds (one row per token; a log
    of some layers only starts at its first); every row finds its token by the packed key
    ``request_id << 24 | position`` with a binary search — much cheaper than sorting or joining nine
    million rows with a list column."""
    import polars as pl

    trace = check_trace(path)  # the gate: every row checked before any is used
    model, prov = trace.model, trace.provenance
    L = model.num_moe_layers
    lay2idx = np.full(65536, -1, dtype=np.int64)
    lay2idx[list(model.moe_layers)] = np.arange(L)
    lf = pl.scan_parquet([str(f) for f in trace.file_paths])
    df = lf.select("request_id", "position", "layer", "expert_ids").collect()
    if df.height == 0:
        raise InputError(f"{path}: the trace has no rows")
    held = set(np.unique(df["layer"].to_numpy()).tolist())
    first_layer = next((x for x in model.moe_layers if x in held), model.moe_layers[0])
    first = (lf.filter(pl.col("layer") == first_layer)
             .select("step", "request_id", "position").collect())
    if first.height == 0:
        raise InputError(f"{path}: field 'layer': no rows for MoE layer {first_layer}")

    def packed(frame) -> np.ndarray:
        rid = frame["request_id"].to_numpy().astype(np.int64)
        pos = frame["position"].to_numpy().astype(np.int64)
        if rid.min() < 0 or rid.max() >= 1 << 39 or pos.min() < 0 or pos.max() >= 1 << 24:
            raise InputError(f"{path}: fields 'request_id' / 'position' outside [0, 2^39) / [0, 2^24)")
        return (rid << 24) | pos

    tok_key = packed(first)
    order = np.lexsort((tok_key, first["step"].to_numpy()))  # by step, then request_id, position
    tok_key = tok_key[order]
    by_key = np.argsort(tok_key, kind="stable")
    sk = tok_key[by_key]
    if (np.diff(sk) == 0).any():
        raise InputError(f"{path}: a (request_id, position) appears twice in MoE layer {first_layer}")
    layer = df["layer"].to_numpy().astype(np.int64)
    layer_idx = lay2idx[layer]
    if (layer_idx < 0).any():
        raise InputError(f"{path}: field 'layer': value {int(layer[layer_idx < 0][0])} is not an MoE "
                         "layer of "
                         f"'{model.name}'")
    row_key = packed(df)
    j = np.minimum(np.searchsorted(sk, row_key), len(sk) - 1)
    missing = sk[j] != row_key
    if missing.any():
        i = int(np.flatnonzero(missing)[0])
        raise InputError(f"{path}: row {i}: token (request_id {row_key[i] >> 24}, "
                         f"position {row_key[i] & 0xFFFFFF}) "
                         f"has no row in MoE layer {first_layer}")
    ids = df.get_column("expert_ids").to_numpy()
    if ids.ndim != 2:
        ids = np.stack(ids)
    return model, prov, ids.astype(np.uint16, copy=False), layer_idx, by_key[j], tok_key >> 24


def read_token_routing(path: str | Path) -> TokenRouting:
    """Read a trace (file or directory) into :class:`TokenRouting`: tokens ordered by (step,
    request_id, position); every token must appear exactly once in every MoE layer the trace holds
    (a log of some layers only is replayed on those)."""
    model, _, ids, layer_idx, token, request_id = index_trace(path)
    n, L = request_id.size, model.num_moe_layers
    present = np.bincount(layer_idx, minlength=L) > 0
    cell = token * L + layer_idx
    seen = np.bincount(cell, minlength=n * L).reshape(n, L)[:, present].ravel()
    if (seen != 1).any():
        c = int(np.flatnonzero(seen != 1)[0])
        lay = np.flatnonzero(present)[c % int(present.sum())]
        raise InputError(f"{path}: field 'layer': token {c // int(present.sum())} has {int(seen[c])} rows in MoE "
                         f"layer {model.moe_layers[lay]}; token-level evaluation needs exactly one per MoE "
                         "layer the trace holds")
    out = np.zeros((n * L, ids.shape[1]), dtype=np.uint16)
    out[cell] = ids
    return TokenRouting(out.reshape(n, L, -1), request_id, model, None if present.all() else present)


@dataclass(frozen=True, eq=False)
class Metrics:
    """Scores of one placement on one routing under one engine rule. Arrays are float64; ``W`` windows
    (or steps of the token-level routing), ``L`` MoE layers, ``G`` GPUs. See the module docstring."""

    engine: str
    source: str  # "loads" | "tokens"
    gpu_loads: np.ndarray  # [W, L, G] tokens (selections) per GPU
    bound_placement: np.ndarray  # [W, L] lower bound on the busiest GPU, this placement and rule
    bound_budget: np.ndarray  # [W, L] lower bound over all placements with this slot budget
    num_nodes: int
    cross_node_share: float
    remote_per_token: dict[str, float]  # mode -> sends per token per MoE layer
    dispatch_bytes_per_token: dict[str, float]  # mode -> bytes per token summed over MoE layers
    traffic_method: str  # "exact" | "uniform-sources, independence approximation"
    expert_bytes_per_gpu: float
    labels: tuple[str, ...] = ()
    batch_balancedness: np.ndarray | None = None  # [S] per-step balancedness (token-level, batch_tokens)
    batch_tokens: int | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    top_k: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens scored: selections of the fullest layer / top-k (0 when top-k is unknown)."""
        return round(float(self.gpu_loads.sum(axis=(0, 2)).max()) / self.top_k) if self.top_k else 0

    # -------------------------------------------------------------- per (window, layer)
    @property
    def mean_load(self) -> np.ndarray:
        return self.gpu_loads.mean(axis=2)

    @property
    def max_load(self) -> np.ndarray:
        return self.gpu_loads.max(axis=2)

    @property
    def scored_wl(self) -> np.ndarray:
        """``[W, L]`` bool: the (window, layer) cells with tokens. Every average below runs over these
        only: a layer a log does not hold (or a window without its tokens) says nothing about balance,
        and counting it as perfectly balanced would flatter every placement."""
        return self.max_load > 0

    @property
    def scored_layers(self) -> int:
        """MoE layers with tokens in at least one window."""
        return int(self.scored_wl.any(axis=0).sum())

    @property
    def layer_balancedness_wl(self) -> np.ndarray:
        """``[W, L]`` mean / max (1 for cells without tokens; averages skip them, see :attr:`scored_wl`)."""
        mx = self.max_load
        return np.divide(self.mean_load, mx, out=np.ones_like(mx), where=mx > 0)

    @property
    def layer_balancedness(self) -> np.ndarray:
        """``[L]`` averaged over the windows with tokens in the layer (NaN for a layer without any)."""
        return _masked_mean(self.layer_balancedness_wl, self.scored_wl, axis=0)

    @property
    def window_balancedness(self) -> np.ndarray:
        """``[W]`` SGLang form: per layer, then averaged over the layers with tokens (NaN: no tokens)."""
        return _masked_mean(self.layer_balancedness_wl, self.scored_wl, axis=1)

    @property
    def window_ratio_of_sums(self) -> np.ndarray:
        """``[W]`` vLLM's logged form: sum over layers of the mean / sum of the max."""
        mx = self.max_load.sum(axis=1)
        return np.divide(self.mean_load.sum(axis=1), mx, out=np.full_like(mx, np.nan), where=mx > 0)

    @property
    def balancedness(self) -> float:
        return float(np.nanmean(self.window_balancedness))

    @property
    def worst_window_balancedness(self) -> float:
        return float(np.nanmin(self.window_balancedness))

    @property
    def ratio_of_sums(self) -> float:
        return float(np.nanmean(self.window_ratio_of_sums))

    @property
    def max_over_mean(self) -> float:
        """Mean over scored (window, layer) cells of max / mean."""
        return float((1.0 / self.layer_balancedness_wl)[self.scored_wl].mean())

    def _ceiling(self, bound: np.ndarray) -> np.ndarray:
        return np.divide(self.mean_load, bound, out=np.ones_like(bound), where=bound > 0)

    def _gap(self, bound: np.ndarray) -> np.ndarray:
        return np.divide(self.max_load, bound, out=np.zeros_like(bound), where=bound > 0) - (bound > 0)

    @property
    def layer_gap_placement(self) -> np.ndarray:
        """``[L]`` ``max / bound_placement - 1``, averaged over the windows with tokens in the layer."""
        return _masked_mean(self._gap(self.bound_placement), self.scored_wl, axis=0)

    @property
    def layer_gap_budget(self) -> np.ndarray:
        return _masked_mean(self._gap(self.bound_budget), self.scored_wl, axis=0)

    @property
    def bound_balancedness_placement(self) -> float:
        """Best balancedness this placement could reach under this rule (its bound's ceiling)."""
        return float(self._ceiling(self.bound_placement)[self.scored_wl].mean())

    @property
    def bound_balancedness_budget(self) -> float:
        """Best balancedness any placement with this slot budget could reach."""
        return float(self._ceiling(self.bound_budget)[self.scored_wl].mean())

    @property
    def gap_placement(self) -> float:
        return float(self._gap(self.bound_placement)[self.scored_wl].mean())

    @property
    def gap_budget(self) -> float:
        return float(self._gap(self.bound_budget)[self.scored_wl].mean())

    def batch_stats(self) -> dict[str, float] | None:
        if self.batch_balancedness is None or self.batch_balancedness.size == 0:
            return None
        b = self.batch_balancedness
        return {"batch_tokens": self.batch_tokens, "num_batches": int(b.size), "mean": float(b.mean()),
                "p5": float(np.percentile(b, 5)), "p50": float(np.percentile(b, 50)),
                "p95": float(np.percentile(b, 95)), "min": float(b.min())}

    def summary(self) -> dict[str, Any]:
        """Scalars only (what a table row shows)."""
        return {
            "engine": self.engine,
            "source": self.source,
            "num_windows": int(self.gpu_loads.shape[0]),
            "tokens": self.num_tokens,
            "scored_layers": self.scored_layers,
            "moe_layers": int(self.gpu_loads.shape[1]),
            "balancedness": self.balancedness,
            "worst_window_balancedness": self.worst_window_balancedness,
            "ratio_of_sums": self.ratio_of_sums,
            "max_over_mean": self.max_over_mean,
            "bound_balancedness_placement": self.bound_balancedness_placement,
            "bound_balancedness_budget": self.bound_balancedness_budget,
            "gap_placement": self.gap_placement,
            "gap_budget": self.gap_budget,
            "cross_node_share": self.cross_node_share,
            "remote_per_token": dict(self.remote_per_token),
            "dispatch_bytes_per_token": dict(self.dispatch_bytes_per_token),
            "traffic_method": self.traffic_method,
            "expert_bytes_per_gpu": self.expert_bytes_per_gpu,
            "batch": self.batch_stats(),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the summary, per-window and per-layer lists."""
        d = self.summary()
        d.update({
            "labels": list(self.labels),
            "window_balancedness": _json_list(self.window_balancedness),
            "window_ratio_of_sums": _json_list(self.window_ratio_of_sums),
            "layer_balancedness": _json_list(self.layer_balancedness),
            "layer_gap_placement": _json_list(self.layer_gap_placement),
            "layer_gap_budget": _json_list(self.layer_gap_budget),
            "notes": list(self.notes),
        })
        return d


def _masked_mean(x: np.ndarray, mask: np.ndarray, axis: int) -> np.ndarray:
    """Mean of ``x`` over ``axis`` counting only ``mask`` entries; NaN where none."""
    n = mask.sum(axis=axis)
    tot = np.where(mask, x, 0.0).sum(axis=axis)
    return np.divide(tot, n, out=np.full(tot.shape, np.nan), where=n > 0)


def _json_list(x: np.ndarray) -> list:
    """``x.tolist()`` with NaN (no tokens) as None, which JSON can carry."""
    return [None if np.isnan(v) else v for v in x.tolist()]


# ---------------------------------------------------------------------------- routing input
def _as_routing(routing, model: ModelSpec | None) -> tuple[str, Any, ModelSpec | None, tuple[str, ...]]:
    """-> ("loads", float [W, L, E], model, labels) or ("tokens", TokenRouting, model, ())."""
    if isinstance(routing, (str, Path)):
        p = Path(routing)
        if is_loads_file(p):
            routing = load_loads(p)
        else:
            tr = read_token_routing(p)
            return "tokens", tr, tr.model, ()
    if isinstance(routing, TokenRouting):
        return "tokens", routing, routing.model, ()
    if isinstance(routing, Loads):
        return "loads", routing.counts.astype(np.float64), routing.model, routing.labels
    arr = np.asarray(routing, dtype=np.float64)
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3:
        raise InputError(f"routing must be Loads, [windows, layers, experts] or [layers, experts], "
                         f"got {arr.shape}")
    return "loads", arr, model, ()


def _model_for(placement: Placement, model: ModelSpec | None) -> ModelSpec:
    if model is not None:
        return model
    if placement.model_name in preset_names():
        return load_model(placement.model_name)
    raise InputError(f"placement is for model '{placement.model_name}', which is not a preset; "
                     "pass the model "
                     "(--model) to evaluate it on a bare array")


# ---------------------------------------------------------------------------- traffic
def _distinct_remote(dest: np.ndarray, src: np.ndarray) -> np.ndarray:
    """Number of distinct values in each row of ``dest`` [n, k] other than ``src`` [n]: int64 [n]."""
    if dest.max(initial=0) < 64 and src.max(initial=0) < 64:  # a set of small ints is a 64-bit mask
        mask = np.bitwise_or.reduce(np.left_shift(np.uint64(1), dest.astype(np.uint64)), axis=1)
        mask &= ~np.left_shift(np.uint64(1), src.astype(np.uint64))
        return np.bitwise_count(mask).astype(np.int64)
    srt = np.sort(dest, axis=1)
    new = np.ones_like(srt, dtype=bool)
    new[:, 1:] = srt[:, 1:] != srt[:, :-1]
    return (new & (srt != src[:, None])).sum(axis=1)


def _traffic_from_dest(dest: np.ndarray, src_gpu: np.ndarray,
                       gpus_per_node: int) -> tuple[float, float, float, float]:
    """Exact traffic of selections with destination GPUs ``dest`` int ``[n, k]`` from ``src_gpu``
    ``[n]``: (remote-node selections, remote nodes touched, remote GPUs touched, remote selections),
    each summed over tokens."""
    src_node = src_gpu // gpus_per_node
    dnode = dest // gpus_per_node
    remote_node_sel = float((dnode != src_node[:, None]).sum())
    remote_sel = float((dest != src_gpu[:, None]).sum())
    return (remote_node_sel, float(_distinct_remote(dnode, src_node).sum()),
            float(_distinct_remote(dest, src_gpu).sum()), remote_sel)


def _traffic_from_loads(placement: Placement, w: np.ndarray, engine: str, k: int,
                        dmap: np.ndarray | None, gpu_loads: np.ndarray) -> tuple[float, dict[str, float]]:
    """Loads-level traffic for one window ``w`` [L, E]: tokens of every expert come evenly from all G
    ranks. Returns (cross-node share, sends per token per layer by mode) — the share is exact under
    that assumption, the per-token counts use the independence approximation."""
    L, G = placement.num_layers, placement.num_gpus
    gpn = placement.gpus_per_node
    node = np.arange(G) // gpn
    total = w.sum(axis=1)  # [L]
    # q[l, s, g]: share of rank s's selections that land on GPU g
    if engine == "sglang":
        q = np.zeros((L, G, G))
        slot_gpu = placement.slot_gpu
        for l in range(L):
            dest = slot_gpu[dmap[:, l, :]]  # [G_src, E]
            key = np.arange(G)[:, None] * G + dest
            q[l] = np.bincount(key.ravel(), weights=np.broadcast_to(w[l], dest.shape).ravel(),
                               minlength=G * G).reshape(G, G)
        q = np.divide(q, total[:, None, None], out=np.zeros_like(q), where=total[:, None, None] > 0)
    else:  # vllm even split and ideal: the split does not depend on the source rank
        share = np.divide(gpu_loads, total[:, None], out=np.zeros_like(gpu_loads), where=total[:, None] > 0)
        q = np.broadcast_to(share[:, None, :], (L, G, G))
    same_node = node[:, None] == node[None, :]
    has = total > 0
    # cross-node share over all selections = sum_l total_l * share_l / sum_l total_l
    per_layer_cross = (q * ~same_node[None]).sum(axis=(1, 2)) / G
    cross = float((per_layer_cross * total).sum() / total.sum()) if total.sum() > 0 else 0.0
    remote = ~np.eye(G, dtype=bool)
    touch = 1.0 - (1.0 - q) ** k  # P(at least one of k independent selections lands on g)
    gpus = (touch * remote[None]).sum(axis=2).mean(axis=1)  # [L]
    qn = np.zeros((L, G, placement.num_nodes))
    for n_ in range(placement.num_nodes):
        qn[:, :, n_] = q[:, :, node == n_].sum(axis=2)
    touch_n = 1.0 - (1.0 - qn) ** k
    other_node = node[:, None] != np.arange(placement.num_nodes)[None, :]
    nodes = (touch_n * other_node[None]).sum(axis=2).mean(axis=1)
    sel_remote = (q * remote[None]).sum(axis=2).mean(axis=1) * k
    n_has = max(int(has.sum()), 1)  # per token per layer: over the layers with tokens only
    return cross, {"node": float(nodes[has].sum() / n_has), "gpu": float(gpus[has].sum() / n_has),
                   "expert": float(sel_remote[has].sum() / n_has)}


def _sample_traffic(placement: Placement, samples: np.ndarray, engine: str, dmap: np.ndarray | None,
                    vllm_rule: str) -> tuple[float, dict[str, float]]:
    """Exact traffic of a token sample ``[N, L, k]`` (-1 rows skipped per layer): token ``i`` runs on DP
    rank ``i % G`` at batch position ``i // G``. Returns (cross-node share, sends per token per layer)."""
    N, L, _ = samples.shape
    G = placement.num_gpus
    src_all = np.arange(N) % G
    pos_all = np.arange(N) // G
    acc = dict.fromkeys(("cross", *TRAFFIC_MODES), 0.0)
    sel = tok = 0
    for l in range(L):
        ok = (samples[:, l, :] >= 0).all(axis=1)
        if not ok.any():
            continue
        src = src_all[ok]
        slots = batch_slots(placement, l, samples[ok, l, :], engine, src_gpu=src, pos_in_batch=pos_all[ok],
                            dispatch_map=dmap, vllm_rule=vllm_rule)
        a, b, c, d = _traffic_from_dest(placement.slot_gpu[slots], src, placement.gpus_per_node)
        for key, v in zip(("cross", "node", "gpu", "expert"), (a, b, c, d)):
            acc[key] += v
        sel += slots.size
        tok += int(ok.sum())
    if tok == 0:
        raise InputError("the token sample has no complete rows")
    return acc["cross"] / sel, {key: acc[key] / tok for key in TRAFFIC_MODES}


# ---------------------------------------------------------------------------- evaluate
def evaluate(placement: Placement, routing, engine: str = "vllm", *, model: ModelSpec | None = None,
             cluster: ClusterSpec | None = None, batch_tokens: int | None = None, seed: int = 42,
             dispatch_dtype: str = "bf16", sglang_variant: str = "mainline",
             vllm_rule: str = "hash", samples: np.ndarray | None = None, what: str = "placement") -> Metrics:
    """Score ``placement`` on ``routing`` under ``engine`` (``vllm`` | ``sglang`` | ``ideal``).

    ``routing``: Loads / ``.npz`` path / array ``[W, L, E]`` or ``[L, E]`` (per-window metrics), or a
    trace path / :class:`TokenRouting` (exact token-level replay: tokens go to DP ranks round-robin
    by request; with ``batch_tokens`` each rank runs ``batch_tokens`` tokens per step and the per-step
    balancedness distribution is reported). ``cluster`` only has to agree with the placement's GPU
    count and node size. ``dispatch_dtype``: dtype of dispatched activations (bytes per send).
    ``sglang_variant`` / ``vllm_rule``: which version of the engine's rule (see :mod:`placement.dispatch`).
    ``samples``: int ``[N, L, k]`` expert ids of a token sample (``-1`` = no row for that layer; default:
    the Loads' own ``samples``): with Loads input, traffic is then replayed exactly on the sampled
    tokens (spread round-robin over the DP ranks) instead of the independence approximation — the
    only way co-located experts show up as fewer remote sends. ``what`` names the placement in errors
    (its file): a placement made for another model or cluster is refused.
    """
    check_engine(engine)
    if vllm_rule not in VLLM_RULES:
        raise InputError(f"unknown vLLM replica rule '{vllm_rule}' (expected one of {VLLM_RULES})")
    if sglang_variant not in SGLANG_VARIANTS:
        raise InputError(f"unknown SGLang dispatch variant '{sglang_variant}' "
                         f"(expected one of {SGLANG_VARIANTS})")
    if samples is None and isinstance(routing, Loads):
        samples = routing.samples
    elif samples is None and isinstance(routing, (str, Path)) and is_loads_file(routing):
        samples = load_loads(routing).samples
    kind, data, rmodel, labels = _as_routing(routing, model)
    m = model or rmodel
    m = _model_for(placement, m)
    check_compatible(placement, m, cluster, what=what)
    if rmodel is not None and rmodel is not m:
        check_compatible(placement, rmodel, what=what)
    if dispatch_dtype not in DTYPE_BYTES:
        raise InputError(f"dispatch dtype '{dispatch_dtype}' unknown (expected one of {sorted(DTYPE_BYTES)})")
    G, L, k = placement.num_gpus, placement.num_layers, m.top_k
    send_bytes = m.expert_hidden_size * DTYPE_BYTES[dispatch_dtype]
    dmap = sglang_dispatch_map(placement, seed, variant=sglang_variant) if engine == "sglang" else None
    notes: list[str] = []
    batch_bal = None
    if kind == "loads":
        W = data.shape[0]
        if data.shape[1:] != (L, placement.num_experts):
            raise InputError(f"routing is {data.shape[1:]} (layers x experts), the placement needs "
                             f"{(L, placement.num_experts)}")
        if (data < 0).any():
            raise InputError("routing loads must be non-negative")
        if data.sum() == 0:
            raise InputError("routing has no tokens (all loads are zero)")
        gpu_loads = np.stack([expected_gpu_loads(placement, data[w], engine, seed=seed, dispatch_map=dmap,
                                                 variant=sglang_variant) for w in range(W)])
        totals = data.sum(axis=2).sum(axis=1)
        if samples is not None and len(samples) and engine != "ideal":
            sm = np.asarray(samples)
            if sm.ndim != 3 or sm.shape[1:] != (L, k):
                raise InputError(f"samples must be [tokens, {L}, {k}], got {sm.shape}")
            cross, remote = _sample_traffic(placement, sm, engine, dmap, vllm_rule)
            traffic_method = f"token sample ({len(sm)} tokens), exact replay on the sample"
        else:
            cross, remote = 0.0, {m_: 0.0 for m_ in TRAFFIC_MODES}
            for w in range(W):
                c_w, r_w = _traffic_from_loads(placement, data[w], engine, k, dmap, gpu_loads[w])
                cross += c_w * totals[w] / totals.sum()
                for key in remote:
                    remote[key] += r_w[key] / W
            traffic_method = "uniform-sources, independence approximation"
            notes.append("Loads input without a token sample: remote GPUs/nodes per token use an "
                         "independence approximation (k selections drawn independently); pass a trace "
                         "for exact counts")
        loads_wle = data
    else:
        tr: TokenRouting = data
        src = dp_ranks_round_robin(tr.request_id, G)
        step, pos = batch_layout(src, G, batch_tokens)
        totals_l = np.zeros(L)
        cnt = {"cross": 0.0, "node": 0.0, "gpu": 0.0, "expert": 0.0}
        loads_le = tr.loads()
        if engine == "ideal":
            gpu_loads = ideal_gpu_loads(placement, loads_le)[0][None]
            c, r = _traffic_from_loads(placement, loads_le, engine, k, dmap, gpu_loads[0])
            cross, remote = c, r
            traffic_method = "ideal split: uniform-sources, independence approximation"
            notes.append("engine 'ideal' is a fractional split; its traffic uses the Loads approximation")
        else:
            gl = np.zeros((L, G))
            S = int(step.max()) + 1
            per_step = np.zeros((S, L, G))
            for l in tr.layers:
                slots = batch_slots(placement, l, tr.expert_ids[:, l, :], engine, src_gpu=src,
                                    pos_in_batch=pos, dispatch_map=dmap, vllm_rule=vllm_rule)
                dest = placement.slot_gpu[slots]
                per_step[:, l, :] = np.bincount((step[:, None] * G + dest).ravel(),
                                                minlength=S * G).reshape(S, G)
                a, b, c, d = _traffic_from_dest(dest, src, placement.gpus_per_node)
                cnt["cross"] += a
                cnt["node"] += b
                cnt["gpu"] += c
                cnt["expert"] += d
                totals_l[l] = dest.size
            gl = per_step.sum(axis=0)
            gpu_loads = gl[None]
            n = tr.num_tokens
            cross = cnt["cross"] / totals_l.sum()
            remote = {key: cnt[key] / (n * len(tr.layers)) for key in TRAFFIC_MODES}
            traffic_method = "exact"
        loads_wle = loads_le[None]
        if batch_tokens:
            if engine == "ideal":
                per_step = token_gpu_loads(placement, tr.expert_ids, engine, src_gpu=src,
                                           batch_tokens=batch_tokens, seed=seed, dispatch_map=dmap)
            mx = per_step.max(axis=2)
            bal = np.divide(per_step.mean(axis=2), mx, out=np.ones_like(mx), where=mx > 0)
            batch_bal = bal[:, tr.layers].mean(axis=1)
    bound_p = np.stack([placement_bound(placement, loads_wle[w], engine) for w in range(loads_wle.shape[0])])
    bound_b = np.stack([budget_bound(loads_wle[w], G, placement.num_slots, engine)
                        for w in range(loads_wle.shape[0])])
    L_moe = m.num_moe_layers
    return Metrics(
        engine=engine, source=kind, gpu_loads=gpu_loads, bound_placement=bound_p, bound_budget=bound_b,
        num_nodes=placement.num_nodes, cross_node_share=float(cross),
        remote_per_token={key: float(v) for key, v in remote.items()},
        dispatch_bytes_per_token={key: float(v) * L_moe * send_bytes for key, v in remote.items()},
        traffic_method=traffic_method,
        expert_bytes_per_gpu=float(placement.slots_per_gpu * m.bytes_per_routed_expert * L_moe),
        labels=tuple(labels), batch_balancedness=batch_bal, batch_tokens=batch_tokens, notes=tuple(notes),
        top_k=k)
