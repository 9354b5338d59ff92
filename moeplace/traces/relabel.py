"""Statistics from a relabelled deployment, back in the original expert ids.

An engine serving a relabelled checkpoint (``place export --format checkpoint``, or the vLLM plugin) knows
its experts by the *engine* ids: its routing logs, load counters and placement dumps say "expert n" where
the original model's expert is ``new2old[l, n]``. Re-planning on those numbers as they are would mix two id
spaces (the optimizer would move expert n believing it is the original n). These functions map engine ids
back, per MoE layer, so every trace and Loads the project keeps is in the original model's ids.

``new2old`` is ``[L, E]`` over ``model.moe_layers`` (the relabel manifest's field; the placement layer reads
it). Pure numpy / pyarrow; no other layer.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moeplace.foundation.errors import InputError
from moeplace.foundation.files import atomic_path
from moeplace.foundation.model import ModelSpec
from moeplace.traces.format import (
    FORMAT_VERSION,
    ID_PLANES,
    META_FORMAT,
    META_PROVENANCE,
    WRITE_CHECKSUMS,
    arrow_schema,
    batch_expert_ids,
    encode_expert_ids,
    file_version,
    trace_files,
)
from moeplace.traces.loads import Loads


def check_map(new2old: np.ndarray, model: ModelSpec, where: str) -> np.ndarray:
    """``new2old`` as int64 ``[L, E]`` for ``model`` (each row a permutation), else a one-line error."""
    m = np.asarray(new2old, dtype=np.int64)
    if m.shape != (model.num_moe_layers, model.num_experts):
        raise InputError(f"{where}: relabelling is [{m.shape[0] if m.ndim else 0} layers][{m.shape[-1] if m.ndim else 0}"
                         f" experts], model '{model.name}' has {model.num_moe_layers} MoE layers x "
                         f"{model.num_experts} experts")
    if not (np.sort(m, axis=1) == np.arange(model.num_experts)).all():
        raise InputError(f"{where}: relabelling is not a permutation in every layer")
    return m


def loads_to_original(loads: Loads, new2old: np.ndarray, source: str = "") -> Loads:
    """Loads counted in engine ids -> the same Loads in original ids: ``out[w, l, new2old[l, n]] =
    in[w, l, n]``; the sampled tokens' expert ids ``[n, L, k]`` are mapped alike."""
    m = check_map(new2old, loads.model, source or "relabelling")
    L = m.shape[0]
    counts = np.empty_like(loads.counts)
    counts[:, np.arange(L)[:, None], m] = loads.counts
    samples = None
    if loads.samples is not None:
        s = np.asarray(loads.samples)
        samples = m[np.arange(L)[None, :, None], np.clip(s, 0, None)]
        samples = np.where(s < 0, s, samples).astype(s.dtype)
    prov = {**loads.provenance, "relabelled_ids_mapped": source or True}
    return Loads(counts, loads.model, loads.window_tokens, loads.labels, prov, samples, loads.sample_windows)


def trace_to_original(src: str | Path, out: str | Path, new2old: np.ndarray, model: ModelSpec,
                      source: str = "", batch_rows: int = 1 << 20) -> int:
    """Rewrite the trace at ``src`` (engine ids) to ``out`` (original ids), streaming row batches; the
    expert ids are mapped (and, in the current trace format, sorted again with their gate weights), every
    other column is copied as it is; each file's provenance records the mapping. Written in the current
    trace format with page checksums whatever the version of ``src``. Atomic; returns the rows written."""
    m = check_map(new2old, model, source or "relabelling")
    lut = np.full((max(model.moe_layers) + 1, model.num_experts), -1, dtype=np.int64)
    lut[list(model.moe_layers)] = m
    k = model.top_k
    rows = 0
    with atomic_path(out, directory=True) as tmp:
        for f in trace_files(src):
            pf = pq.ParquetFile(f)
            meta = dict(pf.schema_arrow.metadata or {})
            version = file_version(meta)
            prov = json.loads(meta.get(META_PROVENANCE, b"{}") or b"{}")
            prov["relabelled_ids_mapped"] = source or True
            names = pf.schema_arrow.names
            schema = arrow_schema(k, **{c: c in names for c in ("gate_weights", "token_id", "domain")})
            meta.update({META_PROVENANCE: json.dumps(prov).encode(), META_FORMAT: FORMAT_VERSION.encode()})
            schema = schema.with_metadata(meta)
            rel = f.relative_to(src) if Path(src).is_dir() else Path(f.name)
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            with pq.ParquetWriter(tmp / rel, schema, compression="zstd", compression_level=1,
                                  use_dictionary=[n for n in schema.names if n not in ID_PLANES],
                                  **WRITE_CHECKSUMS) as w:
                for batch in pf.iter_batches(batch_size=batch_rows):
                    n = batch.num_rows
                    layer = batch.column("layer").to_numpy().astype(np.int64)
                    ids = batch_expert_ids(batch, version, k)
                    mapped = lut[layer[:, None], ids]
                    if (mapped < 0).any():
                        r = int(np.argwhere(mapped < 0)[0][0])
                        raise InputError(f"{f}: row {rows + r}: layer {int(layer[r])} is not an MoE layer of "
                                         f"'{model.name}'")
                    gw = None
                    if "gate_weights" in names:
                        g = batch.column("gate_weights")
                        gw = g.values.slice(g.offset * k, n * k).to_numpy(zero_copy_only=False).reshape(n, k)
                    lo, hi, gw = encode_expert_ids(mapped.astype(np.uint16), gw)
                    cols = {c: batch.column(c) for c in names if c not in ("expert_ids", *ID_PLANES, "gate_weights")}
                    for c, plane in zip(ID_PLANES, (lo, hi)):
                        cols[c] = pa.FixedSizeBinaryArray.from_buffers(pa.binary(k), n, [None, pa.py_buffer(plane)])
                    if gw is not None:
                        cols["gate_weights"] = pa.FixedSizeListArray.from_arrays(
                            pa.array(np.ascontiguousarray(gw, np.float32).reshape(-1)), k)
                    w.write_table(pa.Table.from_arrays([cols[c] for c in schema.names], schema=schema))
                    rows += n
    return rows
