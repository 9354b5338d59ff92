"""Calibration profile: measured operation times that correct the roofline cost model.

Written by ``kernels/`` (``place kernels bench --out profile.json``), read by ``place simulate --profile``.
Schema (JSON object)::

    {
      "format": "moeplace.calibration/1",
      "device": "NVIDIA H200" | "cpu" | ...,       # what was measured
      "dtype": "bf16",                              # expert GEMM compute dtype measured
      "world_size": 4,                              # EP ranks of the dispatch/combine measurement
      "ops": {
        "expert_gemm": {"x": "tokens_per_expert", "hidden": 3584, "intermediate": 3072,
                        "points": [[1, 2.1e-5], [16, 2.3e-5], [256, 6.0e-5], ...]},
        "dispatch":    {"x": "bytes", "link": "nvlink", "points": [[4096, 3.0e-5], ...]},
        "combine":     {"x": "bytes", "link": "any",    "points": [...]},
        "permute":     {"x": "selections", "points": [...]}
      },
      "provenance": {...}                           # free-form: host, torch version, grid
    }

``points`` are ``[x, seconds]`` pairs with strictly increasing ``x > 0`` (at least two). Meaning of each
operation's time:

- ``expert_gemm``: one local expert's gated MLP (gate+up GEMM, SiLU, down GEMM) on ``x`` tokens.
- ``dispatch`` / ``combine``: one EP rank's all-to-all sending ``x`` bytes in total (``link`` says over
  which link kind: ``nvlink``, ``nic`` or ``any``).
- ``permute``: one rank's sort/scan of ``x`` (token, expert) selections into destination order.

How the cost model applies it (:func:`Profile.time`): piecewise-linear interpolation between the
measured points; below the first point the first time (kernels do not get faster than launch latency);
above the last point, linear extrapolation along the last segment. For ``expert_gemm`` measured at a
different (hidden, intermediate) than the simulated model, the time is scaled by the ratio of FLOPs
per token (``hidden * intermediate``), so a profile taken on a small CPU shape still corrects the
*shape* of the time-vs-tokens curve. Operations missing from the profile keep the roofline.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.foundation.files import OutputKind, read_json, register_kind, tagged_artifact, write_text_atomic
from moeplace.foundation.formats import check, tag

PROFILE_FORMAT = tag("calibration")
OPS: dict[str, str] = {
    "expert_gemm": "tokens_per_expert",
    "dispatch": "bytes",
    "combine": "bytes",
    "permute": "selections",
}
LINKS = ("nvlink", "nic", "any")


@dataclass(frozen=True, eq=False)
class OpCurve:
    """Measured seconds at increasing ``x``: float64 ``x [n]`` and ``seconds [n]``."""

    x: np.ndarray
    seconds: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)

    def __call__(self, x: np.ndarray | float) -> np.ndarray:
        """Piecewise-linear in ``x``; first value below range; last segment extrapolated above."""
        xs, ys = self.x, self.seconds
        xv = np.asarray(x, dtype=np.float64)
        out = np.interp(xv, xs, ys)
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return np.where(xv > xs[-1], ys[-1] + slope * (xv - xs[-1]), out)


@dataclass(frozen=True, eq=False)
class Profile:
    device: str
    dtype: str
    ops: dict[str, OpCurve]
    world_size: int = 0
    provenance: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    def has(self, op: str) -> bool:
        return op in self.ops

    def time(self, op: str, x: np.ndarray | float) -> np.ndarray:
        return self.ops[op](x)

    def to_dict(self) -> dict[str, Any]:
        ops = {}
        for name, c in self.ops.items():
            ops[name] = {"x": OPS[name], **c.meta, "points": [[float(a), float(b)] for a, b in zip(c.x, c.seconds)]}
        return {"format": PROFILE_FORMAT, "device": self.device, "dtype": self.dtype, "world_size": self.world_size,
                "ops": ops, "provenance": self.provenance}

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), indent=1) + "\n")


def profile_from_dict(d: Any, source: str = "profile") -> Profile:
    """Validate a parsed profile; every error names the file and the field."""
    check(d, "calibration", source)
    for key in ("device", "dtype"):
        if not isinstance(d.get(key), str) or not d[key]:
            raise InputError(f"{source}: field '{key}' must be a non-empty string")
    ops_in = d.get("ops")
    if not isinstance(ops_in, dict) or not ops_in:
        raise InputError(f"{source}: field 'ops' must be an object with at least one of {sorted(OPS)}")
    ops: dict[str, OpCurve] = {}
    for name, spec in ops_in.items():
        f = f"ops.{name}"
        if name not in OPS:
            raise InputError(f"{source}: field '{f}': unknown operation (expected one of {sorted(OPS)})")
        if not isinstance(spec, dict):
            raise InputError(f"{source}: field '{f}' must be an object")
        if spec.get("x", OPS[name]) != OPS[name]:
            raise InputError(f"{source}: field '{f}.x' is {spec.get('x')!r}, expected {OPS[name]!r}")
        pts = spec.get("points")
        try:
            arr = np.asarray(pts, dtype=np.float64)
        except (TypeError, ValueError):
            raise InputError(f"{source}: field '{f}.points' must be a list of [x, seconds] numbers") from None
        if arr.ndim != 2 or arr.shape[1] != 2 or arr.shape[0] < 2:
            raise InputError(f"{source}: field '{f}.points' must hold >= 2 [x, seconds] pairs")
        if not np.all(np.isfinite(arr)) or np.any(arr[:, 0] <= 0) or np.any(arr[:, 1] < 0):
            raise InputError(f"{source}: field '{f}.points': x must be > 0 and seconds >= 0 (finite)")
        bad = np.nonzero(np.diff(arr[:, 0]) <= 0)[0]
        if bad.size:
            raise InputError(f"{source}: field '{f}.points': row {int(bad[0]) + 1}: x must be strictly increasing")
        meta = {k: v for k, v in spec.items() if k not in ("x", "points")}
        if name == "expert_gemm":
            for k in ("hidden", "intermediate"):
                if k in meta and not (isinstance(meta[k], int) and meta[k] > 0):
                    raise InputError(f"{source}: field '{f}.{k}' must be a positive integer")
        if name in ("dispatch", "combine") and meta.get("link", "any") not in LINKS:
            raise InputError(f"{source}: field '{f}.link' must be one of {LINKS}")
        ops[name] = OpCurve(arr[:, 0].copy(), arr[:, 1].copy(), meta)
    ws = d.get("world_size", 0)
    if not isinstance(ws, int) or ws < 0:
        raise InputError(f"{source}: field 'world_size' must be a non-negative integer")
    return Profile(d["device"], d["dtype"], ops, ws, dict(d.get("provenance") or {}), source)


def load_profile(path: str | Path) -> Profile:
    return profile_from_dict(read_json(path, "no such calibration profile", "not a readable JSON calibration profile"), str(path))


# what `place kernels bench` writes: this profile, and its report of the simulator checked against it
CALIBRATION_PROFILE = register_kind(OutputKind("calibration profile", False, tagged_artifact("calibration")))
KERNEL_REPORT = register_kind(OutputKind("kernel bench report", False,
                                         tagged_artifact("kernel-report", "validation", "raw")))
