"""``evaluate()``: score any placement on any routing under a named engine's replica-choice rule.

One function used by everything (CLI tables, the optimizer's final check, the simulator, the
dashboard). Routing is either expert *loads* (a :class:`traces.loads.Loads`, a ``.npz`` Loads file,
or an array ``[W, L, E]`` / ``[L, E]``) or *token-level* routing (a trace path, or a
:class:`TokenRouting`). The rules live in :mod:`placement.dispatch`, the bounds in
:mod:`placement.bounds`, the traffic arithmetic in :mod:`placement.traffic`. Loads and token routing take
two paths (``_score_loads``, ``_score_tokens``) behind one dispatcher.

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
import polars as pl

from moeplace.foundation.cluster import ClusterSpec
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import DTYPE_BYTES, ModelSpec, load_model, preset_names
from moeplace.placement.dispatch import batch_layout, dp_ranks_round_robin, token_gpu_loads
from moeplace.placement.record import Placement, check_compatible
from moeplace.placement.rules import ReplicaRule, get_rule
from moeplace.placement.rules.ideal import check_loads
from moeplace.placement.traffic import TRAFFIC_MODES, sample_traffic, traffic_from_dest, traffic_from_loads
from moeplace.traces.loads import Loads, is_loads_file, load_loads
from moeplace.traces.validate import check_trace, read_expert_ids


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
    trace = check_trace(path)  # the gate: every row checked before any is used
    model, prov = trace.model, trace.provenance
    L = model.num_moe_layers
    lay2idx = np.full(65536, -1, dtype=np.int64)
    lay2idx[list(model.moe_layers)] = np.arange(L)
    lf = pl.scan_parquet([str(f) for f in trace.file_paths])
    df = lf.select("request_id", "position", "layer").collect()
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
    ids = read_expert_ids(trace)  # trace order, the frame's row order
    return model, prov, ids, layer_idx, by_key[j], tok_key >> 24


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

    rule: str
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
    layers_label: str = ""  # "5 of 24 layers": the routing holds some of the model's MoE layers only

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
            "engine": self.rule,
            "source": self.source,
            "num_windows": int(self.gpu_loads.shape[0]),
            "tokens": self.num_tokens,
            "scored_layers": self.scored_layers,
            "moe_layers": int(self.gpu_loads.shape[1]),
            **({"layers": self.layers_label} if self.layers_label else {}),
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


# ---------------------------------------------------------------------------- evaluate
@dataclass(frozen=True, eq=False)
class _Scored:
    """What one routing path measured: GPU loads ``[W, L, G]`` (W windows, or 1 for token routing), the
    expert loads ``[W, L, E]`` the bounds are computed on, and the traffic."""

    gpu_loads: np.ndarray
    expert_loads: np.ndarray
    cross: float
    remote: dict[str, float]
    traffic_method: str
    notes: tuple[str, ...] = ()
    batch_balancedness: np.ndarray | None = None


def evaluate(placement: Placement, routing, rule: str | ReplicaRule = "vllm", *, model: ModelSpec | None = None,
             cluster: ClusterSpec | None = None, batch_tokens: int | None = None, seed: int = 42,
             dispatch_dtype: str = "bf16", sglang_variant: str = "mainline",
             vllm_rule: str = "hash", samples: np.ndarray | None = None, what: str = "placement") -> Metrics:
    """Score ``placement`` on ``routing`` under the replica rule ``rule`` (a registered name:
    ``vllm`` | ``sglang`` | ``trtllm`` | ``ideal``, or a :class:`ReplicaRule`).

    ``routing``: Loads / ``.npz`` path / array ``[W, L, E]`` or ``[L, E]`` (per-window metrics), or a
    trace path / :class:`TokenRouting` (exact token-level replay: tokens go to DP ranks round-robin
    by request; with ``batch_tokens`` each rank runs ``batch_tokens`` tokens per step and the per-step
    balancedness distribution is reported). ``cluster`` only has to agree with the placement's GPU
    count and node size. ``dispatch_dtype``: dtype of dispatched activations (bytes per send).
    ``sglang_variant`` / ``vllm_rule``: which version of the engine's rule (see :mod:`moeplace.placement.rules`).
    ``samples``: int ``[N, L, k]`` expert ids of a token sample (``-1`` = no row for that layer; default:
    the Loads' own ``samples``): with Loads input, traffic is then replayed exactly on the sampled
    tokens (spread round-robin over the DP ranks) instead of the independence approximation — the
    only way co-located experts show up as fewer remote sends. ``what`` names the placement in errors
    (its file): a placement made for another model or cluster is refused.
    """
    rule = get_rule(rule, seed=seed, vllm_rule=vllm_rule, sglang_variant=sglang_variant)
    if samples is None and isinstance(routing, Loads):
        samples = routing.samples
    elif samples is None and isinstance(routing, (str, Path)) and is_loads_file(routing):
        samples = load_loads(routing).samples
    kind, data, rmodel, labels = _as_routing(routing, model)
    m = model or rmodel
    m = _model_for(placement, m)
    if rmodel is not None and rmodel.is_partial:
        # routing of some layers only: a placement of the whole model is scored on those layers
        placement = placement.held(rmodel, what=what)
        if not m.is_partial and m.moe_layers == rmodel.model_moe_layers:
            m = m.restrict(rmodel.moe_layers)  # --model's settings, on the layers the routing holds
    check_compatible(placement, m, cluster, what=what)
    if rmodel is not None and rmodel is not m:
        check_compatible(placement, rmodel, what=what)
    if dispatch_dtype not in DTYPE_BYTES:
        raise InputError(f"dispatch dtype '{dispatch_dtype}' unknown (expected one of {sorted(DTYPE_BYTES)})")
    dmap = rule.dispatch_state(placement)
    if kind == "loads":
        scored = _score_loads(placement, data, rule, m.top_k, dmap, samples)
    else:
        scored = _score_tokens(placement, data, rule, m.top_k, dmap, batch_tokens=batch_tokens)
    return _metrics(placement, m, rule, kind, scored, labels=labels, batch_tokens=batch_tokens,
                    send_bytes=m.expert_hidden_size * DTYPE_BYTES[dispatch_dtype])


_LOADS_TRAFFIC_NOTE = ("Loads input without a token sample: remote GPUs/nodes per token use an independence "
                       "approximation (k selections drawn independently); pass a trace for exact counts")


def _score_loads(placement: Placement, data: np.ndarray, rule: ReplicaRule, k: int, dmap: np.ndarray | None,
                 samples: np.ndarray | None) -> _Scored:
    """The Loads path: expected GPU loads of every window ``data`` float ``[W, L, E]`` under the rule;
    traffic replayed exactly on the token sample when there is one (not for ``ideal``), otherwise the
    uniform-sources independence approximation, averaged over windows (the share weighted by tokens)."""
    L = placement.num_layers
    W = data.shape[0]
    if data.shape[1:] != (L, placement.num_experts):
        raise InputError(f"routing is {data.shape[1:]} (layers x experts), the placement needs "
                         f"{(L, placement.num_experts)}")
    if (data < 0).any():
        raise InputError("routing loads must be non-negative")
    if data.sum() == 0:
        raise InputError("routing has no tokens (all loads are zero)")
    gpu_loads = np.stack([rule.expected_gpu_loads(placement, check_loads(placement, data[w]), dmap)
                          for w in range(W)])
    if samples is not None and len(samples) and rule.per_token:
        sm = np.asarray(samples)
        if sm.ndim != 3 or sm.shape[1:] != (L, k):
            raise InputError(f"samples must be [tokens, {L}, {k}], got {sm.shape}")
        cross, remote = sample_traffic(placement, sm, rule, dmap)
        return _Scored(gpu_loads, data, cross, remote,
                       f"token sample ({len(sm)} tokens), exact replay on the sample")
    totals = data.sum(axis=2).sum(axis=1)
    cross, remote = 0.0, {m_: 0.0 for m_ in TRAFFIC_MODES}
    for w in range(W):
        c_w, r_w = traffic_from_loads(placement, data[w], rule, k, dmap, gpu_loads[w])
        cross += c_w * totals[w] / totals.sum()
        for key in remote:
            remote[key] += r_w[key] / W
    return _Scored(gpu_loads, data, cross, remote, "uniform-sources, independence approximation",
                   (_LOADS_TRAFFIC_NOTE,))


def _score_tokens(placement: Placement, tr: TokenRouting, rule: ReplicaRule, k: int, dmap: np.ndarray | None,
                  *, batch_tokens: int | None) -> _Scored:
    """The token path: every token replayed under the rule on its DP rank (round-robin by request),
    one window; with ``batch_tokens`` also the balancedness of every step. ``ideal`` is a fractional
    split, so its traffic falls back to the Loads approximation."""
    src = dp_ranks_round_robin(tr.request_id, placement.num_gpus)
    step, pos = batch_layout(src, placement.num_gpus, batch_tokens)
    loads_le = tr.loads()
    notes: tuple[str, ...] = ()
    if not rule.per_token:
        gpu_loads = rule.expected_gpu_loads(placement, loads_le)[None]
        cross, remote = traffic_from_loads(placement, loads_le, rule, k, dmap, gpu_loads[0])
        traffic_method = f"{rule.engine}: uniform-sources, independence approximation"
        notes = (f"engine '{rule.name}' is a fractional split; its traffic uses the Loads approximation",)
        per_step = (token_gpu_loads(placement, tr.expert_ids, rule, src_gpu=src, batch_tokens=batch_tokens,
                                    dispatch_map=dmap) if batch_tokens else None)
    else:
        per_step, cross, remote = _replay_tokens(placement, tr, rule, src, step, pos, dmap)
        gpu_loads = per_step.sum(axis=0)[None]
        traffic_method = "exact"
    batch_bal = None
    if batch_tokens:
        mx = per_step.max(axis=2)
        bal = np.divide(per_step.mean(axis=2), mx, out=np.ones_like(mx), where=mx > 0)
        batch_bal = bal[:, tr.layers].mean(axis=1)
    return _Scored(gpu_loads, loads_le[None], cross, remote, traffic_method, notes, batch_bal)


def _replay_tokens(placement: Placement, tr: TokenRouting, rule: ReplicaRule, src: np.ndarray, step: np.ndarray,
                   pos: np.ndarray, dmap: np.ndarray | None) -> tuple[np.ndarray, float, dict[str, float]]:
    """Each token of ``tr`` on DP rank ``src`` [n] at batch step ``step`` / position ``pos``: the GPU
    loads of every step ``[S, L, G]``, the cross-node share and the exact sends per token per layer."""
    L, G = placement.num_layers, placement.num_gpus
    S = int(step.max()) + 1
    per_step = np.zeros((S, L, G))
    cnt = dict.fromkeys(("cross", *TRAFFIC_MODES), 0.0)
    selections = 0
    for l in tr.layers:
        slots = rule.batch_slots(placement, l, tr.expert_ids[:, l, :].astype(np.int64), src_gpu=src,
                                 pos_in_batch=pos, batch_id=step, state=dmap)
        dest = placement.slot_gpu[slots]
        per_step[:, l, :] = np.bincount((step[:, None] * G + dest).ravel(), minlength=S * G).reshape(S, G)
        for key, v in zip(("cross", *TRAFFIC_MODES), traffic_from_dest(dest, src, placement.gpus_per_node)):
            cnt[key] += v
        selections += dest.size
    remote = {key: cnt[key] / (tr.num_tokens * len(tr.layers)) for key in TRAFFIC_MODES}
    return per_step, cnt["cross"] / selections, remote


def _metrics(placement: Placement, m: ModelSpec, rule: ReplicaRule, kind: str, scored: _Scored, *,
             labels: tuple[str, ...], batch_tokens: int | None, send_bytes: float) -> Metrics:
    """Bounds for every window of the scored expert loads, and the Metrics record."""
    loads = scored.expert_loads
    G = placement.num_gpus
    bound_p = np.stack([rule.placement_bound(placement, loads[w]) for w in range(loads.shape[0])])
    bound_b = np.stack([rule.budget_bound(loads[w], G, placement.num_slots) for w in range(loads.shape[0])])
    L_moe = m.num_moe_layers  # the layers scored (held); the weights count every MoE layer of the model
    return Metrics(
        rule=rule.name, source=kind, gpu_loads=scored.gpu_loads, bound_placement=bound_p, bound_budget=bound_b,
        num_nodes=placement.num_nodes, cross_node_share=float(scored.cross),
        remote_per_token={key: float(v) for key, v in scored.remote.items()},
        dispatch_bytes_per_token={key: float(v) * L_moe * send_bytes for key, v in scored.remote.items()},
        traffic_method=scored.traffic_method,
        expert_bytes_per_gpu=float(placement.slots_per_gpu * m.bytes_per_routed_expert * len(m.model_moe_layers)),
        labels=tuple(labels), batch_balancedness=scored.batch_balancedness, batch_tokens=batch_tokens,
        notes=scored.notes, top_k=m.top_k, layers_label=m.layers_label)
