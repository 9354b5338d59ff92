"""Tiny random MoE checkpoints of every layout the relabelling supports, built with transformers (tests of
the checkpoint writer, the statistics mapping and the vLLM plugin share them)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from moeplace.placement.record import Placement

E = 8  # experts per layer in every tiny model
GPUS = 4


def configs():
    import transformers as tf

    common = {"vocab_size": 64, "hidden_size": 16, "num_attention_heads": 2, "tie_word_embeddings": False}
    return {
        "mixtral": (tf.MixtralConfig(**common, intermediate_size=8, num_hidden_layers=2, num_key_value_heads=1,
                                     num_local_experts=E, num_experts_per_tok=2), tf.MixtralForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig(**common, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=2,
                                        num_key_value_heads=1, num_experts=E, num_experts_per_tok=2, head_dim=8),
                      tf.Qwen3MoeForCausalLM),
        "olmoe": (tf.OlmoeConfig(**common, intermediate_size=8, num_hidden_layers=2, num_key_value_heads=1,
                                 num_experts=E, num_experts_per_tok=2), tf.OlmoeForCausalLM),
        # group-limited routing: 4 groups of 2, top-2 groups; layer 0 dense, as DeepSeek-V3's first three
        "deepseek_v3": (tf.DeepseekV3Config(**common, intermediate_size=16, moe_intermediate_size=8,
                                            num_hidden_layers=3, first_k_dense_replace=1, num_key_value_heads=2,
                                            n_routed_experts=E, num_experts_per_tok=2, n_group=4, topk_group=2,
                                            n_shared_experts=1, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4,
                                            qk_rope_head_dim=4, v_head_dim=4), tf.DeepseekV3ForCausalLM),
        # expert groups every token keeps (topk_group = n_group): any renaming is exact, and vLLM 0.34.0 lays
        # such a model out round-robin where asked (several groups): the round_robin layout's test model
        "deepseek_v3_rr": (tf.DeepseekV3Config(**common, intermediate_size=16, moe_intermediate_size=8,
                                               num_hidden_layers=3, first_k_dense_replace=1, num_key_value_heads=2,
                                               n_routed_experts=E, num_experts_per_tok=2, n_group=4, topk_group=4,
                                               n_shared_experts=1, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4,
                                               qk_rope_head_dim=4, v_head_dim=4), tf.DeepseekV3ForCausalLM),
    }


def build(kind: str, out: Path, *, seed: int = 0, shard: str | None = None, stacked: bool = False):
    """Save a random tiny ``kind`` model to ``out``; ``shard`` (e.g. "20KB") makes several shards with an
    index; ``stacked`` saves the fused in-memory layout (``experts.gate_up_proj [E, 2I, H]``) instead of the
    per-expert one transformers writes. Returns the model (eval mode)."""
    import torch

    cfg, cls = configs()[kind]
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # random router bias: its rows must move with the experts
        for name, prm in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                prm.copy_(torch.randn_like(prm))
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn_like(buf))
    if stacked:
        from safetensors.torch import save_file

        out.mkdir(parents=True)
        model.config.save_pretrained(out)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
    else:
        kw = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(out, **kw)
    return model


def moe_layers(kind: str) -> tuple[int, ...]:
    cfg, _ = configs()[kind]
    first = getattr(cfg, "first_k_dense_replace", 0) or 0
    return tuple(range(first, cfg.num_hidden_layers))


def placement(kind: str, seed: int = 1, groups: int = 1) -> Placement:
    """A random replica-free placement of the tiny model on 4 GPUs; ``groups > 1`` keeps routing groups of
    ``E / groups`` experts whole (each group moves as one, its members shuffled)."""
    rng = np.random.default_rng(seed)
    layers = moe_layers(kind)
    rows = []
    size = E // groups
    for _ in layers:
        order = rng.permutation(groups)
        rows.append(np.concatenate([g * size + rng.permutation(size) for g in order]))
    return Placement(np.array(rows), GPUS, GPUS, kind, E, layers)


def routed(model, ids) -> tuple[object, dict]:
    """``(logits, {decoder layer: top-k indices [tokens, k]})`` of one forward pass."""
    import torch

    got: dict[int, object] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is None or not hasattr(layer.mlp, "experts"):
            continue
        hooks.append(gate.register_forward_hook(lambda m, a, o, i=i: got.__setitem__(i, o[2].clone())))
    with torch.no_grad():
        logits = model(ids).logits
    for h in hooks:
        h.remove()
    return logits, got
