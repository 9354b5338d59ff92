"""Placement: compare placements on the run's routing — per-layer balancedness per policy, GPU loads of a
chosen layer with the replicas marked, balance vs traffic, the gap to the lower bound — or run the
``place optimize`` comparison with small settings from the page; download a placement and its engine
exports. Scores come from ``placement.evaluate.evaluate``; plans from ``placement.compare``."""
from __future__ import annotations

import altair as alt
import numpy as np
import polars as pl
import streamlit as st

from dashboard import data, ui
from foundation.cluster import gpu_preset_names
from placement.compare import DEFAULT_WINDOW_TOKENS, default_redundant
from placement.dispatch import ENGINES
from placement.policies import policy_names


def _comparison_row(r: dict) -> dict:
    """One `place optimize` row: held-out figures only (none when everything was planned on)."""
    plan, held = r.get("plan") or {}, r.get("held_out") or {}
    return {"policy": r.get("policy"), "seconds": r.get("seconds"),
            "plan balancedness": plan.get("balancedness"),
            "held-out balancedness": held.get("balancedness"),
            "held-out worst window": held.get("worst_window_balancedness"),
            "held-out nodes/token": (held.get("remote_per_token") or {}).get("node")}


st.title("Placement")
st.caption("Where every expert lives, which experts get replicas, and what that does to the busiest GPU.")
idx = ui.run_index()
root = idx.root

# ---------------------------------------------------------------------------- routing
routing_paths = list(idx.traces) + list(idx.loads)
if not routing_paths:
    ui.missing("routing trace or Loads file", f"place demo --out {ui.run_dir()}")
c1, c2, c3 = st.columns([3, 1, 1])
with c1:
    routing_path = ui.pick_path("Routing (trace or Loads) to score on", routing_paths, root, key="pl_routing")
window_tokens = int(c2.number_input("Window tokens", min_value=256, value=DEFAULT_WINDOW_TOKENS, step=1024,
                                    key="pl_window", help="tokens per Loads window when reading a trace"))
engine = c3.selectbox("Replica rule", ENGINES, key="pl_engine",
                      help="vllm: even split over replicas; sglang: local replica first; ideal: fractional")
if routing_path is None:
    st.stop()
with st.spinner("Summarizing the routing into per-window expert loads..."):
    loads = ui.load(data.trace_loads, routing_path, window_tokens, what="routing")
model = loads.model
W = loads.num_windows
st.caption(f"{model.name}: {model.num_moe_layers} MoE layers x {model.num_experts} experts, top-{model.top_k}; "
           f"{W} window(s) of {loads.window_tokens or '?'} tokens from {data.rel(routing_path, root)}")
if W > 1:
    lo, hi = st.slider("Score on windows", 0, W - 1, (0, W - 1), key=f"pl_windows_{routing_path}_{window_tokens}",
                       help="e.g. only the windows a placement was not planned on")
else:
    lo, hi = 0, 0
scored = loads.select(slice(lo, hi + 1))
routing_key = (str(routing_path), data.stamp(routing_path), window_tokens, lo, hi)

# ---------------------------------------------------------------------------- placements
candidates: dict[str, object] = {}
stems = [p.stem for p in idx.placements]
short = len(set(stems)) == len(stems)  # label by file stem when that is unambiguous, else by path
for p in idx.placements:
    pl_ = ui.load(data.placement, p, what=data.rel(p, root), stop=False)
    if pl_ is None:
        continue
    try:
        pl_.check_model(model, data.rel(p, root))
    except Exception as exc:  # noqa: BLE001
        st.warning(ui.error_text(exc) + " — not scored on this routing")
        continue
    candidates[p.stem if short else data.rel(p, root)] = pl_

with st.expander("Run `place optimize` here (small settings)", expanded=not candidates):
    with st.form("optimize"):
        f1, f2, f3, f4 = st.columns(4)
        names = policy_names()
        pols = f1.multiselect("Policies", names, default=names, key="opt_policies")
        gpus = int(f2.number_input("GPUs", min_value=1, value=next(iter(candidates.values())).num_gpus
                                   if candidates else 32, key="opt_gpus"))
        red_default = default_redundant(model.num_experts, gpus)
        redundant = int(f3.number_input("Redundant slots", min_value=0, value=red_default, key="opt_red",
                                        help="E + R must be a multiple of the GPUs"))
        time_limit = float(f4.number_input("Time limit per policy (s)", min_value=0.5, value=5.0, key="opt_tl"))
        g0, g1, g2, g3, g4 = st.columns(5)
        gpu_kinds = gpu_preset_names()
        first = next(iter(candidates.values()), None)
        kind = (first.provenance.get("cluster") or {}).get("gpu", "h200") if first is not None else "h200"
        gpu_kind = g0.selectbox("GPU", gpu_kinds, index=gpu_kinds.index(kind) if kind in gpu_kinds else 0,
                                key="opt_gpu", help="sets the node size (GPUs per NVLink domain)")
        plan_fraction = float(g1.slider("Plan on the first share of windows", 0.1, 1.0, 0.5, key="opt_pf"))
        seed = int(g2.number_input("Seed", value=0, key="opt_seed"))
        objective = g3.selectbox("Objective (moeplace)", ["balance", "balance+traffic", "traffic"], key="opt_obj",
                                 help="traffic objectives use the trace's token sample (multi-node clusters)")
        pareto = g4.checkbox("Balance-vs-traffic frontier", value=False, key="opt_pareto",
                             help="moeplace records the frontier per layer (needs a traffic objective)")
        go = st.form_submit_button("Run optimize")
    if go and not pols:
        st.warning("Pick at least one policy.")
    elif go:
        bar = st.progress(0.0, text="starting")

        def progress(i, n, name):
            bar.progress(i / n, text=f"policy {name} ({i + 1}/{n})" if name else "done")

        with ui.shown_errors("optimize"):
            results, cmp = data.run_comparison(
                loads, gpus=gpus, gpu=gpu_kind, gpus_per_node=None, num_redundant=redundant, policies=pols,
                engine=engine, plan_fraction=plan_fraction, seed=seed,
                time_limit=time_limit, options={"pareto": pareto, "objective": objective}, progress=progress)
            st.session_state["opt_results"] = {
                "key": routing_key[:3], "held_windows": cmp.held_windows.tolist(),
                "rows": [r.row() for r in results],
                "placements": {f"optimize: {r.policy}": r.placement for r in results}}
    opt = st.session_state.get("opt_results")
    if opt and opt["key"] == routing_key[:3]:
        st.caption(f"planned on the first windows, held-out windows {opt['held_windows']}")
        st.dataframe([_comparison_row(r) for r in opt["rows"]], hide_index=True)
        candidates.update(opt["placements"])

for cpath in idx.comparisons:
    cmp_d = ui.load(data.read_artifact, cpath, "comparison", stop=False)
    if isinstance(cmp_d, dict) and isinstance(cmp_d.get("rows"), list):
        with st.expander(f"`place optimize` comparison: {data.rel(cpath, root)}"):
            st.dataframe([_comparison_row(r) for r in cmp_d["rows"]], hide_index=True)
            st.caption(f"engine {cmp_d.get('engine')}, {cmp_d.get('num_redundant')} redundant slots, held-out "
                       f"windows {cmp_d.get('held_out_windows')}")

if not candidates:
    st.info("No placement to show: run optimize above, or add placement JSON files to the run directory "
            f"(`place optimize TRACES --out {ui.run_dir() / 'placement.json'}`).")
    st.stop()
# keyed by the candidate set, so placements made by "Run optimize" arrive selected
chosen = st.multiselect("Placements to compare", list(candidates), default=list(candidates),
                        key="pl_chosen_" + "|".join(candidates))
if not chosen:
    st.stop()

# ---------------------------------------------------------------------------- scores
metrics = {}
with st.spinner("Scoring placements (evaluate)..."):
    for label in chosen:
        m = ui.load(data.evaluate_placement, candidates[label], routing_key, scored, engine, what=label, stop=False)
        if m is not None:
            metrics[label] = m
if not metrics:
    st.stop()
summary = []
for label, m in metrics.items():
    p = candidates[label]
    summary.append({"placement": label, "policy": p.provenance.get("policy"), "GPUs": p.num_gpus,
                    "slots": p.num_slots, "balancedness": m.balancedness, "worst window": m.worst_window_balancedness,
                    "max/mean": m.max_over_mean, "bound (any placement)": m.bound_balancedness_budget,
                    "gap to bound": m.gap_budget, "cross-node share": m.cross_node_share,
                    "node sends/token/layer": m.remote_per_token["node"],
                    "dispatch MB/token (node)": m.dispatch_bytes_per_token["node"] / 1e6,
                    "expert GB/GPU": m.expert_bytes_per_gpu / 1e9,
                    "dup-on-GPU layers": int(p.duplicate_on_gpu().sum())})
st.subheader("Scores")
st.caption(f"evaluate(), {engine} rule, windows {lo}-{hi}. balancedness = mean/max tokens per GPU per layer, "
           "averaged; gap = busiest GPU / lower bound - 1.")
st.dataframe(summary, hide_index=True)
best = max(metrics, key=lambda k: metrics[k].balancedness)
cols = st.columns(min(len(metrics), 4))
for col, (label, m) in zip(cols * 4, metrics.items()):
    col.metric(f"{label}: balancedness", f"{m.balancedness:.4f}",
               None if label == best else f"{m.balancedness - metrics[best].balancedness:+.4f} vs {best}")

layers = np.asarray(model.moe_layers)
per_layer = pl.concat([pl.DataFrame({"placement": label, "decoder layer": layers,
                                     "balancedness": m.layer_balancedness,
                                     "gap to bound": m.layer_gap_budget}) for label, m in metrics.items()])
c1, c2 = st.columns(2)
with c1:
    st.markdown("**Per-layer balancedness**")
    ui.show(ui.line(per_layer, "decoder layer", "balancedness", "placement", y_zero=False))
with c2:
    st.markdown("**Gap to the lower bound per layer**")
    ui.show(ui.line(per_layer, "decoder layer", "gap to bound", "placement"))

# ---------------------------------------------------------------------------- GPU loads of one layer
st.subheader("GPU loads of one layer")
worst_l = int(np.nanargmin(next(iter(metrics.values())).layer_balancedness))
layer = st.select_slider("MoE layer (decoder index)", options=layers.tolist(), value=int(layers[worst_l]),
                         key="pl_layer", help="starts at the first placement's worst layer")
li = int(np.flatnonzero(layers == layer)[0])
cols = st.columns(2)
for i, (label, m) in enumerate(metrics.items()):
    p = candidates[label]
    s = p.slots_per_gpu
    per_gpu = p.phy2log[li].reshape(p.num_gpus, s)
    cnt = p.logcnt[li]
    replicated = (cnt[per_gpu] > 1).sum(axis=1)
    experts = [", ".join(f"{e}" + (f" (x{cnt[e]})" if cnt[e] > 1 else "") for e in row) for row in per_gpu]
    df = pl.DataFrame({"GPU": np.arange(p.num_gpus), "node": np.arange(p.num_gpus) // p.gpus_per_node,
                       "tokens": m.gpu_loads[:, li, :].mean(axis=0), "replica slots": replicated,
                       "experts": experts})
    mean_t = float(m.mean_load[:, li].mean())
    bound_t = float(m.bound_budget[:, li].mean())
    bars = (alt.Chart(df.to_pandas()).mark_bar()
            .encode(x=alt.X("GPU:O"), y=alt.Y("tokens:Q", title="tokens (selections) per GPU"),
                    color=alt.Color("replica slots:O", title="replica slots", scale=alt.Scale(scheme="viridis")),
                    tooltip=["GPU", "node", alt.Tooltip("tokens:Q", format=",.0f"), "replica slots", "experts"]))
    rules = (alt.Chart(pl.DataFrame({"y": [mean_t, bound_t], "line": ["mean", "lower bound"]}).to_pandas())
             .mark_rule(strokeDash=[4, 3]).encode(y="y:Q", color=alt.value("black"), tooltip=["line", "y"]))
    with cols[i % 2]:
        st.markdown(f"**{label}** — layer {layer}: max/mean {df['tokens'].max() / max(mean_t, 1e-9):.3f}, "
                    f"{int((cnt > 1).sum())} replicated experts")
        ui.show((bars + rules).properties(height=240))
st.caption("Bar colour: slots on the GPU that hold a replicated expert (its other copies are elsewhere). "
           "Dashed lines: mean load and the lower bound on the busiest GPU for this slot budget.")

# ---------------------------------------------------------------------------- balance vs traffic
st.subheader("Balance vs traffic")
TRAFFIC = {"node sends/token/layer": "nodes a token is sent to per MoE layer (RDMA once per node)",
           "cross-node share": "share of expert selections served on another node",
           "dispatch MB/token (node)": "dispatch bytes per token over all MoE layers, node-deduplicated"}
axis = st.radio("Traffic measure", list(TRAFFIC), horizontal=True, key="pl_traffic",
                help="; ".join(f"{k}: {v}" for k, v in TRAFFIC.items()))
pts = pl.DataFrame([{k: r[k] for k in ("placement", "balancedness", *TRAFFIC)} for r in summary])
ui.show(alt.Chart(pts.to_pandas()).mark_circle(size=140)
        .encode(x=alt.X(f"{axis}:Q", scale=alt.Scale(zero=False)),
                y=alt.Y("balancedness:Q", scale=alt.Scale(zero=False)), color="placement:N",
                tooltip=list(pts.columns)).properties(height=280))
method = next(iter(metrics.values())).traffic_method
st.caption(f"Up and to the left is better. Traffic: {method}.")
front = []
for label in metrics:
    for lr in candidates[label].provenance.get("params", {}).get("layers", []) or []:
        if isinstance(lr, dict) and lr.get("layer") == li:
            for pt in lr.get("pareto", []) or []:
                front.append({"placement": label, "balancedness": pt.get("balancedness"), "span": pt.get("span"),
                              "floor": pt.get("floor")})
if front:
    st.markdown(f"**Optimizer frontier, layer {layer}**: balancedness vs span (nodes a token's experts "
                "reach) at each balancedness floor the optimizer tried")
    ui.show(ui.line(pl.DataFrame(front), "span", "balancedness", "placement", points=True, y_zero=False))
else:
    st.caption("No optimizer frontier recorded for this layer (run optimize with the frontier option, or "
               "`place optimize --pareto`).")

# ---------------------------------------------------------------------------- downloads
st.subheader("Download")
pick = st.selectbox("Placement", list(metrics), key="pl_download")
p = candidates[pick]
st.download_button("placement JSON", data.placement_json_bytes(p), file_name="placement.json",
                   mime="application/json", key="dl_json")
exports = data.export_formats()
cols = st.columns(3)
for i, (fmt, eng, kind, summ) in enumerate(exports):
    with cols[i % 3]:
        try:
            blob, fname, warns = data.export_file(p, model, fmt, routing_key, scored)
        except Exception as exc:  # noqa: BLE001  the engine's own checks reject this placement
            st.warning(f"{fmt}: {ui.error_text(exc)}")
            continue
        st.download_button(f"{fmt} ({eng})", blob, file_name=fname, key=f"dl_{fmt}", help=summ)
        for w in warns:
            st.caption(f"{fmt}: {w}")
