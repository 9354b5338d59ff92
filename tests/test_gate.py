"""One gate: every bad trace (and Loads file) `place trace validate` rejects is rejected by every reader
with the same one-line error, exit code 2 and no traceback; `--max-per-kind` changes the listing only."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fuzzkit import trace_columns
from tracekit import id_arrays

from moeplace.cli.main import main
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import load_model
from moeplace.placement.record import Placement
from moeplace.traces.format import META_FORMAT, WRITE_CHECKSUMS, TraceWriter, arrow_schema, file_metadata
from moeplace.traces.loads import LOADS_FORMAT, Loads, load_loads
from moeplace.traces.stats import compute_stats
from moeplace.traces.validate import check_trace, open_trace, validate_report

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def tiny():
    # 4 decoder layers, layer 0 dense, MoE layers 1..3, 8 experts, top-2
    return load_model(DATA / "tiny-moe-config.json")


def columns(tokens: int = 8) -> dict:
    """``tokens`` tokens (two requests, one step per token) x 3 MoE layers, all valid, with gate weights."""
    cols = trace_columns(tokens)
    cols["gate_weights"] = np.full((tokens * 3, 2), 0.5, np.float32)
    return cols


def write(path: Path, model, cols: dict, *, meta: dict | None = None, row_group_size=None, version: int = 2) -> Path:
    """A one-file trace of ``cols`` (``expert_ids`` as [n, k] in any order, or a list array with nulls) laid
    out as trace format ``version`` stores it (tracekit)."""
    arrays = {}
    for name, v in cols.items():
        if name == "expert_ids":
            arrays.update(id_arrays(v, version))
        elif isinstance(v, pa.Array):
            arrays[name] = v
        elif name == "gate_weights":
            v = np.asarray(v)
            arrays[name] = pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)), v.shape[1])
        else:
            arrays[name] = pa.array(v)
    schema = pa.schema([f.with_nullable(True) for f in arrow_schema(model.top_k, gate_weights=True, version=version)])
    table = pa.table(arrays).select(schema.names).cast(schema)
    md = file_metadata(model, {"kind": "synthetic"}, version)
    md.update(meta or {})
    pq.write_table(table.replace_schema_metadata(md), path, row_group_size=row_group_size, **WRITE_CHECKSUMS)
    return path


def _null_experts(c):
    n = len(c["layer"])
    vals = pa.array(c["expert_ids"].reshape(-1), pa.uint16())
    mask = np.zeros(n, bool)
    mask[4] = True
    c["expert_ids"] = pa.FixedSizeListArray.from_arrays(vals, 2, mask=pa.array(mask))
    return c


def _edit(**changes):
    def f(c):
        for key, (rows, value) in changes.items():
            c[key][rows] = value
        return c
    return f


def _repeat_row(c):
    # token 2's layer-2 row written twice (the layer-3 row replaced by a copy)
    for key in c:
        c[key][8] = c[key][7]
    return c


def _interleave(c):
    # token 0's layer-3 row moved after token 1's rows (same step): its rows are not consecutive
    order = [0, 1, 3, 4, 5, 2] + list(range(6, len(c["layer"])))
    for key in c:
        c[key] = c[key][order]
    c["step"][:6] = 0
    return c


def _drop_row(row: int):
    def f(c):
        return {k: np.delete(v, row, axis=0) for k, v in c.items()}
    return f


# kind -> (edit of the valid columns, extra metadata, expected message after "<file>: ")
BAD_ROWS = {
    "expert_range": (_edit(expert_ids=(5, [1, 9])), None,
                     "row 5: field 'expert_ids': expert id 9 >= num_experts 8 of model 'tiny-moe'"),
    "duplicate_expert": (_edit(expert_ids=(4, [6, 6])), None,
                         "row 4: field 'expert_ids': expert 6 repeated in one token's top-2 [6, 6]"),
    "null_expert": (_null_experts, None,
                    "row 4: field 'expert_ids': null value (every row needs its top-k expert ids)"),
    "dense_layer": (_edit(layer=(3, 0)), None,
                    "row 3: field 'layer': layer 0 is not an MoE layer of model 'tiny-moe' (MoE layers: 1-3)"),
    "weight_nan": (_edit(gate_weights=(2, [np.nan, 0.5])), None,
                   "row 2: field 'gate_weights': gate weight nan is not a finite number"),
    "negative_position": (_edit(position=(6, -3)), None, "row 6: field 'position': position -3 is negative"),
    "step_order": (_edit(step=(slice(9, 12), 1)), None,
                   ("row 9: field 'step': step 1 decreases from step 2 in the row before; steps must be "
                   "non-decreasing")),
    "repeated_row": (_repeat_row, None,
                     ("row 8: field 'layer': layer 2 repeated for token (request 0, position 1, step 2): one row "
                     "per token and MoE layer")),
    "interleaved_token": (_interleave, None,
                          ("row 5: field 'position': token (request 0, position 0, step 0) has rows here and from "
                          "row 0, with other rows between: a token's rows must be consecutive")),
    # token 3's layer-2 row gone (its rows straddle the row groups of 4): 2 of the 3 layers the trace holds
    "incomplete_token": (_drop_row(10), None,
                         ("row 9: field 'layer': token (request 1, position 1, step 3) has rows in 2 of the 3 MoE "
                          "layers the trace holds (1-3); a token needs one row in each")),
    "format_version": (lambda c: c, {META_FORMAT: b"7"},
                       ("metadata 'moeplace.format' is version '7'; this moeplace reads moeplace.trace version "
                        "1, 2 (written by a newer moeplace?)")),
}


def bad_trace(kind: str, model, root: Path) -> tuple[Path, str]:
    """A trace directory with one problem of ``kind`` and the line every reader must stop at."""
    d = root / kind
    d.mkdir()
    if kind == "empty":
        cols = {k: v[:0] for k, v in columns().items()}
        f = write(d / "part-00000.parquet", model, cols)
        return d, f"{d}: the trace has no rows (nothing to compute on)"
    if kind == "truncated":
        f = write(d / "part-00000.parquet", model, columns())
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2])
        return d, f"{f}: not a readable Parquet file: truncated or corrupt ("
    edit, meta, msg = BAD_ROWS[kind]
    f = write(d / "part-00000.parquet", model, edit(columns()), meta=meta, row_group_size=4)
    return d, f"{f}: {msg}"


KINDS = [*BAD_ROWS, "empty", "truncated"]


def _one_line(err: str, expected: str) -> None:
    lines = err.strip().splitlines()
    assert "Traceback" not in err
    assert len(lines) == 1, lines
    assert lines[0].startswith("place: error: " + expected)


@pytest.mark.parametrize("kind", KINDS)
def test_validate_rejects_every_kind_whatever_the_listing_limit(kind, tiny, tmp_path, capsys):
    path, expected = bad_trace(kind, tiny, tmp_path)
    rep = validate_report(path)
    assert not rep.ok and str(rep.first).startswith(expected)
    with pytest.raises(InputError) as err:
        check_trace(path)
    assert str(err.value) == str(rep.first)
    for limit in ("5", "1", "0", "-1"):
        assert main(["trace", "validate", str(path), "--max-per-kind", limit]) == 2
        out = capsys.readouterr()
        assert out.out == "" and "Traceback" not in out.err
        first = out.err.splitlines()[0]
        assert first == f"place: error: {rep.first}"


@pytest.mark.parametrize("kind", KINDS)
def test_every_reader_stops_with_the_validate_line(kind, tiny, tmp_path, capsys):
    path, _ = bad_trace(kind, tiny, tmp_path)
    expected = str(validate_report(path).first)
    pl = Placement.from_phy2log(np.tile(np.arange(8), (3, 1)), tiny, 2, 2, {"policy": "test"})
    placement = tmp_path / "placement.json"
    pl.save(placement)
    commands = {
        "stats": ["trace", "stats", str(path)],
        "optimize": ["optimize", str(path), "--gpus", "2", "--gpus-per-node", "2", "--no-out",
                     "--policy", "eplb"],
        "evaluate": ["evaluate", str(placement), str(path)],
        "simulate": ["simulate", str(path), "--placement", str(placement), "--gpus", "2",
                     "--gpus-per-node", "2", "--attention-tp", "1"],
    }
    for name, argv in commands.items():
        assert main(argv) == 2, name
        err = capsys.readouterr().err
        assert err.strip() == f"place: error: {expected}", name
    with pytest.raises(InputError) as e:
        compute_stats(path, workers=2)
    assert str(e.value) == expected


@pytest.mark.parametrize("kind", KINDS)
def test_batched_statistics_pass_stops_with_the_validate_line(kind, tiny, tmp_path, monkeypatch):
    """The statistics pass checks the list columns batch by batch (here 3 rows, row groups of 4) and
    still stops at validate's first line."""
    path, _ = bad_trace(kind, tiny, tmp_path)
    expected = str(validate_report(path).first)
    monkeypatch.setattr("moeplace.traces.scan.BATCH_ROWS", 3)  # version 1's lists
    monkeypatch.setattr("moeplace.traces.scan.PLANE_BATCH_ROWS", 3)  # version 2's byte planes
    monkeypatch.setattr("moeplace.traces.scan.CHUNK_ROWS", 2)
    for workers in (1, 2):
        with pytest.raises(InputError) as e:
            compute_stats(path, workers=workers)
        assert str(e.value) == expected


def test_batched_statistics_pass_keeps_the_order_of_kinds(tiny, tmp_path, monkeypatch):
    """One row group, a repeated expert in its second batch and an out-of-range id in its third: the gate
    checks ranges before repeats, so both readers name row 7."""
    d = tmp_path / "two"
    d.mkdir()
    f = write(d / "part-00000.parquet", tiny, _edit(expert_ids=(4, [6, 6]))(_edit(expert_ids=(7, [1, 9]))(
        columns())))
    expected = f"{f}: row 7: field 'expert_ids': expert id 9 >= num_experts 8 of model 'tiny-moe'"
    assert str(validate_report(d).first) == expected
    monkeypatch.setattr("moeplace.traces.scan.BATCH_ROWS", 3)
    monkeypatch.setattr("moeplace.traces.scan.PLANE_BATCH_ROWS", 3)
    with pytest.raises(InputError) as e:
        compute_stats(d, workers=1)
    assert str(e.value) == expected


def test_dashboard_reader_shows_the_validate_line(tiny, tmp_path):
    pytest.importorskip("streamlit")
    from moeplace.dashboard import data
    from moeplace.dashboard.ui import error_text

    path, _ = bad_trace("duplicate_expert", tiny, tmp_path)
    expected = str(validate_report(path).first)
    for reader in (lambda: data.trace_stats(path, 16), lambda: data.trace_loads(path, 16)):
        with pytest.raises(InputError) as e:
            reader()
        assert error_text(e.value) == expected


def test_step_order_and_token_rows_across_row_groups_and_workers(tiny, tmp_path):
    """The cross-row-group checks give the same first line in-process, on worker processes and in
    validate: a repeated row whose copy starts the next row group, a token resumed two groups later."""
    c = columns(12)
    c = {k: np.concatenate([v[:12], v[11:12], v[12:]]) for k, v in c.items()}  # row 12 repeats row 11
    d = tmp_path / "split"
    d.mkdir()
    f = write(d / "part-00000.parquet", tiny, c, row_group_size=12)
    first = str(validate_report(d).first)
    assert first == (f"{f}: row 12: field 'layer': layer 3 repeated for token (request 1, position 1, step 3): "
                     "one row per token and MoE layer")
    for workers in (1, 2):
        with pytest.raises(InputError) as e:
            compute_stats(d, workers=workers)
        assert str(e.value) == first
    # one step across two files: token (request 0, position 0) resumes in the second file
    c = columns(4)
    c["step"][:] = 0
    e = tmp_path / "files"
    e.mkdir()
    f0 = write(e / "part-00000.parquet", tiny, {k: v[:6] for k, v in c.items()})
    tail = {k: v[:3].copy() for k, v in c.items()}
    tail["layer"][:] = [1, 2, 3]
    f1 = write(e / "part-00001.parquet", tiny, tail)
    assert str(validate_report(e).first) == (
        f"{f1}: row 0: field 'position': token (request 0, position 0, step 0) has rows here and from row 0 of "
        f"{f0.name}, with other rows between: a token's rows must be consecutive")


def test_tokens_cut_by_row_groups_pass_and_a_trace_missing_a_layer_is_refused_by_every_reader(tiny, tmp_path):
    """Complete tokens whose rows straddle row groups pass the gate in-process, on workers and in validate;
    a trace holding MoE layers 1 and 3 only (every token in both) of a model declaring 1-3 is refused by
    every reader with the same line (it used to pass, and stats printed skew n/a for the layer)."""
    c = columns(12)
    f = write(tmp_path / "cut.parquet", tiny, c, row_group_size=5)
    assert validate_report(f).ok
    assert compute_stats(f, workers=2).num_tokens == 12
    c = {k: v[c["layer"] != 2] for k, v in columns(12).items()}
    f = write(tmp_path / "some.parquet", tiny, c, row_group_size=5)
    want = (f"{f}: field 'layer': no rows for MoE layer 2 (1 of the 3 the model declares: 1-3); a trace holds "
            "every MoE layer of its model or declares the ones it holds (a capture that missed a layer is incomplete)")
    assert [str(p) for p in validate_report(f).problems] == [want]
    for workers in (1, 2):
        with pytest.raises(InputError) as e:
            compute_stats(f, workers=workers)
        assert str(e.value) == want
    with pytest.raises(InputError) as e:
        check_trace(f)
    assert str(e.value) == want


def test_listing_limit_never_changes_the_verdict(tiny, tmp_path):
    c = columns(20)
    c["expert_ids"][10:30, 1] = 9
    f = write(tmp_path / "bad.parquet", tiny, c)
    for limit in (5, 1, 0, -1):
        rep = validate_report(f, max_per_kind=limit)
        assert not rep.ok and rep.total == 20
        listed = max(limit, 1)
        assert len(rep.problems) == listed and rep.suppressed["expert_range"] == 20 - listed
        assert rep.lines()[-1] == f"... and {20 - listed} more 'expert_range' problem(s) not listed"


def test_open_trace_is_the_header_gate(tiny, tmp_path):
    f = write(tmp_path / "ok.parquet", tiny, columns())
    t = open_trace(f)
    assert t.model == tiny and t.num_rows == 24 and t.provenance == {"kind": "synthetic"}
    assert t.row_groups() == [(0, 0, 0)]
    with pytest.raises(InputError, match=r"no such file or directory"):
        open_trace(tmp_path / "missing")


# ---------------------------------------------------------------------------- Loads
def _npz(path: Path, counts, meta) -> Path:
    with open(path, "wb") as fh:
        np.savez(fh, counts=counts, meta=np.array(meta if isinstance(meta, str) else json.dumps(meta)))
    return path


def test_loads_gate_names_file_and_field(tiny, tmp_path, capsys):
    good = {"format": LOADS_FORMAT, "model": tiny.to_dict(), "window_tokens": 4, "labels": ["w0"],
            "provenance": {}}
    ok = _npz(tmp_path / "ok.npz", np.ones((1, 3, 8), np.int64), good)
    assert load_loads(ok).counts.sum() == 24
    cases = {
        "model_string": ({**good, "model": "tiny-moe"}, np.ones((1, 3, 8), np.int64),
                         "field 'meta.model' is \"tiny-moe\", expected a model spec object"),
        "model_invalid": ({**good, "model": {**tiny.to_dict(), "num_experts": "many"}}, np.ones((1, 3, 8), np.int64),
                          "field 'meta.model': model spec"),
        "meta_list": ([1, 2], np.ones((1, 3, 8), np.int64), "field 'meta' is a JSON list, expected an object"),
        "meta_not_json": ("{", np.ones((1, 3, 8), np.int64), "field 'meta' is not valid JSON"),
        "negative": (good, -np.ones((1, 3, 8), np.int64),
                     "field 'counts' is -1 at window 0, MoE layer 0, expert 0: counts must be non-negative"),
        "shape": (good, np.ones((1, 2, 8), np.int64), "field 'counts' has shape [1, 2, 8], but model 'tiny-moe'"),
        "labels": ({**good, "labels": ["a", "b"]}, np.ones((1, 3, 8), np.int64),
                   "field 'labels' has 2 labels for 1 windows"),
        "window_tokens": ({**good, "window_tokens": "x"}, np.ones((1, 3, 8), np.int64),
                          "field 'meta.window_tokens' is \"x\", expected an integer >= 0"),
        "uint64": (good, np.full((1, 3, 8), 2**63, np.uint64), "field 'counts' holds 9223372036854775808, beyond int64"),
    }
    for name, (meta, counts, msg) in cases.items():
        p = _npz(tmp_path / f"{name}.npz", counts, meta)
        with pytest.raises(InputError) as e:
            load_loads(p)
        assert str(e.value).startswith(f"{p}: {msg}"), (name, str(e.value))
        assert main(["optimize", str(p), "--gpus", "2", "--gpus-per-node", "2", "--no-out", "--policy", "eplb"]) == 2
        err = capsys.readouterr().err
        assert err.strip() == f"place: error: {e.value}" and "Traceback" not in err
    trunc = tmp_path / "trunc.npz"
    trunc.write_bytes(ok.read_bytes()[:40])
    with pytest.raises(InputError, match=rf"^{trunc}: not a readable Loads .npz file"):
        load_loads(trunc)
    assert Loads(np.ones((1, 3, 8), np.int64), tiny).counts.shape == (1, 3, 8)


def test_trace_writer_never_wraps_or_truncates(tiny, tmp_path):
    n = 3
    base = {"request_id": np.zeros(n), "position": np.arange(n), "phase": np.zeros(n), "step": np.zeros(n),
            "layer": np.array([1, 2, 3]), "expert_ids": np.tile([0, 1], (n, 1))}
    for key, value, msg in (("position", np.array([0, 1, 2**31]), ("value 2147483648 (row 2 of the output) is "
                                                                   "outside the int32 range")),
                            ("expert_ids", np.array([[0, 1], [0, 1.5], [0, 1]]),
                             "value 1.5 (row 1 of the output) is not an integer"),
                            ("layer", np.array([1, 2, 65537]), "value 65537 (row 2 of the output) is outside")):
        pattern = re.escape(f"field '{key}': {msg}")
        with pytest.raises(InputError, match=pattern), TraceWriter(tmp_path / key, tiny, {"kind": "test"}) as w:
            w.write(**{**base, key: value})
        assert not (tmp_path / key).exists()


def test_sweep_stops_with_the_validate_line(tiny, tmp_path, capsys):
    path, _ = bad_trace("repeated_row", tiny, tmp_path)
    expected = str(validate_report(path).first)
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"""name: gate
model: {DATA / 'tiny-moe-config.json'}
workloads:
  - {{name: bad, trace: {path}, concurrency: 4}}
axes: {{gpu: h100, gpus: [2], tp: 1, redundant: 0, policy: [eplb]}}
plan: {{context: 1k, min_seqs: 1}}
simulate: {{duration: 0.2, mode: stat, max_trace_tokens: 100}}
""")
    assert main(["sweep", str(spec), "--out", str(tmp_path / "run"), "--local", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == f"place: error: {expected}"


def test_model_config_errors_name_the_file(tiny, tmp_path, capsys):
    own = tiny.to_dict()
    hf = json.loads((DATA / "tiny-moe-config.json").read_text())
    cases = {
        "own_type": ({**own, "hidden_size": "big"}, ("model spec 'tiny-moe': field 'hidden_size' must be a whole number, "
                                                    "got 'big'")),
        "own_range": ({**own, "top_k": 99}, "model spec 'tiny-moe': top_k must be in [1, num_experts=8], got 99"),
        "hf_type": ({**hf, "hidden_size": "big"}, "field 'hidden_size' must be a whole number, got 'big'"),
    }
    for name, (d, msg) in cases.items():
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(d))
        with pytest.raises(InputError) as e:
            load_model(p)
        assert str(e.value).startswith(f"{p}: {msg}"), str(e.value)
        assert main(["model", "show", str(p)]) == 2
        err = capsys.readouterr().err
        assert err.strip() == f"place: error: {e.value}" and "Traceback" not in err


def test_token_runs_spilled_to_disk_give_the_same_problems(tiny, tmp_path, monkeypatch):
    """The checks across row groups keep every token run (one step per token, every held layer per token);
    past a memory budget the runs go to sorted temporary files and are merged by ranges of tokens at the
    end: the same problems in the same order (tokens in two steps, incomplete tokens, both at once, many
    of them past the listing limit), the same verdict on a valid trace, and no temporary file left."""
    import tempfile

    import moeplace.traces.gate.order as order_mod

    n = 120  # tokens: two requests, one step each
    c = columns(n)
    bad = {k: v.copy() for k, v in c.items()}
    bad["position"][30 * 3:31 * 3] = 3  # token 30 (request 0, position 15) again at position 1 of request 0
    bad = _drop_row(200)(_drop_row(151)(_drop_row(40)(bad)))  # three tokens lose a layer row
    twice = {k: v.copy() for k, v in c.items()}
    twice["position"][::6] = 0  # request 0's tokens all at position 0: 19 of them in a later step
    cases = {"valid": c, "mixed": bad, "twice": twice}
    seen = {}
    spills = []
    real_spill = order_mod._RunStore._spill

    def counted(store):
        spills.append(1)
        return real_spill(store)

    for spill in (None, 200):  # bytes: every few row groups spill
        if spill is not None:
            monkeypatch.setattr(order_mod, "SPILL_BYTES", spill)
            monkeypatch.setattr(order_mod, "RANGE_RUNS", 16)
            monkeypatch.setattr(order_mod._RunStore, "_spill", counted)
        for name, cols in cases.items():
            d = tmp_path / f"{name}-{spill}"
            d.mkdir()
            write(d / "part-00000.parquet", tiny, cols, row_group_size=9)
            rep = validate_report(d, max_per_kind=7)
            lines = [str(p).replace(str(d), "T") for p in rep.problems]
            seen.setdefault(name, []).append((rep.ok, rep.total, lines, dict(rep.suppressed)))
    assert seen["valid"][0][0] and seen["valid"][0] == seen["valid"][1]
    for name in ("mixed", "twice"):
        assert not seen[name][0][0] and seen[name][0] == seen[name][1], name
    assert any("was already in step" in x for x in seen["mixed"][0][2])
    assert any("has rows in 2 of the 3" in x for x in seen["mixed"][0][2])
    assert seen["twice"][0][1] > 7  # more than listed: the counts agree too
    assert len(spills) > 10  # the second round did go through the files
    assert not list(Path(tempfile.gettempdir()).glob("moeplace-gate-runs-*"))


def _wide_rows(model, tokens: int = 3) -> dict:
    """``tokens`` valid K3 tokens (top-16: the check pass's word-wise path): ids with deltas of 256 and more
    (a zero low byte that is no repeat), expert 0 (a zero first delta) and the last expert."""
    n = tokens * model.num_moe_layers
    tok = np.repeat(np.arange(tokens), model.num_moe_layers)
    ids = np.tile(np.concatenate([[0], np.arange(1, 14) * 20, [512, 768]]).astype(np.uint16), (n, 1))
    ids[1::2, -1] = model.num_experts - 1
    return {"request_id": np.zeros(n, np.int64), "position": tok.astype(np.int32), "phase": np.zeros(n, np.uint8),
            "step": tok.astype(np.int64), "layer": np.tile(np.asarray(model.moe_layers, np.uint16), tokens),
            "expert_ids": ids}


@pytest.mark.parametrize("kind,row,ids,expected", [
    ("duplicate_expert", 100, (3, 20), "row 100: field 'expert_ids': expert 20 repeated"),
    ("expert_range", 7, (15, 900), "row 7: field 'expert_ids': expert id 900 >= num_experts 896"),
])
@pytest.mark.parametrize("compiled", [True, False])
def test_wide_topk_checks_without_counting(kind, row, ids, expected, compiled, tmp_path, monkeypatch):
    """`check_trace` on a top-16 trace (the compiled loop, or word-wise sums of the byte planes without
    keys): a valid trace with deltas of 256+ never falls back to the listing gate; a repeat and an id past
    E (carried by the high byte plane) give the gate's line."""
    from fuzzkit import write_columns
    from test_stats import compiled_loops

    from moeplace.traces import scan

    compiled_loops(compiled, monkeypatch)
    k3 = load_model("kimi-k3")
    good = write_columns(tmp_path / "good.parquet", k3, _wide_rows(k3))
    fallback = scan._reduce_checked
    monkeypatch.setattr(scan, "_reduce_checked", lambda *a: pytest.fail("a valid trace fell back to the gate"))
    assert check_trace(good).num_rows == 3 * k3.num_moe_layers
    monkeypatch.setattr(scan, "_reduce_checked", fallback)
    cols = _wide_rows(k3)
    cols["expert_ids"][row, ids[0]] = ids[1]
    bad = write_columns(tmp_path / f"{kind}.parquet", k3, cols)
    with pytest.raises(InputError) as err:
        check_trace(bad)
    assert str(err.value).startswith(f"{bad}: {expected}")
