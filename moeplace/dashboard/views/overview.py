"""Overview: what the run directory holds and which page shows it."""
from __future__ import annotations

import streamlit as st

from moeplace.dashboard import data, ui

st.title("moeplace")
st.caption("Routing traces, expert placement, memory plan and cluster simulation of one run.")
idx = ui.run_index()
root = idx.root
if idx.empty:
    st.warning(f"`{root}` holds no moeplace artifacts. Run `place demo --out {root}` first.")
# a placement saved in several files (placement.json and placements/placement-<policy>.json) counts once
files, _ = data.distinct_placements(idx.placements)
same = {q: f.path for f in files for q in f.same}
kinds = [
    ("Traces", idx.traces, "routing traces", "Traces"),
    ("Placements", tuple(f.path for f in files), "placement files", "Placement"),
    ("Comparisons", idx.comparisons, "place optimize --json output", "Placement"),
    ("Plans", idx.plans, "place plan --json output", "Plan"),
    ("Simulations", idx.sims, "place simulate --out directory", "Simulate"),
    ("Loads", idx.loads, "Loads .npz files", "Placement"),
    ("Sweeps", idx.sweeps, "place sweep --out directory", "Sweep"),
]
cols = st.columns(len(kinds))
for col, (name, paths, _, _) in zip(cols, kinds):
    col.metric(name, len(paths))
rows = [{"kind": what, "path": data.rel(p, root), "page": page} for _, paths, what, page in kinds for p in paths]
rows += [{"kind": f"placement file (the same placement as {data.rel(first, root)})", "path": data.rel(q, root),
          "page": "Placement"} for q, first in same.items()]
if rows:
    st.dataframe(rows, hide_index=True)
for note in idx.notes:
    st.warning(note)
for page, title, what in (
        ("traces", "Traces", "expert-load heatmap, skew, drift, inter-layer affinity, domain mix, validation"),
        ("placement", "Placement", "policies per layer, GPU loads with replicas, balance vs traffic, downloads"),
        ("plan", "Plan", "per-GPU memory, concurrency vs context length, the pool that is the ceiling"),
        ("simulate", "Simulate", "TTFT/TPOT CDFs, throughput and pool occupancy over time, straggler time per layer"),
        ("sweep", "Sweep", "Pareto frontier of GPUs vs throughput vs p99 TPOT, the recommended deployment")):
    st.page_link(f"views/{page}.py", label=f"**{title}**: {what}")
