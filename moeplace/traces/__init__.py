"""traces/: routing traces of MoE models — the trace format, synthesis, capture, import, validation and
streaming statistics, and the Loads reduction. Imports only foundation/."""
