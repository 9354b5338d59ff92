"""Statistics from a relabelled deployment come back in the original expert ids (issue 33 item 3): the
engine reports its own (relabelled) ids; importing through the manifest maps them back, so the trace, Loads
and placement the optimizer re-plans on are the ones the original model would have produced."""
from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from moeplace.cli.main import main
from moeplace.foundation.formats import tagged
from moeplace.foundation.model import load_model
from moeplace.placement.record import Placement, load_placement
from moeplace.placement.relabel import CONTIGUOUS, from_placement
from moeplace.traces.format import META_CHECKSUMS
from moeplace.traces.loads import load_loads
from moeplace.traces.validate import scan_trace

TINY = Path(__file__).parent / "data" / "tiny-moe-config.json"  # MoE layers 1..3, 8 experts, top-2


@pytest.fixture
def setup(tmp_path):
    model = load_model(TINY)
    rng = np.random.default_rng(7)
    p = Placement(np.stack([rng.permutation(8) for _ in range(3)]), 2, 2, model.name, 8, (1, 2, 3))
    p.save(tmp_path / "p.json")
    rel = from_placement(p, CONTIGUOUS)
    man = tagged("relabel-manifest", {"model": model.name, "layout": "contiguous", "num_experts": 8,
                                      "moe_layers": [1, 2, 3], "num_gpus": 2, "new2old": rel.new2old.tolist()})
    (tmp_path / "m.json").write_text(json.dumps(man))
    return model, rel, tmp_path


def _b64(arr) -> str:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def test_trace_round_trip(setup):
    """The original model routes R0; the relabelled deployment reports old2new[R0]; imported through the
    manifest (or the placement the plugin was given) the trace holds R0 again."""
    _model, rel, d = setup
    rng = np.random.default_rng(1)
    r0 = np.zeros((9, 4, 2), dtype=np.int16)
    for t in range(9):
        for layer in (1, 2, 3):
            r0[t, layer] = rng.choice(8, 2, replace=False)
    engine = r0.copy()
    for i, layer in enumerate((1, 2, 3)):
        engine[:, layer] = rel.old2new[i][r0[:, layer]]
    resp = {"id": "c", "object": "chat.completion", "prompt_token_ids": list(range(5)),
            "usage": {"prompt_tokens": 5, "completion_tokens": 5},
            "choices": [{"index": 0, "token_ids": list(range(5)), "routed_experts": _b64(engine)}]}
    (d / "r.json").write_text(json.dumps(resp))
    base = ["trace", "import", "--format", "vllm-routed-experts", str(d / "r.json"), "--model", str(TINY)]
    assert main([*base, "--out", str(d / "raw")]) == 0
    assert main([*base, "--out", str(d / "orig"), "--relabel-manifest", str(d / "m.json")]) == 0
    assert main([*base, "--out", str(d / "orig2"), "--relabel-manifest", str(d / "p.json")]) == 0
    for out, want in (("raw", engine), ("orig", r0), ("orig2", r0)):
        df = scan_trace(d / out).collect().sort(["position", "layer"])
        for layer in (1, 2, 3):
            got = np.array(df.filter(pl.col("layer") == layer)["expert_ids"].to_list())
            assert got.tolist() == np.sort(want[:, layer], axis=-1).tolist(), (out, layer)  # sets, ascending
    assert engine[:, 1:].tolist() != r0[:, 1:].tolist()  # the renaming was visible in the raw ids
    f = next((d / "orig").glob("*.parquet"))
    meta = pl.read_parquet_schema(str(f))
    assert "expert_delta_lo" in meta and META_CHECKSUMS in pq.read_schema(f).metadata  # the current format
    assert not [p for p in d.iterdir() if "moeplace-tmp" in p.name]


def test_loads_and_placement_dumps_round_trip(setup):
    _model, rel, d = setup
    load0 = np.arange(24).reshape(3, 8) + 1  # original experts' loads per MoE layer
    engine_load = np.take_along_axis(load0, rel.new2old, axis=1)  # engine id n is original new2old[n]
    rec = {"record_type": "eplb_load_stats", "version": 1, "step": 1, "num_ranks": 2,
           "expert_load": engine_load.tolist(), "p2l_map": [list(range(8))] * 3}
    (d / "e.jsonl").write_text(json.dumps(rec) + "\n")
    assert main(["trace", "import", "--format", "vllm-eplb", str(d / "e.jsonl"), "--model", str(TINY),
                 "--out", str(d / "l.npz"), "--relabel-manifest", str(d / "m.json")]) == 0
    assert load_loads(d / "l.npz").counts[0].tolist() == load0.tolist()
    # an engine placement dump (vLLM #49572 map) of the identity layout over engine ids is the placement
    (d / "map.json").write_text(json.dumps([list(range(8))] * 3))
    assert main(["import-placement", str(d / "map.json"), "--format", "vllm-expert-map", "--model", str(TINY),
                 "--gpus", "2", "--out", str(d / "back.json"), "--relabel-manifest", str(d / "m.json")]) == 0
    assert (load_placement(d / "back.json").phy2log == load_placement(d / "p.json").phy2log).all()


def test_manifest_of_another_model_is_refused(setup, capsys):
    _model, _rel, d = setup
    bad = json.loads((d / "m.json").read_text())
    bad["moe_layers"] = [3, 4, 5]
    (d / "bad.json").write_text(json.dumps(bad))
    (d / "e.jsonl").write_text("{}\n")
    assert main(["trace", "import", "--format", "vllm-eplb", str(d / "e.jsonl"), "--model", str(TINY),
                 "--out", str(d / "l.npz"), "--relabel-manifest", str(d / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert "bad.json" in err and "MoE layers" in err and len(err.strip().splitlines()) == 1
