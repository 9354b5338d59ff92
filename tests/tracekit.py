"""Hand-made trace files for the gate's tests: the columns as given (no checks), with the expert ids laid
out the way a trace of format version 1 (lists, the router's order) or 2 (sorted deltas in byte planes,
``traces.format``) stores them."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from moeplace.traces.format import ID_PLANES, encode_expert_ids

VERSIONS = (1, 2)


def id_arrays(ids, version: int) -> dict[str, pa.Array]:
    """``ids`` ([n, k] integers in any order, possibly repeated or out of range; or a fixed-size-list array,
    nulls allowed) as the Parquet columns of ``version``."""
    if version < 2:
        if isinstance(ids, pa.Array):
            return {"expert_ids": ids}
        v = np.asarray(ids)
        return {"expert_ids": pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)), v.shape[1])}
    mask = None
    if isinstance(ids, pa.Array):
        k = ids.type.list_size
        mask = ids.is_null().to_numpy(zero_copy_only=False)
        ids = ids.values.fill_null(0).to_numpy(zero_copy_only=False).reshape(-1, k)
    v = np.asarray(ids)
    n, k = v.shape
    big = v.max(initial=0) > 65535
    lo, hi, _ = encode_expert_ids(np.minimum(v, 65535).astype(np.uint16) if big else v.astype(np.uint16))
    out = {}
    for name, plane in zip(ID_PLANES, (lo, hi)):
        out[name] = pa.FixedSizeBinaryArray.from_buffers(pa.binary(k), n, [None, pa.py_buffer(plane.tobytes())])
        if mask is not None and mask.any():
            out[name] = pa.array([None if m else b for m, b in zip(mask, out[name].to_pylist())], pa.binary(k))
    return out
