"""Entry point of the moeplace dashboard: ``place dashboard [RUN_DIR]`` runs ``streamlit run`` on this
file with the run directory in ``$MOEPLACE_RUN_DIR``. One page per stage of the flow."""
from __future__ import annotations

from pathlib import Path

import streamlit as st

from moeplace.dashboard import data
from moeplace.dashboard.ui import RUN_DIR_KEY

HERE = Path(__file__).parent
# The page scripts live in views/, not pages/: with a pages/ directory next to this file, a fresh
# server answering a deep link (/plan) first would run pages/plan.py on its own (Streamlit's older
# directory-based multipage mode), skipping this script, its sidebar and st.navigation.

st.set_page_config(page_title="moeplace", layout="wide")

if RUN_DIR_KEY not in st.session_state:
    st.session_state[RUN_DIR_KEY] = data.default_run_dir()
st.sidebar.text_input("Run directory", key=RUN_DIR_KEY,
                      help="what `place demo --out DIR` wrote (traces, placements, plan, simulations, sweeps)")

pages = [
    st.Page(HERE / "views" / "overview.py", title="Overview", default=True),
    st.Page(HERE / "views" / "traces.py", title="Traces"),
    st.Page(HERE / "views" / "placement.py", title="Placement"),
    st.Page(HERE / "views" / "plan.py", title="Plan"),
    st.Page(HERE / "views" / "simulate.py", title="Simulate"),
    st.Page(HERE / "views" / "sweep.py", title="Sweep"),
]
st.navigation(pages).run()
