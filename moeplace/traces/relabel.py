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
from moeplace.traces.format import META_PROVENANCE, trace_files
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
    """Rewrite the trace at ``src`` (engine ids) to ``out`` (original ids), streaming row groups; every
    column but ``expert_ids`` is copied as it is; each file's provenance records the mapping. Atomic;
    returns the rows written."""
    m = check_map(new2old, model, source or "relabelling")
    lut = np.full((max(model.moe_layers) + 1, model.num_experts), -1, dtype=np.int64)
    lut[list(model.moe_layers)] = m
    rows = 0
    with atomic_path(out, directory=True) as tmp:
        for f in trace_files(src):
            pf = pq.ParquetFile(f)
            meta = dict(pf.schema_arrow.metadata or {})
            prov = json.loads(meta.get(META_PROVENANCE, b"{}") or b"{}")
            prov["relabelled_ids_mapped"] = source or True
            meta[META_PROVENANCE] = json.dumps(prov).encode()
            schema = pf.schema_arrow.with_metadata(meta)
            rel = f.relative_to(src) if Path(src).is_dir() else Path(f.name)
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            with pq.ParquetWriter(tmp / rel, schema, compression="zstd", compression_level=1) as w:
                for batch in pf.iter_batches(batch_size=batch_rows):
                    layer = batch.column("layer").to_numpy().astype(np.int64)
                    col = batch.column("expert_ids")
                    k = col.type.list_size
                    ids = col.values.to_numpy().astype(np.int64).reshape(-1, k)
                    mapped = lut[layer[:, None], ids]
                    if (mapped < 0).any():
                        r = int(np.argwhere(mapped < 0)[0][0])
                        raise InputError(f"{f}: row {rows + r}: layer {int(layer[r])} is not an MoE layer of "
                                         f"'{model.name}'")
                    arr = pa.FixedSizeListArray.from_arrays(pa.array(mapped.reshape(-1).astype(np.uint16)), k)
                    cols = [arr if n == "expert_ids" else batch.column(n) for n in batch.schema.names]
                    w.write_table(pa.Table.from_arrays(cols, schema=schema))
                    rows += batch.num_rows
    return rows
