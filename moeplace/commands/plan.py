"""``place plan``: does this EP topology fit, at what context length and concurrency?

Thin layer over :mod:`foundation.memory`: parse, build a :class:`PlanConfig`, call ``plan_memory`` (or
``sweep_plans``), print. Exit code 0 when it fits, 3 when it does not (for ``--sweep``: 3 when no row
fits), 2 for bad input.
"""
from __future__ import annotations

import json

from foundation.cluster import gpu_preset_names, load_gpu, make_cluster
from foundation.errors import InputError
from foundation.files import Outputs, write_text_atomic
from foundation.memory import (
    GiB,
    KiB,
    MemoryPlan,
    MiB,
    PlanConfig,
    default_sweep_gpus,
    format_tokens,
    parse_context_mix,
    parse_pool_split,
    parse_tokens,
    plan_memory,
    sweep_plans,
)
from foundation.model import DEFAULT_MODEL, load_model
from moeplace import flags
from moeplace.commands import add_force

EXIT_DOES_NOT_FIT = 3


def _int_list(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{flag} '{text}': expected comma-separated whole numbers, e.g. 16,32,64") from None
    if not out or min(out) < 0:
        raise InputError(f"{flag} '{text}': expected non-negative whole numbers")
    return out


def register(sub) -> None:
    p = sub.add_parser("plan", help="memory plan: does a TP/DP/EP layout fit, at what context and concurrency",
                       description="Per-GPU memory breakdown, KV/state pool capacity, concurrency and a verdict "
                                   "(exit 3 when it does not fit).")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"preset or config.json (default {DEFAULT_MODEL})")
    p.add_argument("--gpus", type=flags.positive_int, default=32, help="GPUs of the engine instance (default 32)")
    p.add_argument("--gpu", default="h200", help=f"GPU kind: {', '.join(gpu_preset_names())} (default h200)")
    p.add_argument("--gpus-per-node", type=flags.positive_int, default=None, help="GPUs per NVLink domain (default: the preset's)")
    p.add_argument("--tp", type=flags.positive_int, default=None, help="attention tensor-parallel size (default GPUs / DP)")
    p.add_argument("--dp", type=flags.positive_int, default=None, help="attention data-parallel ranks (default GPUs / TP, or 1)")
    p.add_argument("--ep", type=flags.positive_int, default=None, help="expert-parallel size (default: all GPUs)")
    p.add_argument("--dense-tp", type=flags.positive_int, default=None,
                   help="TP of shared experts / dense MLP (default: attention TP; 1 = replicated as SGLang+DeepEP)")
    p.add_argument("--redundant", type=flags.nonneg_int, default=0, help="redundant expert slots per MoE layer (default 0)")
    p.add_argument("--dcp", type=flags.positive_int, default=1, help="decode-context-parallel size (shards KV tokens; divides TP)")
    p.add_argument("--context", default=None,
                   help="target length of one sequence, e.g. 128k or 1M (k=1024, M=1048576; default: model max)")
    p.add_argument("--context-mix", default=None, help="length mix, e.g. 8k:0.7,128k:0.25,1M:0.05")
    p.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp16", "fp8", "fp32"], help="KV cache dtype")
    p.add_argument("--gpu-memory-utilization", type=flags.fraction, default=0.9,
                   help="share of HBM the engine may use (default 0.9)")
    p.add_argument("--max-batched-tokens", default="8k", help="tokens per forward per DP rank (default 8k)")
    p.add_argument("--max-num-seqs", type=flags.positive_int, default=1024, help="running-sequence cap per DP rank (default 1024)")
    p.add_argument("--state-slots", type=flags.positive_int, default=1,
                   help="KDA state slots per request (prefix caching keeps 3-5; default 1)")
    p.add_argument("--pool-split", default="shared",
                   help="KV/state split: shared (vLLM), ratio[:0.9] (SGLang mamba_full_memory_ratio), slots:N")
    p.add_argument("--page-size", type=flags.positive_int, default=64, help="KV page size in tokens (default 64)")
    p.add_argument("--other-reserve", type=flags.gib, default=1.0,
                   help="GiB per GPU for CUDA graphs / NCCL / slack (default 1)")
    p.add_argument("--min-seqs", type=flags.positive_int, default=1,
                   help="concurrent sequences at --context required to call it a fit (default 1)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--report", metavar="FILE", default=None, help="also write the plan JSON to FILE")
    add_force(p)
    p.add_argument("--sweep", action="store_true", help="sweep GPU counts / EP sizes / redundant counts")
    p.add_argument("--sweep-gpus", default=None, help="GPU counts for --sweep (default: 1/4x .. 4x --gpus)")
    p.add_argument("--sweep-ep", default=None, help="EP sizes for --sweep (default: the GPU count and half)")
    p.add_argument("--sweep-redundant", default=None, help="redundant counts for --sweep (default: --redundant)")
    p.set_defaults(func=run)


def build_config(args, max_context: int | None = None) -> PlanConfig:
    """The plan config of the flags; ``max_context``: the model's, which no --context-mix length may
    exceed (the same check `place simulate` makes)."""
    rule, param = parse_pool_split(args.pool_split)
    return PlanConfig(
        tp=args.tp, dp=args.dp, ep=args.ep, dense_tp=args.dense_tp, num_redundant=args.redundant, dcp=args.dcp,
        context=parse_tokens(args.context, "--context") if args.context is not None else None,
        context_mix=parse_context_mix(args.context_mix, max_context) if args.context_mix else None,
        kv_dtype=args.kv_dtype, gpu_memory_utilization=args.gpu_memory_utilization,
        max_batched_tokens=parse_tokens(args.max_batched_tokens, "--max-batched-tokens"),
        max_num_seqs=args.max_num_seqs, state_slots_per_seq=args.state_slots, pool_split=rule, pool_param=param,
        page_size=args.page_size, other_reserve_bytes=args.other_reserve * GiB, min_concurrency=args.min_seqs,
    )


def run(args) -> int:
    if args.sweep and args.report:
        raise InputError("--report writes one plan; with --sweep print the table as JSON with --json")
    outs = Outputs(inputs=[args.model], force=args.force)
    outs.add(args.report, "plan report", "--report")
    model = load_model(args.model)
    config = build_config(args, model.max_context)
    if args.sweep:
        return run_sweep(args, model, config)
    cluster = make_cluster(args.gpus, args.gpu, args.gpus_per_node)
    plan = plan_memory(model, cluster, config)
    if args.report:
        outs.write(args.report, lambda: write_text_atomic(args.report, json.dumps(plan.to_dict(), indent=1) + "\n"))
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
    else:
        print(render_plan(plan))
    outs.finish()
    return 0 if plan.fits else EXIT_DOES_NOT_FIT


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

    row("HBM", plan.hbm_bytes)
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
                       "up to 8x the GPUs)")
    return "\n".join(out)


def run_sweep(args, model, config: PlanConfig) -> int:
    gpu = load_gpu(args.gpu)
    per_node = args.gpus_per_node or gpu.gpus_per_node
    counts = (_int_list(args.sweep_gpus, "--sweep-gpus") if args.sweep_gpus
              else default_sweep_gpus(args.gpus, per_node))
    eps = _int_list(args.sweep_ep, "--sweep-ep") if args.sweep_ep else None
    reds = _int_list(args.sweep_redundant, "--sweep-redundant") if args.sweep_redundant else None
    rows = sweep_plans(model, config, gpu=args.gpu, gpus_per_node=args.gpus_per_node, gpu_counts=counts,
                       ep_sizes=eps, redundant=reds)
    if args.json:
        print(json.dumps([{"gpus": r.gpus, "ep": r.ep, "num_redundant": r.num_redundant, "error": r.error,
                           "plan": r.plan.to_dict() if r.plan else None} for r in rows], indent=1))
    else:
        ctx = format_tokens(config.context or model.max_context)
        head = (f"{'gpus':>5} {'tp':>4} {'dp':>4} {'ep':>4} {'R':>4} {'weights':>8} {'reserve':>8} {'free':>8} "
                f"{'seqs@' + ctx:>10} {'ceiling':>9} {'max ctx':>11}  verdict")
        print(f"{model.name} on {args.gpu}, KV {config.kv_dtype}; GB per GPU")
        print(head)
        for r in rows:
            if r.plan is None:
                print(f"{r.gpus:>5} {'':>4} {'':>4} {r.ep:>4} {r.num_redundant:>4}  invalid: {r.error}")
                continue
            p = r.plan
            verdict = "fits" if p.fits else "NO: " + p.reasons[0]
            print(f"{r.gpus:>5} {p.layout.tp:>4} {p.layout.dp:>4} {p.layout.ep:>4} {p.layout.num_redundant:>4} "
                  f"{p.weight_bytes / 1e9:>8.1f} {p.reserve_bytes / 1e9:>8.1f} {p.free_bytes / 1e9:>8.1f} "
                  f"{p.concurrency:>10} {p.concurrency_ceiling:>9} {p.max_context:>11,}  {verdict}")
    return 0 if any(r.plan is not None and r.plan.fits for r in rows) else EXIT_DOES_NOT_FIT
