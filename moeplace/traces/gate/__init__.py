"""The trace gate's parts (``moeplace.traces.validate`` is the one entry every reader goes through):
problems and their sinks (``report``), file-level checks (``files``), row-group checks (``rows``) and
cross-group order checks (``order``)."""
