"""foundation/: what every stage reads — user-facing errors, atomic file writes and JSON readers, model
architecture specs and their presets, GPU/cluster specs and the memory/capacity model (``place plan``'s
arithmetic). The bottom layer: it imports no other moeplace package."""
