"""The capability table (placement/export/capabilities.py, `place engines`) and the commands that read it:
export warnings, launch notes, `place rebalance`, `place plan`/`optimize` advice agree with it cell by
cell, so no two commands disagree about what an engine does with a model."""
from __future__ import annotations

import dataclasses
import json
from importlib import resources

import numpy as np
import pytest

from moeplace.cli.main import main
from moeplace.foundation.model import load_model, preset_names
from moeplace.placement.export import capabilities, export_placement
from moeplace.placement.export.flags import FlagOptions, launch_spec
from moeplace.placement.record import Placement
from moeplace.sim.tune import unavailable


def _placement(model, G, R):
    rows = np.tile(np.concatenate([np.arange(model.num_experts), np.arange(R)]), (model.num_moe_layers, 1))
    return Placement.from_phy2log(rows, model, G, 8, {"cluster": {"gpu": "h200"}})


@pytest.fixture(scope="module")
def presets():
    return [load_model(m) for m in preset_names()]


def test_place_engines_json_has_every_cell_with_a_reason(capsys, presets):
    assert main(["engines", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "moeplace.engine-capabilities/1"
    assert set(doc["features"]) == {"checkpoint", "plugin", "placement_file", "online_eplb", "stats_dump"}
    assert doc["plugin"] == {"entry_point_group": "vllm.general_plugins", "name": "moeplace",
                             "install": "pip install 'moeplace[vllm]'", "env": "MOEPLACE_PLACEMENT"}
    cells = doc["cells"]
    assert len(cells) == len(capabilities.ENGINES) * len(presets) * 5
    assert all(c["reason"] and c["supported"] in (True, False, None) for c in cells)
    k3 = {(c["engine"], c["feature"]): c for c in cells if c["model"] == "kimi-k3"}
    # the facts of issue 33, read in the released engines' source
    assert k3["sglang", "placement_file"]["supported"] is False
    assert "kimi_k3.py lacks get_model_config_for_expert_location" in k3["sglang", "placement_file"]["reason"]
    assert k3["vllm", "placement_file"]["supported"] is False and "#49572" in k3["vllm", "placement_file"]["reason"]
    assert k3["vllm", "online_eplb"]["supported"] is False and "#50647" in k3["vllm", "online_eplb"]["reason"]
    assert k3["trtllm", "placement_file"]["supported"] is False and "excludes" in k3["trtllm", "placement_file"]["reason"]
    assert k3["vllm", "plugin"]["supported"] and k3["sglang", "checkpoint"]["supported"]
    dsv3 = {(c["engine"], c["feature"]): c["supported"] for c in cells if c["model"] == "deepseek-v3"}
    assert dsv3["sglang", "placement_file"] and dsv3["trtllm", "placement_file"] and dsv3["vllm", "online_eplb"]


def test_vllm_placement_file_fact_follows_the_recorded_parser():
    """'vLLM 0.34.0 loads no expert map' is what its recorded EPLBConfig says: no key names a file."""
    rec = json.loads(resources.files("moeplace.placement.export").joinpath(
        "engine_options", "vllm-0.34.0.json").read_text())
    assert not [k for k in rec["eplb_config_keys"] if "path" in k or "map" in k or "file" in k]
    assert "--enable-expert-parallel" in rec["options"]


def test_place_engines_human_table_matches_the_json(capsys):
    assert main(["engines", "--model", "kimi-k3", "--engine", "sglang"]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.strip().startswith("kimi-k3 (kimi_k3)"))
    k3 = load_model("kimi-k3")
    want = [capabilities.cell("sglang", f, k3).mark for f in capabilities.FEATURES]
    assert row[2:] == want == ["yes", "no", "no", "no", "no"]
    assert "kimi-k3, placement file: SGLang 0.5.23: kimi_k3.py lacks" in out and "vLLM" not in out.split("\n\n")[1]


def test_an_architecture_the_table_does_not_name_is_not_checked():
    m = dataclasses.replace(load_model("qwen3-30b-a3b"), name="new-moe", hf_model_type="new_moe")
    assert capabilities.cell("sglang", "placement_file", m).supported is None
    assert "not checked for new_moe" in capabilities.cell("sglang", "online_eplb", m).reason
    assert capabilities.cell("vllm", "placement_file", m).supported is False  # no vLLM release loads a map
    assert capabilities.cell("trtllm", "placement_file", m).supported is False  # the balancer's list is closed
    # not checked is neither assumed to work nor to fail: the rebalancer is still tuned, the file still written
    assert unavailable("sglang", m) is None and capabilities.serving_route("sglang", m, 8).feature == "placement_file"


def test_bad_model_or_engine_is_one_line_exit_2(capsys):
    assert main(["engines", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("place: error:") and len(err.strip().splitlines()) == 1
    assert main(["engines", "--engine", "nosuch"]) == 2
    assert "invalid choice: 'nosuch'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["kimi-k3", "deepseek-v3", "qwen3-30b-a3b", "kimi-k2"])
def test_export_launch_and_rebalance_agree_with_the_table(name, tmp_path):
    model = load_model(name)
    G = 32 if model.num_experts % 32 == 0 else 8
    R = G
    pl = _placement(model, G, R)
    opts = FlagOptions(tp=8, dp=G // 8, placement_path=str(tmp_path / "p.json"))
    for engine, fmt, suffix in (("sglang", "sglang", ".json"), ("vllm", "vllm-expert-map", ".json"),
                                ("trtllm", "trtllm-lb", ".yaml")):
        file_ok = capabilities.cell(engine, "placement_file", model).supported
        warned = export_placement(pl, model, fmt, tmp_path / f"{engine}{suffix}")
        reason = capabilities.cell(engine, "placement_file", model).reason
        assert (reason in " ".join(warned)) == (file_ok is False), (engine, warned)
        eplb_ok = capabilities.cell(engine, "online_eplb", model).supported is not False
        assert (unavailable(engine, model) is None) == eplb_ok, engine
    vl = launch_spec(pl, model, "vllm-expert-map", tmp_path / "v.json", opts)
    assert ("--enable-eplb" in vl.argv()) == (capabilities.cell("vllm", "online_eplb", model).supported is True)
    assert "--enable-expert-parallel" in vl.argv() and not vl.applies_placement  # replicas: no route applies them
    sg = launch_spec(pl, model, "sglang", tmp_path / "s.json", FlagOptions(tp=8, dp=G // 8))
    assert sg.applies_placement == bool(capabilities.cell("sglang", "placement_file", model).supported)
    # the replica-free placement: vLLM applies it through the plugin for every model
    free = launch_spec(_placement(model, G, 0), model, "vllm-expert-map", tmp_path / "v0.json", opts)
    # (with several DP ranks the variable goes to Ray's DP actors too)
    assert free.applies_placement and free.env == {"MOEPLACE_PLACEMENT": str((tmp_path / "p.json").resolve()),
                                                   "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY": "MOEPLACE_PLACEMENT"}


def test_plan_and_optimize_print_what_each_engine_lacks_for_k3(capsys):
    """One line per engine, once: `place plan` with replicas K3's engines cannot apply names each engine's
    route (a replica-free plan) and what it lacks; a replica-free plan prints nothing there."""
    assert main(["plan", "--model", "kimi-k3", "--gpus", "32", "--tp", "8", "--dp", "4", "--redundant", "32"]) == 0
    out = capsys.readouterr().out.splitlines()
    k3 = load_model("kimi-k3")
    i = next(i for i, line in enumerate(out) if line.startswith("serving a kimi-k3 placement"))
    assert out[i:i + 4] == capabilities.serving_lines(k3, 32)
    assert [s.split()[0] for s in out[i + 1:i + 4]] == ["vLLM", "SGLang", "TensorRT-LLM"]
    assert "--redundant 0" in out[i + 1] and "load-time plugin" in out[i + 1] and "relabelled checkpoint" in out[i + 2]
    assert "no placement file or online EPLB for kimi-k3" in out[i + 2]
    assert main(["plan", "--model", "kimi-k3", "--gpus", "32", "--tp", "8", "--dp", "4"]) == 0
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("serving")]
    # the table decides which models are planned replica-free by default
    assert capabilities.replica_free_only(k3)
    assert not any(capabilities.replica_free_only(load_model(m)) for m in ("deepseek-v3", "qwen3-30b-a3b", "kimi-k2"))
