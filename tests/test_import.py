"""Importers: SGLang recorder dumps (stat, per_token), vLLM per-token JSONL logs, vLLM EPLB load records.
Good inputs give hand-computed outputs that validate; bad inputs give one-line errors naming file,
line/record and field, and leave nothing behind."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moeplace.cli.main import main
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import load_model
from moeplace.traces.importers import import_source
from moeplace.traces.importers.vllm_jsonl import detect_numbering, warmup_mask
from moeplace.traces.loads import load_loads
from moeplace.traces.validate import read_trace_meta, scan_trace, validate_report

DATA = Path(__file__).parent / "data"
TINY = DATA / "tiny-moe-config.json"
# the same with 3 decoder layers (MoE layers 1-2): the model of tests/data/vllm_routes.jsonl, which logs
# two MoE layers (a trace holds every MoE layer of its model, so a log of two is a trace of this one)
TINY2 = DATA / "tiny-moe-2layers-config.json"


@pytest.fixture(scope="module")
def tiny():
    # 4 decoder layers, layer 0 dense, MoE layers 1..3, 8 experts, top-2
    return load_model(TINY)


@pytest.fixture(scope="module")
def tiny2():
    return load_model(TINY2)


def rows(path) -> list[dict]:
    """A trace's rows as written, the expert ids decoded (each token's top-k a set, ascending)."""
    return scan_trace(path).collect().to_dicts()


# ------------------------------------------------------------------------------------------ vllm-eplb
def test_vllm_eplb_maps_slots_to_logical_experts(tiny, tmp_path):
    out = tmp_path / "loads.npz"
    res = import_source("vllm-eplb", [DATA / "vllm_eplb.jsonl"], tiny, out)
    loads = load_loads(out)
    assert loads.model == tiny
    # record step 100: slot 8 holds expert 0 and slot 9 expert 7 in layer 0, so e0 = 10 + 6, e7 = 7 + 4
    assert loads.counts[0].tolist() == [
        [16, 1, 5, 2, 0, 3, 4, 11],
        [2, 9, 1, 3, 10, 0, 0, 5],
        [2, 2, 1, 1, 1, 1, 1, 1],
    ]
    # step 200 is all zero (dropped); step 300 has a reversed map in layer 0
    assert loads.counts[1].tolist() == [
        [17, 7, 6, 5, 4, 3, 2, 11],
        [0, 4, 0, 0, 0, 0, 0, 0],
        [4, 0, 0, 0, 0, 0, 0, 0],
    ]
    assert loads.labels == ("vllm_eplb.jsonl step 100", "vllm_eplb.jsonl step 300")
    # the physical load total is preserved
    assert loads.counts.sum() == 42 + 30 + 10 + 55 + 4 + 4
    s = res.summary
    assert (s["records_read"], s["idle_records_dropped"], s["other_records_skipped"], s["windows"]) == (
        3,
        1,
        1,
        2,
    )
    assert loads.provenance["format"] == "vllm-eplb"


def _eplb_line(**over) -> str:
    rec = {
        "record_type": "eplb_load_stats",
        "version": 1,
        "step": 1,
        "num_ranks": 2,
        "expert_load": [[1] * 8] * 3,
        "p2l_map": [list(range(8))] * 3,
    }
    rec.update(over)
    return json.dumps(rec)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "line 2: not valid JSON"),
        (_eplb_line(version=2), "line 2: field 'version' is 2, expected one of (1,)"),
        (
            _eplb_line(p2l_map=[list(range(8))] * 2),
            (
                "line 2: field 'p2l_map' has shape [2, 8], but 'expert_load' has "
                "[3, 8]; both are [num_moe_layers][num_slots]"
            ),
        ),
        (
            _eplb_line(expert_load=[[1] * 8] * 4, p2l_map=[list(range(8))] * 4),
            (
                "line 2: field 'expert_load' has 4 layers, but model 'tiny-moe' has 3 MoE layers "
                "(vLLM numbers MoE layers only; this count includes dense layers?)"
            ),
        ),
        (
            _eplb_line(p2l_map=[list(range(8)), [0, 1, 2, 3, 4, 5, 6, 8], list(range(8))]),
            (
                "line 2: field 'p2l_map': layer 1 slot 7 maps to logical expert 8, "
                "expected 0..7 (model 'tiny-moe')"
            ),
        ),
        (
            _eplb_line(p2l_map=[list(range(8)), [0, 1, 2, 3, 4, 5, 6, 6], list(range(8))]),
            (
                "line 2: field 'p2l_map': layer 1 has no slot for logical expert 7; "
                "every logical expert needs at least one replica"
            ),
        ),
        (_eplb_line(expert_load=[[1.5] * 8] * 3), "line 2: field 'expert_load': [0][0]: value 1.5 is not an integer"),
        (
            _eplb_line(num_ranks=3),
            "line 2: field 'num_ranks' is 3, which does not divide the 8 physical slots",
        ),
        (
            json.dumps({"record_type": "eplb_load_stats", "version": 1, "num_ranks": 2}),
            "line 2: field 'step' missing (expected an integer step)",
        ),
    ],
)
def test_vllm_eplb_bad_records(tiny, tmp_path, line, message):
    src = tmp_path / "stats.jsonl"
    src.write_text(_eplb_line() + "\n" + line + "\n")
    out = tmp_path / "loads.npz"
    with pytest.raises(InputError) as exc:
        import_source("vllm-eplb", [src], tiny, out)
    assert str(exc.value).startswith(f"{src}: {message}")
    assert not out.exists() and list(tmp_path.iterdir()) == [src]


# ---------------------------------------------------------------------------------------- sglang stat
def test_sglang_stat_json_keeps_moe_layers_and_drops_zero_steps(tiny, tmp_path):
    out = tmp_path / "s.npz"
    res = import_source("sglang", [DATA / "sglang_stat.json"], tiny, out)
    loads = load_loads(out)
    raw = json.loads((DATA / "sglang_stat.json").read_text())["logical_count"]
    # layer 0 (dense) removed; step 1 (all zero: an unfilled buffer slot) dropped
    assert loads.counts.tolist() == [raw[0][1:], raw[2][1:]]
    assert res.summary["zero_steps_dropped"] == 1 and res.summary["records_read"] == 3
    assert loads.provenance["mode"] == "stat"


def test_sglang_stat_pt_dump(tiny, tmp_path):
    """The recorder's real form: torch.save of {rank, logical_count int32 tensor, utilization}."""
    raw = json.loads((DATA / "sglang_stat.json").read_text())
    pt = tmp_path / "expert_distribution_recorder_1764302556.1.pt"
    torch.save(
        {
            "rank": 0,
            "logical_count": torch.tensor(raw["logical_count"], dtype=torch.int32),
            "average_utilization_rate_over_window": 0.75,
        },
        pt,
    )
    res = import_source("sglang", [pt], tiny, tmp_path / "s.npz")
    assert res.loads.counts.tolist() == [raw["logical_count"][0][1:], raw["logical_count"][2][1:]]
    assert res.loads.provenance["average_utilization_rate_over_window"] == [0.75]
    # a dump already restricted to the MoE layers is accepted as is; two dumps concatenate
    moe_only = tmp_path / "moe_only.json"
    moe_only.write_text(json.dumps({"logical_count": [step[1:] for step in raw["logical_count"]]}))
    res2 = import_source("sglang", [pt, moe_only], tiny, tmp_path / "s2.npz")
    assert res2.loads.num_windows == 4
    assert np.array_equal(res2.loads.counts[2:], res.loads.counts)


@pytest.mark.parametrize(
    "count, message",
    [
        (
            np.zeros((2, 5, 8)),
            (
                "field 'logical_count': layer axis has 5 layers; model 'tiny-moe' has 4 layers (3 MoE): "
                "expected 4 (SGLang counts every decoder layer) or 3"
            ),
        ),
        (np.zeros((2, 4, 9)), "field 'logical_count' has 9 experts per layer, but model 'tiny-moe' has 8"),
        (
            np.pad(np.ones((1, 1, 8)), ((0, 0), (0, 3), (0, 0))),
            (
                "field 'logical_count': layer 0 is dense in model 'tiny-moe' but has expert counts: "
                "the dump is not of this model (check --model)"
            ),
        ),
        (np.full((1, 4, 8), -1), "field 'logical_count': step 0, layer 0, expert 0: value -1 is negative"),
    ],
)
def test_sglang_stat_bad(tiny, tmp_path, count, message):
    src = tmp_path / "dump.json"
    src.write_text(json.dumps({"logical_count": count.tolist()}))
    with pytest.raises(InputError) as exc:
        import_source("sglang", [src], tiny, tmp_path / "o.npz")
    assert str(exc.value) == f"{src}: {message}"
    assert not (tmp_path / "o.npz").exists()


def test_sglang_corrupt_and_unknown_dumps(tiny, tmp_path):
    bad = tmp_path / "x.pt"
    bad.write_bytes(b"not a torch file")
    with pytest.raises(InputError, match=r"x\.pt: not a readable torch dump \(torch\.load weights_only=True"):
        import_source("sglang", [bad], tiny, tmp_path / "o.npz")
    other = tmp_path / "y.json"
    other.write_text(json.dumps({"physical_to_logical_map": [[0]]}))
    with pytest.raises(
        InputError,
        match=r"y\.json: field 'logical_count' \(stat mode\) or 'records' "
        r"\(per_token mode\) missing",
    ):
        import_source("sglang", [other], tiny, tmp_path / "o.npz")


# ----------------------------------------------------------------------------------- sglang per_token
P2L = [list(range(8)) + [0, 1]] * 4  # 10 physical slots: 8 experts + replicas of 0 and 1, every layer


def _topk(per_layer: dict[int, list[list[int]]], n: int) -> torch.Tensor:
    """SGLang's buffer: [num_layers=4, n, 8] int32, -1 where nothing was recorded (dense layer 0)."""
    t = torch.full((4, n, 8), -1, dtype=torch.int32)
    for layer, ids in per_layer.items():
        t[layer, :, :2] = torch.tensor(ids, dtype=torch.int32)
    return t


def _rank_dump(tmp_path, rank: int) -> Path:
    return tmp_path / f"expert_distribution_recorder_1764302556.5_{rank}.pt"


def _per_token_dumps(tmp_path) -> list[Path]:
    rank0 = {
        "records": [
            # extend pass: two sequences (2 + 1 tokens); physical 8 -> logical 0, 9 -> 1
            {
                "forward_pass_id": 0,
                "rank": 0,
                "gatherer_key": "primary",
                "input_ids": [11, 12, 13],
                "positions": [0, 1, 0],
                "extend_seq_lens": [2, 1],
                "forward_mode": 1,
                "topk_ids_of_layer": _topk(
                    {1: [[8, 2], [3, 4], [5, 6]], 2: [[7, 9], [0, 1], [2, 3]], 3: [[4, 5], [6, 7], [8, 3]]}, 3
                ),
                "misc_objects": [],
            },
            # decode pass: two tokens, MoE layer 3 not recorded (all -1)
            {
                "forward_pass_id": 1,
                "rank": 0,
                "gatherer_key": "primary",
                "input_ids": [14, 15],
                "positions": [2, 1],
                "extend_seq_lens": None,
                "forward_mode": 2,
                "topk_ids_of_layer": _topk({1: [[1, 2], [9, 3]], 2: [[4, 5], [6, 7]]}, 2),
                "misc_objects": [],
            },
        ],
        "last_physical_to_logical_map": torch.tensor(P2L, dtype=torch.int32),
    }
    rank1 = {
        "records": [
            {
                "forward_pass_id": 0,
                "rank": 1,
                "gatherer_key": "primary",
                "input_ids": [21],
                "positions": [0],
                "extend_seq_lens": [1],
                "forward_mode": 1,
                "topk_ids_of_layer": _topk({1: [[0, 9]], 2: [[2, 8]], 3: [[3, 4]]}, 1),
                "misc_objects": [],
            },
        ],
        "last_physical_to_logical_map": torch.tensor(P2L, dtype=torch.int32),
    }
    paths = []
    for rank, d in ((1, rank1), (0, rank0)):  # file order must not matter
        p = _rank_dump(tmp_path, rank)
        torch.save(d, p)
        paths.append(p)
    return paths


def test_sglang_per_token_to_trace(tiny, tmp_path):
    out = tmp_path / "trace"
    res = import_source("sglang", _per_token_dumps(tmp_path), tiny, out)
    assert validate_report(out).ok
    model, prov = read_trace_meta(out)
    assert model == tiny and prov["mode"] == "per_token"
    got = [
        (r["step"], r["request_id"], r["position"], r["phase"], r["layer"], r["expert_ids"], r["token_id"])
        for r in rows(out)
    ]
    assert got == [
        # pass 0, rank 0: sequences 0 (2 tokens) and 1; physical 8/9 mapped to logical 0/1
        (0, 0, 0, 0, 1, [0, 2], 11),
        (0, 0, 0, 0, 2, [1, 7], 11),  # a token's experts as a set, ascending (the router's order is not kept)
        (0, 0, 0, 0, 3, [4, 5], 11),
        (0, 0, 1, 0, 1, [3, 4], 12),
        (0, 0, 1, 0, 2, [0, 1], 12),
        (0, 0, 1, 0, 3, [6, 7], 12),
        (0, 1, 0, 0, 1, [5, 6], 13),
        (0, 1, 0, 0, 2, [2, 3], 13),
        (0, 1, 0, 0, 3, [0, 3], 13),
        # pass 0, rank 1
        (0, 2, 0, 0, 1, [0, 1], 21),
        (0, 2, 0, 0, 2, [0, 2], 21),
        (0, 2, 0, 0, 3, [3, 4], 21),
        # pass 1, rank 0 (decode, layer 3 not recorded): its two tokens have no row in layer 3, dropped
    ]
    s = res.summary
    assert (s["records_read"], s["rows_written"], s["tokens"], s["layers_covered"]) == (3, 12, 4, [1, 2, 3])
    assert s["incomplete_tokens_dropped"] == 2
    assert s["notes"] == [
        ("dropped 2 tokens recorded in only some of the 3 MoE layers the import holds (1-3): 1 forward pass(es), "
        f"the first forward pass 1 of rank 0 ({_rank_dump(tmp_path, 0)}, record 1) records layers 1-2")]
    assert (prov["incomplete_tokens_dropped"], prov["incomplete_passes_dropped"], prov["layers_covered"]) == (
        2, 1, [1, 2, 3])


def test_sglang_per_token_drop_is_said_and_nothing_complete_is_refused(tiny, tmp_path, capsys):
    dumps = _per_token_dumps(tmp_path)
    out = tmp_path / "trace"
    assert main(["trace", "import", "--format", "sglang", *map(str, dumps), "--out", str(out),
                 "--model", str(TINY)]) == 0
    cap = capsys.readouterr()
    assert cap.err == (
        "place: warning: dropped 2 tokens recorded in only some of the 3 MoE layers the import holds (1-3): "
        f"1 forward pass(es), the first forward pass 1 of rank 0 ({dumps[1]}, record 1) records layers 1-2\n")
    assert "  partial tokens dropped 2\n" in cap.out and "  tokens                 4\n" in cap.out
    # the trace passes every reader: validate and stats count the 4 complete tokens
    assert main(["trace", "validate", str(out)]) == 0
    assert "12 rows, 4 tokens" in capsys.readouterr().out
    assert main(["trace", "stats", str(out)]) == 0
    capsys.readouterr()
    # no pass records all of layers 1-3: pass 0 (both ranks) lost layer 1, pass 1 still lacks layer 3
    for p in dumps:
        d = torch.load(p, weights_only=True)
        for rec in d["records"]:
            if rec["forward_pass_id"] == 0:
                rec["topk_ids_of_layer"][1] = -1
        torch.save(d, p)
    with pytest.raises(InputError) as exc:
        import_source("sglang", dumps, tiny, tmp_path / "t")
    assert str(exc.value) == (
        f"{dumps[0]}, {dumps[1]}: no forward pass records every MoE layer the import holds (1-3); the first "
        f"forward pass 0 of rank 0 ({dumps[1]}, record 0) records layers 2-3: nothing complete to import (each "
        "token needs a row in each layer)")
    assert not (tmp_path / "t").exists()


def test_sglang_per_token_errors(tiny, tmp_path):
    dumps = _per_token_dumps(tmp_path)
    # a top-16 model (like K3): SGLang's per_token buffer keeps 8 columns
    wide = dataclasses.replace(tiny, name="tiny-top16", num_experts=32, top_k=16)
    with pytest.raises(
        InputError, match="keeps 8 experts per token, fewer than top_k 16 of model 'tiny-top16'"
    ):
        import_source("sglang", dumps[:1], wide, tmp_path / "t")
    d = torch.load(dumps[1], weights_only=True)
    d["records"][0]["topk_ids_of_layer"][0, 0, :2] = torch.tensor([1, 2])  # dense layer with experts
    torch.save(d, dumps[1])
    with pytest.raises(InputError) as exc:
        import_source("sglang", dumps, tiny, tmp_path / "t")
    assert str(exc.value) == (
        f"{dumps[1]}: record 0: field 'topk_ids_of_layer': layer 0 is dense in model "
        "'tiny-moe' but has recorded experts: the dump is not of this model"
    )
    d["records"][0]["topk_ids_of_layer"][0, 0, :2] = -1
    d["records"][0]["topk_ids_of_layer"][2, 1, 1] = -1  # one of two experts missing
    torch.save(d, dumps[1])
    with pytest.raises(InputError) as exc:
        import_source("sglang", dumps, tiny, tmp_path / "t")
    assert str(exc.value) == (
        f"{dumps[1]}: record 0: field 'topk_ids_of_layer': MoE layer 2 token 1 has 1 of 2 experts recorded"
    )
    assert not (tmp_path / "t").exists()
    with pytest.raises(InputError, match="a per_token dump mixed with stat dumps"):
        import_source("sglang", [dumps[0], DATA / "sglang_stat.json"], tiny, tmp_path / "t")


# ----------------------------------------------------------------------------------------- vllm-jsonl
def test_vllm_jsonl_drops_warmup_and_aligns_layers(tiny2, tmp_path):
    out = tmp_path / "trace"
    res = import_source("vllm-jsonl", [DATA / "vllm_routes.jsonl"], tiny2, out)
    s = res.summary
    assert (s["records_read"], s["warmup_rows_dropped"], s["rows_written"], s["tokens"]) == (46, 36, 10, 5)
    assert s["layers_covered"] == [1, 2] and s["layer_numbering"] == "moe"
    assert validate_report(out).ok
    got = [
        (r["request_id"], r["position"], r["step"], r["layer"], r["expert_ids"], r["gate_weights"])
        for r in rows(out)
    ]
    assert got[:4] == [
        (0, 0, 0, 1, [0, 1], [0.5, 0.5]),
        (0, 0, 0, 2, [6, 7], [0.5, 0.5]),
        (0, 1, 1, 1, [2, 3], [0.75, 0.25]),
        (0, 1, 1, 2, [0, 2], [0.625, 0.375]),
    ]
    assert got[-1] == (1, 1, 4, 2, [2, 6], [0.5, 0.5])
    # without warm-up detection every row is kept
    res0 = import_source("vllm-jsonl", [DATA / "vllm_routes.jsonl"], tiny2, tmp_path / "all", warmup_min_run=0)
    assert res0.summary["rows_written"] == 46 and res0.summary["warmup_rows_dropped"] == 0


def test_vllm_jsonl_repeated_token_idx_joined_by_occurrence(tiny2, tmp_path):
    """The public logger restarts token_idx per batch under one req_id: the n-th (req, token_idx) at one
    layer joins the n-th at the other layer."""
    lines = [json.dumps({"type": "meta", "model_id": "tiny-moe", "top_k": 2})]
    for ids0, ids1 in (
        ([[0, 1], [2, 3]], [[4, 5], [6, 7]]),
        ([[1, 2], [3, 4]], [[5, 6], [7, 0]]),
    ):
        for layer, ids in ((0, ids0), (1, ids1)):
            for t, pair in enumerate(ids):
                lines.append(
                    json.dumps(
                        {
                            "type": "route",
                            "req_id": "r0",
                            "token_idx": t,
                            "layer": layer,
                            "topk_ids": pair,
                            "topk_weights": [0.5, 0.5],
                        }
                    )
                )
    src = tmp_path / "log.jsonl"
    src.write_text("\n".join(lines) + "\n")
    import_source("vllm-jsonl", [src], tiny2, tmp_path / "t")
    got = [(r["step"], r["layer"], r["expert_ids"]) for r in rows(tmp_path / "t")]
    assert got == [
        (0, 1, [0, 1]),
        (0, 2, [4, 5]),
        (1, 1, [2, 3]),
        (1, 2, [6, 7]),
        (2, 1, [1, 2]),
        (2, 2, [5, 6]),
        (3, 1, [3, 4]),
        (3, 2, [0, 7]),  # logged [7, 0]: a trace keeps the top-k as a set, ascending
    ]


def test_layer_numbering_detection(tiny, k3):
    assert detect_numbering(np.array([0, 1]), tiny) == ("moe", False)  # 0 is dense: ordinal
    assert detect_numbering(np.array([2, 3]), tiny) == ("decoder", False)  # 3 >= 3 MoE layers: decoder index
    assert detect_numbering(np.array([1, 2]), tiny) == ("moe", True)  # both fit: ambiguous
    assert detect_numbering(np.array([1, 2]), tiny, "decoder") == ("decoder", False)
    assert detect_numbering(np.arange(91), k3) == ("moe", False)
    assert detect_numbering(np.array([92]), k3) == ("decoder", False)
    with pytest.raises(InputError, match=r"logged layers \[0, 3\] fit neither numbering"):
        detect_numbering(np.array([0, 3]), tiny)
    with pytest.raises(InputError, match="layer 0 is not an MoE decoder layer"):
        detect_numbering(np.array([0]), tiny, "decoder")


def test_vllm_jsonl_decoder_numbered_log(tiny2, tmp_path):
    src = tmp_path / "dec.jsonl"
    text = (DATA / "vllm_routes.jsonl").read_text()
    text = text.replace('"layer": 1,', '"layer": 2,').replace('"layer": 0,', '"layer": 1,')
    src.write_text(text.replace('"layers_logged": [0, 1]', '"layers_logged": [1, 2]'))
    res = import_source("vllm-jsonl", [src], tiny2, tmp_path / "t")
    assert res.summary["layer_numbering"] == "decoder" and res.summary["layers_covered"] == [1, 2]


def test_warmup_mask_runs_per_layer():
    layer = np.array([0, 1, 0, 1, 0, 1, 0, 1, 0, 1])
    ids = np.array([[1, 2]] * 8 + [[3, 4], [3, 4]])
    # layer 0 rows 0,2,4,6 identical then row 8 differs; layer 1 rows 1,3,5,7,9 - row 9 differs from 7
    w = np.ones((10, 2))
    assert warmup_mask(layer, ids, w, 4).tolist() == [True] * 8 + [False, False]
    assert not warmup_mask(layer, ids, w, 5).any()
    w[4] = 0.5  # breaks layer 0's run into 2 + 1 + 1
    assert warmup_mask(layer, ids, w, 4).tolist() == [
        False,
        True,
        False,
        True,
        False,
        True,
        False,
        True,
        False,
        False,
    ]


@pytest.mark.parametrize(
    "line, message",
    [
        (
            '{"type": "route", "req_id": "r", "token_idx": 0, "layer": 0, "topk_ids": [1, 2]}',
            "line 1: a 'route' record before any 'meta' record",
        ),
        (
            '{"type": "meta", "top_k": 4}',
            "line 1: field 'top_k' is 4, but model 'tiny-moe' routes top-2 (wrong --model?)",
        ),
        (
            (
                '{"type": "meta", "top_k": 2}\n{"type": "route", "req_id": "r", "token_idx": 0, "layer": 0, '
                '"topk_ids": [1, 9], "topk_weights": [0.5, 0.5]}'
            ),
            "line 2: field 'topk_ids': expert 9 outside 0..7 (model 'tiny-moe')",
        ),
        (
            (
                '{"type": "meta", "top_k": 2}\n\n'
                '{"type": "route", "req_id": "r", "token_idx": 0, "layer": 0, '
                '"topk_ids": [4, 4], "topk_weights": [0.5, 0.5]}'
            ),
            "line 3: field 'topk_ids': expert repeated in [4, 4]",
        ),
        (
            (
                '{"type": "meta", "top_k": 2}\n{"type": "route", "req_id": "r", "token_idx": 0, "layer": 0, '
                '"topk_ids": [1, 2, 3], "topk_weights": [0.5, 0.5]}'
            ),
            "line 2: field 'topk_ids' has 3 ids, expected a list of top_k = 2 expert ids",
        ),
        (
            (
                '{"type": "meta", "top_k": 2}\n{"type": "route", "req_id": "r", "token_idx": -1, "layer": 0, '
                '"topk_ids": [1, 2]}'
            ),
            "line 2: field 'token_idx' is -1, expected an integer in [0, 2147483647]",
        ),
        (
            (
                '{"type": "meta", "top_k": 2}\n{"type": "route", "req_id": "r", "token_idx": 0, "layer": 0, '
                '"topk_ids": [1, 2], "topk_weights": [0.5, -0.5]}'
            ),
            "line 2: field 'topk_weights': weight -0.5 is not a finite non-negative number",
        ),
        (
            (
                '{"type": "meta", "top_k": 2, "layers_logged": [0]}\n'
                '{"type": "route", "req_id": "r", "token_idx": 0, '
                '"layer": 1, "topk_ids": [1, 2]}'
            ),
            "line 2: field 'layer' is 1, not in the meta record's layers_logged [0]",
        ),
        (
            (
                '{"type": "meta", "top_k": 2}\n{"type": "route", "req_id": "r", "token_idx": 0, "layer": 0, '
                '"topk_ids": [1, 2]}\n'
                '{"type": "route", "req_id": "r", "token_idx": 0, "layer": 3, "topk_ids": [1, 2]}'
            ),
            "field 'layer': logged layers [0, 3] fit neither numbering of model 'tiny-moe'",
        ),
        (
            (
                '{"type": "meta", "top_k": 2}\n{"type": "route", "req_id": "r", "token_idx": 0, "layer": 0, '
                '"topk_ids": [1, 2]}\n'
                '{"type": "route", "req_id": "r", "token_idx": 1, "layer": 0, "topk_ids": [1, 2], '
                '"topk_weights": [1, 0]}'
            ),
            "line 3: field 'topk_weights' present, unlike the lines before",
        ),
        (
            (
                '{"type": "meta", "top_k": 2}\n{"type": "route", "req_id": "r", "token_idx": 0, "layer": 0, '
                '"topk_ids": [1, 2]'
            ),
            "line 2: not valid JSON",
        ),
    ],
)
def test_vllm_jsonl_bad_lines(tiny, tmp_path, line, message):
    src = tmp_path / "log.jsonl"
    src.write_text(line + "\n")
    with pytest.raises(InputError) as exc:
        import_source("vllm-jsonl", [src], tiny, tmp_path / "t")
    assert str(exc.value).startswith(f"{src}: {message}")
    assert list(tmp_path.iterdir()) == [src]


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_import_and_errors(tmp_path, capsys):
    out = tmp_path / "loads.npz"
    assert (
        main(
            [
                "trace",
                "import",
                "--format",
                "vllm-eplb",
                str(DATA / "vllm_eplb.jsonl"),
                "--out",
                str(out),
                "--model",
                str(TINY),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "records read           3" in text and "idle records dropped   1" in text
    assert load_loads(out).num_windows == 2
    assert (
        main(
            [
                "trace",
                "import",
                "--format",
                "vllm-jsonl",
                str(DATA / "vllm_routes.jsonl"),
                "--out",
                str(tmp_path / "t"),
                "--model",
                str(TINY2),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "warm-up rows dropped   36" in text and "layers covered         2: 1-2" in text
    assert main(["trace", "validate", str(tmp_path / "t")]) == 0
    capsys.readouterr()
    # a K3 model against the tiny log: one-line error, exit 2, nothing written
    assert (
        main(
            [
                "trace",
                "import",
                "--format",
                "vllm-jsonl",
                str(DATA / "vllm_routes.jsonl"),
                "--out",
                str(tmp_path / "k3"),
                "--model",
                "kimi-k3",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err == (
        f"place: error: {DATA / 'vllm_routes.jsonl'}: line 1: field 'top_k' is 2, but model 'kimi-k3' "
        "routes top-16 (wrong --model?)"
    )
    assert not (tmp_path / "k3").exists()
    assert (
        main(
            [
                "trace",
                "import",
                "--format",
                "vllm-eplb",
                str(DATA / "vllm_eplb.jsonl"),
                "--out",
                str(tmp_path / "dir"),
                "--model",
                str(TINY),
            ]
        )
        == 2
    )
    assert "give a path ending in .npz" in capsys.readouterr().err


def test_place_trace_stats_accepts_imported_trace(tmp_path, capsys):
    out = tmp_path / "t"
    assert (
        main(
            [
                "trace",
                "import",
                "--format",
                "vllm-jsonl",
                str(DATA / "vllm_routes.jsonl"),
                "--out",
                str(out),
                "--model",
                str(TINY2),
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["trace", "stats", str(out), "--out", str(tmp_path / "loads.npz")]) == 0
    loads = load_loads(tmp_path / "loads.npz")
    # 5 tokens at MoE layer 1 (2 experts each) and 5 at layer 2
    assert loads.total().sum() == 20


def test_sglang_per_token_map_mismatch(tiny, tmp_path):
    """Physical ids 0 and 8 are both logical expert 0 under the dump's map: a token cannot route to one
    logical expert twice, so the map does not fit the recording."""
    dumps = _per_token_dumps(tmp_path)
    d = torch.load(dumps[1], weights_only=True)
    d["records"][0]["topk_ids_of_layer"][1, 0, :2] = torch.tensor([0, 8])
    torch.save(d, dumps[1])
    with pytest.raises(InputError) as exc:
        import_source("sglang", dumps, tiny, tmp_path / "t")
    assert str(exc.value) == (
        f"{dumps[1]}: record 0: field 'topk_ids_of_layer': MoE layer 1 token 0: "
        "physical experts [0, 8] map to logical [0, 0] with a repeat; 'last_physical_to_logical_map' "
        "does not fit this record (EPLB rebalanced during recording?)"
    )


def test_vllm_jsonl_nan_weight_reported_as_field_problem(tiny, tmp_path):
    """Python's json.dumps writes NaN; it must reach the weight check, not fail as 'not valid JSON'."""
    src = tmp_path / "log.jsonl"
    src.write_text(
        '{"type": "meta", "top_k": 2}\n'
        '{"type": "route", "req_id": "r", "token_idx": 0, "layer": 0, "topk_ids": [1, 2], '
        '"topk_weights": [NaN, 1]}\n'
    )
    with pytest.raises(InputError) as exc:
        import_source("vllm-jsonl", [src], tiny, tmp_path / "t")
    assert (
        str(exc.value)
        == f"{src}: line 2: field 'topk_weights': weight nan is not a finite non-negative number"
    )


def test_vllm_jsonl_chunked_parse_matches_and_keeps_line_numbers(tiny2, tmp_path, monkeypatch):
    """Rows move to numpy every FLUSH_ROWS rows: the result must not depend on it, nor the line numbers."""
    import moeplace.traces.importers.vllm_jsonl as vj

    import_source("vllm-jsonl", [DATA / "vllm_routes.jsonl"], tiny2, tmp_path / "one")
    monkeypatch.setattr(vj, "FLUSH_ROWS", 7)
    import_source("vllm-jsonl", [DATA / "vllm_routes.jsonl"], tiny2, tmp_path / "chunked")
    assert rows(tmp_path / "one") == rows(tmp_path / "chunked")
    src = tmp_path / "bad.jsonl"
    lines = (DATA / "vllm_routes.jsonl").read_text().splitlines()
    lines[40] = json.dumps({**json.loads(lines[40]), "topk_ids": [8, 1]})
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError) as exc:
        import_source("vllm-jsonl", [src], tiny2, tmp_path / "t")
    assert str(exc.value) == f"{src}: line 41: field 'topk_ids': expert 8 outside 0..7 (model 'tiny-moe')"


# ------------------------------------------------------------------------------ values are never changed
def test_sglang_values_beyond_their_types_are_errors(tiny, tmp_path):
    """Counts that overflow int64 (alone or summed), fractional counts or ids, positions and token ids
    beyond int32: each an error naming file, record and field, never a wrapped or truncated value."""
    c = np.zeros((1, 4, 8), np.int64)
    c[0, 1, :3] = 2**62  # each fits int64, their sum does not
    pt = tmp_path / "big.pt"
    torch.save({"logical_count": torch.tensor(c)}, pt)
    with pytest.raises(InputError) as exc:
        import_source("sglang", [pt], tiny, tmp_path / "o.npz")
    assert str(exc.value) == (f"{pt}: field 'logical_count': the counts sum to 1.384e+19 selections, beyond the "
                              "int64 range of a Loads file (corrupt or mis-typed counts?)")
    two = [tmp_path / "a.json", tmp_path / "b.json"]
    half = np.zeros((1, 4, 8), np.int64)
    half[0, 1, :3] = 2**61  # one dump fits int64, the two together do not
    for p in two:
        p.write_text(json.dumps({"logical_count": half.tolist()}))
    with pytest.raises(InputError, match=rf"^{two[1]}: field 'logical_count' \(with the dumps before it\): the "
                                         r"counts sum to 1\.384e\+19 selections"):
        import_source("sglang", two, tiny, tmp_path / "o.npz")
    frac = tmp_path / "frac.json"
    frac.write_text(json.dumps({"logical_count": [[[0] * 8, [1.5] + [0] * 7, [0] * 8, [0] * 8]]}))
    with pytest.raises(InputError) as exc:
        import_source("sglang", [frac], tiny, tmp_path / "o.npz")
    assert str(exc.value) == f"{frac}: field 'logical_count': step 0, layer 1, expert 0: value 1.5 is not an integer"
    assert not (tmp_path / "o.npz").exists()

    for field, value, message in (
        ("positions", [0, 2**31, 0], "token 1: value 2147483648 is outside [0, the int32 maximum]"),
        ("input_ids", [11, 12, 2**32], "token 2: value 4294967296 is outside [0, the int32 maximum]"),
        ("positions", [0, -1, 0], "token 1: value -1 is negative"),
    ):
        dumps = _per_token_dumps(tmp_path)
        d = torch.load(dumps[0], weights_only=True)
        d["records"][0][field] = value
        torch.save(d, dumps[0])
        with pytest.raises(InputError) as exc:
            import_source("sglang", dumps, tiny, tmp_path / "t")
        assert str(exc.value) == f"{dumps[0]}: record 0: field '{field}': {message}"
    dumps = _per_token_dumps(tmp_path)
    d = torch.load(dumps[0], weights_only=True)
    ids = d["records"][0]["topk_ids_of_layer"].float()
    ids[2, 0, 0] += 0.5
    d["records"][0]["topk_ids_of_layer"] = ids
    torch.save(d, dumps[0])
    with pytest.raises(InputError) as exc:
        import_source("sglang", dumps, tiny, tmp_path / "t")
    assert str(exc.value).startswith(f"{dumps[0]}: record 0: field 'topk_ids_of_layer': layer 2 token 0: value ")
    assert str(exc.value).endswith(".5 is not an integer")
    assert not (tmp_path / "t").exists()


def test_vllm_jsonl_fractional_ids_and_huge_positions_are_errors(tiny, tmp_path):
    meta = '{"type": "meta", "top_k": 2}'
    for route, message in (
        ('"token_idx": 0, "layer": 1, "topk_ids": [1.5, 2]', ("line 2: field 'topk_ids' holds 1.5, expected integer "
                                                              "expert ids")),
        ('"token_idx": 0, "layer": 1, "topk_ids": [1, 2.0]', ("line 2: field 'topk_ids' holds 2.0, expected integer "
                                                              "expert ids")),
        ('"token_idx": 2147483648, "layer": 1, "topk_ids": [1, 2]', ("line 2: field 'token_idx' is 2147483648, "
                                                                     "expected an integer in [0, 2147483647]")),
        ('"token_idx": 0, "layer": 1, "topk_ids": [1, 18446744073709551615]', ("line 2: field 'topk_ids': expert "
                                                                               "18446744073709551615 outside 0..7")),
    ):
        src = tmp_path / "log.jsonl"
        src.write_text(meta + '\n{"type": "route", "req_id": "r", ' + route + "}\n")
        with pytest.raises(InputError) as exc:
            import_source("vllm-jsonl", [src], tiny, tmp_path / "t")
        assert str(exc.value).startswith(f"{src}: {message}")
        assert not (tmp_path / "t").exists()


def test_vllm_eplb_loads_stay_exact_and_never_overflow(tiny, tmp_path):
    big = 2**53 - 1  # the largest count a Loads holds (float64-exact); beyond is refused as corrupt
    load = [[big] + [0] * 7] + [[1] * 8] * 2
    src = tmp_path / "eplb.jsonl"
    src.write_text(_eplb_line(expert_load=load) + "\n")
    res = import_source("vllm-eplb", [src], tiny, None)
    assert int(res.loads.counts[0, 0, 0]) == big
    load = [[2**60 + 1] + [0] * 7] + [[1] * 8] * 2
    src.write_text(_eplb_line(expert_load=load) + "\n")
    with pytest.raises(InputError, match=r"MoE layer 1 counts 1\.153e\+18 expert selections, more than the ceiling"):
        import_source("vllm-eplb", [src], tiny, None)
    src.write_text("\n".join(_eplb_line(expert_load=load, step=s) for s in range(9)) + "\n")
    with pytest.raises(InputError, match=rf"^{src}: line 8: field 'expert_load': the counts sum to 9\.223e\+18"):
        import_source("vllm-eplb", [src], tiny, None)


def test_a_converted_trace_that_fails_the_gate_names_inputs_and_output(tiny, tmp_path):
    """The last line of defence after an importer's record checks: the message names the sources and the
    output directory, never the temporary directory the trace was staged in (gone by then)."""
    from moeplace.traces.importers._common import write_validated_trace

    out = tmp_path / "t"

    def bad(w):  # expert 1 twice in one row
        w.write(request_id=[0], position=[0], phase=[0], step=[0], layer=[1], expert_ids=[[1, 1]])

    with pytest.raises(InputError) as exc:
        write_validated_trace(out, tiny, {"sources": ["a.jsonl", "b.jsonl"]}, bad)
    assert str(exc.value) == ("a.jsonl, b.jsonl: converted, it would not be a valid trace: "
                              f"{out}/part-00000.parquet: row 0: field 'expert_ids': expert 1 repeated in one "
                              "token's top-2 [1, 1]")
    assert list(tmp_path.iterdir()) == []
