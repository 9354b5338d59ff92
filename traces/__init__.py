"""traces/: routing traces of MoE models — model presets, the trace format, synthesis, capture, import,
validation and streaming statistics. Leftmost package of the flow: it imports no other moeplace package."""
