"""The memory plan in English: the cache lines' formulas and the reasons a plan does not fit (worded
while planning), and the printed report of a plan or a sweep (what ``place plan`` shows). The arithmetic
lives in the other modules; this one only words its results."""
from __future__ import annotations

from typing import Any

from moeplace.foundation.memory.components import MemoryLine
from moeplace.foundation.memory.config import Layout, MemoryConfig
from moeplace.foundation.memory.inputs import GiB, KiB, MiB, format_tokens
from moeplace.foundation.memory.plan import MemoryPlan, SweepRow
from moeplace.foundation.memory.pools import CachePools
from moeplace.foundation.model import ModelSpec


# ---------------------------------------------------------------------------- while planning
def cache_lines(model: ModelSpec, lay: Layout, config: MemoryConfig, pools: CachePools) -> list[MemoryLine]:
    """The per-GPU lines of the cache pools (one for a shared pool, two for split pools), each with the
    per-token / per-sequence sizes it holds."""
    kvb, st = pools.kv_bytes_per_token, pools.state_bytes_per_seq
    # MLA latents are replicated on every attention-TP rank unless DCP shards the tokens.
    if lay.dcp > 1:
        dcp_note = f", tokens sharded over DCP{lay.dcp}"
    elif lay.tp > 1:
        dcp_note = f", KV heads split over TP{lay.tp}" if model.gqa else f", replicated on TP{lay.tp}"
    else:
        dcp_note = ""
    split = {"shared": "one shared pool (vLLM hybrid allocator)" if st and kvb else "one pool",
             "ratio": f"SGLang ratio {0.9 if config.pool_param is None else config.pool_param:g}",
             "slots": f"{int(config.pool_param or 0)} state slots/DP rank"}["shared" if pools.shared else config.pool_split]
    kv_name = "MLA KV" if model.mla else "KV"
    state_name = "KDA state" if model.kda else "state"
    kv_how = f"{kvb / KiB:.2f} KiB/token ({config.kv_dtype}{dcp_note})"
    slots = f"{config.state_slots_per_seq} slot{'s' if config.state_slots_per_seq > 1 else ''}"
    st_how = f"{st / MiB:.1f} MiB/sequence (state / TP{lay.tp} x {slots})"
    if pools.shared and not st:
        return [MemoryLine("cache", f"{kv_name} pool", pools.pool_bytes, f"{kv_how}; no per-sequence state")]
    if pools.shared and not kvb:
        return [MemoryLine("cache", f"{state_name} pool", pools.pool_bytes, f"{st_how}; no per-token KV")]
    if pools.shared:
        return [MemoryLine("cache", f"{kv_name} + {state_name} pool", pools.pool_bytes,
                           f"{split}: {kv_how} + {st_how}")]
    return [MemoryLine("cache", f"{kv_name} pool", pools.kv_pool_bytes, f"{kv_how}; {split}"),
            MemoryLine("cache", f"{state_name} pool", pools.state_pool_bytes, st_how)]


def misfit_reasons(model: ModelSpec, plan: MemoryPlan, used_bytes: float) -> list[str]:
    """Why ``plan`` does not fit (empty when it fits). ``plan``: the plan before its verdict;
    ``used_bytes``: per-GPU weights + runtime reserve, as summed when the pools were sized."""
    config, lay, pools, cluster = plan.config, plan.layout, plan.pools, plan.cluster
    hbm, budget, context, max_ctx = plan.hbm_bytes, plan.budget_bytes, plan.context, plan.max_context
    n_ctx, n_mix = plan.concurrency_per_rank, plan.mix_concurrency_per_rank
    reasons = []
    total_weights = model.checkpoint_bytes + (lay.num_redundant * len(model.model_moe_layers) * model.bytes_per_routed_expert)
    if total_weights > cluster.num_gpus * hbm:
        reasons.append(f"the model's weights ({total_weights / 1e12:.2f} TB) exceed the memory of {cluster.num_gpus} x "
                       f"{hbm / 1e9:.0f} GB = {cluster.num_gpus * hbm / 1e12:.2f} TB")
    weights = plan.weight_bytes
    if used_bytes > budget:
        reasons.append(f"weights {weights / 1e9:.1f} GB + runtime reserve {(used_bytes - weights) / 1e9:.1f} GB per "
                       f"GPU exceed the usable {budget / 1e9:.1f} GB ({config.gpu_memory_utilization:g} x "
                       f"{hbm / 1e9:.0f} GB)")
    elif context > pools.max_model_len:
        reasons.append(f"--context {context:,} exceeds the model's maximum context {pools.max_model_len:,}")
    elif n_ctx * lay.dp < config.min_concurrency:
        if n_ctx == 0:
            reasons.append(f"one {format_tokens(context)}-token sequence needs {pools.seq_bytes(context) / 1e9:.1f} GB "
                           f"per GPU of KV + state, but only {pools.pool_bytes / 1e9:.1f} GB is free for caches "
                           f"(largest context: {max_ctx:,} tokens)")
        else:
            reasons.append(f"only {n_ctx * lay.dp} sequences of {format_tokens(context)} tokens fit, "
                           f"{config.min_concurrency} required")
    if config.context_mix and used_bytes <= budget and (n_mix or 0) * lay.dp < config.min_concurrency:
        longest = max(n for n, _ in config.context_mix)
        if longest > max_ctx:
            reasons.append(f"the mix's longest length {format_tokens(longest)} does not fit one DP rank (largest "
                           f"context: {max_ctx:,} tokens)")
        else:
            reasons.append(f"the context mix admits {(n_mix or 0) * lay.dp} sequences, "
                           f"{config.min_concurrency} required")
    return reasons


# ---------------------------------------------------------------------------- printed reports
def render_plan(plan: MemoryPlan) -> str:
    """The human-readable plan: per-GPU lines, pools, concurrency, verdict."""
    c, lay, p = plan.config, plan.layout, plan.pools
    out = [(f"{plan.model_name} on {plan.cluster.num_gpus} x {plan.cluster.gpu.name} "
           f"({plan.cluster.num_nodes} node{'s' if plan.cluster.num_nodes > 1 else ''} of "
           f"{plan.cluster.gpus_per_node}): {lay.describe()}"),
           "",
           f"per GPU{'':<26}{'GB':>8}   how"]

    def row(name: str, nbytes: float, how: str = "") -> None:
        out.append(f"  {name:<31}{nbytes / 1e9:>8.2f}   {how}")

    gpu = plan.cluster.gpu
    row("GPU memory", plan.hbm_bytes,
        f"as the device reports it (marketing {gpu.hbm_bytes / 1e9:.0f} GB)" if gpu.device_memory_bytes is not None
        else "marketing capacity (no device-reported total for this GPU)")
    row("usable", plan.budget_bytes, f"--gpu-memory-utilization {c.gpu_memory_utilization:g}")
    for section, total_name in (("weights", "= weights"), ("runtime", "= runtime reserve")):
        for x in plan.lines:
            if x.section == section:
                row(x.name, x.bytes, x.how)
        row(total_name, plan.section_bytes(section))
    row("= free for caches", plan.free_bytes)
    for x in plan.lines:
        if x.section == "cache":
            row(x.name, x.bytes, x.how)
    out.append("")
    ctx = format_tokens(plan.context)
    ceiling = {"kv": f"{'MLA ' if p.kv_bytes_per_token else ''}KV cache", "state": "KDA state",
               "max_num_seqs": "--max-num-seqs", "max_model_len": "model max context",
               "weights": "weights + runtime reserve leave nothing for caches"}
    per_seq = p.seq_bytes(plan.context)
    out.append(f"sequence of {ctx} tokens: {p.kv_tokens(plan.context) * p.kv_bytes_per_token / GiB:.2f} GiB KV + "
               f"{p.state_bytes_per_seq / MiB:.1f} MiB state per GPU ({per_seq / 1e9:.2f} GB)")
    out.append(f"concurrent sequences at {ctx}: {plan.concurrency} ({plan.concurrency_per_rank} per DP rank x "
               f"{lay.dp}); ceiling: {ceiling.get(plan.concurrency_ceiling, plan.concurrency_ceiling)}")
    if c.context_mix:
        mix = ",".join(f"{format_tokens(n)}:{w:g}" for n, w in c.context_mix)
        out.append(f"concurrent sequences at mix {mix}: {plan.mix_concurrency} ({plan.mix_concurrency_per_rank} "
                   f"per DP rank); ceiling: {ceiling.get(plan.mix_ceiling, plan.mix_ceiling)}")
    if not p.shared:
        out.append(f"pools per DP rank: {p.state_slots} state slots, {p.kv_token_capacity:,} KV token slots per GPU")
    limit = (f" (the model's maximum; the pools alone would hold {plan.pool_max_context:,})"
             if plan.pool_max_context > plan.max_context else "")
    out.append(f"largest context of one sequence: {plan.max_context:,} tokens{limit}")
    out.append(f"KV per token {p.kv_bytes_per_token / KiB:.2f} KiB per GPU ({c.kv_dtype}); "
               f"state per sequence {p.state_bytes_per_seq / MiB:.1f} MiB per GPU")
    out.append("")
    if plan.fits:
        out.append("verdict: FITS")
    else:
        out.append("verdict: DOES NOT FIT")
        out += [f"  reason: {r}" for r in plan.reasons]
        if plan.suggestions:
            s = plan.suggestions[0]
            sctx = format_tokens(s.config.context or plan.context)
            out.append(f"smallest change: {s.change}  ({s.kind}; then {s.concurrency} concurrent {sctx}-token "
                       f"sequence{'s' if s.concurrency != 1 else ''})")
            out += [f"  also fits: {x.change}  ({x.kind}; {x.concurrency} concurrent)" for x in plan.suggestions[1:]]
        else:
            out.append("smallest change: none found (searched fp8 KV, fewer redundant, larger EP, larger TP, "
                       "up to 8x the GPUs; at most 64 candidates each)")
    return "\n".join(out)


def render_sweep(rows: list[SweepRow], *, model_name: str, gpu: str, kv_dtype: str, context: int) -> str:
    """The sweep table: one line per (GPU count, EP size, redundant count), GB per GPU, the concurrency at
    ``context`` tokens and the verdict (or why the layout is invalid)."""
    ctx = format_tokens(context)
    out = [f"{model_name} on {gpu}, KV {kv_dtype}; GB per GPU",
           (f"{'gpus':>5} {'tp':>4} {'dp':>4} {'ep':>4} {'R':>4} {'weights':>8} {'reserve':>8} {'free':>8} "
            f"{'seqs@' + ctx:>10} {'ceiling':>9} {'max ctx':>11}  verdict")]
    for r in rows:
        if r.plan is None:
            out.append(f"{r.gpus:>5} {'':>4} {'':>4} {r.ep:>4} {r.num_redundant:>4}  invalid: {r.error}")
            continue
        p = r.plan
        verdict = "fits" if p.fits else "NO: " + p.reasons[0]
        out.append(f"{r.gpus:>5} {p.layout.tp:>4} {p.layout.dp:>4} {p.layout.ep:>4} {p.layout.num_redundant:>4} "
                   f"{p.weight_bytes / 1e9:>8.1f} {p.reserve_bytes / 1e9:>8.1f} {p.free_bytes / 1e9:>8.1f} "
                   f"{p.concurrency:>10} {p.concurrency_ceiling:>9} {p.max_context:>11,}  {verdict}")
    return "\n".join(out)


def render_pool_summary(rows: list[tuple[Any, MemoryPlan]], changes: dict[str, list[str]]) -> str:
    """The pools of a deployment side by side, one line each (``rows``: ``(PoolSpec, MemoryPlan)``), then
    per pool that does not fit its reason and the smallest change (``changes``: the pool's suggestions as
    the pool words or flags that apply them, smallest first)."""
    out = ["pools side by side (per GPU; the breakdowns above):",
           (f"  {'pool':<8} {'GPUs':>5} {'layout':<52} {'weights GB':>10} {'reserve GB':>10} {'free GB':>8} "
           f"{'seqs@ctx':>9} {'need':>6}  verdict")]
    for pool, p in rows:
        out.append(f"  {pool.role:<8} {p.cluster.num_gpus:>5} {p.layout.describe():<52} "
                   f"{p.weight_bytes / 1e9:>10.1f} {p.reserve_bytes / 1e9:>10.1f} {p.free_bytes / 1e9:>8.1f} "
                   f"{p.concurrency:>9} {p.config.min_concurrency:>6}  {'fits' if p.fits else 'DOES NOT FIT'}")
    for pool, p in rows:
        if p.fits:
            continue
        out.append(f"{pool.role}: {p.reasons[0]}")
        found = changes.get(pool.role) or []
        out.append(f"{pool.role}: smallest change: {found[0]}" if found else
                   f"{pool.role}: smallest change: none found (searched fp8 KV, fewer redundant, larger EP, larger "
                   "TP, up to 8x the GPUs)")
        out += [f"{pool.role}:   also fits: {x}" for x in found[1:]]
    return "\n".join(out)
