"""A small checkpoint in Kimi K3's shape: what ``place demo`` relabels and ``bench/relabel.py`` times.

Real safetensors files and a real ``model.safetensors.index.json``, with K3's tensor names and quantization
layout at every MoE layer and expert of the model (92 x 896 for K3) but tiny, random tensors: per expert
``language_model.model.layers.{l}.mlp.experts.{e}.{w1,w2,w3}`` each with ``weight_packed`` (uint8, two FP4
values a byte), ``weight_scale`` (uint8 E8M0, one per 32 values) and ``weight_shape`` (int64 [2]) -- the
compressed-tensors pack-quantized layout -- plus the router ``gate.weight`` (BF16 [E, H]) and
``gate.e_score_correction_bias`` (FP32 [E]) and an attention projection per layer. ``config.json`` is a
``kimi_k3`` config whose ``quantization_config`` is compressed-tensors MXFP4 with K3-style ``ignore``
patterns. The bytes are random: it is a stand-in for moving K3's tensors, not a model to run.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import orjson

from moeplace.foundation.model import ModelSpec

PREFIX = "language_model.model.layers"
PROJECTIONS = ("w1", "w2", "w3")


def _config(model: ModelSpec, hidden: int, inter: int) -> dict:
    kda = [i + 1 for i, a in enumerate(model.attention) if a == "kda"]  # Kimi configs number layers from 1
    first = min(model.moe_layers)
    text = {
        "model_type": "kimi_k3", "name_or_path": model.name, "num_hidden_layers": model.num_layers,
        "hidden_size": hidden, "intermediate_size": 2 * inter, "moe_intermediate_size": inter,
        "num_experts": model.num_experts, "num_experts_per_token": model.top_k, "first_k_dense_replace": first,
        "num_shared_experts": model.num_shared_experts, "num_attention_heads": 4, "q_lora_rank": 16,
        "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "vocab_size": 1024,
        "max_position_embeddings": model.max_context, "num_expert_group": 1, "topk_group": 1,
        "moe_router_activation_func": "sigmoid", "routed_expert_hidden_size": hidden // 2,
        "linear_attn_config": {"kda_layers": kda, "num_heads": 4, "head_dim": 8, "short_conv_kernel_size": 4},
    }
    quant = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True}}},
             "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.gate$",
                        "re:vision_tower.*"]}
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text,
            "quantization_config": quant}


def _tensors(model: ModelSpec, layer: int, hidden: int, inter: int) -> list[tuple[str, str, list[int]]]:
    """``(name, dtype, shape)`` of one decoder layer's tensors."""
    pre = f"{PREFIX}.{layer}"
    out = [(f"{pre}.self_attn.o_proj.weight", "BF16", [hidden, hidden])]
    if layer not in model.moe_layers:
        return out
    E = model.num_experts
    out += [(f"{pre}.mlp.gate.weight", "BF16", [E, hidden]), (f"{pre}.mlp.gate.e_score_correction_bias", "F32", [E])]
    for e in range(E):
        for w in PROJECTIONS:
            rows, cols = (hidden // 2, inter) if w == "w2" else (inter, hidden // 2)  # latent MoE: H/2 wide
            out += [(f"{pre}.mlp.experts.{e}.{w}.weight_packed", "U8", [rows, cols // 2]),
                    (f"{pre}.mlp.experts.{e}.{w}.weight_scale", "U8", [rows, max(1, cols // 32)]),
                    (f"{pre}.mlp.experts.{e}.{w}.weight_shape", "I64", [2])]
    return out


_SIZE = {"BF16": 2, "F32": 4, "U8": 1, "I64": 8}


def write_k3_like(root: str | Path, model: ModelSpec, *, hidden: int = 16, inter: int = 8, shards: int = 8,
                  seed: int = 0) -> int:
    """Write the checkpoint into the new directory ``root``; returns the bytes of its shards. ``hidden`` /
    ``inter`` set the tensors' sizes (the byte size scales with ``hidden * inter``; K3's tensor count and
    names do not change); decoder layers are spread over ``shards`` files in order, as real checkpoints
    are."""
    root = Path(root)
    root.mkdir(parents=True)
    if hidden % 4 or hidden < 4 or inter % 2 or inter < 2:
        raise ValueError("hidden must be a multiple of 4 and inter of 2 (the latent width hidden/2 packs FP4 pairs)")
    rng = np.random.default_rng(seed)
    layers = list(range(model.num_layers))
    per = -(-len(layers) // shards)
    weight_map: dict[str, str] = {}
    total = 0
    n_files = -(-len(layers) // per)
    for s in range(n_files):
        fn = f"model-{s + 1:05d}-of-{n_files:05d}.safetensors"
        entries: dict[str, dict] = {"__metadata__": {"format": "pt"}}
        pos = 0
        shapes = []
        for li in layers[s * per:(s + 1) * per]:
            for name, dtype, shape in _tensors(model, li, hidden, inter):
                n = int(np.prod(shape)) * _SIZE[dtype]
                entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
                if name.endswith("weight_shape"):
                    shapes.append((pos, (hidden // 2, inter) if ".w2." in name else (inter, hidden // 2)))
                pos += n
                weight_map[name] = fn
        text = orjson.dumps(entries)  # 0.7 M entries for K3: orjson
        text += b" " * (-len(text) % 8)
        data = bytearray(rng.bytes(pos))
        for off, (rows, cols) in shapes:  # weight_shape holds the unpacked [rows, cols], not noise
            data[off:off + 16] = struct.pack("<qq", rows, cols)
        with open(root / fn, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            f.write(data)
        total += 8 + len(text) + pos
    (root / "model.safetensors.index.json").write_bytes(orjson.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        option=orjson.OPT_INDENT_2) + b"\n")
    (root / "config.json").write_text(json.dumps(_config(model, hidden, inter), indent=2) + "\n")
    return sum(os.path.getsize(root / f"model-{s + 1:05d}-of-{n_files:05d}.safetensors") for s in range(n_files))
