"""Overview: what the run directory holds and which page shows it."""
from __future__ import annotations

import streamlit as st

from dashboard import data, ui

st.title("moeplace")
st.caption("Routing traces, expert placement, memory plan and cluster simulation of one run.")
idx = ui.run_index()
root = idx.root
if idx.empty:
    st.warning(f"`{root}` holds no moeplace artifacts. Run `place demo --out {root}` first.")
kinds = [
    ("Traces", idx.traces, "routing traces", "Traces"),
    ("Placements", idx.placements, "placement files", "Placement"),
    ("Comparisons", idx.comparisons, "`place optimize --json` outputs", "Placement"),
    ("Plans", idx.plans, "`place plan --json` outputs", "Plan"),
    ("Simulations", idx.sims, "`place simulate --out` directories", "Simulate"),
    ("Loads", idx.loads, "Loads .npz files", "Placement"),
]
cols = st.columns(len(kinds))
for col, (name, paths, _, _) in zip(cols, kinds):
    col.metric(name, len(paths))
rows = [{"kind": what, "path": data.rel(p, root), "page": page} for _, paths, what, page in kinds for p in paths]
if rows:
    st.dataframe(rows, hide_index=True)
for note in idx.notes:
    st.warning(note)
st.markdown(
    "**Traces**: expert-load heatmap, skew, drift, inter-layer affinity, domain mix, validation.  \n"
    "**Placement**: compare policies per layer, GPU loads with replicas, frontier, gap to bound, downloads.  \n"
    "**Plan**: per-GPU memory, concurrency vs context length, the pool that is the ceiling.  \n"
    "**Simulate**: TTFT/TPOT CDFs, throughput and pool occupancy over time, straggler time per layer.")
