"""Sweep: what ``place sweep --out DIR`` wrote — per workload every simulated deployment (GPUs vs output
throughput, coloured by p99 TPOT, the Pareto frontier marked), the frontier table, the recommended
deployment with its launch command, and the points that were not simulated with the reason. Everything is
read from ``frontier.json`` and ``sweep.parquet``; nothing is recomputed."""
from __future__ import annotations

import altair as alt
import polars as pl
import streamlit as st

from moeplace.dashboard import data, ui

st.title("Sweep")
st.caption("Design-space search: plan, optimize and simulate every deployment of a sweep spec; the Pareto "
           "frontier of cost in GPUs vs output throughput vs p99 TPOT, and the deployment to launch.")
idx = ui.run_index()
root = idx.root
if not idx.sweeps:
    ui.missing("sweep output (place sweep --out DIR)", f"place sweep SPEC.yaml --local --out {ui.run_dir() / 'sweep'}")
sweep_dir = ui.pick_path("Sweep", list(idx.sweeps), root, key="sweep_dir",
                         help="a directory `place sweep --out` wrote (frontier.json, sweep.parquet)")
if sweep_dir is None:
    st.stop()
report = ui.load(data.sweep_frontier, sweep_dir, what="sweep frontier")
table = ui.load(data.sweep_table, sweep_dir, what="sweep table", stop=False)

limits = report.get("objective_limits") or {}
st.caption(f"Sweep **{report.get('name', '?')}** of {report.get('model', '?')} (spec `{report.get('spec', '?')}`); "
           "objective: " + (", ".join(f"{k} {v:g}" for k, v in limits.items()) if limits else "no limits")
           + "; frontier: fewest GPUs, most output tok/s, lowest p99 TPOT.")
if table is not None:
    counts = table.group_by("status").len().sort("status")
    cols = st.columns(max(counts.height, 1) + 1)
    cols[0].metric("Points", f"{table.height}")
    for col, (status, n) in zip(cols[1:], counts.iter_rows()):
        col.metric(status, f"{n}")

# Columns of the frontier table: (header, point field, unit). Only units change; values are the file's.
COLUMNS = [("#", "index", None), ("GPUs", "gpus", None), ("gpu", "gpu", None), ("nodes", "nodes", None),
           ("TP", "tp", None), ("DP", "dp", None), ("EP", "ep", None), ("redundant", "num_redundant", None),
           ("policy", "policy", None), ("rebalance", "rebalance", None), ("KV", "kv_dtype", None),
           ("engine", "engine", None), ("output tok/s", "output_tok_s", None),
           ("tok/s per GPU", "output_tok_s_per_gpu", None), ("TPOT p50 ms", "tpot_p50_s", "ms"),
           ("TPOT p99 ms", "tpot_p99_s", "ms"), ("TTFT p99 ms", "ttft_p99_s", "ms"),
           ("held-out balancedness", "held_out_balancedness", None)]


def as_table(rows: list[dict]) -> pl.DataFrame:
    out = {}
    for head, key, unit in COLUMNS:
        vals = [r.get(key) for r in rows]
        out[head] = [None if v is None else v * 1e3 for v in vals] if unit == "ms" else vals
    return pl.DataFrame(out, strict=False)


def scatter(points: list[dict], best: dict | None) -> alt.Chart:
    df = pl.DataFrame({
        "point": [f"#{r['index']} {r['label']}" for r in points],
        "GPUs": [r["gpus"] for r in points],
        "output tok/s": [r["output_tok_s"] for r in points],
        "p99 TPOT ms": [r["tpot_p99_s"] * 1e3 for r in points],
        "p99 TTFT ms": [None if r.get("ttft_p99_s") is None else r["ttft_p99_s"] * 1e3 for r in points],
        "frontier": ["on the frontier" if r["on_frontier"] else "dominated" for r in points],
    }, strict=False).to_pandas()
    tip = ["point", "GPUs", "output tok/s", "p99 TPOT ms", "p99 TTFT ms", "frontier"]
    base = alt.Chart(df).encode(x=alt.X("GPUs:Q", scale=alt.Scale(zero=False, padding=20),
                                        axis=alt.Axis(format="d", tickMinStep=1)),
                                y=alt.Y("output tok/s:Q", scale=alt.Scale(zero=True)))
    dots = base.mark_point(filled=True, size=140, opacity=0.9).encode(
        color=alt.Color("p99 TPOT ms:Q", scale=alt.Scale(scheme="viridis", reverse=True)),
        shape=alt.Shape("frontier:N", scale=alt.Scale(domain=["on the frontier", "dominated"],
                                                      range=["diamond", "circle"])),
        tooltip=tip)
    layers = [dots]
    if best is not None:
        mark = pl.DataFrame({"GPUs": [best["gpus"]], "output tok/s": [best["output_tok_s"]],
                             "what": [f"recommended #{best['index']}"]}).to_pandas()
        ring = alt.Chart(mark).encode(x="GPUs:Q", y="output tok/s:Q")
        layers += [ring.mark_point(size=600, color="crimson", strokeWidth=2),
                   ring.mark_text(dy=-22, color="crimson").encode(text="what:N")]
    return alt.layer(*layers).properties(height=340)


launch = report.get("recommended_launch") or {}
for name, w in report["workloads"].items():
    st.header(f"Workload {name}")
    sc = w.get("status_counts") or {}
    st.caption(", ".join(f"{n} {s}" for s, n in sc.items()) + f"; {len(w['points'])} simulated point(s), "
               f"{len(w['frontier'])} on the Pareto frontier.")
    if w["points"]:
        st.subheader("Deployments: GPUs vs output throughput")
        ui.show(scatter(w["points"], w.get("recommended")))
    else:
        st.info("No point of this workload finished its simulation with a p99 TPOT.")
    if w.get("ok_without_tpot"):
        st.warning(f"{w['ok_without_tpot']} simulated point(s) finished no request with more than one output "
                   "token (no TPOT): left off the frontier; lengthen simulate.duration.")
    st.subheader("Pareto frontier")
    if w["frontier"]:
        st.dataframe(as_table(w["frontier"]), hide_index=True)
    else:
        st.info("Empty frontier.")

    st.subheader("Recommended deployment")
    best = w.get("recommended")
    if best is None:
        st.info(f"None: {w.get('why', 'no frontier point qualifies')}.")
    else:
        st.success(f"#{best['index']} {best['label']} — {w.get('why', '')}")
        c = st.columns(4)
        c[0].metric("GPUs", f"{best['gpus']}")
        c[1].metric("output tok/s", f"{best['output_tok_s']:,.0f}")
        c[2].metric("output tok/s per GPU", f"{best['output_tok_s_per_gpu']:,.1f}")
        c[3].metric("p99 TPOT", f"{best['tpot_p99_s'] * 1e3:.1f} ms")
        lw = launch.get(name)
        if lw is None:
            st.info("frontier.json records no launch command for this workload.")
        elif "error" in lw:
            st.error(f"launch files: {lw['error']}")
        else:
            st.markdown(f"**Launch** ({lw.get('format')}; `{lw.get('launch_script')}`)")
            st.code(lw.get("command", ""), language="bash")
            st.caption(f"placement `{lw.get('placement')}`, engine file `{lw.get('engine_file')}`")
            for warning in lw.get("warnings") or []:
                st.warning(warning)

    st.subheader("Points not simulated")
    if table is None:
        st.info("sweep.parquet could not be read (above): no status per point.")
        continue
    rest = (table.filter((pl.col("workload") == name) & (pl.col("status") != "ok"))
            .select("index", "label", "status", "stage", "reason").sort("index"))
    if rest.height:
        st.dataframe(rest, hide_index=True)
    else:
        st.caption("Every point of this workload was simulated.")

if table is not None:
    with st.expander("All rows of sweep.parquet"):
        st.dataframe(table, hide_index=True)
