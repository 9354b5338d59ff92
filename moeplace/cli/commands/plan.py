"""``place plan``: does this EP topology fit, at what context length and concurrency?

Thin layer over :mod:`foundation.memory`: parse, build a :class:`MemoryConfig`, call ``plan_memory`` (or
``sweep_plans``), print. Exit code 0 when it fits, 3 when it does not (for ``--sweep``: 3 when no row
fits), 2 for bad input.
"""
from __future__ import annotations

import json
from dataclasses import replace

from moeplace.cli import flags
from moeplace.cli.commands import add_force
from moeplace.foundation.cluster import gpu_preset_names, load_gpu, make_cluster
from moeplace.foundation.deployment import parse_pools, pools_help
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import OutputKind, Outputs, register_kind, tagged_artifact, write_text_atomic
from moeplace.foundation.formats import tagged
from moeplace.foundation.memory.config import MemoryConfig
from moeplace.foundation.memory.inputs import GiB, parse_context_mix, parse_pool_split, parse_tokens
from moeplace.foundation.memory.planner import (
    default_sweep_gpus,
    plan_deployment,
    plan_memory,
    pool_changes,
    sweep_plans,
)
from moeplace.foundation.memory.report import render_plan, render_pool_summary, render_sweep
from moeplace.foundation.model import DEFAULT_MODEL, load_model
from moeplace.placement.export import capabilities

PLAN_REPORT = register_kind(OutputKind("plan report", False, tagged_artifact(
    "memory-plan", "model", "cluster", "per_gpu", "pools")))  # --report, the --json document
POOLS_REPORT = register_kind(OutputKind("deployment plan report", False, tagged_artifact(
    "deployment-plan", "model", "deployment", "pools")))  # --pools --report, its --json document

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
    p.add_argument("--pools", nargs="+", default=None, metavar="ROLE:KEY=V,...|FILE",
                   help=pools_help("each pool is planned on its own GPUs (prefill holds the KV of what it prefills, "
                                   "decode the KV of batch running sequences per DP rank)"))
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--report", metavar="FILE", default=None, help="also write the plan JSON to FILE")
    add_force(p)
    p.add_argument("--sweep", action="store_true", help="sweep GPU counts / EP sizes / redundant counts")
    p.add_argument("--sweep-gpus", default=None, help="GPU counts for --sweep (default: 1/4x .. 4x --gpus)")
    p.add_argument("--sweep-ep", default=None, help="EP sizes for --sweep (default: the GPU count and half)")
    p.add_argument("--sweep-redundant", default=None, help="redundant counts for --sweep (default: --redundant)")
    p.set_defaults(func=run)


def build_config(args, max_context: int | None = None) -> MemoryConfig:
    """The plan config of the flags; ``max_context``: the model's, which no --context-mix length may
    exceed (the same check `place simulate` makes)."""
    rule, param = parse_pool_split(args.pool_split)
    return MemoryConfig(
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
    outs.add(args.report, POOLS_REPORT if args.pools else PLAN_REPORT, "--report")
    model = load_model(args.model)
    config = build_config(args, model.max_context)
    if args.pools:
        return run_pools(args, model, config, outs)
    if args.sweep:
        return run_sweep(args, model, config)
    cluster = make_cluster(args.gpus, args.gpu, args.gpus_per_node)
    plan = plan_memory(model, cluster, config)
    report = json.dumps(tagged("memory-plan", plan.to_dict()), indent=1)
    if args.report:
        outs.write(args.report, lambda: write_text_atomic(args.report, report + "\n"))
    if args.json:
        print(report)
    else:
        print(render_plan(plan))
        R = plan.layout.num_redundant
        # redundant slots only some engines apply: how each serves them, once (a replica-free plan is the
        # placement's question: place optimize says how it is served)
        if R and any(capabilities.serving_route(e, model, R) is None for e in capabilities.SERVING_ENGINES):
            for line in capabilities.serving_lines(model, R):
                print(line)
    outs.finish()
    return 0 if plan.fits else EXIT_DOES_NOT_FIT


def run_sweep(args, model, config: MemoryConfig) -> int:
    gpu = load_gpu(args.gpu)
    per_node = args.gpus_per_node or gpu.gpus_per_node
    counts = (_int_list(args.sweep_gpus, "--sweep-gpus") if args.sweep_gpus
              else default_sweep_gpus(args.gpus, per_node))
    eps = _int_list(args.sweep_ep, "--sweep-ep") if args.sweep_ep else None
    reds = _int_list(args.sweep_redundant, "--sweep-redundant") if args.sweep_redundant else None
    rows = sweep_plans(model, config, gpu=args.gpu, gpus_per_node=args.gpus_per_node, gpu_counts=counts,
                       ep_sizes=eps, redundant=reds)
    if args.json:
        print(json.dumps(tagged("memory-plan-sweep", {"rows": [
            {"gpus": r.gpus, "ep": r.ep, "num_redundant": r.num_redundant, "error": r.error,
             "plan": r.plan.to_dict() if r.plan else None} for r in rows]}), indent=1))
    else:
        print(render_sweep(rows, model_name=model.name, gpu=args.gpu, kv_dtype=config.kv_dtype,
                           context=config.context or model.max_context))
    return 0 if any(r.plan is not None and r.plan.fits for r in rows) else EXIT_DOES_NOT_FIT


# the flags a pool word sets for its own pool (given with --pools they would be ambiguous)
_POOL_FLAGS = (("gpus", 32, "--gpus"), ("tp", None, "--tp"), ("dp", None, "--dp"), ("ep", None, "--ep"),
               ("dense_tp", None, "--dense-tp"), ("redundant", 0, "--redundant"), ("sweep", False, "--sweep"),
               ("max_batched_tokens", "8k", "--max-batched-tokens"), ("max_num_seqs", 1024, "--max-num-seqs"))


def run_pools(args, model, config: MemoryConfig, outs: Outputs) -> int:
    """``--pools``: each pool planned on its own GPUs, the breakdowns, then the pools side by side with
    each misfit's smallest change. Exit 3 when a pool does not fit."""
    for dest, default, flag in _POOL_FLAGS:
        if getattr(args, dest) != default:
            raise InputError(f"{flag} goes in the pool words with --pools (gpus=, tp=, dp=, ep=, dense_tp=, redundant=, "
                             "tokens=, batch=)")
    dep = parse_pools(args.pools).with_gpu(None, args.gpus_per_node)
    rows = plan_deployment(model, dep, config, args.gpu)
    changes = {pool.role: pool_changes(pool, plan) for pool, plan in rows}
    doc = tagged("deployment-plan", {"model": model.name, "deployment": dep.to_dict(), "gpu": dep.gpu_kind(args.gpu),
                                     "pools": {pool.role: {**plan.to_dict(), "changes": changes[pool.role]}
                                               for pool, plan in rows},
                                     "fits": all(plan.fits for _, plan in rows)})
    report = json.dumps(doc, indent=1)
    if args.report:
        outs.write(args.report, lambda: write_text_atomic(args.report, report + "\n"))
    if args.json:
        print(report)
    else:
        for pool, plan in rows:  # each misfit's changes follow as pool words, after the summary
            print(f"== {pool.role} pool ==")
            print(render_plan(replace(plan, suggestions=())).replace(
                "smallest change: none found", f"smallest change: see '{pool.role}:' below; none found", 1))
            print()
        print(render_pool_summary(rows, changes))
        R = max(plan.layout.num_redundant for _, plan in rows)
        for line in capabilities.advice(model, R):
            print(f"serving: {line}")
    outs.finish()
    return 0 if all(plan.fits for _, plan in rows) else EXIT_DOES_NOT_FIT
