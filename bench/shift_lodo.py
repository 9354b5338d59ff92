"""Leave-one-domain-out on the project's own data: how well placements planned on some workloads balance
an unseen one, how well ``place optimize``'s shift estimate predicts that, and what ``--robust`` (and its
envelope hedge) keeps over EPLB.

Data (made here, deterministic):

- ``synthetic``: a ``place trace synth`` trace of Qwen3-30B-A3B's shape (48 MoE layers x 128 experts,
  top-8), 4 domains, drift 1 (each phase one domain); scenarios = the windows' dominant domain tags.
- ``captured``: ``place trace capture`` of a small random-weight Qwen3-MoE (4 MoE layers x 64 experts,
  top-4) on four prompt domains (code, prose, digits, non-ASCII text), one trace per domain;
  scenarios = the input files.

For each domain ``d``: the planning data is every other domain. ``compare_policies(..., plan_fraction=1,
shift=True)`` plans each policy on it and estimates, by leave-one-scenario-out *within* the planning
domains, the balancedness to expect on an unseen workload; the placement is then scored on ``d`` (the
realized unseen balancedness). Prints a table and writes ``bench/results/shift_lodo.json``.

    .venv/bin/python bench/shift_lodo.py [--tokens 60000] [--time-limit 4] [--skip-captured]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from foundation.cluster import make_cluster
from foundation.files import write_text_atomic
from foundation.model import load_model
from placement.compare import compare_policies, routing_windows, scenarios
from placement.evaluate import evaluate
from traces.synth import SynthConfig, synthesize

RESULTS = ROOT / "bench" / "results"
VARIANTS = {  # name -> (policy, options)
    "eplb": ("eplb", {}),
    "moeplace": ("moeplace", {}),
    "robust": ("moeplace", {"robust": True}),
    "robust+envelope": ("moeplace", {"robust": True, "envelope": True}),
}
DOMAIN_PROMPTS = {
    "code": ["def f(x):\n    return x * {i} + 1", "for (int j = 0; j < {i}; ++j) {{ a[j] = b[j]; }}",
             "import numpy as np; y = np.zeros(({i}, 3))", "SELECT id, name FROM t WHERE k = {i};"],
    "prose": ["The river ran quietly past the old mill on day {i}.",
              "She said that the meeting would start at noon, {i} minutes late.",
              "Once upon a time there lived a king who had {i} daughters.",
              "Weather today: cloudy with a chance of rain in the afternoon {i}."],
    "digits": ["{i} {i}7 3.14159 2.71828 1.41421 {i}0", "2026-12-0{i} 12:34:56 +0000 {i}{i}",
               "{i} + {i} = {i}{i}; 17 * 23 = 391", "0x{i}F 0b1011 0o755 1e-{i}"],
    "unicode": ["Größe über {i} Äpfel — ça coûte cher", "東京都 {i} 番地 の 天気 は 晴れ",
                "Привет, как дела? {i} рублей", "αβγ δεζ ηθι {i} κλμ"],
}


def synthetic_loads(tokens: int, window_tokens: int):
    model = load_model("qwen3-30b-a3b")
    path = RESULTS / f"qwen-lodo-{tokens}"
    if not path.exists():
        print(f"synthesizing {tokens} tokens -> {path}", flush=True)
        synthesize(model, SynthConfig(num_tokens=tokens, seed=3, num_domains=4, drift=1.0, drift_phases=4), path)
    return routing_windows([path], window_tokens=window_tokens)


def captured_loads(window_tokens: int):
    import transformers  # optional: the [capture] extra

    from traces.capture import CaptureConfig, run_capture

    base = RESULTS / "captured-lodo"
    cfg_path = base / "config.json"
    base.mkdir(parents=True, exist_ok=True)
    if not cfg_path.exists():
        cfg = transformers.AutoConfig.for_model(
            "qwen3_moe", vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512, intermediate_size=96, num_hidden_layers=4,
            num_experts=64, num_experts_per_tok=4, moe_intermediate_size=16, norm_topk_prob=True,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
        cfg.to_json_file(str(cfg_path))
    paths = []
    for dom, templates in DOMAIN_PROMPTS.items():
        out = base / dom
        if not out.exists():
            prompts = base / f"{dom}.txt"
            prompts.write_text("\n".join(t.format(i=i) for i in range(1, 25) for t in templates) + "\n")
            run_capture(CaptureConfig(hf_config=cfg_path, prompts=prompts, out=out, max_new_tokens=24,
                                      batch_size=16, seed=0, sample=True, ignore_eos=True, domain=dom))
        paths.append(out)
    return routing_windows(paths, window_tokens=window_tokens)


def lodo(loads, cluster, num_redundant: int, time_limit: float) -> dict:
    ids, names, method = scenarios(loads)
    out = {"method": method, "scenarios": names, "variants": {}}
    for vname, (policy, opts) in VARIANTS.items():
        rows = []
        for d in range(len(names)):
            train = np.flatnonzero(ids != d)
            test = np.flatnonzero(ids == d)
            t0 = time.perf_counter()
            cmp = compare_policies(loads.select(train), cluster, num_redundant=num_redundant, policies=[policy],
                                   plan_fraction=1.0, time_limit=time_limit, options={"workers": 1, **opts},
                                   shift=True)
            r = cmp.results[0]
            realized = evaluate(r.placement, loads.counts[test].astype(np.float64), model=loads.model)
            rows.append({"held_out": names[d], "in_sample": r.plan.balancedness,
                         "estimate_mean": r.shift["mean"], "estimate_worst": r.shift["worst"],
                         "realized": realized.balancedness, "realized_worst_window": realized.worst_window_balancedness,
                         "seconds": time.perf_counter() - t0})
            print(f"  {vname:16s} unseen {names[d]:10s} in-sample {rows[-1]['in_sample']:.4f}  estimate mean "
                  f"{rows[-1]['estimate_mean']:.4f} worst {rows[-1]['estimate_worst']:.4f}  realized "
                  f"{rows[-1]['realized']:.4f}", flush=True)
        real = np.array([x["realized"] for x in rows])
        out["variants"][vname] = {
            "rows": rows,
            "in_sample_mean": float(np.mean([x["in_sample"] for x in rows])),
            "estimate_mean": float(np.mean([x["estimate_mean"] for x in rows])),
            "estimate_worst_mean": float(np.mean([x["estimate_worst"] for x in rows])),
            "realized_mean": float(real.mean()), "realized_worst": float(real.min()),
            "estimate_abs_error_mean": float(np.mean([abs(x["estimate_mean"] - x["realized"]) for x in rows])),
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=60000)
    ap.add_argument("--window-tokens", type=int, default=4096)
    ap.add_argument("--time-limit", type=float, default=4.0, help="seconds per moeplace plan")
    ap.add_argument("--skip-captured", action="store_true")
    ap.add_argument("--skip-synthetic", action="store_true")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of "
                    + ", ".join(VARIANTS))
    args = ap.parse_args()
    for v in set(VARIANTS) - set(args.variants.split(",")):
        VARIANTS.pop(v)
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {}
    if not args.skip_synthetic:
        print("synthetic (Qwen3-30B-A3B shape, 16 GPUs = 4 x 4, R = 16):", flush=True)
        result["synthetic"] = lodo(synthetic_loads(args.tokens, args.window_tokens), make_cluster(16, "h200", 4),
                                   16, args.time_limit)
    if not args.skip_captured:
        print("captured (random-weight Qwen3-MoE, 64 experts, 8 GPUs = 2 x 4, R = 8):", flush=True)
        result["captured"] = lodo(captured_loads(256), make_cluster(8, "h200", 4), 8, args.time_limit)
    print()
    print(f"{'data':10s} {'variant':16s} {'in-sample':>9s} {'est mean':>8s} {'est worst':>9s} {'real mean':>9s} "
          f"{'real worst':>10s} {'|err|':>6s}")
    for data, r in result.items():
        for v, s in r["variants"].items():
            print(f"{data:10s} {v:16s} {s['in_sample_mean']:9.4f} {s['estimate_mean']:8.4f} "
                  f"{s['estimate_worst_mean']:9.4f} {s['realized_mean']:9.4f} {s['realized_worst']:10.4f} "
                  f"{s['estimate_abs_error_mean']:6.4f}")
    # runs of some datasets / variants update the file's other entries instead of dropping them
    path = RESULTS / "shift_lodo.json"
    merged = json.loads(path.read_text()) if path.exists() else {}
    for data, r in result.items():
        old = merged.get(data, {"variants": {}})
        merged[data] = {**r, "variants": {**old.get("variants", {}), **r["variants"]}}
    write_text_atomic(path, json.dumps(merged, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
