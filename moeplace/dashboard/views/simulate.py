"""Simulate: the outputs of ``place simulate --out DIR`` side by side per placement — the summary table,
latency CDFs (TTFT, TPOT), throughput and pool occupancy over time, straggler time per MoE layer."""
from __future__ import annotations

import math

import altair as alt
import numpy as np
import polars as pl
import streamlit as st

from moeplace.dashboard import data, ui

st.title("Simulate")
st.caption("Discrete-event cluster simulation of the same workload under each placement.")
idx = ui.run_index()
root = idx.root
if not idx.sims:
    ui.missing("simulation output (place simulate --out DIR)",
               f"place simulate TRACES --placement placement.json --placement eplb --out {ui.run_dir() / 'sim'}")
    sim_path = ui.pick_path("Simulation directory", [], root, key="sim_dir")
else:
    sim_path = ui.pick_path("Simulation directory", idx.sims, root, key="sim_dir")
if sim_path is None:
    st.stop()
run = ui.load(data.sim_run, sim_path, what="simulation")
labels = st.multiselect("Placements", run.labels, default=run.labels, key=f"sim_labels_{sim_path}")
if not labels:
    st.info("Pick at least one placement.")
    st.stop()
summ = {s["label"]: s for s in run.summaries}
cfg = run.config
if cfg:
    c = cfg.get("cluster", {})
    eng = cfg.get("sim", {}).get("engine", {})
    wl = cfg.get("sim", {}).get("workload", {})
    load = (f"{wl.get('concurrency')} concurrent requests" if wl.get("arrival") == "closed"
            else f"{wl.get('rate')} req/s {wl.get('arrival')}")
    st.caption(f"{cfg.get('model')} on {c.get('num_gpus')} x {c.get('gpu')} ({c.get('num_nodes')} nodes), attention "
               f"TP{eng.get('attention_tp')}, {eng.get('replica_rule')} replica rule, "
               f"{cfg.get('sim', {}).get('duration')} simulated s, {load}; trace {cfg.get('trace', {}).get('path')}")

# -- the table place simulate prints (its rows and units)
def fmt(v, unit: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return {"ms": f"{v * 1e3:.1f}", "s": f"{v:.2f}", "%": f"{v * 100:.1f}%", "GB": f"{v / 1e9:,.1f}",
            "int": f"{int(v):,}", "x": f"{v:.3f}", "n3": f"{v:.3f}"}.get(unit, f"{v:,.0f}")


def cell(s: dict, key: str, unit: str) -> str:
    """The figure as place simulate prints it: the shipped ensemble's median with its 80 % interval
    (summary.json's ``<key>_range``, sim.ensemble.price_run) where the summary has one; an older summary's
    ``null`` range said that no published case resembled the run."""
    text = fmt(s.get(key), unit)
    if f"{key}_range" in s:
        rng = s[f"{key}_range"]
        text += " [no case resembles this run]" if rng is None else f" [{fmt(rng[0], unit)}-{fmt(rng[1], unit)}]"
    return text


table = [{"metric": name, **{lab: cell(summ[lab], key, unit) for lab in labels}}
         for name, key, unit in data.sim_table_rows([summ[lab] for lab in labels])]
st.dataframe(table, hide_index=True)
# a run priced by a place calibrate file says so, with its within-deployment interval (the ranges above)
ui.accuracy_note(next((summ[lab]["calibration"]["note"] for lab in labels if summ[lab].get("calibration")), None))

# -- a disaggregated deployment (place simulate --pools): its two pools side by side, per placement
pooled = [(lab, data.pool_side_by_side(summ[lab])) for lab in labels]
pooled = [(lab, rows) for lab, rows in pooled if rows]
if pooled:
    st.subheader("Pools side by side")
    st.caption("Each pool as deployed: its own GPUs, attention layout, batching limits and placement; the KV cache "
               "handed from prefill to decode over the deployment's link. TTFT is the prefill pool's (arrival to "
               "the first token), TPOT the decode pool's (the hand-off and decode queueing included).")
    for col, (lab, rows) in zip(st.columns(len(pooled)), pooled):
        with col:
            st.markdown(f"**{lab}**")
            st.dataframe([{"figure": r["figure"],
                           **{role: (r[role] if r["unit"] == "text" or r[role] is None else fmt(r[role], r["unit"]))
                              if r[role] is not None else "" for role in ("prefill", "decode")}}
                          for r in rows], hide_index=True)
best = max(labels, key=lambda lab: summ[lab].get("output_tok_s") or 0)
cols = st.columns(len(labels))
for col, lab in zip(cols, labels):
    s = summ[lab]
    delta = None
    if lab != best and summ[best].get("output_tok_s"):
        delta = f"{(s['output_tok_s'] / summ[best]['output_tok_s'] - 1):+.1%} vs {best}"
    col.metric(f"{lab}: output tok/s", f"{s.get('output_tok_s', 0):,.0f}", delta)

# -- latency CDFs
st.subheader("Latency CDFs")
q = np.linspace(0, 1, 201)
cdf_parts = []
for lab in labels:
    r = run.requests[lab]
    for metric in ("ttft_s", "tpot_s"):
        v = r[metric].drop_nulls().to_numpy()
        if v.size:
            cdf_parts.append(pl.DataFrame({"placement": lab, "metric": metric.split("_")[0].upper(),
                                           "ms": np.quantile(v, q) * 1e3, "fraction": q}))
if cdf_parts:
    cdf = pl.concat(cdf_parts)
    c1, c2 = st.columns(2)
    for col, metric in ((c1, "TTFT"), (c2, "TPOT")):
        part = cdf.filter(pl.col("metric") == metric)
        if part.height:
            with col:
                st.markdown(f"**{metric}**")
                ui.show(ui.line(part, "ms", "fraction", "placement", x_title=f"{metric} (ms)",
                                y_title="fraction of requests", log_x=True))
else:
    st.info("No request finished its first token in this simulation.")

# -- over time
ts = pl.concat([run.timeseries[lab].select("time", "pool", "duration", "decode_seqs", "prefill_tokens",
                                           "kv_occupancy", "state_occupancy", "running", "waiting")
                .with_columns(pl.lit(lab).alias("placement")) for lab in labels])
duration = float(cfg.get("sim", {}).get("duration") or ts["time"].max() or 1.0)
nice = [m * 10.0**e for e in range(-4, 3) for m in (1, 2, 5)]
bins = [b for b in nice if duration / 400 <= b <= duration / 4] or [duration / 20]
bin_s = st.select_slider("Time bin (s)", options=bins, value=min(bins, key=lambda b: abs(duration / b - 60)),
                         key=f"sim_bin_{sim_path}", format_func=lambda b: f"{b:g}")
st.subheader("Throughput over time")
st.caption("Tokens the iterations processed per second of simulated time: decode tokens (one per running "
           "sequence per iteration) and prefill tokens.")
binned = (ts.with_columns((pl.col("time") // bin_s * bin_s).alias("t"))
          .group_by("placement", "t")
          .agg((pl.col("decode_seqs").sum() / bin_s).alias("decode tok/s"),
               (pl.col("prefill_tokens").sum() / bin_s).alias("prefill tok/s"),
               pl.col("kv_occupancy").max().alias("KV pool"), pl.col("state_occupancy").max().alias("state pool"))
          .sort("placement", "t"))
few = binned["t"].n_unique() < 12
c1, c2 = st.columns(2)
with c1:
    ui.show(ui.line(binned, "t", "decode tok/s", "placement", x_title="simulated time (s)", points=few))
with c2:
    ui.show(ui.line(binned, "t", "prefill tok/s", "placement", x_title="simulated time (s)", points=few))
st.subheader("Pool occupancy over time")
occ = binned.unpivot(["KV pool", "state pool"], index=["placement", "t"], variable_name="pool", value_name="occupancy")
chart = (alt.Chart(occ.to_pandas()).mark_line(point=few)
         .encode(x=alt.X("t:Q", title="simulated time (s)"),
                 y=alt.Y("occupancy:Q", title="peak occupancy in bin", axis=alt.Axis(format="%")),
                 color="placement:N", strokeDash="pool:N", tooltip=["placement", "pool", "t", "occupancy"])
         .properties(height=260))
ui.show(chart)

# -- straggler time per MoE layer
st.subheader("Straggler time per MoE layer")
st.caption("Seconds the busiest GPU kept the others waiting, summed over the run, per MoE layer.")
strag = []
for lab in labels:
    by_layer = summ[lab].get("straggler_by_layer_s") or []
    strag.append(pl.DataFrame({"placement": lab, "MoE layer": np.arange(len(by_layer)),
                               "straggler s": np.asarray(by_layer, dtype=float)}))
strag_df = pl.concat(strag)
if strag_df.height:
    ui.show(ui.line(strag_df, "MoE layer", "straggler s", "placement", x_title="MoE layer (0 = the first MoE layer)",
                    x_type="O"))
