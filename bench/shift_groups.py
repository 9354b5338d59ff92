"""Does the shift estimate's printed range hold on unseen workloads when related inputs are left out together?

The set-up the estimate is for: planning inputs come in related pairs (one dataset in two "languages"), the
production traffic is other datasets. Six domains, each in two related inputs (12 inputs); plan on three
domains (six inputs, ``--plan-fraction 1``), score the placement on the other three ("realized unseen":
mean over the three domains' balancedness, and the worst of them); then the other direction. The inputs
are grouped the way ``place optimize`` does without ``--group`` (by the similarity of their expert loads,
:func:`moeplace.placement.shift.group_inputs`); the estimate is leave-one-group-out over the planning
groups, every layer (or a sample with its error, as ``place optimize`` decides). Checked: the realized mean
lies in ``mean_range`` and the realized worst in ``worst_range``, and how wide each range is.

Data (made here, deterministic, under bench/results/ which git ignores):

- ``synthetic``: ``place trace synth`` of Qwen3-30B-A3B's shape (48 MoE layers x 128 experts, top-8),
  6 domains, each phase one domain, short requests (prompt median 128, output 64, so every domain
  has a few hundred); each domain's requests split by request id parity into two inputs (the
  two "languages": the same domain, other requests); 16 GPUs = 4 x 4, R = 16.
- ``captured``: ``place trace capture`` of a small random-weight Qwen3-MoE (4 MoE layers x 64 experts,
  top-4), six prompt domains, each domain's prompt templates split in two halves (two related inputs: e.g.
  Python vs C for code); 8 GPUs = 2 x 4, R = 8.

    .venv/bin/python bench/shift_groups.py [--tokens 48000] [--time-limit 2] [--policies eplb,robust]
        [--skip-captured] [--skip-synthetic]

Prints the table and writes ``bench/results/shift_groups.json``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
# bench/ itself off the path: bench/kernels.py would shadow the `kernels` package transformers imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.files import atomic_path, write_text_atomic
from moeplace.foundation.model import load_model
from moeplace.placement.compare import compare_policies
from moeplace.placement.evaluate import evaluate
from moeplace.placement.shift import scenarios
from moeplace.placement.windows import routing_windows
from moeplace.traces.synth import SynthConfig, synthesize

RESULTS = ROOT / "bench" / "results"
POLICIES = {"eplb": ("eplb", {}), "moeplace": ("moeplace", {}), "robust": ("moeplace", {"robust": True})}
PROMPTS = {  # two related halves per domain: templates 0-1 and 2-3
    "code": ["def f(x):\n    return x * {i} + 1", "import numpy as np; y = np.zeros(({i}, 3))",
             "for (int j = 0; j < {i}; ++j) {{ a[j] = b[j]; }}", "SELECT id, name FROM t WHERE k = {i};"],
    "prose": ["The river ran quietly past the old mill on day {i}.",
              "Once upon a time there lived a king who had {i} daughters.",
              "She said that the meeting would start at noon, {i} minutes late.",
              "Weather today: cloudy with a chance of rain in the afternoon {i}."],
    "digits": ["{i} {i}7 3.14159 2.71828 1.41421 {i}0", "{i} + {i} = {i}{i}; 17 * 23 = 391",
               "2026-12-0{i} 12:34:56 +0000 {i}{i}", "0x{i}F 0b1011 0o755 1e-{i}"],
    "unicode": ["Größe über {i} Äpfel — ça coûte cher", "Привет, как дела? {i} рублей",
                "東京都 {i} 番地 の 天気 は 晴れ", "αβγ δεζ ηθι {i} κλμ"],
    "markup": ['{{"id": {i}, "name": "x", "tags": ["a", "b"]}}', '<div class="row"><span>{i}</span></div>',
               "key_{i}: value\nlist:\n  - a\n  - b", "| col {i} | col b |\n|---|---|"],
    "chatter": ["hey!! how r u doing today lol {i}", "ok cool see u at {i} then :)",
                "what do you think about the new phone? {i} stars", "thanks so much, that helped a lot {i}"],
}


def synthetic_inputs(tokens: int) -> tuple[list[list[Path]], object]:
    """Per domain its two inputs (request id parity), and the model."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    model = load_model("qwen3-30b-a3b")
    path = RESULTS / f"qwen-groups-{tokens}"
    if not path.exists():
        print(f"synthesizing {tokens} tokens -> {path}", flush=True)
        synthesize(model, SynthConfig(num_tokens=tokens, seed=5, num_domains=6, drift=1.0, drift_phases=6,
                                      prompt_median=128, output_median=64), path)
    table = pq.read_table(path)
    out = []
    for dom in sorted(set(table.column("domain").to_pylist())):
        pair = []
        for half in (0, 1):
            p = RESULTS / f"qwen-groups-{tokens}-split" / f"{dom}-{'ab'[half]}"
            if not p.exists():
                mask = pc.and_(pc.equal(table["domain"], dom),
                               pc.equal(pc.bit_wise_and(table["request_id"], 1), half))
                with atomic_path(p, directory=True) as tmp:
                    pq.write_table(table.filter(mask), Path(tmp) / "part-00000.parquet")
            pair.append(p)
        out.append(pair)
    return out, model


def _shift_lodo():
    """bench/shift_lodo.py, loaded by path (bench/ is kept off sys.path here, see above)."""
    spec = importlib.util.spec_from_file_location("bench_shift_lodo", ROOT / "bench" / "shift_lodo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def captured_inputs() -> list[list[Path]]:

    from moeplace.traces.capture import CaptureConfig, run_capture

    base = RESULTS / "captured-groups"
    base.mkdir(parents=True, exist_ok=True)
    cfg_path = base / "config.json"
    _shift_lodo().write_tiny_moe_config(cfg_path)  # the same tiny model as the leave-one-domain-out bench
    out = []
    for dom, templates in PROMPTS.items():
        pair = []
        for half in (0, 1):
            name = f"{dom}-{'ab'[half]}"
            p = base / name
            if not p.exists():
                prompts = base / f"{name}.txt"
                prompts.write_text("\n".join(t.format(i=i) for i in range(1, 25)
                                             for t in templates[2 * half:2 * half + 2]) + "\n")
                run_capture(CaptureConfig(hf_config=cfg_path, prompts=prompts, out=p, max_new_tokens=24,
                                          batch_size=16, seed=0, sample=True, ignore_eos=True, domain=dom))
            pair.append(p)
        out.append(pair)
    return out


def run_direction(pairs, plan_doms, test_doms, cluster, R, window_tokens, policies, time_limit, grouping) -> dict:
    plan_paths = [p for d in plan_doms for p in pairs[d]]
    loads = routing_windows(plan_paths, window_tokens=window_tokens)
    if grouping == "given":  # what --group NAME=PATH,PATH does: each domain's two inputs are one group
        loads.provenance["input_groups"] = [p.name[:-2] for p in plan_paths]
    _, groups, method = scenarios(loads)
    tests = [routing_windows(pairs[d], window_tokens=window_tokens) for d in test_doms]
    rows = {}
    for pname in policies:
        policy, opts = POLICIES[pname]
        t0 = time.perf_counter()
        r = compare_policies(loads, cluster, num_redundant=R, policies=[policy], plan_fraction=1.0,
                             time_limit=time_limit if policy == "moeplace" else None,
                             options={"workers": 1, **opts}, shift=True).results[0]
        real = [evaluate(r.placement, t.counts.astype(np.float64), model=t.model).balancedness for t in tests]
        sh = r.shift
        rm, rw = float(np.mean(real)), float(np.min(real))
        rows[pname] = {"estimate_mean": sh["mean"], "estimate_worst": sh["worst"], "mean_range": sh["mean_range"],
                       "worst_range": sh["worst_range"], "layers": len(sh["layers"]),
                       "layer_sample_se": sh["layer_sample_se"], "per_fold": sh["per_scenario"],
                       "realized_mean": rm, "realized_worst": rw, "realized_per_domain": real,
                       "mean_inside": sh["mean_range"][0] <= rm <= sh["mean_range"][1],
                       "worst_inside": sh["worst_range"][0] <= rw <= sh["worst_range"][1],
                       "mean_width": sh["mean_range"][1] - sh["mean_range"][0],
                       "worst_width": sh["worst_range"][1] - sh["worst_range"][0],
                       "seconds": time.perf_counter() - t0}
        x = rows[pname]
        print(f"    {pname:9s} estimate {x['estimate_mean']:.3f} [{x['mean_range'][0]:.3f}, {x['mean_range'][1]:.3f}]"
              f" worst {x['estimate_worst']:.3f} [{x['worst_range'][0]:.3f}, {x['worst_range'][1]:.3f}]  realized "
              f"{rm:.3f} / {rw:.3f}  inside {x['mean_inside']}/{x['worst_inside']}", flush=True)
    return {"groups": groups, "method": method, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48000)
    ap.add_argument("--time-limit", type=float, default=2.0, help="seconds per moeplace comparison")
    ap.add_argument("--policies", default="eplb,robust")
    ap.add_argument("--skip-captured", action="store_true")
    ap.add_argument("--skip-synthetic", action="store_true")
    ap.add_argument("--grouping", default="given,auto",
                    help="given: each domain's two inputs as one group (--group); auto: place optimize's default "
                         "grouping by load similarity")
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    policies = args.policies.split(",")
    data = []
    if not args.skip_synthetic:
        pairs, _ = synthetic_inputs(args.tokens)
        data.append(("synthetic", pairs, make_cluster(16, "h200", 4), 16, 1024))
    if not args.skip_captured:
        data.append(("captured", captured_inputs(), make_cluster(8, "h200", 4), 8, 128))
    result = {"loadavg_start": os.getloadavg()[0], "policies": policies, "time_limit": args.time_limit}
    for name, pairs, cluster, R, wt in data:
        doms = [p[0].name[:-2] for p in pairs]
        result[name] = {"domains": doms, "directions": {}}
        for grouping in args.grouping.split(","):
            for a, b in ((range(3), range(3, 6)), (range(3, 6), range(3))):
                key = f"{grouping}: plan {'+'.join(doms[i] for i in a)} -> unseen {'+'.join(doms[i] for i in b)}"
                print(f"{name}: {key}", flush=True)
                out = run_direction(pairs, list(a), list(b), cluster, R, wt, policies, args.time_limit, grouping)
                print(f"    groups: {', '.join(out['groups'])}", flush=True)
                result[name]["directions"][key] = out
    result["loadavg_end"] = os.getloadavg()[0]
    write_text_atomic(RESULTS / "shift_groups.json", json.dumps(result, indent=1) + "\n")
    print("\n| data | grouping: direction | policy | estimate mean [range] | realized mean | estimate worst [range] | "
          "realized worst | inside |")
    print("|---|---|---|---|---|---|---|---|")
    for name, *_ in data:
        for key, out in result[name]["directions"].items():
            for p, x in out["rows"].items():
                print(f"| {name} | {key} | {p} | {x['estimate_mean']:.3f} [{x['mean_range'][0]:.3f}, "
                      f"{x['mean_range'][1]:.3f}] | {x['realized_mean']:.3f} | {x['estimate_worst']:.3f} "
                      f"[{x['worst_range'][0]:.3f}, {x['worst_range'][1]:.3f}] | {x['realized_worst']:.3f} | "
                      f"{'yes' if x['mean_inside'] else 'NO'} / {'yes' if x['worst_inside'] else 'NO'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
