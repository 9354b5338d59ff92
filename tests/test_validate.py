"""Trace validation: each violation a user can make, written into a real Parquet file, gives its exact
one-line message (file, row or row group, field), and `place trace validate` exits 2 on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tracekit import VERSIONS, id_arrays

from moeplace.cli.main import main
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import load_model
from moeplace.traces.format import WRITE_CHECKSUMS, TraceWriter, arrow_schema, file_metadata
from moeplace.traces.validate import check_trace, validate_report, validate_trace

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def tiny():
    # 4 decoder layers, layer 0 dense, MoE layers 1..3, 8 experts, top-2
    return load_model(DATA / "tiny-moe-config.json")


def good_columns(n: int = 6) -> dict:
    """Two tokens x 3 MoE layers, all valid."""
    return {
        "request_id": np.array([0, 0, 0, 1, 1, 1], dtype=np.int64)[:n],
        "position": np.array([0, 0, 0, 0, 0, 0], dtype=np.int32)[:n],
        "phase": np.zeros(n, dtype=np.uint8),
        "step": np.array([0, 0, 0, 1, 1, 1], dtype=np.int64)[:n],
        "layer": np.array([1, 2, 3, 1, 2, 3], dtype=np.uint16)[:n],
        "expert_ids": np.array([[0, 1], [2, 3], [4, 5], [6, 7], [1, 0], [3, 2]], dtype=np.uint16)[:n],
        "gate_weights": np.full((n, 2), 0.5, dtype=np.float32),
    }


def write(
    path: Path,
    model,
    cols: dict,
    *,
    schema: pa.Schema | None = None,
    meta=True,
    row_group_size: int | None = None,
    version: int = 2,
) -> Path:
    """A one-file trace of ``cols`` (``expert_ids`` as [n, k] in any order) laid out as trace format
    ``version`` stores it (tracekit)."""
    k = model.top_k
    arrays = {}
    for name, v in cols.items():
        if name == "expert_ids" and not (isinstance(v, pa.Array) and schema is False):
            arrays.update(id_arrays(v, version))
        elif isinstance(v, pa.Array):
            arrays[name] = v
        elif name == "gate_weights":
            v = np.asarray(v)
            arrays[name] = pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)), v.shape[1])
        else:
            arrays[name] = pa.array(v)
    table = pa.table(arrays)
    if schema is None:  # cast to the contract's schema; schema=False keeps the columns as given
        schema = arrow_schema(k, gate_weights="gate_weights" in arrays, version=version)
        table = table.select(schema.names).cast(schema)
    md = file_metadata(model, {"kind": "synthetic"}, version) if meta else {}
    table = table.replace_schema_metadata(md)
    pq.write_table(table, path, row_group_size=row_group_size, **(WRITE_CHECKSUMS if meta else {}))
    return path


def messages(path) -> list[str]:
    return [str(p) for p in validate_trace(path)]


def test_valid_trace_passes_and_counts(tiny, tmp_path, capsys):
    f = write(tmp_path / "ok.parquet", tiny, good_columns())
    rep = validate_report(f)
    assert rep.ok and rep.num_rows == 6 and rep.num_tokens == 2 and rep.num_files == 1
    assert check_trace(f).num_rows == 6
    assert main(["trace", "validate", str(f)]) == 0
    assert capsys.readouterr().out.strip() == (
        f"{f}: OK: 1 file(s), 6 rows, 2 tokens (model 'tiny-moe': 3 MoE layers x 8 experts, top-2)"
    )


def test_trace_writer_output_validates(tiny, tmp_path):
    rng = np.random.default_rng(1)
    n = 3000
    with TraceWriter(
        tmp_path / "t", tiny, {"kind": "synthetic"}, gate_weights=True, row_group_rows=700, rows_per_file=1300
    ) as w:
        w.write(
            request_id=np.arange(n) // 300,
            position=np.arange(n) // 3 % 100,
            phase=np.zeros(n),
            step=np.arange(n) // 3,
            layer=np.tile([1, 2, 3], n // 3),
            expert_ids=np.argsort(rng.random((n, 8)), axis=1)[:, :2],
            gate_weights=rng.random((n, 2)),
        )
    rep = validate_report(tmp_path / "t")
    assert rep.ok, rep.lines()
    assert rep.num_files == 3 and rep.num_rows == n and rep.num_tokens == n // 3


def test_expert_id_out_of_range(tiny, tmp_path):
    c = good_columns()
    c["expert_ids"][4] = [1, 8]
    f = write(tmp_path / "bad.parquet", tiny, c)
    assert messages(f) == [
        f"{f}: row 4: field 'expert_ids': expert id 8 >= num_experts 8 of model 'tiny-moe'"
    ]


def test_repeated_expert(tiny, tmp_path):
    c = good_columns()
    c["expert_ids"][2] = [5, 5]
    f = write(tmp_path / "bad.parquet", tiny, c)
    assert messages(f) == [f"{f}: row 2: field 'expert_ids': expert 5 repeated in one token's top-2 [5, 5]"]


@pytest.mark.parametrize("version", VERSIONS)
def test_wrong_k(tiny, tmp_path, version):
    c = good_columns()
    c["expert_ids"] = np.array([[0, 1, 2]] * 6, dtype=np.uint16)
    c.pop("gate_weights")
    f = write(tmp_path / "bad.parquet", tiny, c, schema=False, version=version)
    if version == 1:
        assert messages(f) == [
            (f"{f}: field 'expert_ids': lists of 3 per row, expected k = 2 (top_k of model 'tiny-moe')")
        ]
    else:  # the byte planes of version 2: k bytes a row each
        assert messages(f) == [
            f"{f}: field '{name}': 3 bytes per row, expected k = 2 (top_k of model 'tiny-moe')"
            for name in ("expert_delta_lo", "expert_delta_hi")]


def test_dense_layer(tiny, tmp_path):
    c = good_columns()
    c["layer"][3] = 0
    f = write(tmp_path / "bad.parquet", tiny, c)
    assert messages(f) == [
        (f"{f}: row 3: field 'layer': layer 0 is not an MoE layer of model 'tiny-moe' (MoE layers: 1-3)")
    ]


def test_nan_and_negative_weights(tiny, tmp_path):
    c = good_columns()
    c["gate_weights"][1, 1] = np.nan
    c["gate_weights"][5, 0] = -0.25
    f = write(tmp_path / "bad.parquet", tiny, c)
    assert messages(f) == [
        f"{f}: row 1: field 'gate_weights': gate weight nan is not a finite number",
        f"{f}: row 5: field 'gate_weights': gate weight -0.25 is negative",
    ]


def test_step_decreasing_within_and_across_row_groups(tiny, tmp_path):
    c = good_columns()
    c["request_id"] = np.arange(6, dtype=np.int64)  # one token per row, of a trace of one MoE layer:
    c["layer"][:] = 1  # only the steps are wrong
    c["step"] = np.array([0, 0, 5, 3, 3, 3], dtype=np.int64)
    f = write(tmp_path / "bad.parquet", tiny, c, row_group_size=3)

    def messages(path):  # the trace's missing layers 2-3 are the last problem listed, and not this test's
        return [m for m in globals()["messages"](path) if "no rows for MoE layer" not in m]

    assert messages(f) == [
        (
            f"{f}: row 3: field 'step': step 3 decreases from step 5 (the row before); "
            "steps must be non-decreasing"
        )
    ]
    c["step"] = np.array([0, 2, 1, 3, 3, 3], dtype=np.int64)
    f = write(tmp_path / "bad2.parquet", tiny, c, row_group_size=3)
    assert messages(f) == [
        (
            f"{f}: row 2: field 'step': step 1 decreases from step 2 in the row before; "
            "steps must be non-decreasing"
        )
    ]


def test_step_decreasing_across_files(tiny, tmp_path):
    d = tmp_path / "dir"
    d.mkdir()
    c = good_columns()
    write(d / "part-00000.parquet", tiny, c)
    c2 = good_columns()
    c2["request_id"] += 2  # other tokens than the first file's: only the steps are wrong
    c2["step"] = np.zeros(6, dtype=np.int64)
    f2 = write(d / "part-00001.parquet", tiny, c2)
    assert messages(d) == [
        (
            f"{f2}: row 0: field 'step': step 0 decreases from step 1 (the last row of "
            "part-00000.parquet); steps must be non-decreasing"
        )
    ]


def test_missing_and_mistyped_columns(tiny, tmp_path):
    c = good_columns()
    c.pop("phase")
    c["position"] = c["position"].astype(np.float64)
    f = write(tmp_path / "bad.parquet", tiny, c, schema=False)
    assert messages(f) == [
        f"{f}: field 'phase': required column missing (expected uint8)",
        f"{f}: field 'position': type double, expected int32",
    ]


def test_null_values(tiny, tmp_path):
    c = good_columns()
    c["request_id"] = pa.array([0, None, 0, 1, 1, 1], pa.int64())
    f = write(tmp_path / "bad.parquet", tiny, c, schema=False)
    assert messages(f) == [f"{f}: row 1: field 'request_id': null value (the column must be complete)"]


def test_missing_model_metadata(tiny, tmp_path):
    f = write(tmp_path / "bad.parquet", tiny, good_columns(), meta=False)
    assert messages(f) == [
        (
            f"{f}: metadata 'moeplace.model' missing: not a moeplace trace (import it with "
            "`place trace import`)"
        )
    ]


def test_inconsistent_models_in_directory(tiny, k3, tmp_path):
    d = tmp_path / "dir"
    d.mkdir()
    f0 = write(d / "part-00000.parquet", tiny, good_columns())
    k3_cols = good_columns()
    k3_cols["expert_ids"] = np.tile(np.arange(16, dtype=np.uint16), (6, 1))
    k3_cols["gate_weights"] = np.full((6, 16), 0.1, dtype=np.float32)
    k3_cols["step"] = k3_cols["step"] + 10
    f1 = write(d / "part-00001.parquet", k3, k3_cols)
    assert messages(d) == [
        (
            f"{f1}: metadata 'moeplace.model' declares model 'kimi-k3' (92 MoE layers x 896 "
            f"experts, top-16), inconsistent with {f0} ('tiny-moe'); one trace directory holds "
            "one model"
        )
    ]


def test_truncated_and_corrupt_files(tiny, tmp_path):
    f = write(tmp_path / "t.parquet", tiny, good_columns())
    data = f.read_bytes()
    trunc = tmp_path / "trunc.parquet"
    trunc.write_bytes(data[: len(data) // 2])
    (msg,) = messages(trunc)
    assert msg.startswith(f"{trunc}: not a readable Parquet file: truncated or corrupt (")
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"PAR1" + b"\x00" * 64)
    (msg,) = messages(junk)
    assert msg.startswith(f"{junk}: not a readable Parquet file: truncated or corrupt (")


def test_corrupt_row_group_is_named(tiny, tmp_path):
    c = good_columns()
    f = write(tmp_path / "t.parquet", tiny, c, row_group_size=3)
    md = pq.ParquetFile(f).metadata
    col = md.row_group(1).column(5)  # expert_ids in row group 1
    data = bytearray(f.read_bytes())
    start = col.data_page_offset
    data[start : start + col.total_compressed_size] = b"\xff" * col.total_compressed_size
    f.write_bytes(bytes(data))
    msgs = messages(f)
    assert len(msgs) == 1 and msgs[0].startswith(f"{f}: row group 1: cannot be decoded: corrupt data (")


def test_all_problems_reported_with_limit_per_kind(tiny, tmp_path):
    n = 60
    c = {
        "request_id": np.zeros(n, dtype=np.int64),
        "position": np.arange(n, dtype=np.int32),
        "phase": np.zeros(n, dtype=np.uint8),
        "step": np.arange(n, dtype=np.int64),
        "layer": np.ones(n, dtype=np.uint16),
        "expert_ids": np.tile(np.array([0, 1], np.uint16), (n, 1)),
    }
    c["expert_ids"][10:30, 1] = 9  # 20 rows out of range
    c["layer"][40:43] = 0  # 3 dense-layer rows
    f = write(tmp_path / "bad.parquet", tiny, c)
    rep = validate_report(f, max_per_kind=5)
    kinds = [p.kind for p in rep.problems]
    assert kinds.count("expert_range") == 5 and kinds.count("layer") == 3
    assert [p.row for p in rep.problems if p.kind == "expert_range"] == [10, 11, 12, 13, 14]
    assert rep.suppressed == {"expert_range": 15}
    assert rep.lines()[-1] == "... and 15 more 'expert_range' problem(s) not listed"
    with pytest.raises(InputError, match=r"row 40: field 'layer': layer 0 is not an MoE layer .*\(MoE layers: 1-3\)$"):
        check_trace(f)


def test_cli_exit_code_and_one_line_errors(tiny, tmp_path, capsys):
    c = good_columns()
    c["expert_ids"][0] = [3, 3]
    c["layer"][1] = 0
    f = write(tmp_path / "bad.parquet", tiny, c)
    assert main(["trace", "validate", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        (
            f"place: error: {f}: row 1: field 'layer': layer 0 is not an MoE layer of model 'tiny-moe' "
            "(MoE layers: 1-3)"
        ),
        f"place: error: {f}: row 0: field 'expert_ids': expert 3 repeated in one token's top-2 [3, 3]",
    ]
    assert main(["trace", "validate", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"place: error: {tmp_path / 'nope'}: no such file or directory"


def test_domain_column_nulls_and_dictionary_type(tiny, tmp_path):
    c = good_columns()
    c["domain"] = pa.array(["code", "math", None, "code", "code", "math"], pa.string())
    f = write(tmp_path / "bad.parquet", tiny, c, schema=False)
    assert messages(f) == [f"{f}: row 2: field 'domain': null value (the column must be complete)"]
    c["domain"] = pa.array(["code", "math", "chat", "code", "code", "math"]).dictionary_encode()
    f = write(tmp_path / "dict.parquet", tiny, c, schema=False)
    assert messages(f) == []


def test_a_token_is_processed_in_one_step(tiny, tmp_path):
    c = good_columns()
    c["request_id"] = np.zeros(6, dtype=np.int64)  # (request 0, position 0) in steps 0 and 1
    f = write(tmp_path / "bad.parquet", tiny, c, row_group_size=2)
    assert messages(f) == [
        (f"{f}: row 3: field 'position': token (request 0, position 0) in step 1 was already in step 0 (row 0): "
         "a (request_id, position) is one token, processed in one step")
    ]


def test_request_id_and_position_ranges(tiny, tmp_path):
    c = good_columns()
    c["request_id"] = np.array([-2, -2, -2, 1 << 39, 1 << 39, 1 << 39], dtype=np.int64)
    f = write(tmp_path / "bad.parquet", tiny, c)
    got = messages(f)
    assert got[0] == f"{f}: row 0: field 'request_id': request_id -2 outside [0, {(1 << 39) - 1}]"
    c = good_columns()
    c["position"] = np.array([0, 0, 0, 1 << 24, 1 << 24, 1 << 24], dtype=np.int32)
    f = write(tmp_path / "bad2.parquet", tiny, c)
    assert messages(f)[0] == (f"{f}: row 3: field 'position': position {1 << 24} beyond {(1 << 24) - 1}, "
                              "the longest context a trace holds")

