"""Artifact format tags: every JSON document moeplace writes for itself names its kind and version in one
field, ``"format": "moeplace.<kind>/<version>"`` (e.g. ``"moeplace.placement/1"``), and every reader
dispatches on that field, never on which other keys a document happens to hold (docs/design.md
"Contracts").

One string rather than two fields because the placement, Loads and calibration files carried exactly this
string from the first release: their files stay readable with no special case.

Rules the readers follow (:func:`check`):

- a document tagged with another kind, a foreign ``format`` value, or a version this release does not read
  is refused with one line naming the file, what it is and what was expected;
- an untagged document is refused, except for a kind that the previous release wrote without a tag
  (``legacy`` below) and only where the reader expects exactly that one kind: then it is read as version 0
  and the reader checks its fields as before. Nothing guesses among kinds: a reader that does not know
  which kind to expect (the dashboard's run-directory scan) classifies tagged documents only.

Engine-facing files (SGLang ``.json``/``.pt``, vLLM/vllm-ascend maps, TensorRT-LLM YAML) are the engines'
formats and carry no tag; neither do inputs written by people (model configs, GPU specs, sweep specs).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from moeplace.foundation.errors import InputError

PREFIX = "moeplace."
FIELD = "format"


@dataclass(frozen=True)
class ArtifactFormat:
    """One artifact kind: the versions this release reads (the last one is what it writes), whether the
    previous release wrote it untagged (so an untagged document of this kind reads as version 0), and
    what writes it (for docs and messages)."""

    kind: str
    versions: tuple[int, ...]
    legacy: bool
    written_by: str

    @property
    def version(self) -> int:
        return self.versions[-1]

    @property
    def tag(self) -> str:
        return f"{PREFIX}{self.kind}/{self.version}"

    @property
    def name(self) -> str:
        return PREFIX + self.kind


FORMATS: dict[str, ArtifactFormat] = {f.kind: f for f in (
    ArtifactFormat("placement", (1,), False, "place optimize --out/--save-all, place import-placement --out"),
    ArtifactFormat("loads", (1,), False, "place trace stats --out x.npz (the 'meta' array), place trace import"),
    ArtifactFormat("calibration", (1,), False, "place kernels bench --out"),
    ArtifactFormat("serving-calibration", (1,), False, "place calibrate --out"),
    ArtifactFormat("trace-stats", (1,), True, "place trace stats --out x.json / --json"),
    ArtifactFormat("memory-plan", (1,), True, "place plan --report / --json"),
    ArtifactFormat("memory-plan-sweep", (1,), True, "place plan --sweep --json"),
    ArtifactFormat("deployment-plan", (1,), False, "place plan --pools --report / --json"),
    ArtifactFormat("comparison", (1,), True, "place optimize --report / --json"),
    ArtifactFormat("metrics", (1,), True, "place evaluate --json"),
    ArtifactFormat("sim-summary", (1,), True, "place simulate --out DIR (summary.json) / --json"),
    ArtifactFormat("sim-config", (1,), True, "place simulate --out DIR (config.json)"),
    ArtifactFormat("chrome-trace", (1,), True, "place simulate --chrome-trace (in 'otherData')"),
    ArtifactFormat("frontier", (1,), True, "place sweep --out DIR (frontier.json) / --json"),
    ArtifactFormat("sweep-scores", (1,), True, "place sweep (cache/placements/<key>.scores.json)"),
    ArtifactFormat("kernel-report", (1,), True, "place kernels bench --report"),
    ArtifactFormat("run", (1,), True, "place demo --out DIR (the .moeplace-run marker)"),
    ArtifactFormat("synth-summary", (1,), True, "place trace synth --json"),
    ArtifactFormat("model-facts", (1,), True, "place model show --json"),
    ArtifactFormat("import-summary", (1,), False, "place trace import --json"),
    ArtifactFormat("trace-validation", (1,), False, "place trace validate --json"),
    ArtifactFormat("placement-import", (1,), False, "place import-placement --json"),
    ArtifactFormat("capture-summary", (1,), False, "place trace capture --json"),
    ArtifactFormat("rebalance-report", (1,), False, "place rebalance --report / --json"),
    ArtifactFormat("engine-capabilities", (1,), False, "place engines --json"),
    ArtifactFormat("relabel-manifest", (1,), False, "place export --format checkpoint (moeplace-relabel.json)"),
    # a routing trace's Parquet files carry the bare version in their footer ('moeplace.format': b"2"), read
    # through check_version; 1 stored each token's top-k in the router's order, 2 as sorted id deltas
    ArtifactFormat("trace", (1, 2), False, "place trace synth / import / capture (Parquet metadata 'moeplace.format')"),
    ArtifactFormat("cost-ensemble", (1,), False, "bench/fidelity.py (moeplace/sim/cost_ensemble.json, package data)"),
)}

_TAG = re.compile(r"moeplace\.([a-z][a-z0-9-]*)/(\d+)")


def tag(kind: str) -> str:
    """The tag this release writes for ``kind`` (``"moeplace.placement/1"``)."""
    return FORMATS[kind].tag


def tagged(kind: str, doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with the tag of ``kind`` as its first field (a document names its kind before its content)."""
    return {FIELD: tag(kind), **{k: v for k, v in doc.items() if k != FIELD}}


def parse(value: Any) -> tuple[str, int] | None:
    """``(kind, version)`` of a tag value; ``None`` when it is not ``moeplace.<kind>/<N>``."""
    m = _TAG.fullmatch(value) if isinstance(value, str) else None
    return (m.group(1), int(m.group(2))) if m else None


def kind_of(doc: Any) -> str | None:
    """The kind a document's tag names, when it is one this release knows (any version); else ``None``.
    For dispatch over documents of unknown kind: the chosen reader then checks the version."""
    p = parse(doc.get(FIELD)) if isinstance(doc, dict) else None
    return p[0] if p and p[0] in FORMATS else None


def check(doc: Any, kind: str, source: str, hint: str = "") -> int:
    """The version of ``doc`` (a parsed JSON value read from ``source``), which must be a ``kind`` document
    of a version this release reads; 0 for an untagged document of a ``legacy`` kind. Anything else raises
    a one-line :class:`InputError` naming ``source`` and what was expected (``hint`` is appended, e.g. how
    to read an engine file instead)."""
    f = FORMATS[kind]
    want = f"expected a {f.name} file" + (f" ({hint})" if hint else "")
    if not isinstance(doc, dict):
        raise InputError(f"{source}: a JSON {_json_type(doc)}, {want}")
    if FIELD not in doc:
        if f.legacy:
            return 0
        raise InputError(f"{source}: field '{FIELD}' missing, {want}")
    value = doc[FIELD]
    p = parse(value)
    if p is None or p[0] not in FORMATS:
        raise InputError(f"{source}: field '{FIELD}' is {_short(value)}, {want}")
    if p[0] != kind:
        raise InputError(f"{source}: field '{FIELD}' says a {PREFIX}{p[0]} file, {want}")
    if p[1] not in f.versions:
        newer = " (written by a newer moeplace?)" if p[1] > f.version else ""
        raise InputError(f"{source}: field '{FIELD}' is {value!r}: version {p[1]} unknown, expected {f.name} "
                         f"version {', '.join(map(str, f.versions))}{newer}")
    return p[1]


def check_version(kind: str, value: str, source: str, field: str) -> int:
    """The version a file of ``kind`` states as a bare number in ``field`` (a Parquet footer's
    ``moeplace.format``), which must be one this release reads; anything else raises a one-line
    :class:`InputError` worded as :func:`check` words a tag."""
    f = FORMATS[kind]
    v = int(value) if value.isdigit() and len(value) < 10 else None
    if v is None or v not in f.versions:
        newer = " (written by a newer moeplace?)" if v is not None and v > f.version else ""
        raise InputError(f"{source + ': ' if source else ''}metadata '{field}' is version {value[:40]!r}; this "
                         f"moeplace reads {f.name} version {', '.join(map(str, f.versions))}{newer}")
    return v


def _json_type(v: Any) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean",
            type(None): "null"}.get(type(v), type(v).__name__)


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."
