"""Capture overhead: tokens/s of ``generate()`` on small random-weight MoE models with and without the
routing hooks of ``traces.capture.RoutingRecorder`` (in memory, and streaming a trace to disk).

Runs are interleaved (plain, hooks, hooks+trace, plain, ...) so machine noise hits every variant alike;
the figures are medians over ``--repeats`` runs after one warm-up. Writes bench/results/capture_overhead.json.

    .venv/bin/python bench/capture_overhead.py [--repeats 5] [--device cpu] [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from _timing import RESULTS, write_result  # before any project import: sets sys.path

from moeplace.traces.capture import RoutingRecorder, left_pad

# Small models (4 layers, 32 experts top-4): each forward is cheap, so the per-step cost of the hooks weighs
# relatively more than on a real model; these overheads are an upper bound for larger models.
FAMILIES = {
    "qwen3_moe": {"model_type": "qwen3_moe", "num_hidden_layers": 4, "hidden_size": 128,
                  "intermediate_size": 256, "moe_intermediate_size": 64, "num_experts": 32,
                  "num_experts_per_tok": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 32},
    "deepseek_v3": {"model_type": "deepseek_v3", "num_hidden_layers": 4, "first_k_dense_replace": 1,
                    "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
                    "n_routed_experts": 32, "num_experts_per_tok": 4, "n_group": 8, "topk_group": 4,
                    "n_shared_experts": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
                    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
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


def timed(fn, spent: list[float]):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0
    return wrapper


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
        elif variant == "hooks-timed":  # time spent inside the hooks themselves (direct, load-robust)
            rec = RoutingRecorder(model)
            spent = [0.0]
            rec._pre_hook, rec._post_hook = timed(rec._pre_hook, spent), timed(rec._post_hook, spent)
            factory = rec._router_hook
            rec._router_hook = lambda layer: timed(factory(layer), spent)
            with rec:
                gen()
            if ids.is_cuda:
                torch.cuda.synchronize()
            return spent[0], rec.num_rows
        else:  # hooks + trace written to disk (atomic directory, zstd Parquet)
            with RoutingRecorder(model, tmp / "trace") as rec:
                gen()
            rows = rec.num_rows
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="2 repeats, 8 new tokens (smoke run)")
    ap.add_argument("--out", type=Path, default=RESULTS / "capture_overhead.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.new_tokens = 2, 8
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
            hook_share = []
            for _ in range(args.repeats):
                for v in variants:
                    dt, r = run_once(model, ids, mask, args.new_tokens, v, Path(td))
                    times[v].append(dt)
                    rows = r or rows
                t0 = time.perf_counter()
                spent, _ = run_once(model, ids, mask, args.new_tokens, "hooks-timed", Path(td))
                hook_share.append(spent / (time.perf_counter() - t0))
        med = {v: statistics.median(t) for v, t in times.items()}
        results[family] = {
            "prompt_tokens": prompt_tokens, "generated_tokens": gen_tokens, "rows_per_run": rows,
            "median_seconds": med,
            "generated_tokens_per_s": {v: gen_tokens / med[v] for v in variants},
            "all_tokens_per_s": {v: (prompt_tokens + gen_tokens) / med[v] for v in variants},
            "overhead_vs_plain": {v: med[v] / med["plain"] - 1.0 for v in variants if v != "plain"},
            # ratio of runs made back to back, median over repeats: robust to drift in machine load
            "paired_overhead_vs_plain": {
                v: statistics.median(t / p - 1.0 for t, p in zip(times[v], times["plain"], strict=True))
                for v in variants if v != "plain"},
            "rows_per_s_with_trace": rows / med["hooks+trace"],
            # share of generate() wall time spent inside the recorder's hooks, median over repeats
            "hook_time_share": statistics.median(hook_share),
            "runs_seconds": times,
        }
        r = results[family]
        tps, pair = r["generated_tokens_per_s"], r["paired_overhead_vs_plain"]
        print(f"{family:12s} plain {tps['plain']:8.1f} gen tok/s | hooks {tps['hooks']:8.1f} "
              f"({100 * pair['hooks']:+.1f}% paired) | hooks+trace {tps['hooks+trace']:8.1f} "
              f"({100 * pair['hooks+trace']:+.1f}% paired) | time in hooks {100 * r['hook_time_share']:.2f}% "
              f"| {rows:,} rows/run")
    report = {
        "device": args.device, "torch": torch.__version__,
        "transformers": transformers.__version__, "threads": torch.get_num_threads(),
        "quick": args.quick, "batch": args.batch, "new_tokens": args.new_tokens,
        "repeats": args.repeats, "families": results,
    }
    write_result("capture_overhead", report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
