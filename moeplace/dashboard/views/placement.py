"""Placement: compare placements on the run's routing — per-layer balancedness per policy, GPU loads of a
chosen layer with the replicas marked, balance vs traffic, the gap to the lower bound — or run the
``place optimize`` comparison with small settings from the page; the launch command and the export of a
placement for each engine. Scores come from ``placement.evaluate.evaluate``; plans from
``placement.compare``; exports and launch commands from ``placement.export`` (never the CLI). A placement
held by several files (``placement.json`` and ``placements/placement-<policy>.json``) is listed once."""
from __future__ import annotations

import altair as alt
import numpy as np
import polars as pl
import streamlit as st

from moeplace.dashboard import data, ui
from moeplace.foundation.cluster import gpu_preset_names
from moeplace.placement.dispatch import ENGINES
from moeplace.placement.policies import policy_names
from moeplace.placement.windows import DEFAULT_WINDOW_TOKENS, default_redundant


def _traffic(summary: dict, key: str, scale: float = 1.0) -> str | None:
    """A traffic cell as `place optimize` prints it: ``~`` marks the independence estimate (no token
    sample of those windows)."""
    v = (summary.get(key) or {}).get("node")
    if v is None:
        return None
    est = "~" if not str(summary.get("traffic_method", "")).startswith(("token sample", "exact")) else ""
    return f"{est}{v * scale:.3f}" if scale == 1.0 else f"{est}{v * scale:.0f}"


def _comparison_row(r: dict, shift: dict | None = None) -> dict:
    """One `place optimize` row, the columns it prints: the planning figure, then held-out figures only
    (scored on the windows planning never saw; none when everything was planned on, where the shift
    estimate stands in). Traffic cells marked ``~`` are estimates."""
    plan, held = r.get("plan") or {}, r.get("held_out")
    row = {"policy": r.get("policy"), "seconds": r.get("seconds"), "plan balancedness": plan.get("balancedness")}
    if held:
        row.update({"held-out balancedness": held.get("balancedness"),
                    "held-out worst window": held.get("worst_window_balancedness"),
                    "held-out max/mean": held.get("max_over_mean"),
                    "held-out nodes/token": _traffic(held, "remote_per_token"),
                    "held-out KiB/token": _traffic(held, "dispatch_bytes_per_token", 1 / 1024)})
    else:
        row.update({"plan nodes/token (in-sample)": _traffic(plan, "remote_per_token"),
                    "plan KiB/token (in-sample)": _traffic(plan, "dispatch_bytes_per_token", 1 / 1024)})
    if shift is not None:
        row.update({"shift estimate: mean": shift.get("mean"), "shift estimate: worst": shift.get("worst")})
    row["dup GPUs"] = r.get("duplicate_on_gpu_layers")
    return row


def _comparison_caption(d: dict) -> str:
    """What `place optimize` prints above and under its table: the split, the layers scored, the shift
    estimate's method."""
    held = d.get("held_out_windows") or []
    plan = d.get("plan_windows") or []
    span = (f"planned on windows {plan[0]}-{plan[-1]}, held-out windows {held[0]}-{held[-1]} (never seen by "
            "planning, token sample included)" if held and plan else "planned on every window: nothing held out")
    parts = [f"engine {d.get('engine')}, {d.get('num_redundant')} redundant slots; {span}"]
    scored, total = d.get("scored_layers"), d.get("moe_layers")
    if scored and total and scored < total:
        parts.append(f"scored on {scored} of {total} MoE layers (the others have no tokens)")
    shift = d.get("shift") or {}
    if shift:
        method = next(iter(shift.values())).get("method", "")
        parts.append(f"shift estimate = balancedness to expect on traffic unlike the planning data, an estimate "
                     f"({method}; scenarios {', '.join(map(str, d.get('shift_scenarios') or []))})")
    parts.append("~ = estimate (no token sample: k selections taken as independent draws)")
    return "; ".join(parts)


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
rule = c3.selectbox("Replica rule", ENGINES, key="pl_engine",
                      help="vllm: even split over replicas; sglang: local replica first; ideal: fractional")
if routing_path is None:
    st.stop()
with st.spinner("Summarizing the routing into per-window expert loads..."):
    loads = ui.load(data.trace_loads, routing_path, window_tokens, what="routing")
model = loads.model
W = loads.num_windows
st.caption(f"{model.name}: {model.num_moe_layers} MoE layers x {model.num_experts} experts, top-{model.top_k}; "
           f"{W} window(s) of {loads.window_tokens or '?'} tokens from {data.rel(routing_path, root)}")
SCORE_ON = {"held-out windows": "each placement on the windows it was not planned on (its held-out part)",
            "every window": "in-sample where a placement was planned on this routing",
            "chosen windows": "a window range you pick; in-sample where it overlaps a placement's planning"}
score_on = st.radio("Score on", list(SCORE_ON), horizontal=True, key="pl_score_on",
                    help="; ".join(f"{k}: {v}" for k, v in SCORE_ON.items()))
lo, hi = 0, W - 1
if score_on == "chosen windows" and W > 1:
    lo, hi = st.slider("Windows", 0, W - 1, (0, W - 1), key=f"pl_windows_{routing_path}_{window_tokens}")
routing_key = (str(routing_path), data.stamp(routing_path), window_tokens)

# ---------------------------------------------------------------------------- placements
candidates: dict[str, object] = {}
files, unreadable = data.distinct_placements(idx.placements)
for p, exc in unreadable:
    st.error(f"{data.rel(p, root)}: {ui.error_text(exc)}")
stems = [f.path.stem for f in files]
short = len(set(stems)) == len(stems)  # label by file stem when that is unambiguous, else by path
same_notes = []
for f in files:
    p = f.path
    pl_ = data.placement(p)
    if f.same:
        same_notes.append(f"{data.rel(p, root)} = " + " = ".join(data.rel(q, root) for q in f.same))
    try:
        pl_.check_model(model, data.rel(p, root))
    except Exception as exc:  # noqa: BLE001
        st.warning(ui.error_text(exc) + " — not scored on this routing")
        continue
    candidates[p.stem if short else data.rel(p, root)] = pl_

known: dict[str, object] = {}  # placements planned on this page: which windows they did not see
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
                rule=rule, plan_fraction=plan_fraction, seed=seed,
                time_limit=time_limit, options={"pareto": pareto, "objective": objective}, progress=progress)
            st.session_state["opt_results"] = {
                "key": routing_key[:3], "comparison": cmp.to_dict(), "held_windows": cmp.held_windows.tolist(),
                "rows": [r.row() for r in results],
                "placements": {f"optimize: {r.policy}": r.placement for r in results}}
    opt = st.session_state.get("opt_results")
    if opt and opt["key"] == routing_key[:3]:
        st.dataframe([_comparison_row(r) for r in opt["rows"]], hide_index=True)
        st.caption(_comparison_caption({**opt["comparison"], "shift": None}))
        candidates.update(opt["placements"])
        held_w = tuple(opt["held_windows"])
        for lab in opt["placements"]:  # planned here on this routing's first windows
            known[lab] = (data.Unseen("held-out", held_w, "planned on the windows before them") if held_w else
                          data.Unseen("in-sample", (), "planned on every window"))

for note in idx.notes:  # files the scan skipped (unreadable JSON, FIFOs): said here too, never hidden
    st.warning(note)
for cpath in idx.comparisons:
    cmp_d = ui.load(data.read_comparison, cpath, stop=False)  # a broken one is shown as its one-line problem
    if cmp_d is not None:
        with st.expander(f"`place optimize` comparison: {data.rel(cpath, root)}"):
            shifts = cmp_d.get("shift") or {}
            st.dataframe([_comparison_row(r, shifts.get(r.get("policy")) if shifts else None)
                          for r in cmp_d["rows"]], hide_index=True)
            st.caption(_comparison_caption(cmp_d))

if same_notes:
    st.caption("Listed once (the same placement in several files): " + "; ".join(same_notes) + ".")
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
def _windows_text(w: tuple[int, ...]) -> str:
    return "none" if not w else (f"window {w[0]}" if len(w) == 1 else f"windows {w[0]}-{w[-1]}")


metrics, scored_on, scored_loads, skipped = {}, {}, {}, []
with st.spinner("Scoring placements (evaluate)..."):
    for label in chosen:
        p = candidates[label]
        seen = known.get(label) or data.unseen_windows(p, loads, routing_path, root)
        if score_on == "held-out windows":
            wins = seen.windows
            what = (f"held out: {_windows_text(wins)}" if seen.kind == "held-out" else
                    f"unseen input: {_windows_text(wins)}" if seen.kind == "unseen input" else "")
            if not wins:
                skipped.append(f"{label}: no held-out windows ({seen.kind}: {seen.why})")
                continue
        else:
            wins = tuple(range(lo, hi + 1))
            overlap = seen.kind not in ("held-out", "unseen input") or not set(wins) <= set(seen.windows)
            what = f"{'in-sample' if overlap else 'held out'}: {_windows_text(wins)}"
            if overlap and seen.kind == "unknown":
                what += " (planning data unknown)"
        sub = loads.select(np.asarray(wins))
        m = ui.load(data.evaluate_placement, p, (*routing_key, wins), sub, rule, what=label, stop=False)
        if m is not None:
            metrics[label], scored_on[label], scored_loads[label] = m, what, sub
for line in skipped:
    st.info(line + " — choose 'every window' to score it in-sample")
if not metrics:
    st.stop()


def _estimated(m) -> str:
    return "~" if not m.traffic_method.startswith(("token sample", "exact")) else ""


summary = []
for label, m in metrics.items():
    p = candidates[label]
    summary.append({"placement": label, "policy": p.provenance.get("policy"), "scored on": scored_on[label],
                    "balancedness": m.balancedness, "worst window": m.worst_window_balancedness,
                    "max/mean": m.max_over_mean,
                    "nodes/token": f"{_estimated(m)}{m.remote_per_token['node']:.3f}",
                    "KiB/token": f"{_estimated(m)}{m.dispatch_bytes_per_token['node'] / 1024:.0f}",
                    "dup GPUs": int((p.duplicate_on_gpu() & m.scored_wl.any(axis=0)).sum()),
                    "GPUs": p.num_gpus, "slots": p.num_slots, "expert GB/GPU": round(m.expert_bytes_per_gpu / 1e9, 2)})
# a column every placement shares says nothing about them: it goes to the caption
same = {k: summary[0][k] for k in ("GPUs", "slots", "expert GB/GPU")
        if len({r[k] for r in summary}) == 1}
for r in summary:
    for k in same:
        del r[k]
st.subheader("Scores")
first = next(iter(metrics.values()))
layers_note = (f" Scored on {first.scored_layers} of {model.num_moe_layers} MoE layers (the others have no tokens)."
               if first.scored_layers < model.num_moe_layers else "")
st.caption(f"evaluate(), {rule} rule. balancedness = mean/max tokens per GPU per layer, averaged over layers "
           "with tokens; worst window = the lowest window; nodes/token = other nodes a token is sent to per MoE "
           "layer and KiB/token the bytes those sends carry per token over all MoE layers (one send per remote "
           "node, DeepEP-style); ~ = estimate (no token sample of those windows: k selections taken as "
           "independent draws); dup GPUs = layers with two replicas of one expert on one GPU. "
           "'held out' rows are scored only on windows the placement was not planned on; 'in-sample' rows on "
           f"windows it saw, which flatters it.{layers_note}"
           + (" Same for every placement: " + ", ".join(f"{k} {v}" for k, v in same.items()) + "." if same else ""))
st.dataframe(summary, hide_index=True)
best = max(metrics, key=lambda k: metrics[k].balancedness)
cols = st.columns(min(len(metrics), 4))
for col, (label, m) in zip(cols * 4, metrics.items()):
    col.metric(f"{label}: balancedness", f"{m.balancedness:.4f}",
               None if label == best else f"{m.balancedness - metrics[best].balancedness:+.4f} vs {best}",
               help=scored_on[label])

layers = np.asarray(model.moe_layers)
per_layer = pl.concat([pl.DataFrame({"placement": label, "decoder layer": layers,
                                     "balancedness": m.layer_balancedness}) for label, m in metrics.items()])
gaps = []  # the optimizer's own per-layer gap to its proven bound, on what it planned for (in-sample)
for label in metrics:
    for lr in candidates[label].provenance.get("params", {}).get("layers", []) or []:
        if isinstance(lr, dict) and lr.get("gap") is not None and 0 <= int(lr.get("layer", -1)) < len(layers):
            gaps.append({"placement": label, "decoder layer": int(layers[int(lr["layer"])]), "gap": float(lr["gap"])})
c1, c2 = st.columns(2)
with c1:
    st.markdown("**Per-layer balancedness**")
    ui.show(ui.line(per_layer, "decoder layer", "balancedness", "placement", y_zero=False))
with c2:
    if gaps:
        st.markdown("**Optimizer: gap to its proven bound per layer** (in-sample: on what it planned for, the sum "
                    "of its planning windows, or their worst with --robust)")
        ui.show(ui.line(pl.DataFrame(gaps), "decoder layer", "gap", "placement"))
    else:
        st.caption("No optimizer bound recorded (only moeplace placements carry a proven bound per layer).")

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
    bars = (alt.Chart(df.to_pandas()).mark_bar()
            .encode(x=alt.X("GPU:O"), y=alt.Y("tokens:Q", title="tokens (selections) per GPU"),
                    color=alt.Color("replica slots:O", title="replica slots", scale=alt.Scale(scheme="viridis")),
                    tooltip=["GPU", "node", alt.Tooltip("tokens:Q", format=",.0f"), "replica slots", "experts"]))
    rules = (alt.Chart(pl.DataFrame({"y": [mean_t], "line": ["mean"]}).to_pandas())
             .mark_rule(strokeDash=[4, 3]).encode(y="y:Q", color=alt.value("black"), tooltip=["line", "y"]))
    with cols[i % 2]:
        st.markdown(f"**{label}** — layer {layer}: max/mean {df['tokens'].max() / max(mean_t, 1e-9):.3f}, "
                    f"{int((cnt > 1).sum())} replicated experts")
        ui.show((bars + rules).properties(height=240))
st.caption("Bar colour: slots on the GPU that hold a replicated expert (its other copies are elsewhere). "
           "Dashed line: the mean GPU load (a perfectly balanced layer). Tokens per GPU averaged over the "
           "windows each placement is scored on.")

# ---------------------------------------------------------------------------- balance vs traffic
st.subheader("Balance vs traffic")
TRAFFIC = {"nodes/token": "other nodes a token is sent to per MoE layer (RDMA once per node)",
           "KiB/token": "dispatch bytes per token over all MoE layers, node-deduplicated"}
axis = st.radio("Traffic measure", list(TRAFFIC), horizontal=True, key="pl_traffic",
                help="; ".join(f"{k}: {v}" for k, v in TRAFFIC.items()))
pts = pl.DataFrame([{"placement": label, "balancedness": m.balancedness,
                     "nodes/token": m.remote_per_token["node"],
                     "KiB/token": m.dispatch_bytes_per_token["node"] / 1024} for label, m in metrics.items()])
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

# ---------------------------------------------------------------------------- launch and exports
st.subheader("Launch and export")
pick = st.selectbox("Placement", list(metrics), key="pl_download")
p = candidates[pick]
st.download_button("placement JSON", data.placement_json_bytes(p), file_name="placement.json",
                   mime="application/json", key="dl_json")
export_dir = ui.run_dir().expanduser().resolve() / "export"
st.caption(f"For each engine: the file it loads and the command that serves {model.name} with it, as `place export "
           f"--flags --plan PLAN` prints them (attention layout from the run's memory plan for {p.num_gpus} GPUs and "
           f"{p.num_redundant} redundant slots; what each engine lacks from `place engines`). The commands read "
           f"the files from `{export_dir}` (the placement JSON as placement.json): save the downloads there, or "
           "change the paths in the command.")
plans = tuple(str(x) for x in idx.plans)
exports = data.export_formats()
tabs = st.tabs([f"{fmt} ({eng})" for fmt, eng, _, _ in exports])
for tab, (fmt, eng, kind, summ) in zip(tabs, exports):
    with tab:
        fname = data.export_name(p, fmt)
        launch = data.launch_for(p, model, fmt, str(export_dir / fname), plans, str(export_dir / "placement.json"),
                                 tuple(data.stamp(x) for x in plans))
        try:
            blob, fname, warns = data.export_file(p, model, fmt, routing_key, loads, launch.extra)
        except Exception as exc:  # noqa: BLE001  the engine's own checks reject this placement
            st.warning(f"{fmt}: {ui.error_text(exc)}")
            continue
        st.download_button(f"{fmt} ({eng}): {fname}", blob, file_name=fname, key=f"dl_{fmt}", help=summ)
        for w in warns:
            st.caption(f"{fmt}: {w}")
        if launch.command:
            st.code(launch.command, language="bash")
            st.caption(launch.plan_line)
        else:
            st.info(f"No launch command: {launch.error}")
