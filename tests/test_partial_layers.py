"""Partial-layer traces: a routing log of 5 of Qwen1.5-MoE-A2.7B's 24 MoE layers (tests/data/
vllm_routes_5of24.jsonl, its meta line declaring ``layers_logged``) imports as a trace of those layers, every
reader works on them and says "5 of 24 layers", an undeclared gap is refused, and a placement planned on it is
not exported to an engine file (which needs every layer)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moeplace.cli.main import main
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import load_model
from moeplace.placement.record import load_placement
from moeplace.sim.workload import load_trace_tokens, stand_in_layers
from moeplace.traces.importers import import_source
from moeplace.traces.validate import check_trace

DATA = Path(__file__).parent / "data"
QWEN = DATA / "qwen1.5-moe-a2.7b-config.json"  # 24 decoder layers, all MoE, 60 experts, top-4
LOG = DATA / "vllm_routes_5of24.jsonl"  # layers 0, 5, 11, 17, 23; 48 tokens in two batches
HELD = [0, 5, 11, 17, 23]


@pytest.fixture(scope="module")
def qwen():
    return load_model(QWEN)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("partial") / "q5"
    assert main(["trace", "import", "--format", "vllm-jsonl", str(LOG), "--model", str(QWEN), "--out", str(out)]) == 0
    return out


def _undeclared(tmp_path) -> Path:
    """The fixture log with its meta line's layers_logged removed."""
    lines = LOG.read_text().splitlines()
    meta = json.loads(lines[0])
    del meta["layers_logged"]
    p = tmp_path / "undeclared.jsonl"
    p.write_text("\n".join([json.dumps(meta), *lines[1:]]) + "\n")
    return p


def test_declared_log_imports_as_a_trace_of_its_layers(trace, qwen, capsys):
    t = check_trace(trace)
    assert t.model.moe_layers == tuple(HELD) and t.model.model_moe_layers == qwen.moe_layers
    assert t.model.layers_label == "5 of 24 layers" and t.model.whole() == qwen
    # weights and memory count the whole model, not the 5 held layers
    assert t.model.total_params == qwen.total_params
    assert main(["trace", "validate", str(trace)]) == 0
    assert "5 of 24 MoE layers x 60 experts" in capsys.readouterr().out


def test_undeclared_gap_is_refused_and_layers_flag_declares(tmp_path, qwen):
    src = _undeclared(tmp_path)
    with pytest.raises(InputError) as e:
        import_source("vllm-jsonl", [src], qwen, tmp_path / "t")
    msg = str(e.value)
    assert "does not declare the layers it holds" in msg and "no rows for 1-4,6-10,12-16,18-22" in msg
    assert "--layers" in msg and not (tmp_path / "t").exists()
    res = import_source("vllm-jsonl", [src], qwen, tmp_path / "t", layers=tuple(HELD))
    assert res.summary["layers_declared_by"] == "--layers" and res.summary["layers_covered"] == HELD
    # a declared layer without rows is a gap too
    with pytest.raises(InputError, match=r"declares MoE layers 0-5,11,17,23 \(--layers\) but has no rows for 1-4"):
        import_source("vllm-jsonl", [src], qwen, tmp_path / "u", layers=(0, 1, 2, 3, 4, 5, 11, 17, 23))
    # rows outside the declared layers are refused, naming the row
    with pytest.raises(InputError, match=r"line \d+: field 'layer' is decoder layer 23, not among the layers --layers"):
        import_source("vllm-jsonl", [src], qwen, tmp_path / "v", layers=(0, 5, 11, 17))


def test_optimize_and_stats_say_5_of_24_layers(trace, tmp_path, capsys):
    assert main(["trace", "stats", str(trace), "--out", str(tmp_path / "q5.npz")]) == 0
    assert "5 of 24 layers" in capsys.readouterr().out
    for src in (trace, tmp_path / "q5.npz"):
        assert main(["optimize", str(src), "--gpus", "4", "--policy", "eplb", "--no-shift",
                     "--out", str(tmp_path / "pl.json"), "--force"]) == 0
        head = capsys.readouterr().out.splitlines()[0]
        assert "5 of 24 layers (the MoE layers the input holds" in head
    pl = load_placement(tmp_path / "pl.json")
    assert pl.layers_label == "5 of 24 layers" and pl.moe_layers == tuple(HELD)


def test_evaluate_scores_the_held_layers_and_export_refuses(trace, qwen, tmp_path, capsys):
    assert main(["optimize", str(trace), "--gpus", "4", "--policy", "eplb", "--no-shift",
                 "--out", str(tmp_path / "pl.json")]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "pl.json"), str(trace)]) == 0
    assert "scored on 5 of 24 layers" in capsys.readouterr().out
    # a placement of the whole model is scored on the rows of the held layers
    whole = load_placement(tmp_path / "pl.json")
    rows = np.asarray(stand_in_layers(check_trace(trace).model))
    full = type(whole)(whole.phy2log[rows], 4, 4, whole.model_name, 60, qwen.moe_layers, {"policy": "test"})
    full.save(tmp_path / "full.json")
    other = tmp_path / "config.json"  # the model from another path: its spec's source differs, its shape not
    other.write_text(QWEN.read_text())
    assert main(["evaluate", str(tmp_path / "full.json"), str(trace), "--model", str(other), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["layers"] == "5 of 24 layers" and doc["moe_layers"] == 5
    # an engine file needs every MoE layer: a partial placement is refused, nothing written
    assert main(["export", str(tmp_path / "pl.json"), "--format", "vllm-expert-map", "--model", str(QWEN),
                 "--out", str(tmp_path / "map.json")]) == 2
    err = capsys.readouterr().err
    assert "planned on 5 of 24 layers" in err and "needs every MoE layer" in err
    assert not (tmp_path / "map.json").exists()


def test_simulator_routes_every_layer_from_the_nearest_held_one(trace, qwen):
    tt = load_trace_tokens(trace)
    assert tt.model == qwen and tt.expert_ids.shape == (48, 24, 4)
    assert "5 of 24 layers" in tt.layers_note and "estimate" in tt.layers_note
    # layer 8 is nearest to held layer 5 (index 1), layer 3 to 5 as well, layer 2 to 0
    near = stand_in_layers(check_trace(trace).model)
    assert near[[0, 2, 3, 8, 9, 23]].tolist() == [0, 0, 1, 1, 2, 4]
    np.testing.assert_array_equal(tt.expert_ids[:, 8], tt.expert_ids[:, 5])


@pytest.mark.parametrize("bad", ["5-3", "0,0", "x", "3,1"])
def test_layers_flag_refuses_bad_lists(bad, tmp_path, capsys):
    rc = main(["trace", "import", "--format", "vllm-jsonl", str(LOG), "--model", str(QWEN), "--out",
               str(tmp_path / "t"), "--layers", bad])
    assert rc == 2 and "argument --layers" in capsys.readouterr().err and not (tmp_path / "t").exists()


def test_layers_flag_is_for_vllm_jsonl_only(tmp_path, capsys):
    rc = main(["trace", "import", "--format", "vllm-eplb", str(DATA / "vllm_eplb.jsonl"), "--model", "kimi-k3",
               "--out", str(tmp_path / "l.npz"), "--layers", "1-3"])
    assert rc == 2 and "--layers applies to --format vllm-jsonl only" in capsys.readouterr().err


def test_partial_loads_drive_the_simulator_on_every_layer(trace, qwen, tmp_path, capsys):
    from moeplace.sim.inputs import read_workload

    assert main(["trace", "stats", str(trace), "--out", str(tmp_path / "q5.npz")]) == 0
    capsys.readouterr()
    wl = read_workload(str(tmp_path / "q5.npz"), (), None, 0)
    assert wl.trace.model == qwen and wl.trace.expert_ids.shape[1] == 24
    assert "5 of 24 layers" in wl.trace.layers_note and "estimate" in wl.trace.layers_note
