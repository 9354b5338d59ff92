"""Importers of TensorRT-LLM expert statistics, vLLM routed experts, FLAME-MoE traces and the MoE expert
selection trace dataset, on small files written in exactly those layouts: hand-computed outputs that
validate, and one-line errors naming file, record and field."""

from __future__ import annotations

import base64
import io
import json
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.numpy import load_file, save_file

from moeplace.cli.main import main
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import load_model
from moeplace.traces.importers import import_source
from moeplace.traces.loads import load_loads
from moeplace.traces.validate import read_trace_meta, scan_trace, validate_report

TINY = Path(__file__).parent / "data" / "tiny-moe-config.json"


@pytest.fixture(scope="module")
def tiny():
    # 4 decoder layers, layer 0 dense, MoE layers 1..3, 8 experts, top-2
    return load_model(TINY)


def rows(path) -> pl.DataFrame:
    """A trace's rows, the expert ids decoded: each token's top-k a set, ascending (compare with np.sort)."""
    return scan_trace(path).collect().sort(["step", "layer"])


# ------------------------------------------------------------------------------------ trtllm-stats
def _stat_dir(tmp_path, tiny, raw=False):
    d = tmp_path / "expert_statistic"
    d.mkdir()
    (d / "meta_info.json").write_text(json.dumps({"num_experts": 8, "num_experts_per_token": 2}))
    rng = np.random.default_rng(0)
    ids = {}
    for rank in range(2):
        counts, raws = {}, {}
        for it in (100, 101):
            for layer in (1, 2, 3, 4):  # 4 = an MTP layer past the 4 decoder layers: skipped
                n = 3 + rank + it - 100
                sel = np.stack([rng.choice(8, 2, replace=False) for _ in range(n)]).astype(np.int32)
                ids[(it, layer, rank)] = sel
                raws[f"{it}_{layer}"] = sel
                counts[f"{it}_{layer}"] = np.bincount(sel.ravel(), minlength=8).astype(np.int64)
        save_file(counts, str(d / f"rank{rank}.safetensors"))
        if raw:
            save_file(raws, str(d / f"rank{rank}_raw.safetensors"))
    return d, ids


def test_trtllm_counts_sum_over_ranks_one_window_per_iteration(tiny, tmp_path):
    d, ids = _stat_dir(tmp_path, tiny)
    res = import_source("trtllm-stats", [d], tiny, tmp_path / "l.npz")
    loads = load_loads(tmp_path / "l.npz")
    assert loads.counts.shape == (2, 3, 8) and loads.labels == ("iteration 100", "iteration 101")
    for w, it in enumerate((100, 101)):
        for li, layer in enumerate((1, 2, 3)):
            want = sum(np.bincount(ids[(it, layer, r)].ravel(), minlength=8) for r in range(2))
            assert loads.counts[w, li].tolist() == want.tolist()
    assert res.summary["mtp_layers_skipped"] == 4 and res.summary["ranks"] == 2


def test_trtllm_raw_ids_become_a_trace_matching_the_counts(tiny, tmp_path):
    d, ids = _stat_dir(tmp_path, tiny, raw=True)
    import_source("trtllm-stats", [d], tiny, tmp_path / "trace")
    df = rows(tmp_path / "trace")
    # (iteration, rank) batches: 3 + rank + (it - 100) tokens each, 3 MoE layers
    assert df.height == 3 * (3 + 4 + 4 + 5)
    b = df.filter((pl.col("step") == 101) & (pl.col("request_id") == 3)).sort(["position", "layer"])
    assert b["layer"].to_list()[:3] == [1, 2, 3] and b["position"].max() == 4
    got = np.array(b.filter(pl.col("layer") == 2)["expert_ids"].to_list())
    assert got.tolist() == np.sort(ids[(101, 2, 1)], axis=-1).tolist()
    assert set(df["phase"].unique().to_list()) == {0}
    # the same directory into Loads agrees with the trace's own counts
    import_source("trtllm-stats", [d], tiny, tmp_path / "l.npz")
    counts = load_loads(tmp_path / "l.npz").counts.sum(axis=0)
    flat = np.array(df.filter(pl.col("layer") == 3)["expert_ids"].to_list()).ravel()
    assert np.bincount(flat, minlength=8).tolist() == counts[2].tolist()


@pytest.mark.parametrize("edit, message", [
    (lambda d: (d / "meta_info.json").write_text('{"num_experts": 16, "num_experts_per_token": 2}'),
     "meta_info.json: field 'num_experts' is 16, but model 'tiny-moe' has 8"),
    (lambda d: save_file({"100_0": np.ones(8, dtype=np.int64)}, str(d / "rank0.safetensors")),
     "rank0.safetensors: key '100_0': layer 0 is a dense layer"),
    (lambda d: save_file({"100_1": np.ones(8, dtype=np.float32)}, str(d / "rank0.safetensors")),
     "key '100_1': dtype float32, expected integer token counts"),
    (lambda d: save_file({"100_1": np.ones(7, dtype=np.int64)}, str(d / "rank0.safetensors")),
     "key '100_1': shape [7], expected [8]"),
    (lambda d: save_file({"100_1": np.ones(8, dtype=np.int64) * 2, "102_1": np.ones(8, dtype=np.int64) * 2},
                         str(d / "rank0.safetensors")), "iteration 101 missing"),
    (lambda d: save_file({"1001": np.ones(8, dtype=np.int64)}, str(d / "rank0.safetensors")),
     "key '1001': expected '<iteration>_<layer>'"),
    (lambda d: (d / "rank0.safetensors").write_bytes(b"garbage"), "rank0.safetensors: not a readable safetensors"),
])
def test_trtllm_counts_errors_name_file_and_key(tiny, tmp_path, edit, message):
    d, _ = _stat_dir(tmp_path, tiny)
    (d / "rank1.safetensors").unlink()
    edit(d)
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        import_source("trtllm-stats", [d], tiny, tmp_path / "l.npz")
    assert not (tmp_path / "l.npz").exists()


def test_trtllm_raw_batch_missing_a_layer_is_dropped_and_said(tiny, tmp_path):
    d, _ids = _stat_dir(tmp_path, tiny, raw=True)
    raw0 = load_file(str(d / "rank0_raw.safetensors"))
    del raw0["101_2"]  # iteration 101 of rank 0 (4 tokens) lost layer 2
    save_file(raw0, str(d / "rank0_raw.safetensors"))
    res = import_source("trtllm-stats", [d], tiny, tmp_path / "trace")
    s = res.summary
    assert (s["tokens"], s["incomplete_tokens_dropped"], s["layers_covered"]) == (12, 4, [1, 2, 3])
    assert s["notes"] == [
        ("dropped 4 tokens recorded in only some of the 3 MoE layers the import holds (1-3): 1 (iteration, rank) "
        f"batch(es), the first iteration 101 of rank 0 ({d / 'rank0_raw.safetensors'}: key '101_2' missing)")]
    df = rows(tmp_path / "trace")
    assert df.height == 3 * 12 and df.filter((pl.col("step") == 101) & (pl.col("request_id") == 2)).height == 0
    assert validate_report(tmp_path / "trace").ok
    _, prov = read_trace_meta(tmp_path / "trace")
    assert (prov["incomplete_tokens_dropped"], prov["incomplete_batches_dropped"]) == (4, 1)
    for rank in (0, 1):  # every batch misses layer 2 or 3: nothing complete
        raw = load_file(str(d / f"rank{rank}_raw.safetensors"))
        for it in (100, 101):
            raw.pop(f"{it}_{2 + (it + rank) % 2}", None)
        save_file(raw, str(d / f"rank{rank}_raw.safetensors"))
    with pytest.raises(InputError, match=r"no \(iteration, rank\) batch records every MoE layer the import holds "
                                         r"\(1-3\); the first iteration 100 of rank 0 .*key '100_2' missing\): "
                                         "nothing complete to import"):
        import_source("trtllm-stats", [d], tiny, tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_trtllm_raw_errors(tiny, tmp_path):
    d, _ = _stat_dir(tmp_path, tiny)
    with pytest.raises(InputError, match="holds per-expert counts only"):
        import_source("trtllm-stats", [d], tiny, tmp_path / "t")
    save_file({"100_1": np.array([[0, 9]], dtype=np.int32)}, str(d / "rank0_raw.safetensors"))
    with pytest.raises(InputError, match=r"rank0_raw.safetensors: key '100_1': field 'token_selected_experts': "
                                         r"token 0: expert id 9 out of range \[0, 8\)"):
        import_source("trtllm-stats", [d], tiny, tmp_path / "t")
    save_file({"100_1": np.array([[0, 1]], dtype=np.int32), "100_2": np.array([[0, 1], [2, 3]], dtype=np.int32)},
              str(d / "rank0_raw.safetensors"))
    with pytest.raises(InputError, match="different token counts"):
        import_source("trtllm-stats", [d], tiny, tmp_path / "t")
    assert not (tmp_path / "t").exists()


class _ExpertStatisticMirror:
    """TensorRT-LLM's raw-writing ``ExpertStatistic`` (tensorrt_llm/_torch/expert_statistic.py, NVIDIA/
    TensorRT-LLM commit 7ce477f) line for line, numpy for torch: inclusive range, the raw record of a key
    replaced by each call, the bincount added, both files (and rank 0's meta_info.json) saved when the
    iteration after ``stop`` begins."""

    def __init__(self, rank_id, start, stop, path):
        self.current_iter_id = self.current_layer = self._meta_info = None
        self.rank_id, self.start, self.stop, self.path = rank_id, start, stop, path
        self._records, self._records_bincount = {}, {}

    @property
    def _should_record(self):
        return self.current_iter_id is not None and self.start <= self.current_iter_id <= self.stop

    def _save(self):
        self.path.mkdir(exist_ok=True)
        if self.rank_id == 0:
            (self.path / "meta_info.json").write_text(json.dumps(self._meta_info))
        save_file(self._records_bincount, str(self.path / f"rank{self.rank_id}.safetensors"))
        save_file(self._records, str(self.path / f"rank{self.rank_id}_raw.safetensors"))

    def set_iter(self, iter_id):
        if self.current_iter_id == self.stop:
            self._save()
        self.current_iter_id = iter_id

    def set_layer(self, layer):
        self.current_layer = layer

    def maybe_add_info(self, expert_count, token_selected_experts):
        if not self._should_record:
            return
        if self._meta_info is None:
            self._meta_info = {"num_experts": expert_count, "num_experts_per_token": token_selected_experts.shape[-1]}
        key = f"{self.current_iter_id}_{self.current_layer}"
        self._records[key] = np.ascontiguousarray(token_selected_experts)
        counts = np.bincount(token_selected_experts.ravel(), minlength=expert_count)
        if key not in self._records_bincount:
            self._records_bincount[key] = counts
        else:
            self._records_bincount[key] += counts


def test_trtllm_raw_writer_mirror_imports_and_says_what_chunking_lost(tiny, tmp_path):
    d = tmp_path / "expert_statistic"
    rng = np.random.default_rng(7)
    writers = [_ExpertStatisticMirror(r, 5, 7, d) for r in range(2)]
    last_chunk, all_tokens = {}, {}
    for it in range(3, 10):  # EXPERT_STATISTIC_ITER_RANGE=5-7: iterations 5, 6, 7 recorded, saved at 8
        for rank, w in enumerate(writers):
            w.set_iter(it)
            chunks = [2, 3] if (it, rank) == (6, 1) else [3 + rank]  # one chunked MoE forward
            sels = [[np.stack([rng.choice(8, 2, replace=False) for _ in range(n)]).astype(np.int32)
                     for _ in (1, 2, 3, 4)] for n in chunks]
            for sel in sels:
                for layer, ids in zip((1, 2, 3, 4), sel):  # 4: an MTP layer past the decoder layers
                    w.set_layer(layer)
                    w.maybe_add_info(8, ids)
            last_chunk[(it, rank)] = sels[-1]
            all_tokens[(it, rank)] = sels
    assert sorted(p.name for p in d.iterdir()) == ["meta_info.json", "rank0.safetensors", "rank0_raw.safetensors",
                                                   "rank1.safetensors", "rank1_raw.safetensors"]
    res = import_source("trtllm-stats", [d], tiny, tmp_path / "trace")
    df = rows(tmp_path / "trace")
    assert sorted(df["step"].unique().to_list()) == [5, 6, 7]
    assert res.summary["tokens"] == 3 + 4 + 3 + 3 + 3 + 4  # (6, 1) kept its last chunk of 3 tokens
    b = df.filter((pl.col("step") == 6) & (pl.col("request_id") == 3) & (pl.col("layer") == 2)).sort("position")
    assert np.array(b["expert_ids"].to_list()).tolist() == np.sort(last_chunk[(6, 1)][1], axis=-1).tolist()
    assert res.summary["raw_tokens_short_of_counts"] == 2  # the first chunk's 2 tokens, in all 3 MoE layers
    assert res.summary["notes"][0].startswith("the raw ids hold 2 tokens fewer than the counts beside them in 3 "
                                              "(iteration, layer, rank) keys, the first key '6_1' of rank 1: "
                                              "3 raw tokens, 5 counted")
    assert validate_report(tmp_path / "trace").ok
    import_source("trtllm-stats", [d], tiny, tmp_path / "l.npz")  # the counts hold every chunk
    loads = load_loads(tmp_path / "l.npz")
    want = sum(np.bincount(ids[1].ravel(), minlength=8) for r in (0, 1) for ids in all_tokens[(6, r)])
    assert loads.labels == ("iteration 5", "iteration 6", "iteration 7")
    assert loads.counts[1, 1].tolist() == want.tolist()


# ------------------------------------------------------------------------------ vllm-routed-experts
def _npy_b64(arr) -> str:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def _routes(rng, n, layers=4):
    out = np.zeros((n, layers, 2), dtype=np.int16)  # dense row 0 stays zero, as vLLM's buffer leaves it
    for t in range(n):
        for layer in range(layers - 3, layers):
            out[t, layer] = rng.choice(8, 2, replace=False)
    return out


def test_vllm_routed_main_form_prompt_and_generated(tiny, tmp_path):
    rng = np.random.default_rng(1)
    prompt, gen = [11, 12, 13], [21, 22, 23, 24]
    arr = _routes(rng, len(prompt) + len(gen) - 1)  # the last sampled token was never forwarded
    resp = {"id": "chatcmpl-1", "object": "chat.completion", "prompt_token_ids": prompt,
            "usage": {"prompt_tokens": 3, "completion_tokens": 4},
            "choices": [{"index": 0, "token_ids": gen, "routed_experts": _npy_b64(arr)}]}
    src = tmp_path / "r.json"
    src.write_text(json.dumps(resp))
    res = import_source("vllm-routed-experts", [src], tiny, tmp_path / "t")
    df = rows(tmp_path / "t")
    assert df.height == 6 * 3 and res.summary["tokens"] == 6
    tok = df.filter(pl.col("layer") == 1).sort("position")
    assert tok["position"].to_list() == list(range(6))
    assert tok["phase"].to_list() == [0, 0, 0, 1, 1, 1]
    assert tok["token_id"].to_list() == [11, 12, 13, 21, 22, 23]
    got = np.array(df.filter(pl.col("layer") == 3).sort("position")["expert_ids"].to_list())
    assert got.tolist() == np.sort(arr[:, 3], axis=-1).tolist()


def test_vllm_routed_lists_with_prompt_routed_experts_and_dict_form(tiny, tmp_path):
    rng = np.random.default_rng(2)
    p1, g1 = _routes(rng, 2, layers=3), _routes(rng, 3, layers=3)  # MoE layers only
    g2 = _routes(rng, 2, layers=3)
    r1 = {"id": "a", "prompt_routed_experts": p1.tolist(),
          "choices": [{"routed_experts": g1.tolist()}]}
    raw = {"encoding": "base64", "dtype": "int16", "shape": list(g2.shape),
           "data": base64.b64encode(g2.astype("<i2").tobytes()).decode()}
    r2 = {"id": "b", "usage": {"prompt_tokens": 5}, "choices": [{"routed_experts": raw}]}
    src = tmp_path / "r.jsonl"
    src.write_text(json.dumps(r1) + "\n" + json.dumps(r2) + "\n")
    import_source("vllm-routed-experts", [src], tiny, tmp_path / "t")
    df = rows(tmp_path / "t")
    a = df.filter((pl.col("request_id") == 0) & (pl.col("layer") == 2)).sort("position")
    assert a["position"].to_list() == [0, 1, 2, 3, 4] and a["phase"].to_list() == [0, 0, 1, 1, 1]
    assert np.array(a["expert_ids"].to_list()).tolist() == np.sort(np.concatenate([p1, g1])[:, 1], axis=-1).tolist()
    b = df.filter((pl.col("request_id") == 1) & (pl.col("layer") == 1)).sort("position")
    assert b["position"].to_list() == [5, 6] and b["phase"].to_list() == [1, 1]
    assert "token_id" not in df.columns


def _prompt_start_response(rng, start, record_start=True):
    """A vLLM 0.34 response to a request with routed_experts_prompt_start=start: the worker's emit cursor
    starts at ``start``, so rows cover tokens start .. prompt + generated - 2."""
    prompt, gen = list(range(100, 114)), [200, 201, 202, 203]
    arr = _routes(rng, len(prompt) + len(gen) - 1 - start)
    resp = {"id": "cmpl-s", "prompt_token_ids": prompt, "usage": {"prompt_tokens": 14, "completion_tokens": 4},
            "choices": [{"index": 0, "token_ids": gen, "routed_experts": _npy_b64(arr)}]}
    if record_start:
        resp["routed_experts_prompt_start"] = start
    return resp, prompt + gen, arr


def test_vllm_routed_prompt_start_skips_prompt_rows(tiny, tmp_path):
    resp, ids, arr = _prompt_start_response(np.random.default_rng(5), start=2)
    src = tmp_path / "r.jsonl"
    src.write_text(json.dumps(resp) + "\n")
    import_source("vllm-routed-experts", [src], tiny, tmp_path / "t")
    tok = rows(tmp_path / "t").filter(pl.col("layer") == 2).sort("position")
    assert tok["position"].to_list() == list(range(2, 17))
    assert tok["phase"].to_list() == [0] * 12 + [1] * 3  # prompt tokens 2..13, generated 14..16
    assert tok["token_id"].to_list() == ids[2:17]
    assert np.array(tok["expert_ids"].to_list()).tolist() == np.sort(arr[:, 2], axis=-1).tolist()


def test_vllm_routed_row_count_invariant_refuses(tiny, tmp_path):
    # the request set routed_experts_prompt_start=2 but the record does not say so: 2 rows short
    resp, _, _ = _prompt_start_response(np.random.default_rng(6), start=2, record_start=False)
    src = tmp_path / "r.jsonl"
    src.write_text(json.dumps(resp) + "\n")
    with pytest.raises(InputError, match=r"r.jsonl: line 1: choice 0: field 'routed_experts' has 15 rows, vLLM "
                                         r"returns prompt 14 \+ generated 4 - 1 = 17; refusing rather than "
                                         r"mislabelling tokens; 2 rows short is what a request with "
                                         r"routed_experts_prompt_start=2 returns"):
        import_source("vllm-routed-experts", [src], tiny, tmp_path / "t")
    resp["routed_experts_prompt_start"] = 3  # said, but wrong
    src.write_text(json.dumps(resp) + "\n")
    with pytest.raises(InputError, match=r"has 15 rows, vLLM returns prompt 14 \+ generated 4 - 1 - "
                                         r"routed_experts_prompt_start 3 = 14"):
        import_source("vllm-routed-experts", [src], tiny, tmp_path / "t")
    resp["routed_experts_prompt_start"] = 15
    src.write_text(json.dumps(resp) + "\n")
    with pytest.raises(InputError, match=r"field 'routed_experts_prompt_start' is 15, expected an integer from 0 "
                                         "to the prompt length 14"):
        import_source("vllm-routed-experts", [src], tiny, tmp_path / "t")
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("resp, message", [
    ({"choices": [{"routed_experts": None}], "usage": {"prompt_tokens": 1}},
     "line 1: choice 0: field 'routed_experts' is null"),
    ({"choices": [{"routed_experts": [[[0, 1], [2, 3], [4, 9]]]}], "usage": {"prompt_tokens": 1}},
     r"line 1: choice 0: field 'routed_experts': token 0 \(layer 3\): expert id 9 out of range"),
    ({"choices": [{"routed_experts": [[[0, 1], [2, 3]]]}], "usage": {"prompt_tokens": 1}},
     "layer axis has 2 entries"),
    ({"choices": [{"routed_experts": "bm90IG5weQ=="}]}, "the prompt length is unknown"),
    ({"choices": [{"routed_experts": "bm90IG5weQ=="}], "usage": {"prompt_tokens": 1}},
     "not base64 of a .npy array"),
    ({"choices": [{"routed_experts": [[[0.5, 1], [2, 3], [4, 5]]]}], "usage": {"prompt_tokens": 1}},
     "integer expert ids"),
    ({"id": "x"}, "field 'choices' missing"),
])
def test_vllm_routed_errors_name_line_choice_and_field(tiny, tmp_path, resp, message):
    src = tmp_path / "r.jsonl"
    src.write_text(json.dumps(resp) + "\n")
    with pytest.raises(InputError, match=message):
        import_source("vllm-routed-experts", [src], tiny, tmp_path / "t")
    assert not (tmp_path / "t").exists()


# ------------------------------------------------------------------------------------- flame-moe
def _flame(tmp_path, n_samples=(5, 3), iters=(10, 20), layer_names=("layer_02", "layer_03", "layer_04")):
    root = tmp_path / "flame-moe-tiny"
    (root / "samples").mkdir(parents=True)
    tok = np.arange(100, 100 + sum(n_samples), dtype=np.int32)
    start = 0
    for i, n in enumerate(n_samples):
        pq.write_table(pa.table({"token_id": pa.array(tok[start:start + n], pa.int32())}),
                       root / "samples" / f"{i:03d}.parquet")
        start += n
    rng = np.random.default_rng(3)
    truth = {}
    for it in iters:
        d = root / "actives" / f"iter_{it:04d}"
        d.mkdir(parents=True)
        for name in layer_names:
            idx = np.stack([rng.choice(8, 2, replace=False) for _ in range(len(tok))]).astype(np.int16)
            sc = np.sort(rng.random((len(tok), 2)), axis=1)[:, ::-1].astype(np.float16)
            truth[(it, name)] = (idx, sc)
            table = pa.table({"scores": pa.array(sc.tolist(), pa.list_(pa.float16(), 2)),
                              "indices": pa.array(idx.tolist(), pa.list_(pa.int16(), 2))})
            pq.write_table(table, d / f"{name}.parquet")
    return root, tok, truth


def test_flame_rows_align_with_samples_and_layers_shift_by_one(tiny, tmp_path):
    root, tok, truth = _flame(tmp_path)
    res = import_source("flame-moe", [root], tiny, tmp_path / "t")  # latest iteration: 20
    df = rows(tmp_path / "t")
    assert df.height == 8 * 3 and res.summary["tokens"] == 8
    l2 = df.filter(pl.col("layer") == 2).sort("step")  # layer_03.parquet = decoder layer 2
    assert np.array(l2["expert_ids"].to_list()).tolist() == np.sort(truth[(20, "layer_03")][0], axis=-1).tolist()
    by_id = np.argsort(truth[(20, "layer_03")][0], axis=-1, kind="stable")  # weights stay with their experts
    assert np.allclose(np.array(l2["gate_weights"].to_list()),
                       np.take_along_axis(truth[(20, "layer_03")][1].astype(np.float32), by_id, axis=-1))
    assert l2["token_id"].to_list() == tok.tolist()
    assert l2["request_id"].to_list() == [0] * 5 + [1] * 3 and l2["position"].to_list() == [0, 1, 2, 3, 4, 0, 1, 2]
    import_source("flame-moe", [root / "actives" / "iter_0010"], tiny, tmp_path / "t10", max_tokens=6)
    df10 = rows(tmp_path / "t10")
    assert df10.height == 6 * 3
    got = np.array(df10.filter(pl.col("layer") == 1).sort("step")["expert_ids"].to_list())
    assert got.tolist() == np.sort(truth[(10, "layer_02")][0][:6], axis=-1).tolist()


def test_flame_errors(tiny, tmp_path):
    root, _, _ = _flame(tmp_path, layer_names=("layer_01",))
    with pytest.raises(InputError, match="layer_01 is decoder layer 0 .* not an MoE layer"):
        import_source("flame-moe", [root], tiny, tmp_path / "t")
    root2, _, _ = _flame(tmp_path / "b", n_samples=(4,), iters=(10,))
    pq.write_table(pa.table({"token_id": pa.array([1, 2], pa.int32())}), root2 / "samples" / "000.parquet")
    with pytest.raises(InputError, match="2 token rows, fewer than the 4 rows"):
        import_source("flame-moe", [root2], tiny, tmp_path / "t")
    root3, _, _ = _flame(tmp_path / "c", n_samples=(3,), iters=(10,))
    bad = pa.table({"scores": pa.array([[0.5, 0.2]] * 3, pa.list_(pa.float16(), 2)),
                    "indices": pa.array([[0, 1], [2, 3], [5, 8]], pa.list_(pa.int16(), 2))})
    pq.write_table(bad, root3 / "actives" / "iter_0010" / "layer_02.parquet")
    with pytest.raises(InputError, match=r"layer_02.parquet: rows 0..2: field 'indices': token 2: expert id 8"):
        import_source("flame-moe", [root3], tiny, tmp_path / "t")
    with pytest.raises(InputError, match=r"--iteration 30: .* holds iterations \[10\]"):
        import_source("flame-moe", [root3], tiny, tmp_path / "t", iteration=30)
    assert not (tmp_path / "t").exists()


# ---------------------------------------------------------------------------- moe-selection-json
def test_moe_selection_json_tree_with_domains(tiny, tmp_path, capsys):
    root = tmp_path / "profiling_result"
    q = root / "org" / "model" / "mmlu" / "math"
    q.mkdir(parents=True)
    rng = np.random.default_rng(4)
    a = _routes(rng, 3, layers=4)  # every decoder layer, dense row 0 all zero
    b = _routes(rng, 2, layers=3)  # MoE layers only
    (q / "q1.json").write_text(json.dumps({"prompt": "2+2?", "experts": a.tolist()}))
    (root / "org" / "model" / "hellaswag" / "misc").mkdir(parents=True)
    (root / "org" / "model" / "hellaswag" / "misc" / "q2.json").write_text(json.dumps(b.tolist()))
    out = tmp_path / "t"
    assert main(["trace", "import", "--format", "moe-selection-json", str(root), "--out", str(out),
                 "--model", str(TINY)]) == 0
    assert "rows written" in capsys.readouterr().out
    df = rows(out)
    assert df.height == (3 + 2) * 3 and set(df["phase"].unique().to_list()) == {1}
    # sorted path order: hellaswag/misc/q2.json first
    assert df.filter(pl.col("request_id") == 0)["domain"].unique().to_list() == ["hellaswag/misc"]
    r1 = df.filter((pl.col("request_id") == 1) & (pl.col("layer") == 2)).sort("position")
    assert r1["domain"].unique().to_list() == ["mmlu/math"]
    assert np.array(r1["expert_ids"].to_list()).tolist() == np.sort(a[:, 2], axis=-1).tolist()


def test_moe_selection_keyed_layers_and_errors(tiny, tmp_path):
    rng = np.random.default_rng(5)
    a = _routes(rng, 2, layers=4)
    keyed = {f"layer_{d}": a[:, d].tolist() for d in (1, 2, 3)}
    (tmp_path / "k.json").write_text(json.dumps(keyed))
    import_source("moe-selection-json", [tmp_path / "k.json"], tiny, tmp_path / "t")
    df = rows(tmp_path / "t")
    assert np.array(df.filter(pl.col("layer") == 3).sort("position")["expert_ids"].to_list()).tolist() == np.sort(a[:, 3], axis=-1).tolist()
    (tmp_path / "two.json").write_text(json.dumps({"x": a.tolist(), "y": a.tolist()}))
    with pytest.raises(InputError, match="exactly one field .* found 'x', 'y'"):
        import_source("moe-selection-json", [tmp_path / "two.json"], tiny, tmp_path / "t2")
    (tmp_path / "dense.json").write_text(json.dumps({"layer_0": a[:, 0].tolist()}))
    with pytest.raises(InputError, match="field 'layer_0': layer 0 is not an MoE layer"):
        import_source("moe-selection-json", [tmp_path / "dense.json"], tiny, tmp_path / "t2")
    c = a.copy()
    c[1, 2] = [3, 3]
    (tmp_path / "dup.json").write_text(json.dumps(c.tolist()))
    with pytest.raises(InputError, match="dup.json: query: field 'expert ids': token 1 \\(layer 2\\): expert ids \\[3, 3\\] repeat"):
        import_source("moe-selection-json", [tmp_path / "dup.json"], tiny, tmp_path / "t2")
    assert not (tmp_path / "t2").exists()


def test_cli_summaries_and_option_errors(tiny, tmp_path, capsys):
    d, _ = _stat_dir(tmp_path, tiny)
    assert main(["trace", "import", "--format", "trtllm-stats", str(d), "--model", str(TINY),
                 "--out", str(tmp_path / "l.npz")]) == 0
    out = capsys.readouterr().out
    assert "ranks                  2" in out and "MTP records skipped    4" in out and "windows                2" in out
    root, _, _ = _flame(tmp_path / "f")
    assert main(["trace", "import", "--format", "flame-moe", str(root), "--iteration", "10", "--max-tokens", "3",
                 "--model", str(TINY), "--out", str(tmp_path / "ft")]) == 0
    assert "tokens                 3" in capsys.readouterr().out
    assert main(["trace", "import", "--format", "trtllm-stats", str(d), "--max-tokens", "3", "--model", str(TINY),
                 "--out", str(tmp_path / "l2.npz")]) == 2
    assert "apply to --format flame-moe only" in capsys.readouterr().err
    assert main(["trace", "import", "--format", "flame-moe", str(root), "--model", str(TINY),
                 "--out", str(tmp_path / "x.npz")]) == 2
    assert "produces a trace directory" in capsys.readouterr().err
    assert not (tmp_path / "l2.npz").exists() and not (tmp_path / "x.npz").exists()


def test_sglang_pt_dump_without_torch_is_one_line(tmp_path, monkeypatch):
    """The core install has no torch: a .pt dump says how to get it instead of a traceback."""
    from moeplace.traces.importers.sglang import _load_dump

    dump = tmp_path / "expert_distribution_recorder_0.pt"
    dump.write_bytes(b"not read")
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ModuleNotFoundError
    with pytest.raises(InputError, match=r"\.pt dump needs torch, which this install lacks") as e:
        _load_dump(dump)
    assert "JSON" not in str(e.value)  # SGLang writes no JSON dumps: no way around torch to offer


def test_top_k_mismatch_names_the_shape_the_file_holds(tiny, tmp_path):
    """[tokens, layers, k] with the wrong k: the message quotes the array as written ([3, 4, 3]), not
    the [tokens x MoE layers, k] it is reshaped to inside ([9, 3])."""
    rng = np.random.default_rng(6)
    a = np.concatenate([_routes(rng, 3), np.full((3, 4, 1), 7, dtype=np.int16)], axis=2)  # k = 3, top-k 2
    (tmp_path / "k3.json").write_text(json.dumps(a.tolist()))
    with pytest.raises(InputError, match=r"k3.json: document: field '\(top level\)': shape \[3, 4, 3\], expected "
                                         r"\[tokens, layers, 2\]"):
        import_source("moe-selection-json", [tmp_path / "k3.json"], tiny, tmp_path / "t")
    assert not (tmp_path / "t").exists()
