"""``place export PLACEMENT --format checkpoint --model-path SRC --out DST``: a relabelled copy of a safetensors
checkpoint whose engine layout (contiguous blocks, or vLLM ``round_robin``) is the placement
(:mod:`moeplace.placement.relabel` says why this is exact and which id goes where).

A relabelling is a renaming. DST's shard ``s`` holds SRC's shard ``s`` byte for byte from its data section
on; only its header changes: ``...experts.{old}.<suffix>`` is called ``...experts.{old2new[old]}.<suffix>``
(same dtype, shape and byte range: packed weights and every scale move with their expert by construction),
and ``__metadata__`` gains :data:`METADATA_KEY` naming the relabelling (so a weight cache keyed on the
headers tells DST from SRC). ``model.safetensors.index.json`` maps each renamed tensor to the shard its bytes
are in. The only data that changes: tensors whose dim 0 runs over the experts -- the router's ``gate.weight
[E, H]``, ``e_score_correction_bias [E]`` and stacked experts ``experts.gate_up_proj [E, ...]`` -- have their
rows gathered by ``new2old``, written in place over the copied data.

So a shard's data section is copied as one sequential range: ``FICLONERANGE`` (a reflink: XFS, btrfs share
the blocks and DST costs almost no space) where the file system shares blocks, else ``copy_file_range``
(in the kernel), else a bounded read/write loop. The new header is padded with spaces to the source
header's length (or the next multiple of :data:`BLOCK` bytes beyond it) so the data section keeps its
offset within a block, which a reflink needs. A shard nothing in it changes is hard-linked (same file
system) or copied. Free space is checked before anything is written (:func:`needs`).

Everything is written into a temporary directory next to DST, which is renamed onto DST only when complete,
with the manifest ``moeplace-relabel.json``: the permutation, the layout, the placement's sha256, and per
source shard its size and header sha256 (the source's identity; ``full_hash`` adds the sha256 of every byte,
computed in parallel with the copy). :mod:`moeplace.placement.export.verify` proves DST against SRC.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import hashlib
import itertools
import json
import operator
import os
import re
import shutil
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import orjson

from moeplace.foundation import reading
from moeplace.foundation.checkpoint_files import check_header, read_header_raw, require_file
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import TEMP_MARK, OutputKind, atomic_path, register_kind
from moeplace.foundation.formats import kind_of, tagged
from moeplace.foundation.model import from_hf_config
from moeplace.foundation.reading import read_json
from moeplace.placement.record import Placement
from moeplace.placement.relabel import (
    Layout,
    Relabel,
    check_groups,
    classify,
    from_placement,
    quantization_config,
    relabel_quantization,
)

MANIFEST = "moeplace-relabel.json"
METADATA_KEY = "moeplace.relabel"  # the __metadata__ entry of every rewritten shard
CHUNK = 64 << 20  # bytes copied / compared at a time: bounds memory whatever the tensor size
KERNEL_CHUNK = 1 << 30  # bytes a copy_file_range call copies (in the kernel: no buffer here, one GIL hand-back)
# the kernel's copy runs from DST offsets that are multiples of this after the first call: page-cache writes
# from an offset so aligned fill large folios, and the copy costs ~25 % less CPU than from a DST offset one
# page past it, which a new header (the source's length + a block) makes the usual case (measured on ext4)
KERNEL_ALIGN = 2 << 20
BLOCK = 4096  # file-system block: a reflinked range starts at the same offset within a block in both files
FICLONERANGE = 0x4020940D  # linux/fs.h _IOW(0x94, 13, struct file_clone_range)


class TensorInfo(NamedTuple):
    """One tensor of a safetensors file: absolute byte range ``[start, end)`` in ``shard`` (a named tuple:
    K3 has ~0.7 M of them)."""

    shard: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShardHeader:
    """A shard's header: its length (JSON bytes), its sha256 (with the 8 length bytes), the file size and
    the JSON text itself (``text``: kept by a light scan, which the relabelling works on)."""

    length: int
    sha256: str
    size: int
    text: bytes = b""

    @property
    def data_start(self) -> int:
        return 8 + self.length


@dataclass
class Checkpoint:
    """A safetensors checkpoint directory: its shards (file names, in order), every tensor (a full scan;
    empty after a light one), the index file (``None`` for a single file) and ``config.json``."""

    root: Path
    shards: list[str]
    tensors: dict[str, TensorInfo]
    index: str | None
    config: dict[str, Any]
    headers: dict[str, ShardHeader] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(h.size for h in self.headers.values())


def read_header_bytes(path: Path) -> tuple[int, bytes, str]:
    """``(header length, JSON header bytes, sha256 of the length and header bytes)`` of a safetensors file
    (8-byte little-endian header length, then the header): a regular file (not a FIFO, a device or a
    directory), a length within safetensors' limit and within the file."""
    raw, text, _ = read_header_raw(path)
    return len(text), text, hashlib.sha256(raw + text).hexdigest()


def checked_header(head: dict[str, Any], text: bytes, path: Path, data_start: int, size: int, *, tensors: bool = True):
    """:func:`~moeplace.foundation.checkpoint_files.check_header` (``tensors=False``: the checks only, no
    tensor returned); a header it refuses is parsed again by the strict reader first, so a key given twice
    (which orjson collapses) is named as such."""
    try:
        return check_header(head, path, data_start, size, tensors=tensors)
    except InputError:
        reading.parse_json(text, f"{path}: header", "a safetensors header (JSON)")
        raise


def parse_header(text: bytes, path: Path) -> dict[str, Any]:
    """The JSON header, parsed by orjson (K3's headers are ~90 MB of JSON in all: ~5x faster than the
    standard library). What orjson refuses is worded by the strict reader (depth, duplicate keys, numbers);
    a key given twice, which orjson would silently collapse, is refused too: every tensor entry holds one
    ``"data_offsets"``, so fewer tensors than that key's occurrences means a name was repeated."""
    if not text.lstrip(b" ").startswith(b"{"):
        raise InputError(f"{path}: not a safetensors file (the header is not a JSON object)")
    try:
        head = orjson.loads(text)
    except (ValueError, UnicodeDecodeError):
        head = reading.parse_json(text, f"{path}: header", "a safetensors header (JSON)")  # words the problem
    if not isinstance(head, dict):
        raise InputError(f"{path}: not a safetensors file (the header is not a JSON object)")
    if len(head) - ("__metadata__" in head) < text.count(b'"data_offsets"'):
        reading.parse_json(text, f"{path}: header", "a safetensors header (JSON)")  # names the repeated key
        raise InputError(f"{path}: header: a tensor name or field is given twice")
    return head


def scan(root: str | Path, what: str = "--model-path", *, full: bool = True) -> Checkpoint:
    """Read every shard's header (no tensor data) of the checkpoint in ``root``: with ``full`` every tensor
    (dtype, shape, byte range; what verifying reads), else only each header's text (what relabelling
    rewrites: K3's 0.7 M tensors are not turned into objects)."""
    ck, wm = open_checkpoint(root, what, full=full)
    for s in ck.shards:
        read_shard(ck, s, full=full)
    if wm is not None:
        for x, v in wm.items():
            got = ck.tensors.get(x)
            if got is None or got.shard != str(v):
                raise InputError(f"{ck.root / ck.index}: tensor {x} is mapped to {v}, which does not hold it")
    return ck


def open_checkpoint(root: str | Path, what: str = "--model-path", *, full: bool = False
                    ) -> tuple[Checkpoint, dict[str, Any] | None]:
    """The checkpoint in ``root`` before its headers are read (:func:`read_shard` reads each): its config,
    index and shards, each a regular file in the directory; with ``full`` also the index's weight map."""
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"{what} {root}: not a directory (a safetensors checkpoint directory expected)")
    cfg_path = root / "config.json"
    require_file(cfg_path, "the checkpoint's config.json, which says which model it is")
    config = read_json(cfg_path, unreadable="not a readable config.json")
    if not isinstance(config, dict):
        raise InputError(f"{cfg_path}: not a JSON object")
    indexes = sorted(p.name for p in root.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise InputError(f"{root}: {len(indexes)} safetensors index files ({', '.join(indexes)}); expected one")
    wm = None
    if indexes:
        index = indexes[0]
        if full:
            wm = read_index(root / index)
            shards = list(dict.fromkeys(str(v) for v in wm.values()))
        else:
            shards = index_shards(root / index)
    else:
        index = None
        shards = sorted(p.name for p in root.glob("*.safetensors"))
        if len(shards) != 1:
            raise InputError(f"{root}: {len(shards)} .safetensors files and no model.safetensors.index.json; "
                             "expected one file or an index")
    for s in shards:
        if "/" in s or s.startswith("."):
            raise InputError(f"{root / index}: shard name {s!r} is not a file in the checkpoint directory")
        require_file(root / s, f"a shard named in {index}" if index else "the checkpoint's one shard")
    return Checkpoint(root, shards, {}, index, config), wm


@contextlib.contextmanager
def _gc_paused():
    """The cyclic garbage collector paused: a K3 header parses into ~8,000 dicts and lists, none in a cycle,
    whose allocation would set off collections that walk everything alive (~10 % of the header work)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def read_shard(ck: Checkpoint, s: str, *, full: bool = False) -> ShardHeader:
    """Read, parse and check shard ``s``'s header into ``ck.headers`` (with ``full`` its tensors into
    ``ck.tensors``, else the header's text): every tensor checked before a byte of it moves."""
    path = ck.root / s
    n, text, digest = read_header_bytes(path)
    size = path.stat().st_size
    with _gc_paused():
        head = parse_header(text, path)
        checked = checked_header(head, text, path, 8 + n, size, tensors=full)
        del head
    h = ck.headers[s] = ShardHeader(n, digest, size, b"" if full else text)
    if full:
        for name, x in checked.items():
            if name in ck.tensors:
                raise InputError(f"{path}: tensor {name} also in {ck.tensors[name].shard}")
            ck.tensors[name] = TensorInfo(s, x.dtype, x.shape, x.start, x.end)
    return h




def index_shards(path: Path) -> list[str]:
    """The shards a ``model.safetensors.index.json`` names, in order, read from its text (K3's index names
    0.7 M tensors; a text with escapes, or a ``weight_map`` not a plain map of names to names, is parsed).
    With no escapes every ``"`` delimits a string, so the map's text split at them is ``ws, key, ':', value,
    ',', key, ...`` up to the separator holding its closing brace."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None
    if b"\\" in raw or b'"weight_map"' not in raw:
        return list(dict.fromkeys(str(v) for v in read_index(path).values()))
    start = raw.index(b"{", raw.index(b'"weight_map"')) + 1
    parts = raw[start:].split(b'"')
    after = list(map(bytes.strip, parts[4::4]))  # what follows each value: ',' but after the last
    last = next(itertools.compress(itertools.count(), map(b",".__ne__, after)), None)
    if (parts[0].strip() or last is None or not after[last].startswith(b"}")
            or set(map(bytes.strip, parts[2:4 * last + 3:4])) != {b":"}):
        return list(dict.fromkeys(str(v) for v in read_index(path).values()))
    return [v.decode() for v in dict.fromkeys(parts[3:4 * last + 4:4])]


def new_index(raw: bytes, path: Path, ren: _Renamer) -> bytes:
    """DST's index: SRC's with every per-expert name renamed as in the headers (its shard stays: the bytes did
    not move); parsed and renamed where the text has escapes."""
    ren.count = False
    if b"\\" not in raw:
        return ren.rename_text(raw)
    doc = orjson.loads(raw)
    doc["weight_map"] = {ren.name(k): v for k, v in read_index(path).items()}
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2)


def read_index(path: Path) -> dict[str, Any]:
    """The ``weight_map`` of a ``model.safetensors.index.json`` (~50 MB for K3: orjson)."""
    try:
        doc = orjson.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not a readable safetensors index ({exc})") from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise InputError(f"{path}: field 'weight_map' missing or empty")
    return wm


# ---------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class RowPatch:
    """A tensor of a relabelled layer whose dim 0 runs over the experts: DST's row ``n`` is SRC's row
    ``rows[n]`` (the router, a per-expert bias, stacked experts)."""

    name: str
    info: TensorInfo
    rows: np.ndarray


@dataclass
class ShardPlan:
    """How DST's shard is made: ``header`` the new header bytes (padded) and ``patches`` the row gathers
    written over the copied data; ``header is None``: nothing changes (linked or copied as it is)."""

    header: bytes | None = None
    patches: list[RowPatch] = field(default_factory=list)
    renamed: int = 0


@dataclass
class Plan:
    """The relabelling of one checkpoint: per shard what changes, the new index text (``None``: no index),
    the new quantization config (``None``: unchanged) and what was counted."""

    relabel: Relabel
    shards: dict[str, ShardPlan]
    index_text: bytes | None
    quantization: dict[str, Any] | None
    counts: dict[str, int]
    untouched_layers: list[int]
    n_group: int
    topk_group: int
    tag: str

    def changed(self, shard: str) -> bool:
        return self.shards[shard].header is not None


def relabel_tag(placement: Placement, layout: Layout, new2old: np.ndarray) -> str:
    """The ``__metadata__`` value naming a relabelling: layout, placement fingerprint, permutation hash."""
    digest = hashlib.sha256(np.ascontiguousarray(new2old, dtype=np.int64).tobytes()).hexdigest()[:16]
    return f"layout={layout.name};placement={placement.fingerprint()};new2old={digest}"


# A JSON object key that is one expert's tensor, in a header or index with no escapes (a backslash sends
# the text to the parsed path): the same names as relabel.classify's per-expert pattern. Its three groups
# cover the whole key, quotes included, so re.split keeps every byte: text, '"head', 'id', 'tail"', text, ...
_KEY = re.compile(rb'("(?:[^".\\]*+\.)*?layers\.\d+\.(?:mlp|block_sparse_moe|feed_forward)\.experts\.)(\d+)(\.[^"\\]+")'
                  rb'(?=\s*:)')
_HEAD = re.compile(rb'"(?:[^"\\]*\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe|feed_forward)\.experts\.')
# where a key whose rows follow the experts may be (router, per-expert bias, stacked experts): found by
# these markers, then the key around each is read and its entry parsed (a few per layer, not 0.7 M)
_ROWS_MARKS = (re.compile(rb"\.gate\."), re.compile(rb"\.router\."), re.compile(rb"e_score_correction_bias"),
               re.compile(rb"\.experts\.[A-Za-z_]"))  # each with a literal prefix: scanned at memory speed


class _Tables(dict):
    """name head (``"...layers.5.mlp.experts.``, quote included) -> old id -> new id, all as spelled bytes;
    a head of a layer outside the relabelling maps every id to itself."""

    def __init__(self, ren: _Renamer) -> None:
        super().__init__()
        self.ren = ren

    def __missing__(self, head: bytes) -> dict[bytes, bytes]:
        layer = _HEAD.match(head)[1]
        tab = self.ren.ids.get(layer)
        if tab is None:
            self.ren.untouched.add(int(layer))
            tab = _Identity()
        self[head] = tab
        return tab


class _Identity(dict):
    def __missing__(self, key: bytes) -> bytes:
        return key


class _Renamer:
    """Renames per-expert keys in header / index text through a :class:`Relabel`, counting per layer the
    tensors each expert suffix has (every expert of a layer must have the same ones)."""

    def __init__(self, rel: Relabel, E: int) -> None:
        self.E = E
        # decoder layer (as the name spells it) -> old id (as spelled) -> new id: no int() per tensor
        self.ids = {str(d).encode(): {str(e).encode(): str(n).encode() for e, n in enumerate(rel.old2new[i])}
                    for i, d in enumerate(rel.moe_layers)}
        self.seen: dict[bytes, dict[bytes, int]] = {}  # layer -> tail -> tensors
        self.heads: dict[bytes, bytes] = {}  # layer -> the names' head up to the id ("...layers.5.mlp.experts.")
        self.untouched: set[int] = set()
        self.renamed = 0
        self.changed = 0  # tensors whose id changes
        self.count = True
        self.tables = _Tables(self)

    def rename_text(self, text: bytes) -> bytes:
        """``text`` (no escapes) with every per-expert key renamed: one re.split, then list operations per key
        (K3's 0.7 M keys: no Python call per key)."""
        parts = _KEY.split(text)
        heads, ids = parts[1::4], parts[2::4]
        tables = self.tables
        tabs = [tables[h] for h in heads]
        try:
            new = [t[i] for t, i in zip(tabs, ids)]
        except KeyError:  # an id out of range (or spelled with leading zeros): the slow path names it
            for h, i, tail in zip(heads, ids, parts[3::4]):
                self.new_id(h[1:], _HEAD.match(h)[1], i, tail[:-1])
            raise
        if self.count:
            counts = Counter(zip(heads, parts[3::4]))
            for (h, tail), k in counts.items():
                layer = _HEAD.match(h)[1]
                if layer not in self.ids:
                    continue
                tails = self.seen.get(layer)
                if tails is None:
                    tails = self.seen[layer] = {}
                    self.heads[layer] = h[1:]
                tails[tail[:-1]] = tails.get(tail[:-1], 0) + k
                self.renamed += k
            self.changed += sum(map(operator.ne, ids, new))
        parts[2::4] = new
        return b"".join(parts)

    def new_id(self, head: bytes, layer: bytes, e: bytes, tail: bytes) -> bytes | None:
        """The new id of expert ``e``'s tensor ``tail`` in decoder layer ``layer`` (``None``: not relabelled)."""
        ids = self.ids.get(layer)
        if ids is None:
            self.untouched.add(int(layer))
            return None
        new = ids.get(e)
        if new is None:  # out of range, or spelled with leading zeros
            raise InputError(f"tensor {(head + e + tail).decode()}: expert id {e.decode()} is not one of the "
                             f"layer's {self.E} ids 0..{self.E - 1}")
        if self.count:
            tails = self.seen.get(layer)
            if tails is None:
                tails = self.seen[layer] = {}
                self.heads[layer] = head
            tails[tail] = tails.get(tail, 0) + 1
            self.renamed += 1
            self.changed += new != e
        return new

    def name(self, k: str) -> str:
        """The same renaming on a parsed name (headers and indexes with escapes)."""
        t = classify(k)
        if t is None or t.role != "expert":
            return k
        new = self.new_id(t.head.encode(), str(t.layer).encode(), str(t.expert).encode(), t.tail.encode())
        return k if new is None else t.head + new.decode() + t.tail


def _modules(ren: _Renamer, layers: set[int]) -> dict[int, list[tuple[int, str]]]:
    """Per decoder layer of ``layers``: ``(expert id, module name)`` of every per-expert module (a tensor name
    without its last component: what a ``quantization_config`` pattern is matched against). Every expert of
    a layer has the same tensors (:func:`plan` checked), so they are spelled from the layer's name head and
    suffixes."""
    out = {}
    for layer, tails in ren.seen.items():
        d = int(layer)
        if d not in layers:
            continue
        head = ren.heads[layer].decode()
        mods = sorted({t.rsplit(b".", 1)[0].decode() for t in tails})
        out[d] = [(e, f"{head}{e}{m}") for e in range(ren.E) for m in mods]
    return out


def _rename(text: bytes, path: Path, ren: _Renamer) -> bytes:
    """Header text with every per-expert key renamed: in the text where it has no escapes, else parsed."""
    if b"\\" not in text:
        return ren.rename_text(text)
    return orjson.dumps({ren.name(k): v for k, v in parse_header(text, path).items()})


def _with_tag(text: bytes, tag: str, path: Path) -> bytes:
    """``text`` with ``__metadata__`` holding :data:`METADATA_KEY` = ``tag``."""
    entry = orjson.dumps(METADATA_KEY) + b":" + orjson.dumps(tag)
    stripped = text.strip()
    if b"\\" not in text and orjson.dumps(METADATA_KEY) not in text:
        if stripped.startswith(b'{"__metadata__":{'):
            rest = stripped[len(b'{"__metadata__":{'):]
            return b'{"__metadata__":{' + entry + (b"" if rest.lstrip().startswith(b"}") else b",") + rest
        if b'"__metadata__"' not in text and stripped.startswith(b"{"):
            rest = stripped[1:]
            return b'{"__metadata__":{' + entry + b"}" + (b"" if rest.lstrip().startswith(b"}") else b",") + rest
    head = parse_header(text, path)
    meta = head.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise InputError(f"{path}: header entry __metadata__ is not a JSON object")
    return orjson.dumps({"__metadata__": {**meta, METADATA_KEY: tag}, **head})


def _pad(text: bytes, length: int) -> bytes:
    """``text`` padded with spaces to ``length``, or to ``length`` plus whole blocks when it is longer, so the
    data section keeps its offset within a block."""
    if len(text) > length:
        length += -(-(len(text) - length) // BLOCK) * BLOCK
    return text + b" " * (length - len(text))


def _row_entries(text: bytes, path: Path):
    """``(name, entry)`` of the header's keys whose rows may follow the experts (router, per-expert bias,
    stacked experts; :func:`_row_patches` classifies them), the entries parsed one at a time."""
    if b"\\" in text:
        yield from ((k, v) for k, v in parse_header(text, path).items() if isinstance(v, dict)
                    and any(rx.search(k.encode()) for rx in _ROWS_MARKS))
        return
    done: set[int] = set()
    for m in (m for rx in _ROWS_MARKS for m in rx.finditer(text)):
        start = text.rfind(b'"', 0, m.start())
        end = text.find(b'"', m.end())
        if start < 0 or end < 0 or start in done:
            continue
        done.add(start)
        colon = text[end + 1:end + 64].lstrip()
        if not colon.startswith(b":"):
            continue  # a value (dtype), not a key
        brace = text.find(b"{", end)
        close = text.find(b"}", brace)
        try:
            yield text[start + 1:end].decode(), orjson.loads(text[brace:close + 1])
        except ValueError:
            raise InputError(f"{path}: tensor {text[start + 1:end].decode()}: header entry is not JSON") from None


def _row_patches(text: bytes, path: Path, s: str, start: int, size: int, rel: Relabel, E: int, stacked: set[int]
                 ) -> tuple[list[RowPatch], dict[str, int]]:
    """The row gathers of one shard (and, into ``stacked``, the layers whose experts are stacked tensors)."""
    patches: list[RowPatch] = []
    counts = {"stacked": 0, "router": 0, "bias": 0}
    for name, entry in _row_entries(text, path):
        t = classify(name)
        if t is None or t.role == "expert" or rel.moe_index(t.layer) is None:
            continue
        try:
            a, b = entry["data_offsets"]
            info = TensorInfo(s, str(entry["dtype"]), tuple(map(int, entry["shape"])), start + int(a), start + int(b))
        except (ValueError, KeyError, TypeError):
            raise InputError(f"{path}: tensor {name}: header entry is not dtype/shape/data_offsets") from None
        if t.role == "stacked" and not info.shape:
            continue  # one scalar shared by all experts (a per-tensor scale): nothing to permute
        if not info.shape or info.shape[0] != E or info.nbytes % E or not start <= info.start <= info.end <= size:
            raise InputError(f"tensor {name} ({s}): shape {list(info.shape)}, expected {E} expert rows along dim 0 "
                             "to permute, within the file")
        counts[t.role] += 1
        if t.role == "stacked":
            stacked.add(t.layer)
        rows = rel.rows(t)
        if (rows != np.arange(E)).any():
            patches.append(RowPatch(name, info, rows))
    return patches, counts


def plan(ck: Checkpoint, placement: Placement, layout: Layout, *, placement_name: str = "placement") -> Plan:
    """Check the checkpoint (a light :func:`scan`) against the placement and say what changes: each header's
    per-expert names renamed in its text, the rows to gather. Refuses (one line) a placement with replicas, a
    model whose expert count or MoE layers differ, a renaming that splits a routing group, a checkpoint whose
    experts of one layer do not all have the same tensors, and a ``quantization_config`` pattern that names
    some experts only."""
    return Planner(ck, placement, layout, placement_name=placement_name).plan_all()


class Planner:
    """:func:`plan` one step at a time: what needs only the config and the placement when made (the
    refusals of a placement with replicas, another model, a split routing group, a layout vLLM would not
    use), each shard when its header is read (:meth:`shard`), and what spans the shards at the end
    (:meth:`finish`: every expert of a layer has the same tensors, ``quantization_config``, the index).
    :func:`relabel_checkpoint` writes a shard while the next is planned."""

    def __init__(self, ck: Checkpoint, placement: Placement, layout: Layout, *, placement_name: str = "placement"
                 ) -> None:
        spec = from_hf_config(ck.config, source=str(ck.root / "config.json"))
        if spec.num_experts != placement.num_experts or tuple(spec.moe_layers) != tuple(placement.moe_layers):
            raise InputError(f"{placement_name}: made for '{placement.model_name}' ({placement.num_experts} experts, "
                             f"{len(placement.moe_layers)} MoE layers) but {ck.root / 'config.json'} is a "
                             f"{spec.hf_model_type} with {spec.num_experts} experts and {spec.num_moe_layers} MoE "
                             "layers")
        relabel = from_placement(placement, layout)  # refuses replicas
        check_groups(relabel.new2old, spec.n_group, spec.topk_group, placement_name)
        if layout.interleaved and spec.n_group <= 1:
            raise InputError(f"--layout {layout.name}: vLLM 0.34.0 places the experts of a model with one expert "
                             "group linearly whatever --expert-placement-strategy says "
                             f"(determine_expert_placement_strategy), so a {layout.name} relabelling of "
                             f"{spec.hf_model_type} would not be the placement: use --layout contiguous")
        self.ck, self.placement, self.spec, self.relabel = ck, placement, spec, relabel
        self.E = placement.num_experts
        self.ren = _Renamer(relabel, self.E)
        self.tag = relabel_tag(placement, layout, relabel.new2old)
        self.counts = {"expert": 0, "stacked": 0, "router": 0, "bias": 0}
        self.shards: dict[str, ShardPlan] = {}
        self.stacked: set[int] = set()

    def shard(self, s: str) -> ShardPlan:
        """Shard ``s``'s plan (its header read by a light :func:`scan` or :func:`read_shard`)."""
        with _gc_paused():
            return self._shard(s)

    def _shard(self, s: str) -> ShardPlan:
        ck, ren = self.ck, self.ren
        h = ck.headers[s]
        path = ck.root / s
        if not h.text:
            raise InputError(f"{path}: planned from a full scan; relabelling reads the header text (scan(full=False))")
        before = ren.changed
        text = _rename(h.text, path, ren)
        patches, c = _row_patches(h.text, path, s, h.data_start, h.size, self.relabel, self.E, self.stacked)
        for k, v in c.items():
            self.counts[k] += v
        n = ren.changed - before
        if n == 0 and not patches:
            sp = ShardPlan()
        else:
            sp = ShardPlan(_pad(_with_tag(text, self.tag, path), h.length), patches, n)
        self.shards[s] = sp
        return sp

    def plan_all(self) -> Plan:
        """Every shard planned in turn (its header read first where it has not been), then :meth:`finish`:
        the plan-first route."""
        for s in self.ck.shards:
            if s not in self.ck.headers:
                read_shard(self.ck, s)
            self.shard(s)
        return self.finish()

    def finish(self) -> Plan:
        """The plan, after the checks that span the shards."""
        with _gc_paused():
            return self._finish()

    def _finish(self) -> Plan:
        ck, ren, E, relabel = self.ck, self.ren, self.E, self.relabel
        self.counts["expert"] = ren.renamed
        for d in self.placement.moe_layers:
            tails = ren.seen.get(str(d).encode())
            if not tails and d in self.stacked:
                continue
            if not tails:
                raise InputError(f"{ck.root}: no expert tensors found for MoE layer {d} (layers.{d}.mlp.experts.* / "
                                 "block_sparse_moe.experts.*); not a checkpoint layout this export knows")
            short = next(((t, k) for t, k in tails.items() if k != E), None)
            if short is not None:
                raise InputError(f"{ck.root}: MoE layer {d}: {short[1]} of {E} experts have a tensor "
                                 f"experts.N{short[0].decode()}; every expert of a layer must have the same tensors")
        quant = None
        q = quantization_config(ck.config)
        if q is not None:
            moved = {d for i, d in enumerate(relabel.moe_layers) if (relabel.new2old[i] != np.arange(E)).any()}
            new_q, n = relabel_quantization(q, relabel, lambda: _modules(ren, moved), str(ck.root / "config.json"))
            quant = new_q if n else None
        index_text = None
        if ck.index is not None:
            index_text = new_index((ck.root / ck.index).read_bytes(), ck.root / ck.index, ren)
        return Plan(relabel, self.shards, index_text, quant, self.counts, sorted(ren.untouched), self.spec.n_group,
                    self.spec.topk_group, self.tag)


# ---------------------------------------------------------------------------- space
@dataclass(frozen=True)
class Needs:
    """What writing DST takes: ``write`` bytes newly written, ``reflink`` bytes shared with SRC by reflink,
    ``hardlink`` bytes of shards hard-linked; ``free`` bytes free on DST's file system; ``reflinks``: the
    probe found that DST's file system shares blocks with SRC's."""

    write: int
    reflink: int
    hardlink: int
    free: int
    reflinks: bool

    def line(self) -> str:
        gb = lambda b: f"{b / 1e9:,.2f} GB"
        share = (f"{gb(self.reflink)} to link (reflink: the file system shares SRC's blocks)" if self.reflinks
                 else "0 to link (no reflink between SRC and DST: every data byte is copied)")
        hard = f", {gb(self.hardlink)} hard-linked (unchanged shards)" if self.hardlink else ""
        return f"{gb(self.write)} to write, {share}{hard}; {gb(self.free)} free on DST's file system"


def _existing_dir(p: Path) -> Path:
    p = p.resolve()
    while not p.is_dir():
        p = p.parent
    return p


def _clone(src_fd: int, dst_fd: int, src_off: int, length: int, dst_off: int) -> bool:
    """Reflink ``length`` bytes (FICLONERANGE); ``False`` where the file system does not share blocks."""
    try:
        fcntl.ioctl(dst_fd, FICLONERANGE, struct.pack("qQQQ", src_fd, src_off, length, dst_off))
        return True
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EBADF,
                         errno.EPERM, errno.EISDIR):
            return False
        raise


def probe_reflink(src_file: Path, dst_dir: Path) -> bool:
    """Whether a file in ``dst_dir`` can share ``src_file``'s blocks: one block cloned into a temporary
    file there (removed at once)."""
    if src_file.stat().st_size < BLOCK:
        return False
    probe = dst_dir / f".probe{TEMP_MARK}{os.getpid()}-reflink"
    try:
        fd_in = os.open(src_file, os.O_RDONLY)
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            os.close(fd_in)
            return False
        try:
            return _clone(fd_in, fd, 0, BLOCK, 0)
        finally:
            os.close(fd)
            os.close(fd_in)
            os.unlink(probe)
    except OSError:
        return False


def _aligned(src_off: int, dst_off: int, length: int) -> tuple[int, int, int]:
    """``(head, bulk, tail)`` bytes of a range: ``bulk`` whole blocks that a reflink can share (both offsets
    at the same place within a block), ``head``/``tail`` copied."""
    if (src_off - dst_off) % BLOCK:
        return length, 0, 0
    head = min(length, (-src_off) % BLOCK)
    bulk = (length - head) // BLOCK * BLOCK
    return head, bulk, length - head - bulk


def needs(ck: Checkpoint, p: Plan, dst: str | Path, link: bool = True) -> Needs:
    """Bytes to write and to link for DST, from the plan and a reflink probe on DST's file system, and the
    space free there. Writes nothing but the probe's one-block temporary file."""
    free, reflinks, same_fs = _space_facts(ck, dst)
    write = shared = hard = 0
    for s in ck.shards:
        h = ck.headers[s]
        sp = p.shards[s]
        if sp.header is None:
            if link and same_fs:
                hard += h.size
                continue
            head, bulk, tail = _aligned(0, 0, h.size) if reflinks else (h.size, 0, 0)
            write += head + tail
            shared += bulk
            continue
        data = h.size - h.data_start
        d_start = 8 + len(sp.header)
        head, bulk, tail = _aligned(h.data_start, d_start, data) if reflinks else (data, 0, 0)
        patched = sum(x.info.nbytes for x in sp.patches)
        write += d_start + head + tail + (patched if reflinks else 0)
        shared += max(0, bulk - (patched if reflinks else 0))
    # the index, config and the other files are copied (subdirectories too: what _copy_others copies)
    for rel, fn in _other_files(ck):
        write += os.stat(os.path.realpath(ck.root / rel / fn)).st_size
    return Needs(write, shared, hard, free, reflinks)


def _space_facts(ck: Checkpoint, dst: str | Path) -> tuple[int, bool, bool]:
    """``(bytes free on DST's file system, whether it shares SRC's blocks (a reflink probe), whether it is
    SRC's file system)``."""
    where = _existing_dir(Path(dst).parent)
    st = os.statvfs(where)
    first = ck.root / ck.shards[0]
    same_fs = os.stat(where).st_dev == os.stat(first).st_dev
    reflinks = same_fs and probe_reflink(Path(os.path.realpath(first)), where)
    return st.f_bavail * st.f_frsize, reflinks, same_fs


_ENTRY_BOUND = 1024  # bytes: more than the __metadata__ entry naming the relabelling (and its braces) adds


def space_bound(ck: Checkpoint, dst: str | Path, relabel: Relabel) -> Needs:
    """An upper bound on what writing DST takes, known before any header is planned (:func:`open_checkpoint`
    only): every shard rewritten -- none hard-linked, nothing shared by reflink -- with its header grown by
    at most its own length (a renamed id is at most 4 digits longer, in an entry of more than 40 bytes), the
    ``__metadata__`` entry and a block of padding; every other file at most twice its size (an index or
    config written again, indented); and the manifest (``relabel``: its permutation). Reads each shard's 8-byte header length only."""
    free, reflinks, _ = _space_facts(ck, dst)
    write = 0
    for s in ck.shards:
        with open(os.path.realpath(ck.root / s), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
        length = min(struct.unpack("<Q", raw)[0], size) if len(raw) == 8 else size
        write += size + length + _ENTRY_BOUND + BLOCK
    for rel, fn in _other_files(ck):
        write += 2 * os.stat(os.path.realpath(ck.root / rel / fn)).st_size + BLOCK
    write += 1024 * (len(ck.shards) + 64) + 8 * relabel.new2old.size  # the manifest (ids of at most 5 digits)
    return Needs(write, 0, 0, free, reflinks)


def fits(n: Needs) -> bool:
    return n.write + (1 << 20) <= n.free


def check_space(n: Needs, dst: str | Path) -> None:
    if not fits(n):
        raise InputError(f"--out {dst}: the relabelled checkpoint needs {n.write / 1e9:,.2f} GB of new data "
                         f"but its file system has {n.free / 1e9:,.2f} GB free ({n.line()})")


# ---------------------------------------------------------------------------- writing
def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            if progress:
                progress(len(chunk))
    return h.hexdigest()


class _Stopped(Exception):
    """The write was abandoned (the planning found a problem, or the command was interrupted)."""


def _copy(src_fd: int, dst_fd: int, src_off: int, dst_off: int, length: int, path: Path,
          stop: threading.Event | None = None) -> None:
    """``length`` bytes of ``src_fd`` at ``src_off`` to ``dst_fd`` at ``dst_off``: in the kernel
    (copy_file_range, :data:`KERNEL_CHUNK` bytes a call) where the file system allows, else through a
    buffer of :data:`CHUNK` bytes; ``stop`` looked at between calls (a write abandoned stops within one)."""
    done = 0
    fast = hasattr(os, "copy_file_range")
    while done < length:
        if stop is not None and stop.is_set():
            raise _Stopped
        n = min(KERNEL_CHUNK if fast else CHUNK, length - done)
        if fast and (dst_off + done) % KERNEL_ALIGN:
            n = min(n, -(dst_off + done) % KERNEL_ALIGN)
        got = 0
        if fast:
            try:
                got = os.copy_file_range(src_fd, dst_fd, n, src_off + done, dst_off + done)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                fast = False
                n = min(CHUNK, n)
        if not fast:
            buf = os.pread(src_fd, n, src_off + done)
            got = os.pwrite(dst_fd, buf, dst_off + done) if buf else 0
        if got <= 0:
            raise InputError(f"{path}: shorter than its header says (changed while read?)")
        done += got


def copy_region(src_fd: int, dst_fd: int, src_off: int, dst_off: int, length: int, path: Path,
                reflink: bool, stop: threading.Event | None = None) -> int:
    """Copy one sequential range; with ``reflink`` its whole blocks are shared (FICLONERANGE) and the rest
    copied. Returns the bytes shared."""
    head, bulk, tail = _aligned(src_off, dst_off, length) if reflink else (length, 0, 0)
    if bulk and not _clone(src_fd, dst_fd, src_off + head, bulk, dst_off + head):
        head, bulk, tail = length, 0, 0
    if head:
        _copy(src_fd, dst_fd, src_off, dst_off, head, path, stop)
    if tail:
        _copy(src_fd, dst_fd, src_off + head + bulk, dst_off + head + bulk, tail, path, stop)
    return bulk


def _open_source(path: Path) -> int:
    """``path`` opened for reading in order (the kernel reads ahead further, as ``cp`` asks it to)."""
    fd = os.open(path, os.O_RDONLY)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    return fd


@contextlib.contextmanager
def _source_and_new(src: Path, dst: Path, flags: int):
    """``(source fd, new DST fd)``: ``src`` opened as :func:`_open_source`, ``dst`` created (it must not
    exist) with ``flags``; both closed on the way out, the source also when creating DST fails."""
    fd_in = _open_source(src)
    try:
        out = os.open(dst, flags | os.O_CREAT | os.O_EXCL, 0o644)
    except BaseException:
        os.close(fd_in)
        raise
    try:
        yield fd_in, out
    finally:
        os.close(out)
        os.close(fd_in)


def _gather_rows(src_fd: int, dst_fd: int, patch: RowPatch, src_start: int, dst_start: int) -> int:
    """Write DST's rows of ``patch`` (SRC's rows in ``new2old`` order) over the copied data."""
    info = patch.info
    E = len(patch.rows)
    size = info.nbytes // E
    at = info.start - src_start + dst_start
    if info.nbytes <= CHUNK:
        raw = np.frombuffer(os.pread(src_fd, info.nbytes, info.start), dtype=np.uint8)
        if raw.size != info.nbytes:
            raise InputError(f"tensor {patch.name}: the shard is shorter than its header says")
        os.pwrite(dst_fd, raw.reshape(E, size)[patch.rows].tobytes(), at)
    else:
        for n, r in enumerate(patch.rows):
            for off in range(0, size, CHUNK):
                k = min(CHUNK, size - off)
                os.pwrite(dst_fd, os.pread(src_fd, k, info.start + int(r) * size + off), at + n * size + off)
    return info.nbytes


def _write_shard(ck: Checkpoint, shard: str, sp: ShardPlan, dst: Path, reflink: bool,
                 stop: threading.Event | None = None) -> tuple[int, int]:
    """DST's ``shard``: the new header, SRC's data section as one range, the row gathers over it.
    Returns ``(bytes written, bytes shared by reflink)``."""
    h = ck.headers[shard]
    src = Path(os.path.realpath(ck.root / shard))
    with _source_and_new(src, dst, os.O_RDWR) as (fd_in, out):
        head = struct.pack("<Q", len(sp.header)) + sp.header
        d_start = len(head)
        shared = copy_region(fd_in, out, h.data_start, d_start, h.size - h.data_start, src, reflink, stop)
        os.pwrite(out, head, 0)
        patched = sum(_gather_rows(fd_in, out, x, h.data_start, d_start) for x in sp.patches)
        return d_start + (h.size - h.data_start - shared) + (patched if shared else 0), max(0, shared - patched)


def _link_or_copy(src: Path, dst: Path, link: bool, reflink: bool, stop: threading.Event | None = None
                  ) -> tuple[str, int, int]:
    """``(how, bytes written, bytes shared)`` of an unchanged shard: hard link, else a copy (reflinked
    where the file system shares blocks)."""
    real = Path(os.path.realpath(src))  # a Hugging Face cache snapshot holds symlinks into blobs/
    if link:
        try:
            os.link(real, dst)
            return "linked", 0, 0
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
                raise
    size = real.stat().st_size
    with _source_and_new(real, dst, os.O_WRONLY) as (fd_in, out):
        shared = copy_region(fd_in, out, 0, 0, size, real, reflink, stop)
    return "copied", size - shared, shared


def _is_relabelled(path: Path) -> bool:
    return path.is_dir() and kind_of(read_json(path / MANIFEST)) == "relabel-manifest"


RELABELLED_CHECKPOINT = register_kind(OutputKind("relabelled checkpoint", True, _is_relabelled))


def write_checkpoint(ck: Checkpoint, p: Plan, placement: Placement, placement_path: Path, dst: str | Path, *,
                     link: bool = True, full_hash: bool = False, space: Needs | None = None, pool: str | None = None,
                     progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Write the relabelled checkpoint to ``dst`` from its plan (atomically: a temporary sibling renamed at
    the end) and return its manifest. ``space``: :func:`needs` of this write (computed and checked when not
    given); ``full_hash``: also record the sha256 of every source byte (hashed on other threads while the
    copy runs). ``progress`` receives one line per shard."""
    space = space or needs(ck, p, dst, link)
    check_space(space, dst)
    shards = ((s, p.shards[s]) for s in ck.shards)
    return _write(ck, shards, lambda: p, placement, placement_path, dst, link=link, full_hash=full_hash,
                  reflinks=space.reflinks, pool=pool, progress=progress)


def relabel_checkpoint(ck: Checkpoint, planner: Planner, placement: Placement, placement_path: Path,
                       dst: str | Path, *, link: bool = True, full_hash: bool = False, space: Needs,
                       pool: str | None = None, progress: Callable[[str], None] | None = None
                       ) -> tuple[Plan, dict[str, Any]]:
    """Plan and write at once: each shard's header is read, checked and planned (:func:`read_shard`,
    :meth:`Planner.shard`) while the shard before it is copied on another thread, so the header work (K3:
    0.7 M tensors) runs alongside the copy instead of before it. ``ck`` is :func:`open_checkpoint`'s (no
    header read yet) and ``space`` its :func:`space_bound`, checked here before anything is written. DST's
    bytes and manifest are :func:`write_checkpoint`'s from :func:`plan`'s plan; a problem the planning finds
    after writing began (a damaged later shard, experts with differing tensors, a ``quantization_config``
    pattern that cannot be renamed) is the same one-line error and leaves nothing behind: the temporary
    directory is removed, DST not touched. Returns the plan and the manifest."""
    check_space(space, dst)
    done: list[Plan] = []

    def shards():
        for s in ck.shards:
            if s not in ck.headers:
                read_shard(ck, s)
            yield s, planner.shard(s)

    def finish() -> Plan:
        done.append(planner.finish())
        return done[0]

    manifest = _write(ck, shards(), finish, placement, placement_path, dst, link=link, full_hash=full_hash,
                      reflinks=space.reflinks, pool=pool, progress=progress)
    return done[0], manifest


def _put_shard(ck: Checkpoint, s: str, sp: ShardPlan, tmp: Path, link: bool, reflinks: bool,
               stop: threading.Event, drop: bool) -> tuple[dict[str, Any], int, int]:
    """Write DST's shard ``s`` into ``tmp``: ``(its manifest entry, bytes written, bytes shared)``. ``drop``:
    then let the kernel drop the source shard's pages from the page cache (:func:`_drop_cached`)."""
    if stop.is_set():
        raise _Stopped
    h = ck.headers[s]
    if sp.header is None:
        how, w, sh = _link_or_copy(ck.root / s, tmp / s, link, reflinks, stop)
        if drop and how == "copied":
            _drop_cached(ck.root / s)
        return {"how": how, "bytes": h.size, "header_sha256": h.sha256}, w, sh
    w, sh = _write_shard(ck, s, sp, tmp / s, reflinks, stop)
    if drop:
        _drop_cached(ck.root / s)
    return ({"how": "rewritten", "bytes": 8 + len(sp.header) + h.size - h.data_start,
             "header_sha256": hashlib.sha256(struct.pack("<Q", len(sp.header)) + sp.header).hexdigest(),
             "renamed_tensors": sp.renamed, "permuted_tensors": len(sp.patches)}, w, sh)


def _drop_cached(path: Path) -> None:
    """Ask the kernel to drop ``path``'s clean pages from the page cache (``POSIX_FADV_DONTNEED``; the file is
    not touched). The relabelling reads each source byte once: kept, a K3-sized source (1.56 TB) would push
    everything else out of memory, and the kernel's reclaim of those pages while DST is written costs more
    CPU than the copy itself (bench/relabel.py: without this, twice cp's CPU seconds on this 2-core machine)."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(os.path.realpath(path), os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _write(ck: Checkpoint, shards, finish: Callable[[], Plan], placement: Placement, placement_path: Path,
           dst: str | Path, *, link: bool, full_hash: bool, reflinks: bool, pool: str | None,
           progress: Callable[[str], None] | None) -> dict[str, Any]:
    """Write DST from ``shards`` (``(shard, plan)`` in order, each written on one writer thread as it comes,
    while the next is produced) and ``finish()`` (the whole plan, after the last shard); the manifest. Each
    source shard's pages leave the page cache once it is copied (:func:`_drop_cached`), but with
    ``full_hash``, whose hashing threads read the same bytes on their own schedule."""
    say = progress or (lambda s: None)
    t0 = time.perf_counter()
    total_w = total_s = 0
    hasher = ThreadPoolExecutor(max_workers=2) if full_hash else None
    hashes = {s: hasher.submit(sha256_file, Path(os.path.realpath(ck.root / s))) for s in ck.shards} if hasher else {}
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeplace-relabel")
    stop = threading.Event()
    failed: list[BaseException] = []
    n = len(ck.shards)

    def put(i: int, s: str, sp: ShardPlan):
        t1 = time.perf_counter()
        try:
            entry, w, sh = _put_shard(ck, s, sp, tmp, link, reflinks, stop, not full_hash)
        except BaseException as exc:
            stop.set()  # the shards queued after it are not written
            failed.append(exc)
            raise
        dt = time.perf_counter() - t1
        size = ck.headers[s].size
        say(f"[{i}/{n}] {s}: {entry['how']}, {size / 1e6:,.1f} MB in {dt:.2f} s "
            f"({size / 1e6 / max(dt, 1e-9):,.0f} MB/s; {w / 1e6:,.1f} MB written, {sh / 1e6:,.1f} MB "
            "shared by reflink)")
        return entry, w, sh

    switch = sys.getswitchinterval()
    # the writer thread wants the GIL back after each system call; the header work (a Python loop) hands it
    # over within this interval instead of the default 5 ms
    sys.setswitchinterval(min(switch, 1e-4))
    try:
        with atomic_path(dst, directory=True) as tmp:
            try:
                futures = []
                for i, (s, sp) in enumerate(shards, 1):
                    if failed:  # the writer's error, at once: the planning stops
                        break
                    futures.append((s, writer.submit(put, i, s, sp)))
                p = None if failed else finish()
                written = {}
                for s, fut in futures:
                    entry, w, sh = fut.result()  # the first shard that failed raises its error here
                    written[s] = entry
                    total_w += w
                    total_s += sh
            except BaseException:
                stop.set()
                writer.shutdown(wait=True, cancel_futures=True)  # before the temporary directory is removed
                if failed and not isinstance(failed[0], _Stopped):
                    raise failed[0] from None
                raise
            finally:
                writer.shutdown(wait=True)
            assert p is not None
            others = _copy_others(ck, p, tmp)
            sources = {s: {"bytes": ck.headers[s].size, "header_sha256": ck.headers[s].sha256} for s in ck.shards}
            for s, fut in hashes.items():
                sources[s]["sha256"] = fut.result()
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
                "relabel_tag": p.tag,
                "pool": pool,  # the serving pool (prefill / decode) this checkpoint is for; None: the whole deployment
                "source": {"path": str(ck.root.resolve()), "identity": "size + header sha256"
                           + (" + sha256 of every byte" if full_hash else "")},
                "tensors_relabelled": p.counts,
                "untouched_moe_layers": p.untouched_layers,
                "quantization_config_renamed": p.quantization is not None,
                "source_shards": sources,
                "shards": written,
                "copied_files": sorted(others),
                "new2old": p.relabel.new2old.tolist(),
            })
            rows = ",\n  ".join(json.dumps(r, separators=(",", ":")) for r in manifest.pop("new2old"))
            head = json.dumps(manifest, indent=1)[:-2]
            (tmp / MANIFEST).write_text(f'{head},\n "new2old": [\n  {rows}\n ]\n}}\n')
    finally:
        sys.setswitchinterval(switch)
        if hasher is not None:
            hasher.shutdown(cancel_futures=True)
    manifest["new2old"] = p.relabel.new2old.tolist()
    manifest["seconds"] = time.perf_counter() - t0
    manifest["written_bytes"] = total_w
    manifest["reflinked_bytes"] = total_s
    return manifest


def _other_files(ck: Checkpoint) -> Iterator[tuple[Path, str]]:
    """``(directory relative to SRC, file name)`` of every file DST gets a copy of besides the shards: config,
    tokenizer, index and the rest, in subdirectories too; hidden files and directories, SRC's shards and a
    manifest left out."""
    for d, dirs, files in os.walk(ck.root):
        dirs[:] = [x for x in dirs if not x.startswith(".")]
        rel = Path(d).relative_to(ck.root)
        for fn in files:
            if not (fn.startswith(".") or (rel == Path(".") and (fn in ck.shards or fn == MANIFEST))):
                yield rel, fn


def _copy_others(ck: Checkpoint, p: Plan, tmp: Path) -> list[str]:
    """Config, tokenizer, index and the rest: copied, the index and a renamed quantization_config rewritten."""
    others = []
    for rel, fn in _other_files(ck):
        (tmp / rel).mkdir(parents=True, exist_ok=True)
        if rel == Path(".") and fn == ck.index:
            (tmp / fn).write_bytes(p.index_text)
        elif rel == Path(".") and fn == "config.json" and p.quantization is not None:
            (tmp / fn).write_text(json.dumps(with_quantization(ck.config, p.quantization), indent=2) + "\n")
        else:
            shutil.copyfile(os.path.realpath(ck.root / rel / fn), tmp / rel / fn)
        others.append(str(rel / fn))
    return others


def with_quantization(config: dict[str, Any], q: dict[str, Any]) -> dict[str, Any]:
    """``config`` with its ``quantization_config`` (top level or ``text_config``) replaced by ``q``."""
    out = dict(config)
    if isinstance(out.get("quantization_config"), dict):
        out["quantization_config"] = q
    else:
        out["text_config"] = {**out["text_config"], "quantization_config": q}
    return out


# ---------------------------------------------------------------------------- what the vLLM plugin asks
def relabelled_reason(root: str | Path) -> str | None:
    """Why the checkpoint in ``root`` is already relabelled (its manifest, or a shard header naming a
    relabelling in ``__metadata__``); ``None`` when it is not. Every shard's header is looked at: a
    relabelling leaves the shards it did not change as they were (hard links), so the first shard may say
    nothing."""
    root = Path(root)
    if (root / MANIFEST).is_file():
        return f"{root} is already a relabelled checkpoint ({MANIFEST})"
    key = orjson.dumps(METADATA_KEY)
    for shard in sorted(root.glob("*.safetensors")):
        _, text, _ = read_header_raw(shard)
        if key in text:
            return (f"{root} is already a relabelled checkpoint ({shard.name}'s __metadata__ names a relabelling: "
                    f"{METADATA_KEY})")
    return None


def expert_module_names(root: str | Path, rel: Relabel) -> dict[int, list[tuple[int, str]]]:
    """Per relabelled decoder layer that moves: ``(expert id, module name)`` of every per-expert module of the
    checkpoint in ``root`` (what ``quantization_config`` entries are matched against), read off its headers."""
    ck = scan(root, full=False)
    ren = _Renamer(rel, rel.num_experts)
    for s in ck.shards:
        _rename(ck.headers[s].text, ck.root / s, ren)
    E = rel.num_experts
    moved = {d for i, d in enumerate(rel.moe_layers) if (rel.new2old[i] != np.arange(E)).any()}
    return _modules(ren, moved)
