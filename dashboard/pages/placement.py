import streamlit as st; st.title("wip")
