"""Plan: the per-GPU memory breakdown of ``place plan`` as a stacked bar, concurrency against context
length, and which pool is the ceiling. Starts from a ``place plan --json`` file of the run directory
(or the defaults) and re-plans with ``foundation.memory.plan_memory`` when a setting is changed."""
from __future__ import annotations

import altair as alt
import polars as pl
import streamlit as st

from moeplace.dashboard import data, ui
from moeplace.foundation.cluster import gpu_preset_names
from moeplace.foundation.memory.config import MemoryConfig
from moeplace.foundation.memory.inputs import format_tokens, parse_tokens
from moeplace.foundation.model import DEFAULT_MODEL, preset_names

CEILING = {"kv": "MLA KV cache", "state": "KDA state", "max_num_seqs": "max-num-seqs",
           "max_model_len": "model max context", "weights": "weights + reserve"}

st.title("Plan")
st.caption("Does this EP layout fit next to the KV cache and the KDA state, and at what context and concurrency?")
idx = ui.run_index()
root = idx.root

if idx.plans:
    plan_path = ui.pick_path("Plan file", idx.plans, root, key="plan_file")
    if plan_path is None:
        st.stop()
    recorded = ui.load(data.read_artifact, plan_path, "memory-plan", what="plan file")
    model_name, gpus, gpu, gpn, config = ui.load(data.plan_inputs, recorded, what=str(plan_path))
    src = data.rel(plan_path, root)
else:
    ui.missing("plan (place plan --json)", f"place plan --json > {ui.run_dir() / 'plan.json'}")
    model_name, gpus, gpu, gpn, config = DEFAULT_MODEL, 32, "h200", None, MemoryConfig()
    src = "defaults"

with st.expander("Change the layout (re-plans with plan_memory)", expanded=not idx.plans):
    k = f"plan_{src}"  # widgets start from the chosen file's values
    c1, c2, c3, c4 = st.columns(4)
    models = preset_names()
    model_name = c1.selectbox("Model", models + ([model_name] if model_name not in models else []),
                              index=(models + [model_name]).index(model_name), key=f"{k}_model")
    gpus = int(c2.number_input("GPUs", min_value=1, value=int(gpus), step=8, key=f"{k}_gpus"))
    gpu_kinds = gpu_preset_names()
    gpu = c3.selectbox("GPU", gpu_kinds, index=gpu_kinds.index(gpu) if gpu in gpu_kinds else 0, key=f"{k}_gpu")
    kv = c4.selectbox("KV dtype", ["bf16", "fp8"], index=["bf16", "fp8"].index(config.kv_dtype)
                      if config.kv_dtype in ("bf16", "fp8") else 0, key=f"{k}_kv")
    c5, c6, c7, c8 = st.columns(4)
    ctx_text = c5.text_input("Context (tokens, k/M suffix)",
                             value=format_tokens(config.context) if config.context else "", key=f"{k}_ctx",
                             help="empty: the model's maximum context")
    red = int(c6.number_input("Redundant slots", min_value=0, value=int(config.num_redundant), key=f"{k}_red"))
    dp_text = c7.text_input("Attention DP ranks", value=str(config.dp or ""), key=f"{k}_dp",
                            help="empty: derived (TP over all GPUs the heads allow)")
    split = c8.selectbox("Pool split", ["shared", "ratio", "slots"],
                         index=["shared", "ratio", "slots"].index(config.pool_split), key=f"{k}_split")
    changes = {"kv_dtype": kv, "num_redundant": red, "pool_split": split}
    with ui.shown_errors("settings"):
        changes["context"] = parse_tokens(ctx_text, "context") if ctx_text.strip() else None
        if dp_text.strip() != str(config.dp or ""):
            changes["dp"] = int(dp_text) if dp_text.strip() else None
            changes["tp"] = None
        if split != config.pool_split:
            changes["pool_param"] = 64 if split == "slots" else None
    config = ui.load(data.with_changes, config, **changes, what="settings")
    if gpn is not None and gpus % gpn:
        gpn = None

model = ui.load(data.resolve_model, model_name, idx.traces, what="model")
plan = ui.load(data.memory_plan, model, gpus, gpu, gpn, config, what="plan")
lay, pools = plan.layout, plan.pools
st.subheader(f"{plan.model_name} on {plan.cluster.num_gpus} x {plan.cluster.gpu.name}: {lay.describe()}")
st.caption(f"from {src}")
if plan.fits:
    st.success("verdict: FITS")
else:
    st.warning("verdict: DOES NOT FIT — " + "; ".join(plan.reasons))
    for s in plan.suggestions:
        st.write(f"- smallest change: **{s.change}** ({s.kind}; then {s.concurrency} concurrent sequences)")

ctx = format_tokens(plan.context)
if plan.config.context_mix:
    mix = ",".join(f"{format_tokens(n)}:{w:g}" for n, w in plan.config.context_mix)
    x1, x2 = st.columns(2)
    x1.metric(f"Concurrent sequences at mix {mix}", f"{plan.mix_concurrency:,}")
    x2.metric("Ceiling at the mix", CEILING.get(plan.mix_ceiling, plan.mix_ceiling))
m1, m2, m3, m4 = st.columns(4)
m1.metric(f"Concurrent sequences at {ctx}", f"{plan.concurrency:,}")
m2.metric("Ceiling", CEILING.get(plan.concurrency_ceiling, plan.concurrency_ceiling))
m3.metric("Longest sequence (tokens)", f"{plan.max_context:,}")
m4.metric("Free for caches per GPU", f"{plan.free_bytes / 1e9:.1f} GB")

# -- per-GPU memory as one stacked bar (every GPU of the layout holds the same)
rows = [{"part": x.name, "section": x.section, "GB": x.bytes / 1e9, "how": x.how, "order": i}
        for i, x in enumerate(plan.lines)]
rows.append({"part": "outside --gpu-memory-utilization", "section": "unused",
             "GB": (plan.hbm_bytes - plan.budget_bytes) / 1e9,
             "how": f"{1 - plan.config.gpu_memory_utilization:.0%} of the memory the GPU reports", "order": len(rows)})
mem = pl.DataFrame(rows).with_columns(pl.lit("each GPU").alias("gpu"))
st.markdown("**Memory per GPU**")
bar = (alt.Chart(mem.to_pandas()).mark_bar(size=80)
       .encode(x=alt.X("sum(GB):Q", title="GB (1e9 bytes)"), y=alt.Y("gpu:N", title=None),
               color=alt.Color("part:N", sort=[r["part"] for r in rows], title=None,
                               scale=alt.Scale(scheme="tableau20"),
                               legend=alt.Legend(labelLimit=260)),
               order=alt.Order("order:Q"), tooltip=["section", "part", alt.Tooltip("GB:Q", format=".2f"), "how"])
       .properties(height=20 * len(rows) + 20))
hbm_rule = alt.Chart(pl.DataFrame({"GB": [plan.hbm_bytes / 1e9]}).to_pandas()).mark_rule(color="black").encode(x="GB:Q")
ui.show(bar + hbm_rule)
st.dataframe(mem.select("section", "part", pl.col("GB").round(2), "how"), hide_index=True)

# -- concurrency against context length (the planner's own admission model at each length)
st.markdown("**Concurrent sequences vs context length**")
top = pools.max_model_len if pools.max_model_len < 2**40 else (model.max_context or 1 << 20)
lengths = sorted({1 << p for p in range(10, 41) if (1 << p) <= top} | {top, plan.context})
curve = data.concurrency_curve(plan, lengths).with_columns(
    pl.col("ceiling").replace_strict(CEILING, default=pl.col("ceiling")).alias("limited by"))
base = alt.Chart(curve.to_pandas()).encode(
    x=alt.X("context_tokens:Q", scale=alt.Scale(type="log", base=2), title="context tokens"),
    y=alt.Y("concurrency:Q", title="concurrent sequences (all DP ranks)", scale=alt.Scale(type="symlog")))
chart = (base.mark_line(color="gray")
         + base.mark_circle(size=70).encode(color=alt.Color("limited by:N"),
                                            tooltip=["context_tokens", "concurrency", "limited by"])
         ).properties(height=300)
ui.show(chart)
st.caption(f"Per GPU: {pools.kv_bytes_per_token / 1024:.2f} KiB KV per token ({plan.config.kv_dtype}), "
           f"{pools.state_bytes_per_seq / 2**20:.1f} MiB state per sequence; "
           + ("one shared pool." if pools.shared else
              f"{pools.state_slots} state slots and {pools.kv_token_capacity:,} KV token slots per DP rank."))
st.dataframe(curve.select("context_tokens", "concurrency", "limited by"), hide_index=True)
