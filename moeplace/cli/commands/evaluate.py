"""``place evaluate placement.json TRACES_OR_LOADS``: score one placement under an engine's replica
rule (:func:`placement.evaluate.evaluate`). A trace is replayed token by token (exact traffic, per-batch
balancedness with --batch-tokens); Loads are scored per window."""
from __future__ import annotations

import json
from pathlib import Path

from moeplace.cli import flags
from moeplace.foundation.errors import InputError
from moeplace.foundation.formats import tagged
from moeplace.foundation.model import DTYPE_BYTES, load_model
from moeplace.placement.dispatch import ENGINES
from moeplace.placement.evaluate import evaluate
from moeplace.placement.record import load_placement
from moeplace.placement.rules.sglang import SGLANG_VARIANTS
from moeplace.placement.rules.vllm import VLLM_RULES


def register(sub) -> None:
    p = sub.add_parser("evaluate", help="score a placement on traces or Loads under an engine's replica rule")
    p.add_argument("placement", help="placement JSON (from `place optimize`)")
    p.add_argument("routing", metavar="TRACES_OR_LOADS", help="a trace file/directory or a Loads .npz")
    p.add_argument("--engine", choices=ENGINES, default="vllm")
    p.add_argument("--batch-tokens", type=flags.positive_int, default=None,
                   help="tokens per DP rank per engine step (token-level traces): per-batch balancedness")
    p.add_argument("--model", default=None, help="model preset / config (if the routing does not carry one)")
    p.add_argument("--dispatch-dtype", default="bf16", choices=sorted(DTYPE_BYTES),
                   help="dtype of dispatched activations (bytes per send)")
    p.add_argument("--seed", type=flags.seed, default=42, help="SGLang dispatch-map seed (SGLang uses 42)")
    p.add_argument("--vllm-rule", choices=VLLM_RULES, default="hash",
                   help="vLLM replica choice: hash (main since 2026-04) or modulo (2025-09 .. 2026-04)")
    p.add_argument("--sglang-variant", choices=SGLANG_VARIANTS, default="mainline",
                   help="SGLang static map: mainline (same GPU, then same node) or legacy (same GPU only)")
    p.add_argument("--json", action="store_true", help="print the full metrics as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.batch_tokens is not None and args.batch_tokens < 1:
        raise InputError(f"--batch-tokens must be >= 1, got {args.batch_tokens}")
    placement = load_placement(args.placement)
    if not Path(args.routing).exists():
        raise InputError(f"{args.routing}: no such file or directory")
    model = load_model(args.model) if args.model else None
    m = evaluate(placement, args.routing, args.engine, model=model, batch_tokens=args.batch_tokens,
                 seed=args.seed, dispatch_dtype=args.dispatch_dtype, sglang_variant=args.sglang_variant,
                 vllm_rule=args.vllm_rule, what=args.placement)
    if args.json:
        print(json.dumps(tagged("metrics", m.to_dict()), indent=1))
        return 0
    s = m.summary()
    GB = 1e9
    rows = [
        ("placement", (f"{args.placement} ({placement.provenance.get('policy', '?')}, "
                      f"{placement.num_gpus} GPUs, {placement.num_slots} slots, "
                      f"{placement.num_redundant} redundant)")),
        ("routing", (f"{args.routing} ({s['source']}, {s['tokens']:,} tokens, {s['num_windows']} window(s); "
                     + (f"scored on {s['layers']} (the MoE layers it holds))" if "layers" in s else
                        f"scored on {s['scored_layers']} of {s['moe_layers']} MoE layers)"))),
        ("engine", args.engine),
        ("balancedness", (f"{s['balancedness']:.4f} mean, {s['worst_window_balancedness']:.4f} worst window; "
                         f"ratio-of-sums {s['ratio_of_sums']:.4f}; max/mean {s['max_over_mean']:.4f}")),
        ("bound (placement)",
         f"balancedness <= {s['bound_balancedness_placement']:.4f}, gap {s['gap_placement']:+.2%}"),
        ("bound (slot budget)",
         f"balancedness <= {s['bound_balancedness_budget']:.4f}, gap {s['gap_budget']:+.2%}"),
        ("cross-node share", f"{s['cross_node_share']:.4f} of expert selections"),
        ("remote / token / layer", ", ".join(f"{v:.3f} {k}s" for k, v in s["remote_per_token"].items())
         + f" ({s['traffic_method']})"),
        ("dispatch / token", ", ".join(f"{v / 1e6:.3f} MB per-{k}"
                                       for k, v in s["dispatch_bytes_per_token"].items())
         + f" ({args.dispatch_dtype}, " + (f"the {s['layers']} held)" if "layers" in s else "all MoE layers)")),
        ("expert weights / GPU", f"{s['expert_bytes_per_gpu'] / GB:.2f} GB"),
    ]
    if s["batch"]:
        b = s["batch"]
        rows.append(("per-batch balancedness",
                     (f"{b['num_batches']} steps of {b['batch_tokens']} tokens/rank: mean {b['mean']:.4f}, "
                     f"p5 {b['p5']:.4f}, p50 {b['p50']:.4f}, p95 {b['p95']:.4f}")))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    for n in m.notes:
        print(f"note: {n}")
    return 0
