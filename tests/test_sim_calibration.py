"""The calibration profile file: schema validation with located errors, save/load round trip."""
import json

import pytest

from moeplace.foundation.errors import InputError
from moeplace.sim.calibration import PROFILE_FORMAT, load_profile, profile_from_dict

GOOD = {"format": PROFILE_FORMAT, "device": "NVIDIA H200", "dtype": "bf16", "world_size": 4,
        "ops": {"expert_gemm": {"x": "tokens_per_expert", "hidden": 3584, "intermediate": 3072,
                                "points": [[1, 2e-5], [64, 3e-5], [512, 1.2e-4]]},
                "combine": {"x": "bytes", "link": "nvlink", "points": [[4096, 2e-5], [1 << 24, 4e-5]]}},
        "provenance": {"host": "test"}}


def test_round_trip(tmp_path):
    p = tmp_path / "profile.json"
    profile_from_dict(GOOD, "x").save(p)
    prof = load_profile(p)
    assert prof.device == "NVIDIA H200" and prof.world_size == 4 and sorted(prof.ops) == ["combine", "expert_gemm"]
    assert prof.ops["combine"].meta["link"] == "nvlink"
    assert prof.time("expert_gemm", 64) == pytest.approx(3e-5)
    assert json.loads(p.read_text())["ops"]["expert_gemm"]["points"][2] == [512.0, 1.2e-4]


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(format="other/1"), "field 'format'"),
    (lambda d: d.update(device=""), "field 'device'"),
    (lambda d: d["ops"].update(attention={"points": [[1, 1], [2, 2]]}), "field 'ops.attention': unknown"),
    (lambda d: d["ops"]["expert_gemm"].update(points=[[1, 1e-5]]), "field 'ops.expert_gemm.points'"),
    (lambda d: d["ops"]["expert_gemm"].update(points=[[1, 1e-5], [1, 2e-5]]), "row 1: x must be strictly"),
    (lambda d: d["ops"]["expert_gemm"].update(points=[[1, 1e-5], [2, -1]]), "seconds >= 0"),
    (lambda d: d["ops"]["expert_gemm"].update(x="bytes"), "field 'ops.expert_gemm.x'"),
    (lambda d: d["ops"]["combine"].update(link="pcie"), "field 'ops.combine.link'"),
    (lambda d: d["ops"]["expert_gemm"].update(hidden=-3), "field 'ops.expert_gemm.hidden'"),
])
def test_bad_profiles_name_the_file_and_field(tmp_path, change, message):
    d = json.loads(json.dumps(GOOD))
    change(d)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    with pytest.raises(InputError, match=message) as exc:
        load_profile(p)
    assert str(p) in str(exc.value)


def test_unreadable_file(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(InputError, match="not a readable JSON"):
        load_profile(p)
    with pytest.raises(InputError, match="no such calibration profile"):
        load_profile(tmp_path / "missing.json")
