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

from placement.bounds import budget_bound, placement_bound
from placement.cluster import ClusterSpec
from placement.dispatch import (
    batch_layout,
    batch_slots,
    check_engine,
    dp_ranks_round_robin,
    expected_gpu_loads,
    ideal_gpu_loads,
    sglang_dispatch_map,
    token_gpu_loads,
)
from placement.record import Placement
from traces.errors import InputError
from traces.loads import Loads, is_loads_file, load_loads
from traces.model import DTYPE_BYTES, ModelSpec, load_model, preset_names

TRAFFIC_MODES = ("node", "gpu", "expert")


@dataclass(frozen=True)
class TokenRouting:
    """Token-level routing: ``expert_ids`` int ``[n, L, k]`` (tokens in arrival/step order, L over MoE
    layers) and ``request_id`` int ``[n]`` (to assign tokens to DP ranks round-robin by request)."""

    expert_ids: np.ndarray
    request_id: np.ndarray
    model: ModelSpec

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

    def loads(self) -> np.ndarray:
        """Expert counts float64 ``[L, E]``."""
        L, E = self.model.num_moe_layers, self.model.num_experts
        out = np.zeros((L, E))
        for l in range(L):
            out[l] = np.bincount(self.expert_ids[:, l, :].ravel().astype(np.int64), minlength=E)
        return out


def read_token_routing(path: str | Path) -> TokenRouting:
    """Read a trace (file or directory) into :class:`TokenRouting`: tokens ordered by (step,
    request_id, position); every token must appear once in every MoE layer."""
    from traces.format import read_trace_meta, scan_trace

    model, _ = read_trace_meta(path)
    L = model.num_moe_layers
    df = (scan_trace(path).select("request_id", "position", "step", "layer", "expert_ids")
          .sort("layer", "step", "request_id", "position").collect())
    if df.height == 0:
        raise InputError(f"{path}: the trace has no rows")
    layers = df["layer"].to_numpy()
    counts = {int(x): c for x, c in zip(*np.unique(layers, return_counts=True))}
    unknown = sorted(set(counts) - set(model.moe_layers))
    if unknown:
        raise InputError(f"{path}: field 'layer': value {unknown[0]} is not an MoE layer of '{model.name}'")
    n = counts.get(model.moe_layers[0], 0)
    for lay in model.moe_layers:
        if counts.get(lay, 0) != n:
            raise InputError(f"{path}: field 'layer': layer {lay} has {counts.get(lay, 0)} rows but layer "
                             f"{model.moe_layers[0]} has {n}; token-level evaluation needs every token in every MoE layer")
    keys = np.stack([df["step"].to_numpy(), df["request_id"].to_numpy(), df["position"].to_numpy()], axis=1)
    keys = keys.reshape(L, n, 3)
    bad = np.flatnonzero((keys != keys[:1]).any(axis=(1, 2)))
    if bad.size:
        raise InputError(f"{path}: layer {model.moe_layers[int(bad[0])]} covers different tokens (step, request_id, "
                         f"position) than layer {model.moe_layers[0]}")
    ids = df.get_column("expert_ids").to_numpy()
    if ids.ndim != 2:
        ids = np.stack(ids)
    ids = ids.reshape(L, n, -1).transpose(1, 0, 2)
    return TokenRouting(np.ascontiguousarray(ids.astype(np.uint16)), keys[0, :, 1].copy(), model)


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

    # -------------------------------------------------------------- per (window, layer)
    @property
    def mean_load(self) -> np.ndarray:
        return self.gpu_loads.mean(axis=2)

    @property
    def max_load(self) -> np.ndarray:
        return self.gpu_loads.max(axis=2)

    @property
    def layer_balancedness_wl(self) -> np.ndarray:
        """``[W, L]`` mean / max (1 for layers without tokens)."""
        mx = self.max_load
        return np.divide(self.mean_load, mx, out=np.ones_like(mx), where=mx > 0)

    @property
    def layer_balancedness(self) -> np.ndarray:
        """``[L]`` averaged over windows."""
        return self.layer_balancedness_wl.mean(axis=0)

    @property
    def window_balancedness(self) -> np.ndarray:
        """``[W]`` SGLang form: per layer, then averaged over layers."""
        return self.layer_balancedness_wl.mean(axis=1)

    @property
    def window_ratio_of_sums(self) -> np.ndarray:
        """``[W]`` vLLM's logged form: sum over layers of the mean / sum of the max."""
        mx = self.max_load.sum(axis=1)
        return np.divide(self.mean_load.sum(axis=1), mx, out=np.ones_like(mx), where=mx > 0)

    @property
    def balancedness(self) -> float:
        return float(self.window_balancedness.mean())

    @property
    def worst_window_balancedness(self) -> float:
        return float(self.window_balancedness.min())

    @property
    def ratio_of_sums(self) -> float:
        return float(self.window_ratio_of_sums.mean())

    @property
    def max_over_mean(self) -> float:
        """Mean over windows and layers of max / mean."""
        return float((1.0 / self.layer_balancedness_wl).mean())

    def _ceiling(self, bound: np.ndarray) -> np.ndarray:
        return np.divide(self.mean_load, bound, out=np.ones_like(bound), where=bound > 0)

    def _gap(self, bound: np.ndarray) -> np.ndarray:
        return np.divide(self.max_load, bound, out=np.zeros_like(bound), where=bound > 0) - (bound > 0)

    @property
    def layer_gap_placement(self) -> np.ndarray:
        """``[L]`` ``max / bound_placement - 1``, averaged over windows."""
        return self._gap(self.bound_placement).mean(axis=0)

    @property
    def layer_gap_budget(self) -> np.ndarray:
        return self._gap(self.bound_budget).mean(axis=0)

    @property
    def bound_balancedness_placement(self) -> float:
        """Best balancedness this placement could reach under this rule (its bound's ceiling)."""
        return float(self._ceiling(self.bound_placement).mean())

    @property
    def bound_balancedness_budget(self) -> float:
        """Best balancedness any placement with this slot budget could reach."""
        return float(self._ceiling(self.bound_budget).mean())

    @property
    def gap_placement(self) -> float:
        return float(self.layer_gap_placement.mean())

    @property
    def gap_budget(self) -> float:
        return float(self.layer_gap_budget.mean())

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
            "window_balancedness": self.window_balancedness.tolist(),
            "window_ratio_of_sums": self.window_ratio_of_sums.tolist(),
            "layer_balancedness": self.layer_balancedness.tolist(),
            "layer_gap_placement": self.layer_gap_placement.tolist(),
            "layer_gap_budget": self.layer_gap_budget.tolist(),
            "notes": list(self.notes),
        })
        return d


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
        raise InputError(f"routing must be Loads, [windows, layers, experts] or [layers, experts], got {arr.shape}")
    return "loads", arr, model, ()


def _model_for(placement: Placement, model: ModelSpec | None) -> ModelSpec:
    if model is not None:
        return model
    if placement.model_name in preset_names():
        return load_model(placement.model_name)
    raise InputError(f"placement is for model '{placement.model_name}', which is not a preset; pass the model "
                     "(--model) to evaluate it on a bare array")


# ---------------------------------------------------------------------------- traffic
def _traffic_from_dest(dest: np.ndarray, src_gpu: np.ndarray, gpus_per_node: int) -> tuple[float, float, float, float]:
    """Exact traffic of selections with destination GPUs ``dest`` int ``[n, k]`` from ``src_gpu``
    ``[n]``: (remote-node selections, remote nodes touched, remote GPUs touched, remote selections),
    each summed over tokens."""
    src = src_gpu[:, None]
    remote_gpu = dest != src
    dnode = dest // gpus_per_node
    remote_node = dnode != src // gpus_per_node
    srt = np.sort(dest, axis=1)
    new = np.ones_like(srt, dtype=bool)
    new[:, 1:] = srt[:, 1:] != srt[:, :-1]
    uniq_remote_gpus = (new & (srt != src)).sum()
    srtn = np.sort(dnode, axis=1)
    newn = np.ones_like(srtn, dtype=bool)
    newn[:, 1:] = srtn[:, 1:] != srtn[:, :-1]
    uniq_remote_nodes = (newn & (srtn != src // gpus_per_node)).sum()
    return float(remote_node.sum()), float(uniq_remote_nodes), float(uniq_remote_gpus), float(remote_gpu.sum())


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
    wl = has.astype(float)  # layers without tokens send nothing
    return cross, {"node": float((nodes * wl).mean()), "gpu": float((gpus * wl).mean()),
                   "expert": float((sel_remote * wl).mean())}


# ---------------------------------------------------------------------------- evaluate
def evaluate(placement: Placement, routing, engine: str = "vllm", *, model: ModelSpec | None = None,
             cluster: ClusterSpec | None = None, batch_tokens: int | None = None, seed: int = 42,
             dispatch_dtype: str = "bf16", sglang_variant: str = "mainline") -> Metrics:
    """Score ``placement`` on ``routing`` under ``engine`` (``vllm`` | ``sglang`` | ``ideal``).

    ``routing``: Loads / ``.npz`` path / array ``[W, L, E]`` or ``[L, E]`` (per-window metrics), or a
    trace path / :class:`TokenRouting` (exact token-level replay: tokens go to DP ranks round-robin
    by request; with ``batch_tokens`` each rank runs ``batch_tokens`` tokens per step and the per-step
    balancedness distribution is reported). ``cluster`` only has to agree with the placement's GPU
    count and node size. ``dispatch_dtype``: dtype of dispatched activations (bytes per send).
    """
    check_engine(engine)
    kind, data, rmodel, labels = _as_routing(routing, model)
    m = model or rmodel
    m = _model_for(placement, m)
    placement.check_model(m, "placement")
    if rmodel is not None and rmodel is not m:
        placement.check_model(rmodel, "placement")
    if cluster is not None and (cluster.num_gpus != placement.num_gpus
                                or cluster.gpus_per_node != placement.gpus_per_node):
        raise InputError(f"cluster {cluster.name} does not match the placement ({placement.num_gpus} GPUs, "
                         f"{placement.gpus_per_node} per node)")
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
        cross, remote = 0.0, {m_: 0.0 for m_ in TRAFFIC_MODES}
        for w in range(W):
            c_w, r_w = _traffic_from_loads(placement, data[w], engine, k, dmap, gpu_loads[w])
            cross += c_w * totals[w] / totals.sum()
            for key in remote:
                remote[key] += r_w[key] / W
        traffic_method = "uniform-sources, independence approximation"
        notes.append("Loads input: remote GPUs/nodes per token use an independence approximation "
                     "(k selections drawn independently); pass a token-level trace for exact counts")
        loads_wle = data
    else:
        tr: TokenRouting = data
        src = dp_ranks_round_robin(tr.request_id, G)
        _, pos = batch_layout(src, G, batch_tokens)
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
            for l in range(L):
                slots = batch_slots(placement, l, tr.expert_ids[:, l, :], engine, src_gpu=src, pos_in_batch=pos,
                                    dispatch_map=dmap)
                dest = placement.slot_gpu[slots]
                gl[l] = np.bincount(dest.ravel(), minlength=G)
                a, b, c, d = _traffic_from_dest(dest, src, placement.gpus_per_node)
                cnt["cross"] += a
                cnt["node"] += b
                cnt["gpu"] += c
                cnt["expert"] += d
                totals_l[l] = dest.size
            gpu_loads = gl[None]
            n = tr.num_tokens
            cross = cnt["cross"] / totals_l.sum()
            remote = {"node": cnt["node"] / (n * L), "gpu": cnt["gpu"] / (n * L), "expert": cnt["expert"] / (n * L)}
            traffic_method = "exact"
        loads_wle = loads_le[None]
        if batch_tokens:
            per_step = token_gpu_loads(placement, tr.expert_ids, engine, src_gpu=src, batch_tokens=batch_tokens,
                                       seed=seed, dispatch_map=dmap)
            mx = per_step.max(axis=2)
            bal = np.divide(per_step.mean(axis=2), mx, out=np.ones_like(mx), where=mx > 0)
            batch_bal = bal.mean(axis=1)
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
        labels=tuple(labels), batch_balancedness=batch_bal, batch_tokens=batch_tokens, notes=tuple(notes))
