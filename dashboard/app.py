"""Entry point of the moeplace dashboard: ``place dashboard [RUN_DIR]`` runs ``streamlit run`` on this
file with the run directory in ``$MOEPLACE_RUN_DIR``. One page per stage of the flow."""
from __future__ import annotations

from pathlib import Path

import streamlit as st

from dashboard import data
from dashboard.ui import RUN_DIR_KEY

HERE = Path(__file__).parent

st.set_page_config(page_title="moeplace", layout="wide")

if RUN_DIR_KEY not in st.session_state:
    st.session_state[RUN_DIR_KEY] = data.default_run_dir()
st.sidebar.text_input("Run directory", key=RUN_DIR_KEY,
                      help="what `place demo --out DIR` wrote (traces, placements, plan, simulations)")

pages = [
    st.Page(HERE / "pages" / "overview.py", title="Overview", default=True),
    st.Page(HERE / "pages" / "traces.py", title="Traces"),
    st.Page(HERE / "pages" / "placement.py", title="Placement"),
    st.Page(HERE / "pages" / "plan.py", title="Plan"),
    st.Page(HERE / "pages" / "simulate.py", title="Simulate"),
]
st.navigation(pages).run()
