"""The planner: :func:`plan_memory` (does a layout fit, and how many sequences does it hold),
:func:`suggest_changes` (the smallest change that makes a plan fit), :func:`sweep_plans` (a grid of
layouts) and :func:`cache_pools` (the pools a simulator admits against)."""
from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Any

from moeplace.foundation import limits
from moeplace.foundation.cluster import ClusterSpec, make_cluster
from moeplace.foundation.deployment import Deployment, PoolSpec
from moeplace.foundation.errors import InputError
from moeplace.foundation.memory.components import MemoryLine, a2a_buffer_bytes, activation_bytes, weight_lines
from moeplace.foundation.memory.config import Layout, MemoryConfig, next_valid_redundant, resolve_layout
from moeplace.foundation.memory.inputs import format_tokens
from moeplace.foundation.memory.plan import MemoryPlan, Suggestion, SweepRow
from moeplace.foundation.memory.pools import CachePools, make_pools
from moeplace.foundation.memory.report import cache_lines, misfit_reasons
from moeplace.foundation.model import KV_DTYPE_BYTES, ModelSpec


def plan_memory(model: ModelSpec, cluster: ClusterSpec, config: MemoryConfig, *, suggest: bool = True) -> MemoryPlan:
    """Plan the memory of ``model`` served on ``cluster`` with ``config``; see :mod:`foundation.memory`.

    A plan fits when the weights and runtime reserve fit the usable memory of every GPU and at least
    ``config.min_concurrency`` sequences of ``context`` tokens (and, if given, of the mix) fit the
    pools. When it does not fit and ``suggest`` is set, :func:`suggest_changes` searches the smallest
    change that makes it fit.
    """
    lay = resolve_layout(model, cluster.num_gpus, config)
    context = config.context or model.max_context
    if not context:
        raise InputError(f"model '{model.name}'{' (' + model.source + ')' if model.source else ''} has no maximum context in its spec: give --context")
    hbm = cluster.gpu.memory_bytes  # what the device reports: the engines' memory fractions apply to it
    budget = config.gpu_memory_utilization * hbm
    lines = weight_lines(model, lay)
    act, act_how = activation_bytes(model, lay, config)
    a2a, a2a_how = a2a_buffer_bytes(model, lay, config)
    lines += [MemoryLine("runtime", "activations", act, act_how),
              MemoryLine("runtime", "all-to-all buffers", a2a, a2a_how),
              MemoryLine("runtime", "CUDA graphs / NCCL / slack", config.other_reserve_bytes,
                         "fixed reserve (--other-reserve)")]
    used = sum(x.bytes for x in lines)
    pools = make_pools(model, lay, config, budget - used)
    lines += cache_lines(model, lay, config, pools)
    n_ctx, ceiling = pools.concurrency(((context, 1.0),))
    n_mix = mix_ceiling = None
    if config.context_mix:
        n_mix, mix_ceiling = pools.concurrency(config.context_mix)
    if used > budget:  # nothing is left for the caches: the weights are the ceiling
        ceiling = mix_ceiling = "weights"
        if not config.context_mix:
            mix_ceiling = None
    pool_ctx = pools.max_context()
    draft = MemoryPlan(model_name=model.name, cluster=cluster, config=config, layout=lay, lines=tuple(lines),
                       hbm_bytes=hbm, budget_bytes=budget, pools=pools, context=context,
                       concurrency_per_rank=n_ctx, concurrency_ceiling=ceiling,
                       mix_concurrency_per_rank=n_mix, mix_ceiling=mix_ceiling,
                       max_context=min(pool_ctx, pools.max_model_len), pool_max_context=pool_ctx,
                       fits=False, reasons=())
    reasons = misfit_reasons(model, draft, used)
    plan = replace(draft, fits=not reasons, reasons=tuple(reasons))
    if not plan.fits and suggest:
        plan = replace(plan, suggestions=tuple(suggest_changes(model, cluster, config)))
    return plan


def cache_pools(model: ModelSpec, cluster: ClusterSpec, config: MemoryConfig) -> CachePools:
    """The cache pools of one DP rank under ``config`` (what a simulator admits sequences against)."""
    return plan_memory(model, cluster, config, suggest=False).pools



# ---------------------------------------------------------------------------- search for a fix
def _try(model: ModelSpec, cluster: ClusterSpec, config: MemoryConfig) -> MemoryPlan | None:
    try:
        plan = plan_memory(model, cluster, config, suggest=False)
    except InputError:
        return None
    return plan if plan.fits else None


def _with_layout(config: MemoryConfig, lay: Layout, **changes: Any) -> MemoryConfig:
    """``config`` with the resolved layout made explicit, then ``changes`` applied."""
    base = {"tp": lay.tp, "dp": lay.dp, "ep": lay.ep, "dense_tp": lay.dense_tp, "num_redundant": lay.num_redundant}
    base.update(changes)
    return replace(config, **base)


def suggest_changes(model: ModelSpec, cluster: ClusterSpec, config: MemoryConfig,
                    *, max_gpus_factor: int = 8) -> list[Suggestion]:
    """Single changes that make the plan fit, cheapest kind first; within a kind the smallest.

    A ``--context`` beyond the model's maximum is answered with the maximum only. Otherwise kinds, in
    this order: FP8 KV cache; fewer redundant experts; a larger EP; a larger attention TP
    (fewer DP ranks); more GPUs (whole nodes, up to ``max_gpus_factor`` x, keeping the attention TP and
    scaling DP and EP with the world size, redundant count rounded up to a valid one). Every candidate
    is re-planned with :func:`plan_memory` on the same model and cluster kind.
    """
    lay = resolve_layout(model, cluster.num_gpus, config)
    W, E = cluster.num_gpus, model.num_experts
    found: list[Suggestion] = []
    context = config.context or model.max_context
    if model.max_context and context > model.max_context:
        # Nothing about the topology can help a sequence longer than the model reads.
        cfg = replace(config, context=model.max_context)
        plan = _try(model, cluster, cfg)
        if plan is not None:
            found.append(Suggestion("model max context", f"--context {format_tokens(model.max_context)}", W, cfg,
                                    plan.concurrency))
        return found

    def add(kind: str, change: str, cl: ClusterSpec, cfg: MemoryConfig) -> bool:
        plan = _try(model, cl, cfg)
        if plan is None:
            return False
        found.append(Suggestion(kind, change, cl.num_gpus, cfg, plan.concurrency))
        return True

    if KV_DTYPE_BYTES[config.kv_dtype] > KV_DTYPE_BYTES["fp8"] and model.kv_bytes_per_token("bf16") > 0:
        add("fp8 KV", "--kv-dtype fp8", cluster, _with_layout(config, lay, kv_dtype="fp8"))
    # every search below re-plans at most MAX_TRIES candidates, and walks only valid ones (the valid
    # redundant counts, the divisors of W): the cost is bounded whatever the sizes
    if lay.num_redundant:
        first = lay.num_redundant - 1 - (E + lay.num_redundant - 1) % lay.ep  # largest valid r below R
        for r in itertools.islice(range(first, -1, -lay.ep), MAX_TRIES):
            if add("fewer redundant", f"--redundant {r}", cluster, _with_layout(config, lay, num_redundant=r)):
                break
    divs = _divisors(W)
    for ep in itertools.islice((d for d in divs if d > lay.ep), MAX_TRIES):
        r = next_valid_redundant(E, ep, lay.num_redundant)
        note = f" --redundant {r}" if r != lay.num_redundant else ""
        if add("larger EP", f"--ep {ep}{note}", cluster, _with_layout(config, lay, ep=ep, num_redundant=r)):
            break
    for tp in itertools.islice((d for d in divs if d > lay.tp), MAX_TRIES):
        if tp % lay.dcp == 0:
            dense_tp = tp if config.dense_tp is None else lay.dense_tp
            if add("larger attention TP", f"--tp {tp} --dp {W // tp}", cluster,
                   _with_layout(config, lay, tp=tp, dp=W // tp, dense_tp=dense_tp)):
                break
    step = min(cluster.gpus_per_node, W)
    tries = 0
    for W2 in range(W + step, min(max_gpus_factor * W, limits.MAX_GPUS) + 1, step):
        if W2 % lay.tp:
            continue
        ep2 = lay.ep * W2 // W if (lay.ep * W2) % W == 0 else W2
        r = next_valid_redundant(E, ep2, lay.num_redundant)
        if W2 > cluster.gpus_per_node and W2 % cluster.gpus_per_node:
            continue  # whole nodes only
        per_node = min(cluster.gpus_per_node, W2)
        cl = ClusterSpec(gpu=cluster.gpu, num_nodes=W2 // per_node, gpus_per_node=per_node)
        dense_tp = lay.dense_tp if W2 % lay.dense_tp == 0 else lay.tp
        note = f" --redundant {r}" if r != lay.num_redundant else ""
        tries += 1
        if tries > MAX_TRIES:
            break
        if add("more GPUs", f"--gpus {W2} --tp {lay.tp} --dp {W2 // lay.tp} --ep {ep2}{note}", cl,
               _with_layout(config, lay, dp=W2 // lay.tp, ep=ep2, num_redundant=r, dense_tp=dense_tp)):
            break
    return found


MAX_TRIES = 64  # candidate plans one suggestion search re-plans at most


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (trial division to sqrt(n): n is at most limits.MAX_GPUS)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small) | {n // d for d in small})


# ---------------------------------------------------------------------------- sweep
def sweep_plans(model: ModelSpec, config: MemoryConfig, *, gpu: str, gpus_per_node: int | None,
                gpu_counts: list[int], ep_sizes: list[int] | None = None,
                redundant: list[int] | None = None) -> list[SweepRow]:
    """Plan every (GPU count, EP size, redundant count) combination.

    ``ep_sizes`` ``None``: EP = the GPU count and half of it. EP sizes that do not divide a GPU count are
    skipped; a redundant count that does not make ``E + R`` divisible by EP is rounded up to the next valid
    one (rows are deduplicated). The attention TP/DP the user gave are kept where they divide the GPU
    count; rows whose layout is invalid carry the error instead of a plan.
    """
    rows: list[SweepRow] = []
    seen = set()
    E = model.num_experts
    for W in gpu_counts:
        try:
            cluster = make_cluster(W, gpu, gpus_per_node if gpus_per_node and W >= gpus_per_node else None)
        except InputError as exc:
            rows.append(SweepRow(W, config.tp, config.dp, 0, 0, None, str(exc)))
            continue
        eps = ep_sizes or sorted({W, W // 2} - {0})
        tp, dp = config.tp, config.dp
        if tp is not None and dp is not None and tp * dp != W:
            dp = None  # keep the attention TP, let DP follow the GPU count
        for ep in eps:
            if ep > W or W % ep:
                continue
            for r in (redundant or [config.num_redundant]):
                r2 = next_valid_redundant(E, ep, r)
                key = (W, ep, r2)
                if key in seen:
                    continue
                seen.add(key)
                cfg = replace(config, tp=tp, dp=dp, ep=ep, num_redundant=r2)
                try:
                    rows.append(SweepRow(W, tp, dp, ep, r2, plan_memory(model, cluster, cfg, suggest=False)))
                except InputError as exc:
                    rows.append(SweepRow(W, tp, dp, ep, r2, None, str(exc)))
    return rows


def default_sweep_gpus(num_gpus: int, gpus_per_node: int) -> list[int]:
    """Quarter, half, the same, double and quadruple the GPU count, in whole nodes where possible."""
    out = []
    for f in (0.25, 0.5, 1, 2, 4):
        w = int(num_gpus * f)
        if w >= 1 and (w < gpus_per_node or w % gpus_per_node == 0) and w not in out:
            out.append(w)
    return out


# ---------------------------------------------------------------------------- disaggregated pools
def pool_layout(model: ModelSpec, pool: PoolSpec) -> Layout:
    """The resolved layout of one pool (attention TP x DP as given, else as :func:`resolve_layout` picks
    it for the pool's GPU count)."""
    try:
        return resolve_layout(model, pool.gpus, _pool_base(pool, MemoryConfig()))
    except InputError as exc:
        raise InputError(f"--pools {pool.role}: {exc}") from None


def _pool_base(pool: PoolSpec, config: MemoryConfig) -> MemoryConfig:
    return replace(config, tp=pool.tp, dp=pool.dp, ep=pool.ep_size, dense_tp=pool.dense_tp,
                   num_redundant=pool.redundant, max_batched_tokens=pool.max_batched_tokens,
                   max_num_seqs=pool.max_seqs)


def pool_config(model: ModelSpec, pool: PoolSpec, config: MemoryConfig) -> MemoryConfig:
    """The plan config of one pool of a deployment: its layout and batching limits over ``config`` (the
    command's context, KV dtype, memory share). The prefill pool holds the KV of the sequences it prefills
    until they move to decode: ``config.min_concurrency`` of them (default one) must fit. The decode pool
    holds the KV of every running sequence: with ``batch`` given, ``batch`` per attention-DP rank must fit
    at the context (else ``config.min_concurrency``)."""
    need = config.min_concurrency
    if pool.role == "decode" and pool.batch is not None:
        need = max(need, pool.batch * pool_layout(model, pool).dp)
    return replace(_pool_base(pool, config), min_concurrency=need)


def pool_cluster(deployment: Deployment, pool: PoolSpec, gpu: str, gpus_per_node: int | None = None) -> ClusterSpec:
    """The pool's own cluster: its GPUs, of the deployment's GPU kind (else ``gpu``), in nodes of the
    deployment's ``gpus_per_node`` (else the ``gpus_per_node`` given, else the GPU preset's; a pool smaller
    than one node is one node of its size)."""
    per_node = deployment.gpus_per_node or gpus_per_node
    per_node = per_node if per_node is not None and pool.gpus >= per_node else None
    try:
        return make_cluster(pool.gpus, deployment.gpu_kind(gpu), per_node)
    except InputError as exc:
        raise InputError(f"--pools {pool.role}: {exc}") from None


def plan_deployment(model: ModelSpec, deployment: Deployment, config: MemoryConfig, gpu: str,
                    *, suggest: bool = True) -> list[tuple[PoolSpec, MemoryPlan]]:
    """Plan the memory of each pool of ``deployment`` (:func:`pool_config`) on its own GPUs; a pool that
    does not fit carries the smallest changes that make it fit (:func:`suggest_changes`). ``gpu``: the GPU
    kind when the deployment names none."""
    out = []
    for pool in deployment.pools:
        cluster = pool_cluster(deployment, pool, gpu)
        try:
            plan = plan_memory(model, cluster, pool_config(model, pool, config), suggest=suggest)
        except InputError as exc:
            raise InputError(f"--pools {pool.role}: {exc}") from None
        out.append((pool, plan))
    return out


def pool_change(pool: PoolSpec, s: Suggestion) -> str:
    """A suggestion for one pool as what a user changes: the pool word that applies it
    (``decode:gpus=32,tp=1,dp=32,ep=32``), or the command flag when it is not the pool's (``--kv-dtype fp8``,
    ``--context``)."""
    if s.kind in ("fp8 KV", "model max context"):
        return s.change
    c = s.config
    word = f"{pool.role}:gpus={s.gpus},tp={c.tp},dp={c.dp},ep={c.ep}"
    if c.num_redundant:
        word += f",redundant={c.num_redundant}"
    if c.dense_tp is not None and c.dense_tp != c.tp:
        word += f",dense_tp={c.dense_tp}"
    for key in ("batch", "tokens"):
        if getattr(pool, key) is not None:
            word += f",{key}={getattr(pool, key)}"
    return word


def pool_changes(pool: PoolSpec, plan: MemoryPlan) -> list[str]:
    """The changes that make a pool fit, smallest first, as users write them: a decode pool whose running
    sequences do not fit first gets the batch that does (``batch=N``: the same GPUs), then the plan's own
    suggestions (:func:`pool_change`)."""
    out = []
    n = plan.concurrency_per_rank
    if pool.role == "decode" and pool.batch is not None and 1 <= n < pool.batch and plan.free_bytes > 0:
        word = f"{pool.role}:" + ",".join(f"{k}={v}" for k, v in pool.to_dict().items() if k not in ("role", "batch") and not (k == "redundant" and v == 0))
        out.append(f"{word},batch={n}  (fewer running sequences per DP rank: {n} fit)")
    return out + [f"{pool_change(pool, s)}  ({s.kind}; then {s.concurrency} concurrent)" for s in plan.suggestions]
