"""Benchmark of the moeplace optimizer against DeepSeek EPLB.

Workload: a synthetic K3 trace (``traces/synth/`` defaults: 5 domains, drift, skew 6) written once to
``bench/results/k3-trace``; 32 GPUs (4 x 8 H200), 32 redundant slots; vLLM rule unless said otherwise.
Every score comes from ``placement.evaluate.evaluate``. Prints the figures and writes
``bench/results/optimize.json``.

    .venv/bin/python bench/optimize.py [--tokens 60000] [--skip-scaling] [--layers N]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
from _timing import RESULTS, timed, write_result  # before any project import: sets sys.path

from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.model import load_model
from moeplace.placement.evaluate import TokenRouting, evaluate, index_trace
from moeplace.placement.optimizer import OptimizerConfig, solve_layer
from moeplace.placement.optimizer.layer import PARETO_SLACKS
from moeplace.placement.policies import PlacementProblem, get_policy
from moeplace.traces.format import trace_files
from moeplace.traces.synth import SynthConfig, synthesize

PARETO_LAYERS = (5, 30, 60, 85)
WINDOW_TOKENS = 4096


def ensure_trace(tokens: int) -> Path:
    out = RESULTS / f"k3-trace-{tokens}"
    if not out.exists():
        print(f"synthesizing {tokens} tokens of K3 routing -> {out}", flush=True)
        synthesize(load_model("kimi-k3"), SynthConfig(num_tokens=tokens, seed=0), out)
    return out


def token_routing(path: Path):
    """``(model, expert_ids [n, L, k] in step order, request_id [n], domain [n] int, domain names)``."""
    model, _prov, ids, lay, tok, rid = index_trace(path)
    n, L, k = len(rid), model.num_moe_layers, model.top_k
    routed = np.empty((n, L, k), dtype=np.uint16)
    routed[tok, lay] = ids
    # domain per token: from the first MoE layer's rows (one per token), same (request, position) keys
    names: list[str] = []
    dom_of_req: dict[int, int] = {}
    for f in trace_files(path):
        t = pq.read_table(f, columns=["request_id", "layer", "domain"])
        first = t.filter(pc.equal(t["layer"], model.moe_layers[0]))
        r = first["request_id"].to_numpy()
        d = first["domain"].to_pylist()
        for ri, di in zip(r.tolist(), d):
            if di not in names:
                names.append(di)
            dom_of_req[ri] = names.index(di)
    domain = np.array([dom_of_req[int(r)] for r in rid], dtype=np.int64)
    return model, routed, rid, domain, names


def window_loads(ids: np.ndarray, E: int, window_tokens: int) -> np.ndarray:
    """``[W, L, E]`` counts of consecutive windows of ``window_tokens`` tokens."""
    n, L, _ = ids.shape
    W = max(1, n // window_tokens)
    out = np.zeros((W, L, E))
    for w in range(W):
        chunk = ids[w * window_tokens:(w + 1) * window_tokens].astype(np.int64)
        key = np.arange(L)[None, :, None] * E + chunk
        out[w] = np.bincount(key.ravel(), minlength=L * E).reshape(L, E)
    return out


def group_loads(ids: np.ndarray, groups: np.ndarray, num_groups: int, E: int) -> np.ndarray:
    L = ids.shape[1]
    out = np.zeros((num_groups, L, E))
    for d in range(num_groups):
        sel = ids[groups == d].astype(np.int64)
        key = np.arange(L)[None, :, None] * E + sel
        out[d] = np.bincount(key.ravel(), minlength=L * E).reshape(L, E)
    return out


def plan(policy: str, loads, model, cluster, R, seed=0, samples=None, time_limit=None, **options):
    prob = PlacementProblem(np.asarray(loads, dtype=np.float64), model, cluster, R, rule=options.pop("engine", "vllm"),
                            seed=seed, time_limit=time_limit, samples=samples, options=options)
    with timed() as t:
        pl = get_policy(policy)(prob)
    return pl, t.wall_s


def bal(pl, loads, engine="vllm"):
    m = evaluate(pl, np.asarray(loads, dtype=np.float64), engine)
    return m


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=60000)
    ap.add_argument("--skip-scaling", action="store_true")
    ap.add_argument("--skip-traffic", action="store_true")
    ap.add_argument("--skip-robust", action="store_true", help="skip the --robust runs (the slow ones)")
    ap.add_argument("--out", default="optimize.json", help="file name under bench/results")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--traffic-time-limit", type=float, default=150.0,
                    help="hard budget of each traffic-objective run (s)")
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out: dict = {"tokens": args.tokens,
                 "skipped": [k for k in ("robust", "traffic", "scaling") if getattr(args, f"skip_{k}")]}
    trace = ensure_trace(args.tokens)
    model, ids, rid, domain, names = token_routing(trace)
    E = model.num_experts
    cluster = make_cluster(32)
    R = 32
    windows = window_loads(ids, E, WINDOW_TOKENS)
    W = windows.shape[0]
    n_plan = W // 2
    plan_w, held_w = windows[:n_plan], windows[n_plan:]
    out["windows"] = {"plan": n_plan, "held_out": W - n_plan, "window_tokens": WINDOW_TOKENS,
                      "domains": names}
    print(f"K3 trace {args.tokens} tokens, {W} windows ({n_plan} planned, {W - n_plan} held out), "
          f"domains {names}", flush=True)

    # ---- targets 1, 2, 5 (32 GPUs) and 6: plain balance, plan windows -> held-out windows
    rows = {}
    for name, pol, opts in (("eplb", "eplb", {}), ("moeplace", "moeplace", {"workers": args.workers}),
                            ("moeplace --robust", "moeplace", {"robust": True, "workers": args.workers})):
        if args.skip_robust and opts.get("robust"):
            continue
        pl, secs = plan(pol, plan_w, model, cluster, R, **opts)
        m_sum = bal(pl, plan_w.sum(0, keepdims=True))
        m_pw = bal(pl, plan_w)
        m_ho = bal(pl, held_w)
        rows[name] = {"seconds": secs, "plan_balancedness": m_sum.balancedness,
                      "plan_bound_balancedness": m_sum.bound_balancedness_budget,
                      "plan_gap_budget": m_sum.gap_budget,
                      "plan_windows_mean": m_pw.balancedness, "plan_windows_worst": m_pw.worst_window_balancedness,
                      "held_out_mean": m_ho.balancedness, "held_out_worst": m_ho.worst_window_balancedness,
                      "duplicates_on_gpu": int(pl.duplicate_on_gpu().sum())}
        if pol == "moeplace":
            rows[name]["summary"] = pl.provenance["params"]["summary"]
        if name == "moeplace":
            pl_again, _ = plan(pol, plan_w, model, cluster, R, **opts)
            out["deterministic"] = bool(np.array_equal(pl.phy2log, pl_again.phy2log))
        print(f"{name:18s} {secs:6.1f}s plan {m_sum.balancedness:.4f} (ceiling {m_sum.bound_balancedness_budget:.4f}, "
              f"gap {m_sum.gap_budget:.4%})  plan-windows mean {m_pw.balancedness:.4f} worst "
              f"{m_pw.worst_window_balancedness:.4f}  held-out mean {m_ho.balancedness:.4f} worst "
              f"{m_ho.worst_window_balancedness:.4f}", flush=True)
    out["balance"] = rows
    print(f"deterministic (same seed, same input): {out['deterministic']}", flush=True)

    # ---- target 3: robust over the domains
    dom = group_loads(ids, domain, len(names), E)
    if args.skip_robust:
        dom = dom[:0]
    rob = {}
    for name, pol, data, opts in (("eplb (union)", "eplb", dom.sum(0, keepdims=True), {}),
                                  ("moeplace (union)", "moeplace", dom.sum(0, keepdims=True),
                                   {"workers": args.workers}),
                                  ("moeplace --robust", "moeplace", dom, {"robust": True, "workers": args.workers})):
        if not len(dom):
            break
        pl, secs = plan(pol, data, model, cluster, R, **opts)
        m = bal(pl, dom)
        rob[name] = {"seconds": secs, "domain_balancedness": m.window_balancedness.tolist(),
                     "worst_domain": m.worst_window_balancedness, "mean": m.balancedness}
        print(f"{name:20s} per-domain {np.round(m.window_balancedness, 4).tolist()} worst "
              f"{m.worst_window_balancedness:.4f} ({secs:.1f}s)", flush=True)
    out["robust_domains"] = rob

    # ---- target 4: traffic (token-level, exact): plan on the first half's tokens, score on the second
    if not args.skip_traffic:
        n = ids.shape[0]
        half = n // 2
        # the optimizer's default sample size (max_traffic_samples), evenly spaced over the planning half
        sample_idx = np.linspace(0, half - 1, OptimizerConfig().max_traffic_samples).astype(np.int64)
        samples = ids[sample_idx].astype(np.int64)
        held = TokenRouting(ids[half:].astype(np.int64), rid[half:].astype(np.int64), model)
        out["traffic_samples"] = len(samples)
        out["pareto_layers"] = list(PARETO_LAYERS)
        tr = {}
        eplb_bal = rows["eplb"]["plan_balancedness"]
        for name, pol, opts in (("eplb", "eplb", {}), ("moeplace", "moeplace", {"workers": args.workers}),
                                ("moeplace --objective traffic", "moeplace",
                                 {"objective": "traffic", "balance_floor": eplb_bal - 0.01,
                                  "workers": args.workers}),
                                ("moeplace --objective balance+traffic", "moeplace",
                                 {"objective": "balance+traffic", "traffic_weight": 10.0,
                                  "balance_floor": eplb_bal - 0.01, "workers": args.workers})):
            pl, secs = plan(pol, plan_w, model, cluster, R, samples=samples if pol == "moeplace" else None,
                            time_limit=args.traffic_time_limit if "objective" in opts else None, **opts)
            m_tok = evaluate(pl, held, "vllm")
            m_ld = bal(pl, plan_w.sum(0, keepdims=True))
            m_ho = bal(pl, held_w)
            tr[name] = {"seconds": secs, "remote_nodes_per_token": m_tok.remote_per_token["node"],
                        "remote_gpus_per_token": m_tok.remote_per_token["gpu"],
                        "cross_node_share": m_tok.cross_node_share, "plan_balancedness": m_ld.balancedness,
                        "held_out_balancedness": m_ho.balancedness}
            print(f"{name:38s} remote nodes/token/layer {m_tok.remote_per_token['node']:.4f}  "
                  f"cross-node share {m_tok.cross_node_share:.4f}  plan bal {m_ld.balancedness:.4f}  "
                  f"held-out bal {m_ho.balancedness:.4f} ({secs:.1f}s)", flush=True)
        base = tr["eplb"]["remote_nodes_per_token"]
        for row in tr.values():
            row["remote_nodes_vs_eplb"] = row["remote_nodes_per_token"] / base - 1.0
        # the frontier (planned span, balancedness) on a few layers: floors at the balance plan's minus slack
        front = []
        for lay in PARETO_LAYERS:
            r = solve_layer(lay, plan_w[:, lay, :], E + R, 32, 8, OptimizerConfig(objective="traffic", pareto=True),
                            time.time() + 120, samples_nk=samples[:, lay, :])
            front.append(r.pareto)
        tr["pareto"] = [{"floor_slack": PARETO_SLACKS[i],
                         "balancedness": float(np.mean([f[i]["balancedness"] for f in front])),
                         "span_nodes_per_token": float(np.mean([f[i]["span"] for f in front]))}
                        for i in range(len(PARETO_SLACKS))]
        print("frontier (mean over layers " + ",".join(map(str, PARETO_LAYERS)) + "): " + "  ".join(
            f"bal {p['balancedness']:.4f} span {p['span_nodes_per_token']:.3f}" for p in tr["pareto"]), flush=True)
        out["traffic"] = tr

    # ---- target 5: time for the whole model at 32, 64, 128, 256 GPUs
    if not args.skip_scaling:
        sc = {}
        for G in (32, 64, 128, 256):
            R_g = next(r for r in range(32, 10 ** 4) if (E + r) % G == 0)
            cl = make_cluster(G)
            pl, secs = plan("moeplace", plan_w, model, cl, R_g, workers=args.workers)
            m = bal(pl, plan_w.sum(0, keepdims=True))
            sc[G] = {"redundant": R_g, "seconds": secs, "balancedness": m.balancedness,
                     "ceiling": m.bound_balancedness_budget}
            print(f"{G:4d} GPUs R={R_g:4d}: {secs:6.1f}s  balancedness {m.balancedness:.4f} "
                  f"(ceiling {m.bound_balancedness_budget:.4f})", flush=True)
        out["scaling"] = sc

    out["traffic_time_limit_s"] = args.traffic_time_limit
    write_result("optimize", out, RESULTS / args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
