"""Sweep: what ``place sweep --out DIR`` wrote — per workload every simulated deployment (GPUs vs output
throughput, coloured by p99 TPOT, the Pareto frontier marked), the frontier table, the recommended
deployment with its launch command, and the points that were not simulated with the reason. Everything is
read from ``frontier.json`` and ``sweep.parquet``; nothing is simulated again. The cost view prices each
point with a per-GPU-type table the user edits (defaults: ``data.DEFAULT_GPU_PRICES``) and marks the
frontier in cost (``data.cost_points``)."""
from __future__ import annotations

import altair as alt
import polars as pl
import streamlit as st

from moeplace.dashboard import data, ui
from moeplace.sim.frontier import range_text

st.title("Sweep")
st.caption("Design-space search: plan, optimize and simulate every deployment of a sweep spec; the Pareto "
           "frontier of cost in GPUs vs output throughput vs p99 TPOT, and the deployment to launch.")
idx = ui.run_index()
root = idx.root
if not idx.sweeps:
    # place demo makes no sweep: point at the spec the repository ships (docs/sweep.md)
    ui.missing("sweep output (place sweep --out DIR)",
               f"place sweep examples/sweep-k3.yaml --local --out {ui.run_dir() / 'runs' / 'sweep-k3'}", demo=False)
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
ui.accuracy_note((report.get("fidelity") or {}).get("note"))

# ---------------------------------------------------------------------------- prices
kinds = sorted({str(r.get("gpu")) for w in report["workloads"].values() for r in w["points"] if r.get("gpu")})
prices: dict[str, float] = {}
if kinds:
    st.subheader("GPU prices")
    st.caption("USD per GPU-hour of each GPU type in this sweep, used for the cost axis and the cost frontier. "
               "Defaults are on-demand list prices taken as assumptions (docs/dashboard.md names the source of "
               "each); edit them to your own rates.")
    pcols = st.columns(min(len(kinds), 6))
    for i, k in enumerate(kinds):
        default = data.DEFAULT_GPU_PRICES.get(k.lower(), 0.0)
        prices[k.lower()] = float(pcols[i % len(pcols)].number_input(
            f"{k} USD/GPU-hour", min_value=0.0, value=float(default), step=0.1, format="%.2f", key=f"price_{k}"))
AXES = {"GPUs": "GPUs", "cost (USD/hour)": "USD/hour"}
axis = st.radio("Cost axis", list(AXES), horizontal=True, key="sweep_axis",
                help="x axis of the deployment charts: the GPU count, or GPUs x the price of their type per hour")
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
    # each point's 80 % intervals from the shipped ensemble (frontier.json's *_range fields)
    out["range (out tok/s; TPOT p99)"] = [range_text(r) for r in rows]
    return pl.DataFrame(out, strict=False)


def scatter(points: list[dict], best: dict | None, x: str = "GPUs") -> alt.Chart:
    """Output tok/s against ``x`` (``GPUs`` or ``USD/hour``); diamonds: the frontier in that cost."""
    cost = x == "USD/hour"
    on = [r["on_cost_frontier"] if cost else r["on_frontier"] for r in points]
    df = pl.DataFrame({
        "point": [f"#{r['index']} {r['label']}" for r in points],
        "GPUs": [r["gpus"] for r in points],
        "USD/hour": [r.get("usd_per_hour") for r in points],
        "USD per M output tok": [r.get("usd_per_mtok") for r in points],
        "output tok/s": [r["output_tok_s"] for r in points],
        "p99 TPOT ms": [r["tpot_p99_s"] * 1e3 for r in points],
        "p99 TTFT ms": [None if r.get("ttft_p99_s") is None else r["ttft_p99_s"] * 1e3 for r in points],
        "frontier": ["on the frontier" if o else "dominated" for o in on],
    }, strict=False).to_pandas()
    tip = ["point", "GPUs", "USD/hour", "USD per M output tok", "output tok/s", "p99 TPOT ms", "p99 TTFT ms",
           "frontier"]
    xenc = (alt.X("USD/hour:Q", scale=alt.Scale(zero=False, padding=20), title="cost (USD per hour)") if cost else
            alt.X("GPUs:Q", scale=alt.Scale(zero=False, padding=20), axis=alt.Axis(format="d", tickMinStep=1)))
    base = alt.Chart(df).encode(x=xenc, y=alt.Y("output tok/s:Q", scale=alt.Scale(zero=True)))
    dots = base.mark_point(filled=True, size=140, opacity=0.9).encode(
        color=alt.Color("p99 TPOT ms:Q", scale=alt.Scale(scheme="viridis", reverse=True)),
        shape=alt.Shape("frontier:N", scale=alt.Scale(domain=["on the frontier", "dominated"],
                                                      range=["diamond", "circle"])),
        tooltip=tip)
    layers = [dots]
    if best is not None:
        mine = next((r for r in points if r["index"] == best["index"]), best)
        mark = pl.DataFrame({"GPUs": [best["gpus"]], "USD/hour": [mine.get("usd_per_hour")],
                             "output tok/s": [best["output_tok_s"]],
                             "what": [f"recommended #{best['index']}"]}, strict=False).to_pandas()
        ring = alt.Chart(mark).encode(x=f"{x}:Q", y="output tok/s:Q")
        layers += [ring.mark_point(size=600, color="crimson", strokeWidth=2),
                   ring.mark_text(dy=-22, color="crimson").encode(text="what:N")]
    return alt.layer(*layers).properties(height=340)


launch = report.get("recommended_launch") or {}
for name, w in report["workloads"].items():
    st.header(f"Workload {name}")
    sc = w.get("status_counts") or {}
    st.caption(", ".join(f"{n} {s}" for s, n in sc.items()) + f"; {len(w['points'])} simulated point(s), "
               f"{len(w['frontier'])} on the Pareto frontier.")
    priced = data.cost_points(w["points"], prices)
    if w["points"]:
        st.subheader(f"Deployments: {axis} vs output throughput")
        ui.show(scatter(priced, w.get("recommended"), AXES[axis]))
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

    st.subheader("Frontier in cost")
    front = sorted((r for r in priced if r["on_cost_frontier"]), key=lambda r: r["usd_per_hour"])
    unpriced = sorted({str(r.get("gpu")) for r in priced if r["usd_per_hour"] is None})
    if front:
        st.dataframe(pl.DataFrame({
            "#": [r["index"] for r in front], "deployment": [r["label"] for r in front],
            "GPUs": [r["gpus"] for r in front], "gpu": [r.get("gpu") for r in front],
            "USD/hour": [round(r["usd_per_hour"], 2) for r in front],
            "USD per M output tok": [None if r["usd_per_mtok"] is None else round(r["usd_per_mtok"], 3) for r in front],
            "output tok/s": [r["output_tok_s"] for r in front],
            "TPOT p99 ms": [r["tpot_p99_s"] * 1e3 for r in front]}, strict=False), hide_index=True)
        cheap = min((r for r in front if r["usd_per_mtok"] is not None), key=lambda r: r["usd_per_mtok"], default=None)
        if cheap is not None:
            st.metric("Cheapest per million output tokens", f"${cheap['usd_per_mtok']:.3f}",
                      help=f"#{cheap['index']} {cheap['label']}: ${cheap['usd_per_hour']:.2f}/hour at "
                           f"{cheap['output_tok_s']:,.0f} output tok/s (simulated)")
        st.caption("Fewest USD per hour, most output tok/s, lowest p99 TPOT, with the prices above; a point "
                   "on the GPU-count frontier can leave this one when its GPU type costs more.")
    else:
        st.info("No simulated point has a price: set the prices above.")
    if unpriced:
        st.warning(f"No price for GPU type(s) {', '.join(unpriced)}: those points are left off the cost frontier.")

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
