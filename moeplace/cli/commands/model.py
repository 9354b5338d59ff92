"""``place model show NAME [--json]`` and ``place model list``: architecture facts of a model preset or a
Hugging Face config.json."""
from __future__ import annotations

import json

from moeplace.foundation.formats import tagged
from moeplace.foundation.model import DEFAULT_MODEL, ModelSpec, format_ranges, load_model, preset_names

GROUP = "model"


def register(sub) -> None:
    p = sub.add_parser("show", help="architecture, parameters and memory facts of a model")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL,
                   help=f"preset ({', '.join(preset_names())}) or path to a config.json (default {DEFAULT_MODEL})")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=show)
    p = sub.add_parser("list", help="list the model presets")
    p.set_defaults(func=lambda args: print("\n".join(preset_names())) or 0)


def model_facts(m: ModelSpec) -> dict:
    """Derived facts of a model (what `place model show` prints)."""
    return {
        "name": m.name,
        "source": m.source,
        "num_layers": m.num_layers,
        "num_moe_layers": m.num_moe_layers,
        "moe_layers": list(m.moe_layers),
        "dense_layers": list(m.dense_layers),
        "num_experts": m.num_experts,
        "top_k": m.top_k,
        "num_shared_experts": m.num_shared_experts,
        "router": {"scoring": m.scoring, "n_group": m.n_group, "topk_group": m.topk_group},
        "expert_shape": {"hidden": m.expert_hidden_size, "intermediate": m.moe_intermediate_size,
                         "params": m.params_per_routed_expert},
        "expert_dtype": m.expert_dtype,
        "weight_dtype": m.weight_dtype,
        "bytes_per_routed_expert": m.bytes_per_routed_expert,
        "routed_expert_bytes_per_layer": m.bytes_per_routed_expert * m.num_experts,
        "attention_layers": {k: list(m.layers_of(k)) for k in ("mla", "kda", "gqa") if m.layers_of(k)},
        "kv_bytes_per_token": {"bf16": m.kv_bytes_per_token("bf16"), "fp8": m.kv_bytes_per_token("fp8")},
        "state_bytes_per_sequence": m.state_bytes_per_sequence(),
        "params": m.param_breakdown(),
        "total_params": m.total_params,
        "active_params": m.active_params,
        "checkpoint_bytes": m.checkpoint_bytes,
        "max_context": m.max_context,
    }




def show(args) -> int:
    m = load_model(args.name)
    f = model_facts(m)
    if args.json:
        print(json.dumps(tagged("model-facts", f), indent=1))
        return 0
    GiB, MiB, KiB = 2**30, 2**20, 2**10
    rows = [
        ("model", f"{m.name}  ({m.source})"),
        ("parameters", f"{m.total_params / 1e12:.3f} T total, {m.active_params / 1e9:.1f} B active per token"),
        ("layers", (f"{m.num_layers} ({m.num_moe_layers} MoE: {format_ranges(list(m.moe_layers))}; "
                    f"dense: {format_ranges(list(m.dense_layers)) or 'none'})")),
        ("routed experts", (f"{m.num_experts} per MoE layer, top-{m.top_k}, {m.scoring} router"
                            + (f", {m.n_group} groups / top-{m.topk_group}" if m.n_group > 1
                               else ", no group limit"))),
        ("shared experts", f"{m.num_shared_experts} x intermediate {m.shared_intermediate_size}"),
        ("expert shape", (f"{m.expert_hidden_size} x {m.moe_intermediate_size} (gated MLP, "
                         f"{m.params_per_routed_expert / 1e6:.1f} M params)")),
        ("expert bytes", (f"{m.bytes_per_routed_expert / 1e6:.2f} MB at {m.expert_dtype}; "
                         f"{m.bytes_per_routed_expert * m.num_experts / 1e9:.2f} GB per MoE layer; "
                         f"{m.bytes_per_routed_expert * m.num_experts * m.num_moe_layers / 1e12:.3f} TB all")),
    ]
    for kind in ("mla", "kda", "gqa"):
        layers = list(m.layers_of(kind))
        if layers:
            rows.append((f"{kind.upper()} layers", f"{len(layers)}: {format_ranges(layers)}"))
    rows += [
        ("KV cache / token", (f"{m.kv_bytes_per_token('bf16') / KiB:.2f} KiB bf16, "
                             f"{m.kv_bytes_per_token('fp8') / KiB:.2f} KiB fp8 (attention-TP 1)")),
        ("state / sequence", f"{m.state_bytes_per_sequence() / MiB:.1f} MiB (attention-TP 1, any length)"),
        ("1 M-token sequence", f"{m.kv_bytes_per_token('bf16') * 2**20 / GiB:.1f} GiB KV bf16"),
        ("checkpoint", f"{m.checkpoint_bytes / 1e12:.3f} TB ({m.expert_dtype} experts, {m.weight_dtype} rest)"),
        ("max context", f"{m.max_context:,} tokens"),
    ]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    return 0
