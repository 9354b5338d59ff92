"""Which routed tokens are prompt tokens (prefill) and which are generated (decode), and whether a trace can
tell.

Every row of a trace carries ``phase`` (0 prefill, 1 decode; :mod:`traces.format`). Captured traces set it
from the forward pass (the prompt's pass is prefill, every later step decode), synthetic ones from the request
structure they generate, and an importer from what its source says (vLLM's routed-experts array: the prompt's
rows, then the generated ones; SGLang's recorder: the pass's forward mode). A source that does not say writes
phase 0 on every row and records ``"phases_known": false`` in the provenance with a sentence under
``"phase"``; :func:`phase_knowledge` is how a reader asks (``place optimize --phase`` refuses an input that
cannot tell, naming the file and the sentence). Loads files reduce every phase to counts: they cannot tell.
"""
from __future__ import annotations

from typing import Any

PHASES_KNOWN = "phases_known"  # provenance key: true when the rows' phase column says what the source said
PHASE_NAMES = ("prefill", "decode")  # the phase column's values 0 and 1

# the provenance of each kind of input that predates the key, and what it meant
_BY_KIND = {"synthetic": (True, "synthetic requests: prompt tokens prefill, generated tokens decode"),
            "captured": (True, "captured: the prompt's forward pass prefill, every later step decode")}


def phase_knowledge(provenance: dict[str, Any] | None) -> tuple[bool, str]:
    """``(known, sentence)``: whether the trace's ``phase`` column says which tokens were prompt and which
    generated, and the provenance's own words on it."""
    prov = provenance or {}
    sentence = str(prov.get("phase") or "")
    if isinstance(prov.get(PHASES_KNOWN), bool):
        return prov[PHASES_KNOWN], sentence or ("recorded by the source" if prov[PHASES_KNOWN] else "unknown")
    kind = prov.get("kind")
    if kind in _BY_KIND:
        known, why = _BY_KIND[kind]
        return known, sentence or why
    return False, sentence or f"the provenance ({kind or 'none'}) does not say"
