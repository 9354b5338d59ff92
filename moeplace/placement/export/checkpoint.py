"""``place export PLACEMENT --format checkpoint --model-path SRC --out DST``: a relabelled copy of a safetensors
checkpoint whose engine layout (contiguous blocks, or vLLM ``round_robin``) is the placement
(:mod:`moeplace.placement.relabel` says why this is exact and which id goes where).

The copy keeps every tensor name, dtype and shape, and every shard's header byte for byte: only data moves.
DST's ``...experts.{n}.<suffix>`` holds the bytes of SRC's ``...experts.{new2old[n]}.<suffix>`` (wherever in
SRC's shards it lies: packed weights and their scales alike), and a tensor whose dim 0 runs over the experts
(stacked ``experts.gate_up_proj [E, ...]``, the router's ``gate.weight [E, H]``, ``e_score_correction_bias
[E]``) has its rows gathered by ``new2old``. So ``model.safetensors.index.json`` stays valid as it is, the
writer needs no torch and reads any dtype (fp8, packed int4, mxfp4 blocks): it copies byte ranges.

Memory stays bounded (a chunk of at most :data:`CHUNK` bytes at a time); a shard none of whose tensors moves
is hard-linked (same file system) or copied byte for byte (``link=False``). Everything is written into a
temporary directory next to DST, which is renamed onto DST only when complete, with the manifest
``moeplace-relabel.json`` recording the permutation, the layout and the sha256 of the placement and of every
source shard.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moeplace.foundation.checkpoint_files import check_not_relabelled, read_safetensors_header, require_file
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import OutputKind, atomic_path, register_kind
from moeplace.foundation.formats import kind_of, tagged
from moeplace.foundation.model import from_hf_config
from moeplace.foundation.reading import read_json
from moeplace.placement.record import Placement
from moeplace.placement.relabel import (
    ExpertTensor,
    Layout,
    Relabel,
    check_groups,
    classify,
    from_placement,
)

MANIFEST = "moeplace-relabel.json"
CHUNK = 64 << 20  # bytes copied at a time: bounds the memory of a rewrite whatever the tensor size


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: absolute byte range ``[start, end)`` in ``shard``."""

    shard: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class Checkpoint:
    """A safetensors checkpoint directory: its shards (file names, in order), every tensor, the index file
    (``None`` for a single file) and ``config.json``."""

    root: Path
    shards: list[str]
    tensors: dict[str, TensorInfo]
    index: str | None
    config: dict[str, Any]
    data_start: dict[str, int] = field(default_factory=dict)


def read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """``(data_start, header)`` of a safetensors file (8-byte little-endian header length, JSON header),
    checked as the safetensors library checks it before anything is copied
    (:func:`moeplace.foundation.checkpoint_files.read_safetensors_header`)."""
    start, head, _ = read_safetensors_header(path)
    return start, head


def scan(root: str | Path) -> Checkpoint:
    """Read every shard's header (no tensor data) of the checkpoint in ``root``."""
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"--model-path {root}: not a directory (a safetensors checkpoint directory expected)")
    check_not_relabelled(root, MANIFEST)  # as the vLLM plugin refuses one
    cfg_path = root / "config.json"
    require_file(cfg_path, "the checkpoint's config.json, which says which model it is")
    config = read_json(cfg_path, unreadable="not a readable config.json")
    indexes = sorted(p.name for p in root.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise InputError(f"{root}: {len(indexes)} safetensors index files ({', '.join(indexes)}); expected one")
    if indexes:
        index = indexes[0]
        doc = read_json(root / index, unreadable="not a readable safetensors index")
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise InputError(f"{root / index}: field 'weight_map' missing or empty")
        shards = list(dict.fromkeys(str(v) for v in wm.values()))
    else:
        index = None
        shards = sorted(p.name for p in root.glob("*.safetensors"))
        if len(shards) != 1:
            raise InputError(f"{root}: {len(shards)} .safetensors files and no model.safetensors.index.json; "
                             "expected one file or an index")
    ck = Checkpoint(root, shards, {}, index, config)
    for s in shards:
        path = root / s
        if "/" in s or s.startswith("."):
            raise InputError(f"{root / index}: shard name {s!r} is not a file in the checkpoint directory")
        require_file(path, f"a shard named in {index}" if index else "the checkpoint's one shard")
        start, head, checked = read_safetensors_header(path)  # every tensor checked before a byte moves
        ck.data_start[s] = start
        for name, t in checked.items():
            info = TensorInfo(s, t.dtype, t.shape, t.start, t.end)
            if name in ck.tensors:
                raise InputError(f"{path}: tensor {name} also in {ck.tensors[name].shard}")
            ck.tensors[name] = info
        if index is not None:
            missing = [n for n, v in wm.items() if v == s and n not in head]
            if missing:
                raise InputError(f"{root / index}: tensor {missing[0]} is mapped to {s}, which does not hold it")
    return ck


# ---------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Piece:
    """A byte range of DST's data: ``length`` bytes from SRC's ``shard`` at ``offset``."""

    shard: str
    offset: int
    length: int


@dataclass
class Plan:
    """What DST's shards hold: per shard, the ordered pieces of its data section (``None``: unchanged)."""

    relabel: Relabel
    pieces: dict[str, list[Piece] | None]
    counts: dict[str, int]
    untouched_layers: list[int]
    n_group: int
    topk_group: int


def _rows(info: TensorInfo, rows: np.ndarray, name: str, E: int) -> list[Piece]:
    if not info.shape or info.shape[0] != E or info.nbytes % E:
        raise InputError(f"tensor {name} ({info.shard}): shape {list(info.shape)}, expected {E} expert rows "
                         "along dim 0 to permute")
    size = info.nbytes // E
    return [Piece(info.shard, info.start + int(r) * size, size) for r in rows]


def plan(ck: Checkpoint, placement: Placement, layout: Layout, *, placement_name: str = "placement") -> Plan:
    """Check the checkpoint against the placement and say which bytes go where. Refuses (one line) a
    placement with replicas, a model whose expert count or MoE layers differ, a renaming that splits a
    routing group, and a checkpoint whose expert tensors do not line up."""
    spec = from_hf_config(ck.config, source=str(ck.root / "config.json"))
    if spec.num_experts != placement.num_experts or tuple(spec.moe_layers) != tuple(placement.moe_layers):
        raise InputError(f"{placement_name}: made for '{placement.model_name}' ({placement.num_experts} experts, "
                         f"{len(placement.moe_layers)} MoE layers) but {ck.root / 'config.json'} is a "
                         f"{spec.hf_model_type} with {spec.num_experts} experts and {spec.num_moe_layers} MoE layers")
    relabel = from_placement(placement, layout)  # refuses replicas
    check_groups(relabel.new2old, spec.n_group, spec.topk_group, placement_name)
    E = placement.num_experts
    counts = {"expert": 0, "stacked": 0, "router": 0, "bias": 0}
    seen: set[int] = set()
    untouched: set[int] = set()
    changed: dict[str, dict[str, list[Piece]]] = {}
    for name, info in ck.tensors.items():
        t: ExpertTensor | None = classify(name)
        if t is None:
            continue
        if relabel.moe_index(t.layer) is None:
            untouched.add(t.layer)
            continue
        seen.add(t.layer)
        if t.role == "expert":
            if t.expert >= E:
                raise InputError(f"tensor {name} ({info.shard}): expert id {t.expert} out of range [0, {E})")
            src_name = relabel.source_name(t)
            src = ck.tensors.get(src_name)
            if src is None or (src.dtype, src.shape) != (info.dtype, info.shape):
                got = "missing" if src is None else f"{src.dtype} {list(src.shape)}"
                raise InputError(f"tensor {name} ({info.dtype} {list(info.shape)}) would take {src_name}: {got}; "
                                 "experts of one layer must have the same tensors")
            pieces = [Piece(src.shard, src.start, src.nbytes)]
            moved = src_name != name
        elif t.role == "stacked" and not info.shape:
            continue  # one scalar shared by all experts (a per-tensor scale): nothing to permute
        else:
            rows = relabel.rows(t)
            pieces = _rows(info, rows, name, E)
            moved = bool((rows != np.arange(E)).any())
        counts[t.role] += 1
        if moved:
            changed.setdefault(info.shard, {})[name] = pieces
    missing = [d for d in placement.moe_layers if d not in seen]
    if missing:
        raise InputError(f"{ck.root}: no expert tensors found for MoE layer {missing[0]} (layers.{missing[0]}."
                         "mlp.experts.* / block_sparse_moe.experts.*); not a checkpoint layout this export knows")
    by_shard: dict[str, list[tuple[int, str]]] = {}
    for n, i in ck.tensors.items():  # once, not once per shard: K3 holds ~0.5 M expert tensors
        if i.shard in changed:
            by_shard.setdefault(i.shard, []).append((i.start, n))
    out: dict[str, list[Piece] | None] = {}
    for s in ck.shards:
        if s not in changed:
            out[s] = None
            continue
        ps: list[Piece] = []
        order = sorted(by_shard[s])
        pos = ck.data_start[s]
        for start, n in order:
            if start > pos:  # bytes between tensors (none in files safetensors writes): kept
                ps.append(Piece(s, pos, start - pos))
            info = ck.tensors[n]
            ps.extend(changed[s].get(n, [Piece(s, info.start, info.nbytes)]))
            pos = max(pos, info.end)
        out[s] = ps
    return Plan(relabel, out, counts, sorted(untouched), spec.n_group, spec.topk_group)


# ---------------------------------------------------------------------------- writing
def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            if progress:
                progress(len(chunk))
    return h.hexdigest()


def _link_or_copy(src: Path, dst: Path, link: bool) -> str:
    real = Path(os.path.realpath(src))  # a Hugging Face cache snapshot holds symlinks into blobs/
    if link:
        try:
            os.link(real, dst)
            return "linked"
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
                raise
    shutil.copyfile(real, dst)
    return "copied"


def _copy_range(src_fd: int, dst_fd: int, offset: int, length: int, path: Path) -> None:
    """Append ``length`` bytes of ``src_fd`` at ``offset`` to ``dst_fd``: in the kernel (copy_file_range,
    no pass through this process) where the file system allows, else through a bounded buffer."""
    done = 0
    fast = hasattr(os, "copy_file_range")
    while done < length:
        n = min(CHUNK, length - done)
        got = 0
        if fast:
            try:
                got = os.copy_file_range(src_fd, dst_fd, n, offset + done)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                fast = False
        if not fast:
            buf = os.pread(src_fd, n, offset + done)
            got = os.write(dst_fd, buf) if buf else 0
        if got <= 0:
            raise InputError(f"{path}: shorter than its header says (changed while read?)")
        done += got


def _write_shard(ck: Checkpoint, shard: str, pieces: list[Piece], dst: Path) -> None:
    """Write DST's ``shard``: SRC's header bytes as they are, then ``pieces`` in order."""
    handles: dict[str, int] = {}
    out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for p in [Piece(shard, 0, ck.data_start[shard]), *pieces]:
            fd = handles.get(p.shard)
            if fd is None:
                fd = handles[p.shard] = os.open(ck.root / p.shard, os.O_RDONLY)
            _copy_range(fd, out, p.offset, p.length, ck.root / p.shard)
    finally:
        os.close(out)
        for fd in handles.values():
            os.close(fd)


def _is_relabelled(path: Path) -> bool:
    return path.is_dir() and kind_of(read_json(path / MANIFEST)) == "relabel-manifest"


RELABELLED_CHECKPOINT = register_kind(OutputKind("relabelled checkpoint", True, _is_relabelled))


def write_checkpoint(ck: Checkpoint, p: Plan, placement: Placement, placement_path: Path, dst: str | Path, *,
                     link: bool = True, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Write the relabelled checkpoint to ``dst`` (atomically: a temporary sibling renamed at the end) and
    return its manifest. ``progress`` receives one line per shard."""
    say = progress or (lambda s: None)
    t0 = time.perf_counter()
    written: dict[str, dict[str, Any]] = {}
    sources: dict[str, dict[str, Any]] = {}
    moved = 0
    with atomic_path(dst, directory=True) as tmp:
        for i, s in enumerate(ck.shards, 1):
            t1 = time.perf_counter()
            size = (ck.root / s).stat().st_size
            src_sha = sha256_file(ck.root / s)
            sources[s] = {"bytes": size, "sha256": src_sha}
            pieces = p.pieces[s]
            if pieces is None:
                how = _link_or_copy(ck.root / s, tmp / s, link)
                written[s] = {"how": how, "sha256": src_sha}
            else:
                _write_shard(ck, s, pieces, tmp / s)
                moved += size
                written[s] = {"how": "rewritten"}  # its bytes follow from the source's and new2old
            dt = time.perf_counter() - t1
            say(f"[{i}/{len(ck.shards)}] {s}: {written[s]['how']}, {size / 1e6:,.1f} MB in {dt:.2f} s "
                f"({size / 1e6 / max(dt, 1e-9):,.0f} MB/s, source sha256 included)")
        others = []
        for d, dirs, files in os.walk(ck.root):
            dirs[:] = [x for x in dirs if not x.startswith(".")]
            rel = Path(d).relative_to(ck.root)
            for fn in files:
                if fn.startswith(".") or (rel == Path(".") and (fn in ck.shards or fn == MANIFEST)):
                    continue
                (tmp / rel).mkdir(parents=True, exist_ok=True)
                shutil.copyfile(os.path.realpath(Path(d) / fn), tmp / rel / fn)  # config, tokenizer, index
                others.append(str(rel / fn))
        manifest = tagged("relabel-manifest", {
            "model": placement.model_name,
            "hf_model_type": str(ck.config.get("model_type", "")),
            "layout": p.relabel.layout.name,
            "num_experts": placement.num_experts,
            "moe_layers": list(placement.moe_layers),
            "num_gpus": placement.num_gpus,
            "gpus_per_node": placement.gpus_per_node,
            "n_group": p.n_group,
            "topk_group": p.topk_group,
            "placement": {"file": placement_path.name, "sha256": sha256_file(placement_path),
                          "fingerprint": placement.fingerprint()},
            "tensors_relabelled": p.counts,
            "untouched_moe_layers": p.untouched_layers,
            "source_shards": sources,
            "shards": written,
            "copied_files": sorted(others),
            "new2old": p.relabel.new2old.tolist(),
        })
        rows = ",\n  ".join(json.dumps(r, separators=(",", ":")) for r in manifest.pop("new2old"))
        head = json.dumps(manifest, indent=1)[:-2]
        (tmp / MANIFEST).write_text(f'{head},\n "new2old": [\n  {rows}\n ]\n}}\n')
    manifest["new2old"] = p.relabel.new2old.tolist()
    manifest["seconds"] = time.perf_counter() - t0
    manifest["rewritten_bytes"] = moved
    return manifest
