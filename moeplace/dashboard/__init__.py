"""The moeplace dashboard: a Streamlit app over the artifacts of a run directory (``place dashboard``).

``app.py`` is the entry point (``streamlit run dashboard/app.py``); ``views/`` holds one script per page;
``data.py`` finds and loads artifacts through the library functions the CLI uses; ``ui.py`` holds the
helpers the pages share (run-directory picker, error boxes, chart helpers). Nothing here computes a
metric of its own.
"""
