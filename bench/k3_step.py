"""Kimi K3's decode step before and after pricing it through its engines' kernels (sim/k3_kernels.py).

    python bench/k3_step.py

"Before": every layer floored at the generic kernel counts (sim.cost.KERNEL_BUILDS, unfused) x the kernel
floor, plus their gaps; "after": the K3 kernel list of the deployment's engine and layout, each kernel
priced at its own roofline (at least the floor), plus the gaps of the kernels along the critical path.
Both with the shipped constants, one decode iteration at a context of 8,192 + 512 tokens, routing balanced
in expectation (each GPU receives its share of the selections; touched experts by Poisson occupancy).
Then the event simulator on the README demo's cluster (32 H200, attention TP8; a 20k-token stationary
synthetic trace, ISL 2,048 / OSL 256, 150 simulated s) at concurrency 32 and 1,024, before and after.
Nothing here is compared with a published K3 figure. Writes bench/results/k3_step.json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "results" / "k3_step.json"
# (label, GPU, GPUs, attention TP, engine): the layouts K3's guides deploy (REFERENCE: vLLM's DEP16 decode on
# GB300, SGLang's TP16 / EP16 on 2 x 8 H200), vLLM TP8 x DP2 on B200, and the README demo's 32 H200 at TP8
DEPLOYMENTS = (("vLLM DEP16 (MegaMoE), GB300", "gb300-nvl72", 16, 1, "vllm"),
               ("vLLM TP8 x DP2, B200", "b200", 16, 8, "vllm"),
               ("SGLang TP16 / EP16, H200", "h200", 16, 16, "sglang"),
               ("vLLM TP8 x DP4 (the demo's), H200", "h200", 32, 8, "vllm"))
BATCHES = (1, 8, 64, 256)
CONTEXT = 8192 + 512


def step(model, cluster, tp: int, engine: str, batch: int, generic: bool) -> dict:
    from moeplace.sim.config import CostConfig, EngineConfig
    from moeplace.sim.cost import KERNEL_BUILDS, CostModel, MoeWork, RankWork

    cost = CostModel.for_engine(model, cluster, CostConfig(), EngineConfig(attention_tp=tp, replica_rule=engine))
    if generic:  # the step model before K3's own kernels: the generic counts, uniformly floored
        b = KERNEL_BUILDS["unfused"]
        cost._k3 = None
        cost._layer_kernels = np.array([b[k] + b["moe" if m else "mlp"] + b["norm"]
                                        for k, m in zip(model.attention, cost._is_moe)], dtype=np.float64)
    D, G, L = cluster.num_gpus // tp, cluster.num_gpus, model.num_moe_layers
    w = RankWork.zeros(D)
    w.dec_seqs[:] = batch
    w.tokens[:] = w.sampled[:] = batch
    w.dec_ctx[:] = batch * (CONTEXT + 1)
    sel = batch * D * model.top_k / G  # selections per GPU (the pool's tokens x top-k, spread evenly)
    local = model.num_experts / G
    touched = local * -np.expm1(-sel / local)
    remote = sel * (1 - 1 / G)
    nv = remote if cluster.num_nodes == 1 else remote * (cluster.gpus_per_node - 1) / (G - 1)
    moe = MoeWork(np.full((L, G), sel), np.full((L, G), touched), np.full((L, G), nv), np.full((L, G), remote - nv))
    st = cost.step_time(w, moe)
    return {"step_ms": st.total * 1e3, "kernels": float(cost.layer_kernels().sum()),
            "output_tok_s_per_gpu": batch * D / st.total / G}


def serving(conc: int, trace, generic: bool) -> dict:
    """The event simulator, stat mode, on 32 H200 at attention TP8 (the README demo's cluster): ISL 2,048 /
    OSL 256 at ``conc`` requests, 150 simulated s; "before" with the generic counts (K3 not recognised)."""
    import moeplace.sim.cost as cost_module
    from moeplace.foundation.cluster import make_cluster
    from moeplace.sim.config import EngineConfig, LengthMix, SimConfig, WorkloadConfig
    from moeplace.sim.k3_kernels import is_k3
    from moeplace.sim.runner import resolve_placement, simulate

    cl = make_cluster(32, "h200")
    _, placement = resolve_placement("linear", trace, cl, 0, "vllm", 0)
    cfg = SimConfig(duration=150.0, mode="stat", engine=EngineConfig(attention_tp=8),
                    workload=WorkloadConfig(arrival="closed", concurrency=conc, lengths=LengthMix(
                        components=((2048, 1.0),), sigma=0.0, output_mean=256, output_sigma=0.0)))
    cost_module.is_k3 = (lambda _m: False) if generic else is_k3  # the hook's test, switched for "before"
    try:
        s = simulate(trace, [("linear", placement)], cl, cfg)[0].summary
    finally:
        cost_module.is_k3 = is_k3
    return {"output_tok_s": s["output_tok_s"], "tpot_p50_ms": (s["tpot_p50_s"] or 0) * 1e3,
            "iterations": s["iterations"]}


def main() -> int:
    from moeplace.foundation.cluster import make_cluster
    from moeplace.foundation.files import write_text_atomic
    from moeplace.foundation.model import load_model
    from moeplace.sim.k3_kernels import build_of

    model = load_model("kimi-k3")
    rows = []
    print(f"{'deployment':36s} {'batch/rank':>10s} {'before ms':>10s} {'after ms':>9s} {'change':>7s} "
          f"{'kernels before':>14s} {'after':>6s}")
    for label, gpu, gpus, tp, engine in DEPLOYMENTS:
        cluster = make_cluster(gpus, gpu)
        for b in BATCHES:
            before = step(model, cluster, tp, engine, b, True)
            after = step(model, cluster, tp, engine, b, False)
            rows.append({"deployment": label, "gpu": gpu, "gpus": gpus, "attention_tp": tp, "engine": engine,
                         "build": build_of(engine, tp), "batch_per_rank": b, "before": before, "after": after})
            print(f"{label:36s} {b:10d} {before['step_ms']:10.2f} {after['step_ms']:9.2f} "
                  f"{after['step_ms'] / before['step_ms'] - 1:+7.1%} {before['kernels']:14.0f} {after['kernels']:6.0f}")
    import shutil
    import tempfile

    from moeplace.sim.workload import load_trace_tokens
    from moeplace.traces.synth import SynthConfig, synthesize

    tmp = Path(tempfile.mkdtemp(prefix="k3-step-"))
    synthesize(model, SynthConfig(num_tokens=20000, drift=0.0), tmp / "trace")
    trace = load_trace_tokens(tmp / "trace")
    shutil.rmtree(tmp)
    serve = []
    for conc in (32, 1024):
        before, after = serving(conc, trace, True), serving(conc, trace, False)
        serve.append({"concurrency": conc, "before": before, "after": after})
        print(f"serving 32 x H200 TP8, concurrency {conc}: output tok/s {before['output_tok_s']:,.0f} -> "
              f"{after['output_tok_s']:,.0f} ({after['output_tok_s'] / before['output_tok_s'] - 1:+.1%}), TPOT p50 "
              f"{before['tpot_p50_ms']:.1f} -> {after['tpot_p50_ms']:.1f} ms")
    write_text_atomic(OUT, json.dumps({"rows": rows, "serving": serve, "context": CONTEXT,
                                       "note": __doc__.split("\n\n")[1]}, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
