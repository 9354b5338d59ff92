"""What a Hugging Face checkpoint's own files may hold, checked before anything is allocated or a byte of
tensor data moves: a safetensors header (:func:`read_safetensors_header`) and the numbers of a
``config.json`` (:func:`check_hf_config`).

A relabelled copy (``place export --format checkpoint``) keeps every shard's header byte for byte, so a
header the safetensors library would refuse to load must be refused here, before the copy: the rules are
the library's own (safetensors 0.8, ``SafeTensors::read_metadata`` / ``Metadata::validate``):

- the first 8 bytes are the header's length N (little endian), at most :data:`MAX_HEADER` and within the
  file; the header is UTF-8 JSON, an object, keys unique, nested no deeper than
  :data:`~moeplace.foundation.reading.MAX_DEPTH` (no ``RecursionError``: a header needs 3 levels);
- ``__metadata__``, when present, maps strings to strings;
- every other key is a tensor: ``dtype`` one of :data:`DTYPE_BITS`, ``shape`` a list of whole numbers >= 0,
  ``data_offsets`` two whole numbers ``[begin, end]`` (not floats, strings or booleans);
- ``end - begin`` is the tensor's size (elements x the dtype's bits / 8, a whole number of bytes), and the
  tensors, in offset order, cover the data section exactly: the first begins at 0, each where the last
  ended (no overlap, no gap), the last ends at the end of the file.

A config's numbers are checked for type and range before :func:`foundation.model.from_hf_config` builds
anything per layer: whole numbers (not ``"8"``, ``8.5``, ``true`` or ``null`` where one is required), layers
and experts within the ceilings the rest of moeplace stores them in (:data:`MAX_LAYERS`,
:data:`MAX_EXPERTS`: a trace's ``layer`` and ``expert_ids`` columns are uint16), top-k within the experts,
``topk_group <= n_group`` with the experts split evenly into the groups. A config declaring a billion layers
is refused in microseconds, not after building a billion-entry layer list.
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moeplace.foundation import reading
from moeplace.foundation.errors import InputError
from moeplace.foundation.reading import is_int, quote

MAX_HEADER = 100_000_000  # safetensors' MAX_HEADER_SIZE (bytes of the JSON header)
# bits per element of every dtype safetensors 0.8 reads (its Dtype enum)
DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
              "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
              "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
MAX_LAYERS = 1 << 16  # decoder layers: a trace's layer column is uint16 (indices 0..65535)
MAX_EXPERTS = 65535  # routed experts per layer: expert ids are uint16 (ModelSpec checks the same)
MAX_DIM = 1 << 31  # any other size of a config (hidden size, heads, vocabulary): far beyond any model
# Hugging Face model types of the DeepSeek-V3 family (MLA, n_routed_experts, group-limited routing)
DEEPSEEK_TYPES = ("deepseek_v3", "deepseek_v2", "kimi_k2", "kimi_linear", "kimi_k3")


@dataclass(frozen=True)
class HeaderTensor:
    """One tensor of a checked header: ``[start, end)`` are absolute byte offsets in the file."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_header_raw(p: Path) -> tuple[bytes, bytes, int]:
    """``(the 8-byte length, the header bytes, the file's size)`` of the safetensors file ``p``: a regular file (not a FIFO, a
    device or a directory), a length within safetensors' limit and within the file; an :class:`InputError`
    naming the file otherwise."""
    try:
        with reading.open_regular(p, "a safetensors shard") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) != 8:
                raise InputError(f"{p}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER:
                raise InputError(f"{p}: not a safetensors file (header length {n:,} bytes, over safetensors' "
                                 f"limit of {MAX_HEADER:,})")
            if 8 + n > size:
                raise InputError(f"{p}: not a safetensors file (header length {n:,} bytes, but the file holds "
                                 f"{size - 8:,} after the length)")
            text = f.read(n)
    except FileNotFoundError:
        raise InputError(f"{p}: no such safetensors file") from None
    except OSError as exc:
        raise InputError(f"{p}: cannot be read ({exc.strerror or exc})") from None
    if len(text) != n:
        raise InputError(f"{p}: shorter than its header length says (changed while read?)")
    return raw, text, size


def read_safetensors_header(path: str | os.PathLike) -> tuple[int, dict[str, Any], dict[str, HeaderTensor]]:
    """``(data_start, header, tensors)`` of the safetensors file ``path``: the byte where its data starts, the
    header as parsed and its tensors checked by the rules of the module docstring (an :class:`InputError`
    naming the file, the tensor and the field otherwise). Reads the 8-byte length and the header only."""
    p = Path(path)
    _, text, size = read_header_raw(p)
    n = len(text)
    if not text.lstrip(b" ").startswith(b"{"):
        raise InputError(f"{p}: not a safetensors file (the header is not a JSON object)")
    head = reading.parse_json(text, f"{p}: header", "a safetensors header (JSON)")
    if not isinstance(head, dict):
        raise InputError(f"{p}: not a safetensors file (the header is not a JSON object)")
    return 8 + n, head, check_header(head, p, 8 + n, size)


def check_header(head: dict[str, Any], path: Path, data_start: int, size: int, *, tensors: bool = True
                 ) -> dict[str, HeaderTensor]:
    """The tensors of a parsed header, after every check of the module docstring. A header that passes
    them all takes :func:`_valid_tensors` (K3's shards hold ~0.7 M tensors: no error text is built, the
    back-to-back check runs in numpy); anything else is checked entry by entry, which words the problem.
    ``tensors=False``: the same checks, an empty dict returned (no object made per tensor)."""
    got = _valid_tensors(head, data_start, size, build=tensors)
    return got if got is not None else _check_header_entries(head, path, data_start, size)


def _valid_tensors(head: dict[str, Any], data_start: int, size: int, *, build: bool = True
                   ) -> dict[str, HeaderTensor] | None:
    """The tensors of a header every entry of which passes the checks (plain JSON values only), else None;
    ``build=False``: an empty dict when every check passes."""
    meta = head.get("__metadata__")
    if meta is not None and not (type(meta) is dict
                                 and all(type(k) is str and type(v) is str for k, v in meta.items())):
        return None
    bits_of = DTYPE_BITS
    tensors: dict[str, HeaderTensor] = {}
    begins: list[int] = []
    ends: list[int] = []
    for name, t in head.items():
        if name == "__metadata__":
            continue
        if type(t) is not dict:
            return None
        dtype, shape, offsets = t.get("dtype"), t.get("shape"), t.get("data_offsets")
        bits = bits_of.get(dtype) if type(dtype) is str else None
        if bits is None or type(shape) is not list or type(offsets) is not list or len(offsets) != 2:
            return None
        n = 1
        for d in shape:
            if type(d) is not int or d < 0:
                return None
            n *= d
        b, e = offsets
        if type(b) is not int or type(e) is not int or b < 0 or e < b or e >= 1 << 62:  # int64 below
            return None
        n *= bits
        if n % 8 or e - b != n // 8:
            return None
        if build:
            tensors[name] = HeaderTensor(dtype, tuple(shape), data_start + b, data_start + e)
        begins.append(b)
        ends.append(e)
    if not begins:
        return tensors if data_start == size else None
    lo, hi = np.asarray(begins, dtype=np.int64), np.asarray(ends, dtype=np.int64)
    order = np.lexsort((hi, lo))
    lo, hi = lo[order], hi[order]
    if lo[0] != 0 or data_start + int(hi[-1]) != size or not np.array_equal(lo[1:], hi[:-1]):
        return None
    return tensors


def _check_header_entries(head: dict[str, Any], path: Path, data_start: int, size: int) -> dict[str, HeaderTensor]:
    """:func:`check_header` entry by entry: the first problem as a one-line error."""
    meta = head.get("__metadata__")  # null is none (safetensors reads it as an absent map)
    if meta is not None and not (isinstance(meta, dict)
                                 and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise InputError(f"{path}: field '__metadata__' must map strings to strings, got {quote(meta)}")
    tensors: dict[str, HeaderTensor] = {}
    for name, t in head.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {quote(name)}"
        if not isinstance(t, dict):
            raise InputError(f"{where}: expected {{dtype, shape, data_offsets}}, got {quote(t)}")
        missing = [k for k in ("dtype", "shape", "data_offsets") if k not in t]
        if missing:
            raise InputError(f"{where}: field '{missing[0]}' missing")
        dtype, shape, offsets = t["dtype"], t["shape"], t["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
            raise InputError(f"{where}: field 'dtype' is {quote(dtype)}, not a safetensors dtype "
                             f"({', '.join(DTYPE_BITS)})")
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise InputError(f"{where}: field 'shape' must be a list of whole numbers >= 0, got {quote(shape)}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(x) and x >= 0 for x in offsets)):
            raise InputError(f"{where}: field 'data_offsets' must be two whole numbers [begin, end] >= 0, got "
                             f"{quote(offsets)}")
        begin, end = offsets
        if end < begin:
            raise InputError(f"{where}: field 'data_offsets' {offsets}: end before begin")
        bits = math.prod(shape) * DTYPE_BITS[dtype]
        if bits % 8 or end - begin != bits // 8:
            need = f"{bits / 8:g} bytes" + (" (not a whole number of bytes)" if bits % 8 else "")
            raise InputError(f"{where}: {dtype} {shape} is {need}, but 'data_offsets' {offsets} span "
                             f"{end - begin:,}")
        tensors[name] = HeaderTensor(dtype, tuple(shape), data_start + begin, data_start + end)
    pos, last = data_start, None
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if t.start != pos:
            before = f"tensor {quote(last)}, which ends at {pos - data_start:,}" if last else "the data's start"
            what = "overlaps" if t.start < pos else "leaves a gap after"
            raise InputError(f"{path}: tensor {quote(name)}: 'data_offsets' begin at {t.start - data_start:,}, which "
                             f"{what} {before}; safetensors needs the tensors to cover the data back to back")
        pos, last = t.end, name
    if pos != size:
        raise InputError(f"{path}: " + (f"data_offsets beyond the file: the tensors end at byte {pos:,}, the file "
                                         f"holds {size:,} (truncated?)" if pos > size else
                                         f"the tensors end at byte {pos:,}, but the file holds {size:,}: bytes no "
                                         "tensor covers follow (safetensors refuses such a file)"))
    return tensors


def require_file(path: Path, what: str) -> None:
    """``path`` is a regular file the checkpoint reader may open: missing, a FIFO, a device or a directory is
    one line saying which (``what``: the role, e.g. "the checkpoint's config.json")."""
    try:
        reading.require_regular(path, what)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file ({what})") from None


def check_not_relabelled(root: Path, manifest: str, flag: str = "--model-path") -> None:
    """Refuse a source checkpoint that is itself a relabelled copy (it holds ``manifest``): relabelling it
    again would map the new ids to the intermediate ones without a word of the first renaming (the vLLM
    plugin refuses to relabel such a checkpoint for the same reason)."""
    m = root / manifest
    if not os.path.lexists(m):
        return
    try:
        doc = reading.read_json(m, unreadable="not readable JSON")
    except InputError:
        doc = {}
    planned = doc.get("placement", {}).get("file") if isinstance(doc, dict) and isinstance(doc.get("placement"),
                                                                                             dict) else None
    origin = f", written from placement {quote(planned)}" if planned else ""
    raise InputError(f"{flag} {root}: is already a relabelled checkpoint ({manifest}{origin}); its expert ids are "
                     "not the model's own, and relabelling it again would lose that mapping: relabel the original "
                     f"checkpoint instead, or serve {root} as it is")


# ---------------------------------------------------------------------------- config.json numbers
def _whole(cfg: dict, names: tuple[str, ...], source: str, lo: int, hi: int, required: bool) -> int | None:
    """The first of ``names`` present (and not null) in ``cfg``, a whole number in ``[lo, hi]``."""
    for n in names:
        if n in cfg and cfg[n] is not None:
            v = cfg[n]
            if not is_int(v):
                raise InputError(f"{source}: field '{n}' must be a whole number, got {quote(v)}")
            if not lo <= v <= hi:
                raise InputError(f"{source}: field '{n}' is {v}, expected {lo}..{hi:,}")
            return int(v)
    if required:
        given = [n for n in names if n in cfg]
        if given:
            raise InputError(f"{source}: field '{given[0]}' is null, expected a whole number")
        raise InputError(f"{source}: field '{names[0]}' missing from the Hugging Face config")
    return None


def _int_list(cfg: dict, name: str, source: str, lo: int, hi: int) -> None:
    v = cfg.get(name)
    if v is None:
        return
    if not isinstance(v, list) or not all(is_int(x) and lo <= x <= hi for x in v):
        raise InputError(f"{source}: field '{name}' must be a list of layer numbers {lo}..{hi}, got {quote(v)}")


def check_hf_config(cfg: dict[str, Any], source: str) -> None:
    """Refuse a Hugging Face config whose numbers are of the wrong type or out of range (module docstring),
    before anything is built from them. ``cfg`` is the text config (``text_config`` already taken)."""
    deepseek = str(cfg.get("model_type", "")) in DEEPSEEK_TYPES
    L = _whole(cfg, ("num_hidden_layers",), source, 1, MAX_LAYERS, True)
    assert L is not None
    E = _whole(cfg, ("n_routed_experts", "num_experts") if deepseek else ("num_experts", "num_local_experts"),
               source, 1, MAX_EXPERTS, True)
    assert E is not None
    _whole(cfg, ("num_experts_per_tok", "num_experts_per_token"), source, 1, E, True)
    for names, lo, required in ((("hidden_size",), 1, True), (("vocab_size",), 1, True),
                                (("num_attention_heads",), 1, True), (("intermediate_size",), 1, True),
                                (("max_position_embeddings", "model_max_length"), 0, False)):
        _whole(cfg, names, source, lo, MAX_DIM, required)
    if deepseek:
        _whole(cfg, ("first_k_dense_replace",), source, 0, L, False)
        _whole(cfg, ("moe_layer_freq",), source, 1, L, False)
        _whole(cfg, ("moe_intermediate_size",), source, 1, MAX_DIM, True)
        _whole(cfg, ("routed_expert_hidden_size",), source, 1, MAX_DIM, False)
        _whole(cfg, ("n_shared_experts", "num_shared_experts"), source, 0, MAX_EXPERTS, False)
        for names in (("kv_lora_rank",), ("qk_nope_head_dim",), ("qk_rope_head_dim",), ("v_head_dim",)):
            _whole(cfg, names, source, 0 if names[0] == "qk_nope_head_dim" else 1, MAX_DIM, True)
        _whole(cfg, ("q_lora_rank",), source, 1, MAX_DIM, False)
        groups = _whole(cfg, ("n_group", "num_expert_group"), source, 1, E, False) or 1
        topk_group = _whole(cfg, ("topk_group",), source, 1, MAX_EXPERTS, False) or 1
        if topk_group > groups:
            raise InputError(f"{source}: topk_group {topk_group} is more than n_group {groups} (the router keeps "
                             "the best topk_group of n_group expert groups)")
        if E % groups:
            raise InputError(f"{source}: {E} experts do not split into n_group={groups} equal routing groups")
        lin = cfg.get("linear_attn_config")
        if isinstance(lin, dict):
            _int_list(lin, "kda_layers", f"{source}: linear_attn_config", 1, L)  # Kimi numbers layers from 1
            for names in (("num_heads",), ("head_dim",), ("short_conv_kernel_size",)):
                _whole(lin, names, f"{source}: linear_attn_config", 1, MAX_DIM, False)
        for name in ("mlp_layer_types", "layer_types"):
            v = cfg.get(name)
            if isinstance(v, list) and len(v) != L:
                raise InputError(f"{source}: field '{name}' lists {len(v)} layers, num_hidden_layers is {L}")
    else:
        _whole(cfg, ("decoder_sparse_step",), source, 1, L, False)
        _int_list(cfg, "mlp_only_layers", source, 0, L - 1)
        _whole(cfg, ("num_key_value_heads",), source, 1, MAX_DIM, False)
        _whole(cfg, ("head_dim",), source, 1, MAX_DIM, False)
        _whole(cfg, ("moe_intermediate_size", "intermediate_size"), source, 1, MAX_DIM, True)
        _whole(cfg, ("shared_expert_intermediate_size",), source, 0, MAX_DIM, False)
