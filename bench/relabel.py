"""Relabelling speed: `place export --format checkpoint` on a generated K3-shaped checkpoint (names and dtypes
as K3's: ``experts.{id}.w1/w2/w3.weight_packed`` uint8 + ``weight_scale``, router ``gate.weight`` and
``e_score_correction_bias``; random bytes), against a plain byte copy of the same files.

    python bench/relabel.py [--layers 4] [--experts 64] [--mb-per-expert 2]   # prints, writes bench/results/relabel.json
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def generate(root: Path, layers: int, experts: int, mb: float, shards: int) -> int:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    hidden = 512
    per = int(mb * 2**20 / 3)  # bytes per projection
    names: dict[str, str] = {}
    layer_ids = list(range(1, layers + 1))
    for s in range(shards):
        part = {}
        for li in layer_ids[s::shards]:
            pre = f"language_model.model.layers.{li}.mlp."
            part[pre + "gate.weight"] = rng.standard_normal((experts, hidden), dtype=np.float32)
            part[pre + "gate.e_score_correction_bias"] = rng.standard_normal(experts, dtype=np.float32)
            part[f"language_model.model.layers.{li}.self_attn.o_proj.weight"] = rng.standard_normal((hidden, hidden),
                                                                                                   dtype=np.float32)
            for e in range(experts):
                for w in ("w1", "w2", "w3"):
                    part[f"{pre}experts.{e}.{w}.weight_packed"] = rng.integers(0, 255, per - per // 16, np.uint8)
                    part[f"{pre}experts.{e}.{w}.weight_scale"] = rng.integers(0, 255, per // 16, np.uint8)
        fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(root / fn))
        names.update({k: fn for k in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
    cfg = {"model_type": "kimi_k3", "num_hidden_layers": layers + 1, "hidden_size": hidden, "n_routed_experts": experts,
           "num_experts_per_token": 4, "first_k_dense_replace": 1, "moe_intermediate_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
           "qk_rope_head_dim": 8, "v_head_dim": 8, "vocab_size": 1000, "q_lora_rank": 16}
    (root / "config.json").write_text(json.dumps(cfg))
    return sum(f.stat().st_size for f in root.glob("*.safetensors"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--mb-per-expert", type=float, default=2.0)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--gpus", type=int, default=8)
    a = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from moeplace.placement.export import checkpoint as ckpt
    from moeplace.placement.record import Placement
    from moeplace.placement.relabel import CONTIGUOUS

    with tempfile.TemporaryDirectory(dir=REPO / "bench") as tmp:
        src = Path(tmp) / "src"
        size = generate(src, a.layers, a.experts, a.mb_per_expert, a.shards)
        rng = np.random.default_rng(1)
        p = Placement(np.stack([rng.permutation(a.experts) for _ in range(a.layers)]), a.gpus, a.gpus, "bench",
                      a.experts, tuple(range(1, a.layers + 1)))
        p.save(Path(tmp) / "p.json")
        t = time.perf_counter()
        ck = ckpt.scan(src)
        plan = ckpt.plan(ck, p, CONTIGUOUS)
        plan_s = time.perf_counter() - t
        t = time.perf_counter()
        man = ckpt.write_checkpoint(ck, plan, p, Path(tmp) / "p.json", Path(tmp) / "dst")
        write_s = time.perf_counter() - t
        t = time.perf_counter()
        for s in ck.shards:
            ckpt.sha256_file(src / s)
        sha_s = time.perf_counter() - t
        t = time.perf_counter()
        shutil.copytree(src, Path(tmp) / "copy")
        copy_s = time.perf_counter() - t
        assert all(v["how"] == "rewritten" for v in man["shards"].values())
    mb = size / 1e6
    res = {"checkpoint_mb": round(mb, 1), "layers": a.layers, "experts": a.experts, "shards": a.shards,
           "scan_and_plan_s": round(plan_s, 2), "relabel_s": round(write_s, 2),
           "relabel_mb_per_s": round(mb / write_s, 1), "of_which_source_sha256_s": round(sha_s, 2),
           "relabel_without_hash_mb_per_s": round(mb / max(write_s - sha_s, 1e-9), 1),
           "plain_copy_s": round(copy_s, 2), "plain_copy_mb_per_s": round(mb / copy_s, 1),
           "load_average": round(__import__("os").getloadavg()[0], 1),
           "note": "relabel = one sha256 pass over every source shard (the manifest) + the rewrite (kernel "
                   "copy_file_range of each tensor's byte range); plain copy = shutil.copytree of the same files"}
    print(json.dumps(res, indent=1))
    out = REPO / "bench" / "results" / "relabel.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
