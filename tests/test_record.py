"""The Placement record (placement/record.py): derived maps, validation, JSON round trip."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from moeplace.foundation.errors import InputError
from moeplace.placement.record import Placement, load_placement


@pytest.fixture(scope="module")
def small(k3):
    return replace(k3, name="small", num_layers=3, moe_layers=(1, 2), num_experts=4, top_k=2,
                   attention=("kda",) * 3, mla=None)


def test_derived_maps(small):
    pl = Placement.from_phy2log(np.array([[0, 1, 2, 3, 0, 0], [3, 2, 1, 0, 1, 2]]), small, 3, 3)
    assert pl.num_slots == 6 and pl.num_redundant == 2 and pl.slots_per_gpu == 2 and pl.num_nodes == 1
    assert pl.logcnt.tolist() == [[3, 1, 1, 1], [1, 2, 2, 1]]
    assert pl.log2phy.shape == (2, 4, 3)
    assert pl.log2phy[0, 0].tolist() == [0, 4, 5] and pl.log2phy[0, 1].tolist() == [1, -1, -1]
    assert pl.log2phy[1, 1].tolist() == [2, 4, -1] and pl.log2phy[1, 2].tolist() == [1, 5, -1]
    assert pl.slot_gpu.tolist() == [0, 0, 1, 1, 2, 2]
    assert pl.gpu_experts(1, 2).tolist() == [1, 2]
    assert pl.duplicate_on_gpu().tolist() == [True, False]  # layer 0: GPU2 holds expert 0 twice


def test_validation(small, k3):
    with pytest.raises(InputError, match="do not divide evenly"):
        Placement.from_phy2log(np.array([[0, 1, 2, 3, 0]] * 2), small, 2, 2)
    with pytest.raises(InputError, match="no replica"):
        Placement.from_phy2log(np.array([[0, 1, 2, 2]] * 2), small, 2, 2)
    with pytest.raises(InputError, match="out of range"):
        Placement.from_phy2log(np.array([[0, 1, 2, 4]] * 2), small, 2, 2)
    with pytest.raises(InputError, match="MoE layers"):
        Placement.from_phy2log(np.array([[0, 1, 2, 3]]), small, 2, 2)
    with pytest.raises(InputError, match="gpus_per_node"):
        Placement.from_phy2log(np.array([[0, 1, 2, 3]] * 2), small, 2, 4)
    pl = Placement.from_phy2log(np.array([[0, 1, 2, 3]] * 2), small, 2, 2)
    with pytest.raises(InputError, match="made for model 'small'"):
        pl.check_model(k3)
    assert pl.phy2log.flags.writeable is False


def test_json_roundtrip_and_errors(small, tmp_path):
    pl = Placement.from_phy2log(np.array([[0, 1, 2, 3], [3, 2, 1, 0]]), small, 2, 1, {"policy": "x"})
    pl.save(tmp_path / "p.json")
    back = load_placement(tmp_path / "p.json")
    assert np.array_equal(back.phy2log, pl.phy2log) and back.provenance == {"policy": "x"}
    assert back.fingerprint() == pl.fingerprint() and back.moe_layers == (1, 2)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InputError, match="not a readable placement JSON"):
        load_placement(tmp_path / "bad.json")
    d = json.loads((tmp_path / "p.json").read_text())
    d["format"] = "other"
    (tmp_path / "fmt.json").write_text(json.dumps(d))
    with pytest.raises(InputError, match="field 'format'"):
        load_placement(tmp_path / "fmt.json")
    d["format"] = "moeplace.placement/1"
    del d["num_gpus"]
    (tmp_path / "miss.json").write_text(json.dumps(d))
    with pytest.raises(InputError, match="'num_gpus' missing"):
        load_placement(tmp_path / "miss.json")
    with pytest.raises(InputError, match="no such placement file"):
        load_placement(tmp_path / "nope.json")
