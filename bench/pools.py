"""Per-pool placements measured: does a decode pool gain from a placement planned for decode, and a prefill
pool from one planned on prompt tokens, against EPLB, the engines' defaults and one shared placement?

Two inputs, each split in file order: policies plan on the tokens before the middle, every figure is scored
on the tokens after it (held out).

- **K3-shaped**: a synthetic Kimi K3 trace (896 experts, top-16, K3's routing statistics) of 8 of its 92 MoE
  layers (evenly spaced; the simulator routes the others like their nearest held layer), 1 M tokens of short
  requests (many requests, so decode steps of 16 x 256 sequences can be formed from held-out ones).
- **captured**: the routing of a tiny random-weight OLMoE-style model (64 experts, top-8, 2 MoE layers)
  generating from 1,600 prompts on CPU (``place trace capture``'s code), the kind of capture the tests make.

Decode pool: DEP16 (16 attention-DP ranks of one GPU, EP16; for the captured model's 64 experts DEP4, so that
a GPU holds 16 of them as a K3 GPU holds 56) at 4, 16, 64 and 256 running sequences per DP rank. Policies: the engines' defaults (vLLM ``linear``, ``round_robin``), EPLB and moeplace's token-balance
optimizer on the planning decode tokens, **shared** (moeplace's token-balance optimizer on the planning tokens
of both phases: the one placement a co-located deployment would use), and **moeplace-decode** planned for each
batch. Figures on held-out decode steps (``placement.decode``): the slots the busiest GPU reads per step
(``act max``), its max / mean over GPUs, and tokens per GPU max / mean. For K3, the simulated decode-pool
TPOT of moeplace-decode, EPLB, shared and ``linear`` (``place simulate --phase decode``, replay routing of the
held-out requests, GB300, the roofline cost model, whose expert time counts the distinct experts each GPU
reads).

Prefill pool: TEP8 on one GB300 NVLink domain (balance) and TP8 x DP2 on 2 x 8 H200 (balance and cross-node
bytes): per-pool (moeplace on the planning prompt tokens), shared, EPLB, ``linear``; scored on the held-out
prompt tokens under vLLM's rule.

Prints the tables and writes bench/results/pools.json.

    .venv/bin/python bench/pools.py [--quick]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
from _timing import loadavg, timed, write_result  # before any project import: sets sys.path

from moeplace.cli.main import main as place
from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.model import load_model
from moeplace.placement.decode import decode_steps, read_phase_tokens, score_decode
from moeplace.placement.evaluate import evaluate
from moeplace.placement.policies import PlacementProblem, get_policy

BATCHES = (4, 16, 64, 256)
DECODE_GPUS = 16
RULE = "vllm"
SIM_POLICIES = ("moeplace-decode", "eplb", "shared", "linear")


def _place(argv: list[str]) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = place(argv)
    if rc != 0:
        sys.exit(f"place {' '.join(argv)} exited with {rc}")
    return buf.getvalue()


# ---------------------------------------------------------------------------- inputs
def k3_trace(d: Path, tokens: int) -> Path:
    k3 = load_model("kimi-k3")
    held = [k3.moe_layers[i] for i in range(0, k3.num_moe_layers, 12)]  # 8 evenly spaced MoE layers
    spec = d / "k3-8-layers.json"
    spec.write_text(k3.restrict(held).to_json())
    out = d / "k3"
    _place(["trace", "synth", "--model", str(spec), "--tokens", str(tokens), "--prompt-median", "16",
            "--output-median", "48", "--long-fraction", "0", "--max-prefill-tokens", "32", "--max-decode-tokens", "96",
            "--seed", "0", "--out", str(out), "--no-progress"])
    return out


def captured_trace(d: Path, prompts: int) -> Path:
    """A tiny random OLMoE-style model's routing, captured while it generates (CPU, float32)."""
    cfg = {"model_type": "olmoe", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": 64,
           "num_experts_per_tok": 8, "norm_topk_prob": False, "max_position_embeddings": 256, "pad_token_id": 0,
           "bos_token_id": 1, "eos_token_id": 2}
    (d / "tiny-olmoe").mkdir()
    (d / "tiny-olmoe" / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "sum", "code", "proof", "story", "list", "why", "how", "then"]
    lines = [" ".join(rng.choice(words, size=int(rng.integers(2, 12)))) for _ in range(prompts)]
    (d / "prompts.txt").write_text("\n".join(lines) + "\n")
    out = d / "captured"
    _place(["trace", "capture", "--hf-config", str(d / "tiny-olmoe" / "config.json"), "--prompts",
            str(d / "prompts.txt"), "--max-new-tokens", "40", "--ignore-eos", "--sample", "--batch-size", "64",
            "--out", str(out), "--no-progress"])
    return out


def _counts(pt, keep: np.ndarray) -> np.ndarray:
    """Expert counts ``[1, L, E]`` of the tokens ``keep`` (a boolean mask) of ``pt``."""
    L, E = pt.model.num_moe_layers, pt.model.num_experts
    ids = pt.expert_ids[keep].astype(np.int64)
    flat = (np.arange(L)[None, :, None] * E + ids).ravel()
    return np.bincount(flat, minlength=L * E).reshape(1, L, E).astype(np.float64)


def _plan(name: str, loads: np.ndarray, model, cluster, **options):
    prob = PlacementProblem(loads=loads, model=model, cluster=cluster, num_redundant=0, rule=RULE, seed=0,
                            time_limit=60.0 if name.startswith("moeplace") else None, options=options)
    return get_policy(name)(prob)


# ---------------------------------------------------------------------------- decode pool
MAX_DOUBLINGS = 3  # simulate_decode: a TPOT run's simulated seconds double at most this many times


def decode_figures(trace: Path, gpu: str, sim: bool, duration: float, gpus: int = DECODE_GPUS) -> dict:
    dec = read_phase_tokens(trace, "decode")
    pre = read_phase_tokens(trace, "prefill")
    cut = dec.source_tokens // 2
    model = dec.model
    cluster = make_cluster(gpus, gpu)
    plan_mask = dec.file_tokens < cut
    held = dec.take(np.flatnonzero(~plan_mask))
    loads = _counts(dec, plan_mask)
    both = loads + _counts(pre, pre.file_tokens < cut)
    fixed = {"linear": _plan("linear", loads, model, cluster), "round_robin": _plan("round_robin", loads, model, cluster),
             "eplb": _plan("eplb", loads, model, cluster), "moeplace": _plan("moeplace", loads, model, cluster),
             "shared": _plan("moeplace", both, model, cluster)}
    out = {"gpus": gpus, "tokens": {"decode_planning": int(plan_mask.sum()), "decode_held_out": held.num_tokens,
                      "requests_held_out": int(np.unique(held.request_ids).size)}, "batches": {}}
    for b in BATCHES:
        steps = decode_steps(held, gpus, b)
        placements = {**fixed, "moeplace-decode": _plan("moeplace-decode", loads, model, cluster,
                                                        decode_step_tokens=gpus * b)}
        rows = {name: score_decode(pl, held, steps, RULE).to_dict() for name, pl in placements.items()}
        entry = {"steps": steps.num_steps, "tokens_per_step": steps.tokens_per_step, "rows": rows}
        if sim:
            entry["sim"] = simulate_decode(trace, {k: placements[k] for k in SIM_POLICIES}, cut, b, gpu, duration)
        out["batches"][str(b)] = entry
    return out


def simulate_decode(trace: Path, placements: dict, cut: int, batch: int, gpu: str, duration: float) -> dict:
    """The decode pool alone (``--phase decode``: requests arrive with their prompt's KV), each placement, on
    the held-out requests (replay routing), ``batch`` running sequences per DP rank. The run is sized by what it
    simulates, never by the clock: ``duration`` simulated seconds, doubled (at most :data:`MAX_DOUBLINGS` times)
    until every placement has finished at least one request per running slot (a whole wave of the closed loop,
    so its TPOT percentiles are over a full batch, however long a step is under the constants)."""
    with tempfile.TemporaryDirectory(prefix="bench-pools-") as tmp:
        args = []
        for name, pl in placements.items():
            pl = replace(pl, provenance={**pl.provenance, "planned_on": {"inputs": [str(trace)],
                                                                           "held_out_from_token": int(cut)}})
            f = Path(tmp) / f"{name}.json"
            pl.save(f)
            args += ["--placement", str(f)]
        slots = DECODE_GPUS * batch
        for _ in range(MAX_DOUBLINGS + 1):
            cmd = ["simulate", str(trace), *args, "--phase", "decode", "--gpus", str(DECODE_GPUS), "--gpu", gpu,
                   "--attention-tp", "1", "--max-seqs", str(batch), "--concurrency", str(slots),
                   "--isl", "1024", "--osl", "128", "--mode", "replay", "--duration", f"{duration:g}",
                   "--max-trace-tokens", "400000", "--no-progress", "--json"]
            doc = json.loads(_place(cmd))
            short = [s["label"] for s in doc["summaries"] if (s.get("requests_finished") or 0) < slots]
            if not short:
                break
            duration *= 2
        else:  # a TPOT of fewer requests than one wave is no figure: stop rather than write one
            raise SystemExit(f"error: bench/pools.py: {batch} sequences per rank, {', '.join(short)}: fewer than "
                             f"{slots} requests finished in {duration / 2:g} simulated seconds (one per running "
                             "slot); rerun with a longer --duration")
    keys = ("tpot_p50_s", "tpot_p99_s", "output_tok_s_per_gpu", "mean_decode_seqs", "experts_s", "requests_finished")
    return {"command": "place " + " ".join(c if not c.startswith(tempfile.gettempdir()) else Path(c).name for c in cmd),
            "duration_s": duration,
            "rows": {s["label"]: {k: s.get(k) for k in keys} for s in doc["summaries"]}}


# ---------------------------------------------------------------------------- prefill pool
def prefill_figures(trace: Path) -> dict:
    pre = read_phase_tokens(trace, "prefill")
    dec = read_phase_tokens(trace, "decode")
    cut = pre.source_tokens // 2
    model = pre.model
    plan_mask = pre.file_tokens < cut
    held = pre.take(np.flatnonzero(~plan_mask))
    loads = _counts(pre, plan_mask)
    both = loads + _counts(dec, dec.file_tokens < cut)
    held_counts = _counts(pre, ~plan_mask)
    sample = held.expert_ids[:: max(1, held.num_tokens // 8192)].astype(np.int32)
    out = {"tokens": {"prefill_planning": int(plan_mask.sum()), "prefill_held_out": held.num_tokens}, "pools": {}}
    for label, gpus, gpu, per_node in (("TEP8, 1 x 8 GB300 (one NVLink domain)", 8, "gb300-nvl72", None),
                                       ("TP8 x DP2, 2 x 8 H200", 16, "h200", 8)):
        cluster = make_cluster(gpus, gpu, per_node)
        placements = {"per-pool (moeplace on prompt tokens)": _plan("moeplace", loads, model, cluster),
                      "shared (moeplace on both phases)": _plan("moeplace", both, model, cluster),
                      "eplb": _plan("eplb", loads, model, cluster), "linear": _plan("linear", loads, model, cluster)}
        rows = {}
        for name, pl in placements.items():
            m = evaluate(pl, held_counts, RULE, model=model, cluster=cluster, samples=sample).summary()
            rows[name] = {"balancedness": m["balancedness"], "max_over_mean": m["max_over_mean"],
                          "nodes_per_token": m["remote_per_token"]["node"],
                          "remote_node_kib_per_token": m["dispatch_bytes_per_token"]["node"] / 1024}
        out["pools"][label] = rows
    return out


# ---------------------------------------------------------------------------- report
def print_decode(name: str, d: dict) -> None:
    t = d["tokens"]
    print(f"\n{name}: decode pool DEP{d['gpus']} ({t['decode_planning']:,} planning / {t['decode_held_out']:,} held-out decode "
          f"tokens, {t['requests_held_out']:,} held-out requests)")
    print(f"  {'seqs/rank':>9} {'policy':<16} {'act max':>8} {'vs eplb':>8} {'act max/mean':>12} {'tok max/mean':>12}"
          + ("   TPOT p50 ms  vs eplb" if any("sim" in e for e in d["batches"].values()) else ""))
    for b, e in d["batches"].items():
        ref = e["rows"]["eplb"]["active_max"]
        sim = e.get("sim", {}).get("rows", {})
        for pol, r in e["rows"].items():
            line = (f"  {b:>9} {pol:<16} {r['active_max']:>8.2f} {r['active_max'] / ref - 1:>+8.1%} "
                    f"{r['active_max_over_mean']:>12.4f} {r['token_max_over_mean']:>12.4f}")
            if pol in sim and sim[pol]["tpot_p50_s"]:
                base = sim["eplb"]["tpot_p50_s"]
                line += f"   {sim[pol]['tpot_p50_s'] * 1e3:>11.2f}  {sim[pol]['tpot_p50_s'] / base - 1:>+6.1%}"
            print(line)
        if sim:
            seqs = sim["eplb"]["mean_decode_seqs"]
            print(f"  {'':>9} (steps: {e['steps']} of {e['tokens_per_step']:.0f} tokens; simulated decode batch "
                  f"{seqs:.0f} sequences of {d['gpus'] * int(b)} asked)")
        else:
            print(f"  {'':>9} (steps: {e['steps']} of {e['tokens_per_step']:.0f} tokens)")


def print_prefill(name: str, d: dict) -> None:
    t = d["tokens"]
    print(f"\n{name}: prefill pool ({t['prefill_planning']:,} planning / {t['prefill_held_out']:,} held-out prompt tokens)")
    for label, rows in d["pools"].items():
        print(f"  {label}")
        print(f"    {'policy':<38} {'balancedness':>12} {'max/mean':>9} {'nodes/tok':>9} {'KiB/tok':>8}")
        for pol, r in rows.items():
            print(f"    {pol:<38} {r['balancedness']:>12.4f} {r['max_over_mean']:>9.4f} {r['nodes_per_token']:>9.3f} "
                  f"{r['remote_node_kib_per_token']:>8.1f}")


def main_(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller inputs, no TPOT simulation (a smoke run)")
    # the first try of each TPOT run; simulate_decode doubles it until a whole wave of requests has finished
    ap.add_argument("--duration", type=float, default=24.0,
                    help="simulated seconds of each TPOT run's first try, doubled until one request per running slot "
                         "has finished (default 24)")
    args = ap.parse_args(argv)
    result: dict = {"batches_per_dp_rank": list(BATCHES), "decode_gpus": DECODE_GPUS, "rule": RULE}
    with tempfile.TemporaryDirectory(prefix="bench-pools-in-") as tmp, timed() as t:
        d = Path(tmp)
        inputs = {"k3": (k3_trace(d, 200_000 if args.quick else 1_000_000), not args.quick, DECODE_GPUS),
                  "captured": (captured_trace(d, 300 if args.quick else 1600), False, 4)}
        for name, (trace, sim, gpus) in inputs.items():
            result[name] = {"decode": decode_figures(trace, "gb300-nvl72", sim, args.duration, gpus),
                            "prefill": prefill_figures(trace)}
            print_decode(name, result[name]["decode"])
            print_prefill(name, result[name]["prefill"])
    result["wall_s"] = t.wall_s
    result["loadavg"] = loadavg()
    result["quick"] = args.quick
    path = write_result("pools" if not args.quick else "pools_quick", result)
    print(f"\nwrote {path} ({t.wall_s:.0f} s; load average {loadavg()[0]:.1f}: the machine is shared)")
    return 0


if __name__ == "__main__":
    sys.exit(main_())
