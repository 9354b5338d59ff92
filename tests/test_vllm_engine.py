"""The load-time plugin inside released vLLM's own code (issue 33 item 4; run by `make check-engines`, which
builds ``.venv-engines`` with vllm==0.34.0; skipped where vLLM is not installed).

What runs here is vLLM's, unmodified: the plugin discovery (``vllm.plugins.load_general_plugins`` reading
the ``vllm.general_plugins`` entry point of the installed moeplace), ``ModelConfig`` parsing the checkpoint's
config.json, ``DefaultModelLoader.get_all_weights`` -> ``_prepare_weights`` (shard discovery through the
index) -> ``safetensors_weights_iterator`` with the EP weight filter (``local_expert_ids``). Where it stops
on CPU: ``VllmConfig`` cannot be built without a device (vLLM 0.34.0 "Failed to infer device type"), so the
current config holds vLLM's real ``ParallelConfig`` alone; the model classes' ``load_weights`` (FusedMoE's
per-expert weight loader) need a device platform and are not run here (the GPU script does)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

import relabelkit as kit

from moeplace.cli.main import main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    kit.build("deepseek_v3", root / "src", shard="20KB")
    kit.placement("deepseek_v3", seed=5, groups=4).save(root / "p.json")
    assert main(["export", str(root / "p.json"), "--format", "checkpoint", "--model-path", str(root / "src"),
                 "--out", str(root / "dst")]) == 0
    return root


def _plugin_on(path, monkeypatch):
    import vllm.plugins as vp
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    monkeypatch.setenv("MOEPLACE_PLACEMENT", str(path))
    monkeypatch.setattr(DefaultModelLoader, "get_all_weights", DefaultModelLoader.get_all_weights)  # undone after
    monkeypatch.setattr(vp, "plugins_loaded", False)
    vp.load_general_plugins()
    assert getattr(DefaultModelLoader.get_all_weights, "_moeplace", False), "vLLM did not load the moeplace plugin"
    return DefaultModelLoader


def _load(loader_cls, src, local, ep=4, strategy="linear"):
    from vllm.config import LoadConfig, ModelConfig, ParallelConfig, set_current_vllm_config

    par = ParallelConfig(enable_expert_parallel=True, data_parallel_size=ep, expert_placement_strategy=strategy)
    loader = loader_cls(LoadConfig())
    loader.local_expert_ids = local  # what _init_ep_weight_filter computes for this EP rank
    with set_current_vllm_config(SimpleNamespace(parallel_config=par)):
        return dict(loader.get_all_weights(ModelConfig(model=str(src)), SimpleNamespace()))


def test_vllm_loads_the_relabelled_model_through_the_plugin(ckpt, monkeypatch):
    from vllm.model_executor.model_loader.ep_weight_filter import compute_local_expert_ids, should_skip_weight
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    loader = _plugin_on(ckpt / "p.json", monkeypatch)
    for rank in range(kit.GPUS):
        local = compute_local_expert_ids(kit.E, kit.GPUS, rank, "linear")
        got = _load(loader, ckpt / "src", local)
        files = sorted(str(f) for f in (ckpt / "dst").glob("*.safetensors"))
        want = {k: v for k, v in safetensors_weights_iterator(files, False) if not should_skip_weight(k, local)}
        assert got.keys() == want.keys(), rank
        assert all(torch.equal(got[k], want[k]) for k in want), rank
        ids = {int(k.split(".experts.")[1].split(".")[0]) for k in got if ".mlp.experts." in k}
        assert ids == local


def test_vllm_refuses_through_the_plugin(ckpt, monkeypatch):
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from moeplace.placement.export.vllm_plugin import PluginRefused

    loader = _plugin_on(ckpt / "p.json", monkeypatch)
    with pytest.raises(PluginRefused, match="4 EP ranks but vLLM runs with EP size 8"):
        _load(loader, ckpt / "src", None, ep=8)
    with pytest.raises(PluginRefused, match="already a relabelled checkpoint"):
        _load(loader, ckpt / "dst", None)
    monkeypatch.delenv("MOEPLACE_PLACEMENT")
    assert DefaultModelLoader.get_all_weights is loader.get_all_weights
    assert os.environ.get("MOEPLACE_PLACEMENT") is None
