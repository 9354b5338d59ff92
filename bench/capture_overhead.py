"""Capture overhead: tokens/s of ``generate()`` on small random-weight MoE models with and without the
routing hooks of ``traces.capture.RoutingRecorder`` (in memory, and streaming a trace to disk).

Runs are interleaved (plain, hooks, hooks+trace, plain, ...) so machine noise hits every variant alike;
the figures are medians over ``--repeats`` runs after one warm-up. Writes bench/results/capture_overhead.json.

    .venv/bin/python bench/capture_overhead.py [--repeats 5] [--device cpu] [--quick]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from traces.capture import RoutingRecorder, left_pad  # noqa: E402
from traces.files import write_text_atomic  # noqa: E402

# Small but not toy-small: enough expert work per token that the hooks are measured against real compute.
FAMILIES = {
    "qwen3_moe": {"model_type": "qwen3_moe", "num_hidden_layers": 8, "hidden_size": 256,
                  "intermediate_size": 512, "moe_intermediate_size": 128, "num_experts": 64,
                  "num_experts_per_tok": 8, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32},
    "deepseek_v3": {"model_type": "deepseek_v3", "num_hidden_layers": 8, "first_k_dense_replace": 1,
                    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
                    "n_routed_experts": 64, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
                    "n_shared_experts": 1, "num_attention_heads": 8, "num_key_value_heads": 8,
                    "q_lora_rank": 64, "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
                    "v_head_dim": 32},
}
COMMON = {"vocab_size": 1024, "max_position_embeddings": 2048, "pad_token_id": 0, "bos_token_id": 1,
          "eos_token_id": None}


def build(family: str, device: str):
    d = {**COMMON, **FAMILIES[family]}
    cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(device).eval()


def prompts(batch: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 64, (batch,), generator=g)
    return [torch.randint(3, 1024, (int(n),), generator=g).tolist() for n in lengths]


def run_once(model, ids, mask, new_tokens: int, variant: str, tmp: Path) -> tuple[float, int]:
    def gen():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0)

    if ids.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    rows = 0
    with torch.inference_mode():
        if variant == "plain":
            gen()
        elif variant == "hooks":
            with RoutingRecorder(model) as rec:
                gen()
            rows = rec.num_rows
        else:  # hooks + trace written to disk (atomic directory, zstd Parquet)
            with RoutingRecorder(model, tmp / "trace") as rec:
                gen()
            rows = rec.num_rows
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="2 repeats, 8 new tokens (smoke run)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "capture_overhead.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.new_tokens = 2, 8
    torch.set_num_threads(max(1, torch.get_num_threads()))
    variants = ("plain", "hooks", "hooks+trace")
    results = {}
    for family in FAMILIES:
        model = build(family, args.device)
        enc = prompts(args.batch)
        ids, mask = left_pad(enc, 0)
        ids, mask = ids.to(args.device), mask.to(args.device)
        prompt_tokens = sum(map(len, enc))
        gen_tokens = args.batch * args.new_tokens
        with tempfile.TemporaryDirectory() as td:
            run_once(model, ids, mask, args.new_tokens, "plain", Path(td))  # warm-up
            times = {v: [] for v in variants}
            rows = 0
            for _ in range(args.repeats):
                for v in variants:
                    dt, r = run_once(model, ids, mask, args.new_tokens, v, Path(td))
                    times[v].append(dt)
                    rows = r or rows
        med = {v: statistics.median(t) for v, t in times.items()}
        results[family] = {
            "prompt_tokens": prompt_tokens, "generated_tokens": gen_tokens, "rows_per_run": rows,
            "median_seconds": med,
            "generated_tokens_per_s": {v: gen_tokens / med[v] for v in variants},
            "all_tokens_per_s": {v: (prompt_tokens + gen_tokens) / med[v] for v in variants},
            "overhead_vs_plain": {v: med[v] / med["plain"] - 1.0 for v in variants if v != "plain"},
            "rows_per_s_with_trace": rows / med["hooks+trace"],
            "runs_seconds": times,
        }
        r = results[family]
        print(f"{family:12s} plain {r['generated_tokens_per_s']['plain']:8.1f} gen tok/s | "
              f"hooks {r['generated_tokens_per_s']['hooks']:8.1f} ({100 * r['overhead_vs_plain']['hooks']:+.1f}%) | "
              f"hooks+trace {r['generated_tokens_per_s']['hooks+trace']:8.1f} "
              f"({100 * r['overhead_vs_plain']['hooks+trace']:+.1f}%) | {rows:,} rows/run")
    report = {
        "bench": "capture_overhead", "device": args.device, "torch": torch.__version__,
        "transformers": transformers.__version__, "threads": torch.get_num_threads(),
        "machine": platform.machine(), "batch": args.batch, "new_tokens": args.new_tokens,
        "repeats": args.repeats, "families": results,
    }
    write_text_atomic(args.out, json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
