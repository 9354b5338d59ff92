"""``place export --verify DST``: prove a relabelled checkpoint against its source and its manifest, byte for
byte, without torch (the checks a user runs before serving DST).

From DST's ``moeplace-relabel.json`` (its permutation ``new2old``, layout and MoE layers) and SRC (the
manifest's source path, or ``--model-path``):

- SRC is the checkpoint the relabelling read: every shard's size and header sha256 as recorded;
- DST names exactly SRC's tensors, each with the dtype and shape of the tensor it must hold;
- every per-expert tensor of every relabelled MoE layer (weights and every scale, any suffix) holds the
  bytes of SRC's ``experts.{new2old[n]}`` tensor of the same suffix;
- every tensor whose dim 0 runs over the experts (router rows, per-expert biases, stacked experts) holds
  SRC's rows in ``new2old`` order;
- every other tensor is SRC's, byte for byte; ``config.json`` is SRC's (its ``quantization_config`` entries
  that name experts renamed through the permutation), the other files too;
- with a placement: the manifest's permutation is that placement's under the manifest's layout.

The first mismatch ends the check (:class:`VerifyFailed`, exit 1), naming the tensor and the shard.
"""
from __future__ import annotations

import json
import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from moeplace.foundation.errors import InputError, MoeplaceError
from moeplace.foundation.reading import read_json
from moeplace.placement.export.checkpoint import (
    CHUNK,
    MANIFEST,
    Checkpoint,
    expert_module_names,
    read_header_bytes,
    scan,
    with_quantization,
)
from moeplace.placement.record import Placement
from moeplace.placement.relabel import (
    Relabel,
    classify,
    permutations,
    quantization_config,
    read_relabel,
    relabel_quantization,
)


class VerifyFailed(MoeplaceError):
    """DST is not SRC relabelled as its manifest says; the message names the first difference."""

    exit_code = 1


class _Files:
    """Read-only memory maps of a checkpoint's shards (opened on first use)."""

    def __init__(self, ck: Checkpoint) -> None:
        self.ck = ck
        self.maps: dict[str, mmap.mmap | bytes] = {}

    def view(self, shard: str) -> mmap.mmap | bytes:
        if shard not in self.maps:
            with open(os.path.realpath(self.ck.root / shard), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self.maps[shard] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        return self.maps[shard]

    def close(self) -> None:
        for m in self.maps.values():
            if isinstance(m, mmap.mmap):
                m.close()
        self.maps.clear()


def _equal(a, a0: int, b, b0: int, n: int) -> bool:
    """``a[a0:a0+n] == b[b0:b0+n]`` for memory maps, compared :data:`CHUNK` bytes at a time."""
    return all(a[a0 + i:a0 + min(n, i + CHUNK)] == b[b0 + i:b0 + min(n, i + CHUNK)] for i in range(0, n, CHUNK))


def _flush(run: list, dv, sf: _Files, shard: str, fail) -> None:
    """Compare a run of DST tensors whose sources are consecutive as one range; where it differs, find and
    name the first tensor that does. Empties ``run``."""
    if not run:
        return
    d0, s0, d1 = run[0][2], run[0][3], run[-1][2]
    if not _equal(dv, d0.start, sf.view(s0.shard), s0.start, d1.end - d0.start):
        for name, src, d, s in run:
            if not _equal(dv, d.start, sf.view(s.shard), s.start, d.nbytes):
                if src != name:
                    t = classify(name)
                    raise fail(f"tensor {name} ({shard}) does not hold the bytes of SRC's {src} ({s.shard}): expert "
                               f"{t.expert} of layer {t.layer} must be original expert {classify(src).expert}")
                raise fail(f"tensor {name} ({shard}) differs from SRC's ({s.shard})")
    run.clear()


def _manifest(dst: Path) -> tuple[dict[str, Any], Relabel]:
    path = dst / MANIFEST
    if not path.is_file():
        raise InputError(f"{dst}: no {MANIFEST} (not a relabelled checkpoint `place export --format checkpoint` "
                         "wrote)")
    rel, _facts = read_relabel(str(path))
    return read_json(path), rel


def verify(dst: str | Path, src: str | Path | None = None, placement: Placement | None = None,
           placement_name: str = "placement", progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Check DST against SRC and its manifest (see the module docstring); raises :class:`VerifyFailed` at
    the first difference, :class:`InputError` for a missing or unreadable input. Returns what was checked."""
    say = progress or (lambda s: None)
    t0 = time.perf_counter()
    dst = Path(dst)
    doc, rel = _manifest(dst)
    if src is None:
        src = (doc.get("source") or {}).get("path")
        if not src:
            raise InputError(f"{dst / MANIFEST}: names no source checkpoint; give it with --model-path SRC")
    fail = lambda msg: VerifyFailed(f"{dst}: {msg}")
    # SRC is the checkpoint the relabelling read (before its headers are checked: a changed shard is a
    # mismatch to report as such, not only a damaged file)
    for s, rec in (doc.get("source_shards") or {}).items():
        path = Path(src) / s
        if "/" in s or s.startswith(".") or not path.is_file():
            raise fail(f"source shard {s} (in the manifest) is not in {src}")
        _, _, sha = read_header_bytes(path)
        if (path.stat().st_size, sha) != (rec.get("bytes"), rec.get("header_sha256", sha)):
            raise fail(f"{path} is not the shard the relabelling read (size or header sha256 differ "
                       "from the manifest's)")
    s_ck = scan(src)
    d_ck = scan(dst, "--verify")
    if placement is not None:
        want = permutations(placement, rel.layout)
        if want.shape != rel.new2old.shape or (want != rel.new2old).any():
            raise fail(f"the manifest's permutation is not {placement_name}'s under the {rel.layout.name} layout")
    if set(d_ck.tensors) != set(s_ck.tensors):
        extra = sorted(set(d_ck.tensors) - set(s_ck.tensors))
        gone = sorted(set(s_ck.tensors) - set(d_ck.tensors))
        raise fail(f"tensor {(extra or gone)[0]} is {'in DST but not in SRC' if extra else 'in SRC but not in DST'}")
    E = rel.num_experts
    ident = np.arange(E)
    sf, df = _Files(s_ck), _Files(d_ck)
    counts = {"expert": 0, "rows": 0, "other": 0}
    nbytes = 0
    try:
        by_shard: dict[str, list[tuple[int, str]]] = {s: [] for s in d_ck.shards}
        for n, i in d_ck.tensors.items():
            by_shard[i.shard].append((i.start, n))
        for k, shard in enumerate(d_ck.shards, 1):
            dv = df.view(shard)
            names = [n for _, n in sorted(by_shard[shard])]  # in file order: DST is read sequentially
            # byte comparisons of consecutive tensors whose sources are consecutive too are merged into one
            # range (a relabelling by renaming leaves whole shards so): few, large compares; a range that
            # differs is then searched tensor by tensor for the first one to name
            run: list[tuple[str, str, Any, Any]] = []  # (name, source name, DST info, SRC info)

            for name in names:
                d = d_ck.tensors[name]
                t = classify(name)
                li = None if t is None else rel.moe_index(t.layer)
                src_name, rows = name, None
                if li is not None and t.role == "expert":
                    if t.expert >= E:
                        raise fail(f"tensor {name} ({shard}): expert id {t.expert} out of range [0, {E})")
                    src_name = rel.source_name(t)
                elif li is not None and d.shape:
                    rows = rel.rows(t)
                s = s_ck.tensors.get(src_name)
                if s is None or (s.dtype, s.shape) != (d.dtype, d.shape):
                    got = "missing" if s is None else f"{s.dtype} {list(s.shape)}"
                    raise fail(f"tensor {name} ({shard}) is {d.dtype} {list(d.shape)}, but {src_name} in SRC is {got}")
                nbytes += d.nbytes
                if rows is not None and (rows != ident).any():
                    _flush(run, dv, sf, shard, fail)
                    if d.shape[0] != E or d.nbytes % E:
                        raise fail(f"tensor {name} ({shard}): shape {list(d.shape)}, expected {E} expert rows")
                    size = d.nbytes // E
                    sv = sf.view(s.shard)
                    bad = next((n for n in range(E)
                                if not _equal(dv, d.start + n * size, sv, s.start + int(rows[n]) * size, size)), None)
                    if bad is not None:
                        raise fail(f"tensor {name} ({shard}): row {bad} is not SRC's row {int(rows[bad])} "
                                   f"(the router / bias rows must follow the experts)")
                    counts["rows"] += 1
                    continue
                counts["expert" if li is not None and t.role == "expert" else
                       "rows" if rows is not None else "other"] += 1
                if run and not (run[-1][3].shard == s.shard and run[-1][3].end == s.start and run[-1][2].end == d.start):
                    _flush(run, dv, sf, shard, fail)
                run.append((name, src_name, d, s))
            _flush(run, dv, sf, shard, fail)
            say(f"[{k}/{len(d_ck.shards)}] {shard}: {len(names):,} tensors match")
    finally:
        sf.close()
        df.close()
    _check_files(s_ck, d_ck, rel, doc, fail)
    return {"verified": str(dst), "source": str(src), "tensors": counts, "bytes": nbytes,
            "layout": rel.layout.name, "seconds": time.perf_counter() - t0}


def _check_files(s_ck: Checkpoint, d_ck: Checkpoint, rel: Relabel, doc: dict[str, Any], fail) -> None:
    """config.json as SRC's (quantization entries renamed), every other copied file byte for byte."""
    want = s_ck.config
    q = quantization_config(s_ck.config)
    if q is not None:
        new_q, n = relabel_quantization(q, rel, lambda: expert_module_names(s_ck.root, rel),
                                        str(s_ck.root / "config.json"))
        if n:
            want = with_quantization(s_ck.config, new_q)
    if json.loads(json.dumps(want)) != d_ck.config:
        raise fail("config.json is not SRC's (with the quantization_config entries that name experts renamed)")
    for rel_name in doc.get("copied_files") or []:
        if rel_name in ("config.json", s_ck.index):
            continue
        a, b = s_ck.root / rel_name, d_ck.root / rel_name
        if not b.is_file() or (a.is_file() and a.read_bytes() != b.read_bytes()):
            raise fail(f"{rel_name} is not SRC's")
