"""Traces: what the routing looks like — the per-layer expert-load heatmap (experts sorted by load), skew
per layer, drift between windows, inter-layer affinity of a chosen layer pair, the domain mix — and the
validation report when the trace has problems. Everything comes from one streaming pass of
``traces.stats.compute_stats`` (cached per trace and window size) and ``traces.validate``; the trace is
never loaded whole."""
from __future__ import annotations

import altair as alt
import numpy as np
import polars as pl
import streamlit as st

from moeplace.dashboard import data, ui
from moeplace.traces.stats import DEFAULT_WINDOW_TOKENS, affinity_lift, pair_counts

MAX_HEATMAP_COLUMNS = 224  # expert ranks per layer drawn; beyond that adjacent ranks are averaged
TOP_PAIR_EXPERTS = 32

st.title("Traces")
st.caption("Routing traces: which experts the router picks, how skewed, how it drifts, how layers couple.")
idx = ui.run_index()
root = idx.root
if not idx.traces:
    ui.missing("routing trace", f"place trace synth --model kimi-k3 --tokens 20000 --out {ui.run_dir() / 'traces'}")
c1, c2 = st.columns([4, 1])
with c1:
    path = ui.pick_path("Trace", list(idx.traces), root, key="tr_path",
                        help="a trace directory or Parquet file (place trace synth / capture / import)")
window_tokens = int(c2.number_input("Window tokens", min_value=256, value=DEFAULT_WINDOW_TOKENS, step=1024,
                                    key="tr_window"))
if path is None:
    st.stop()

info = ui.load(data.trace_info, path, what="trace")
prov = info.provenance or {}
st.caption(f"{data.rel(path, root)}: model **{info.model_name}** ({info.num_moe_layers} MoE layers x "
           f"{info.num_experts} experts, top-{info.top_k}); {info.num_files} file(s), {info.num_rows:,} rows; "
           f"provenance: {prov.get('kind', 'unknown')}"
           + (f" ({prov.get('generator') or prov.get('source') or ''})" if prov.get("generator") or prov.get("source")
              else ""))

with st.expander("Provenance (how the trace was made)"):
    st.json(prov, expanded=1)

# -- validation first: a trace with problems gets its report, and statistics only if they still read
with st.spinner("Validating the trace (streaming)..."):
    report = ui.load(data.trace_validation, path, what="validation", stop=False)
if report is not None:
    if report.ok:
        st.success(f"valid — {report.summary()}")
    else:
        lines = report.lines()
        st.error(f"the trace has {len(report.problems) + sum(report.suppressed.values())} problem(s); "
                 "statistics below may be incomplete")
        st.code("\n".join(lines), language=None)

with st.spinner("Computing streaming statistics (one pass; cached)..."):
    stats = ui.load(data.trace_stats, path, window_tokens, what="statistics")
loads = stats.loads
model = loads.model
layers = np.asarray(model.moe_layers)
W = loads.num_windows
m1, m2, m3, m4, m5 = st.columns(5)
m1.metric("Tokens", f"{stats.num_tokens:,}")
m2.metric("Requests", f"{stats.num_requests:,}")
m3.metric("Windows", f"{W} x {loads.window_tokens:,}")
m4.metric("Median skew (max/mean)", f"{np.nanmedian(stats.layer_skew):.2f}")
m5.metric("Locality (top-k overlap)", "-" if np.isnan(stats.locality) else f"{stats.locality:.3f}")

# -- heatmap: layers x experts, each layer's experts sorted by load, coloured by load / layer mean
st.subheader("Expert load per layer (experts sorted by load)")
win_opts = ["all windows"] + [f"window {w}" + (f" ({loads.labels[w]})" if loads.labels else "") for w in range(W)]
win = st.selectbox("Windows", win_opts, key="tr_heat_window")
counts = loads.total() if win == win_opts[0] else loads.counts[win_opts.index(win) - 1]
ranked = -np.sort(-counts.astype(np.float64), axis=1)  # [L, E] descending per layer
mean = ranked.mean(axis=1, keepdims=True)
rel_load = np.divide(ranked, mean, out=np.zeros_like(ranked), where=mean > 0)
E = rel_load.shape[1]
group = int(np.ceil(E / MAX_HEATMAP_COLUMNS))
cols = -(-E // group)
padded = np.full((rel_load.shape[0], cols * group), np.nan)
padded[:, :E] = rel_load
cells = np.nanmean(padded.reshape(rel_load.shape[0], cols, group), axis=2)
heat = pl.DataFrame({"decoder layer": np.repeat(layers, cols), "expert rank": np.tile(np.arange(cols) * group, len(layers)),
                     "load / mean": cells.ravel()})
chart = (alt.Chart(heat.to_pandas()).mark_rect()
         .encode(x=alt.X("expert rank:O", title=f"expert rank by load (0 = hottest){'' if group == 1 else f'; {group} ranks per cell'}",
                         axis=alt.Axis(labelOverlap=True, values=list(range(0, cols * group, max(group, 1) * 16)))),
                 y=alt.Y("decoder layer:O", sort="ascending", axis=alt.Axis(labelOverlap=True)),
                 color=alt.Color("load / mean:Q", scale=alt.Scale(scheme="inferno", type="sqrt")),
                 tooltip=["decoder layer", "expert rank", alt.Tooltip("load / mean:Q", format=".2f")])
         .properties(height=max(200, min(4 * len(layers), 460))))
ui.show(chart)

# -- skew per layer and drift between windows
c1, c2 = st.columns(2)
with c1:
    st.markdown("**Skew per layer**")
    skew = pl.DataFrame({"decoder layer": np.concatenate([layers, layers]),
                         "value": np.concatenate([stats.layer_skew, stats.layer_cv]),
                         "statistic": ["max/mean"] * len(layers) + ["CV (std/mean)"] * len(layers)})
    ui.show(ui.line(skew, "decoder layer", "value", "statistic"))
with c2:
    st.markdown("**Drift between consecutive windows**")
    if W < 2:
        st.info(f"One window of {loads.window_tokens:,} tokens: lower the window size to see drift.")
    else:
        drift = pl.DataFrame({"window": np.concatenate([np.arange(1, W)] * 2),
                              "value": np.concatenate([stats.drift_corr, stats.drift_js]),
                              "statistic": ["load correlation"] * (W - 1) + ["JS divergence"] * (W - 1)})
        ui.show(ui.line(drift, "window", "value", "statistic", x_title="window (vs the one before)", points=True,
                        x_type="O"))

# -- inter-layer affinity of a chosen pair (on the statistics' token sample)
st.subheader("Inter-layer affinity")
samples = loads.samples
if samples is None or samples.shape[0] < 4 or len(layers) < 2:
    st.info("The statistics kept no token sample (or the model has one MoE layer): no affinity to show.")
else:
    a1, a2 = st.columns(2)
    la = a1.selectbox("From layer", layers[:-1].tolist(), index=0, key="tr_aff_a")
    ia = int(np.flatnonzero(layers == la)[0])
    lb = a2.selectbox("To layer", layers[ia + 1:].tolist(), index=0, key=f"tr_aff_b_{la}")
    ib = int(np.flatnonzero(layers == lb)[0])
    pair = samples[:, [ia, ib]]
    _, lift, cov, cov_perm = affinity_lift(pair, model.num_experts, max_pairs=1)
    ok = (pair >= 0).all(axis=(1, 2))
    cnt = pair_counts(pair[:, 0], pair[:, 1], model.num_experts)
    b1, b2, b3 = st.columns(3)
    b1.metric("Affinity lift (1 = independent)", "-" if not np.isfinite(lift[0]) else f"{lift[0]:.2f}")
    b2.metric("Top-20% pairs cover", "-" if not np.isfinite(cov[0]) else f"{cov[0]:.1%}",
              None if not np.isfinite(cov_perm[0]) else f"{cov[0] - cov_perm[0]:+.1%} vs permuted")
    b3.metric("Sampled tokens", f"{int(ok.sum()):,}")
    top_a = np.argsort(-cnt.sum(axis=1))[:TOP_PAIR_EXPERTS]
    top_b = np.argsort(-cnt.sum(axis=0))[:TOP_PAIR_EXPERTS]
    sub = cnt[np.ix_(top_a, top_b)]
    aff = pl.DataFrame({f"expert @ {la}": np.repeat(top_a, len(top_b)), f"expert @ {lb}": np.tile(top_b, len(top_a)),
                        "co-activations": sub.ravel()})
    ui.show(alt.Chart(aff.to_pandas()).mark_rect()
            .encode(x=alt.X(f"expert @ {lb}:O", sort=top_b.tolist()), y=alt.Y(f"expert @ {la}:O", sort=top_a.tolist()),
                    color=alt.Color("co-activations:Q", scale=alt.Scale(scheme="blues")),
                    tooltip=list(aff.columns)).properties(height=420))
    st.caption(f"Co-activation counts of the {TOP_PAIR_EXPERTS} most-used experts of each layer in the sampled "
               "tokens (one count per pair of a token's experts). Lift: how much better a token's experts at the "
               "first layer predict its experts at the second than popularity alone.")

# -- domain mix
st.subheader("Domain mix")
if not stats.domains:
    st.info("The trace has no domain column.")
else:
    dom = pl.DataFrame({"window": np.repeat(np.arange(W), len(stats.domains)),
                        "domain": list(stats.domains) * W, "tokens": stats.domain_tokens.ravel()})
    d1, d2 = st.columns([2, 1])
    with d1:
        ui.show(alt.Chart(dom.to_pandas()).mark_area()
                .encode(x=alt.X("window:Q", axis=alt.Axis(tickMinStep=1, format="d")),
                        y=alt.Y("tokens:Q", stack="normalize", title="share of tokens"),
                        color="domain:N", tooltip=["window", "domain", "tokens"]).properties(height=260))
    with d2:
        tot = dom.group_by("domain").agg(pl.col("tokens").sum()).sort("tokens", descending=True)
        st.dataframe(tot, hide_index=True)
