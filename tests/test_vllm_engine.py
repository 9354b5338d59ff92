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


def test_the_plugin_relabels_for_the_layout_vllm_decides(ckpt):
    """vLLM 0.34.0's own determine_expert_placement_strategy (through effective_strategy): round_robin holds only
    for a model with expert groups and an all-to-all kernel with round-robin tables; the plugin relabels for
    what it answers, MegaMoE contiguous."""
    from vllm.config import ParallelConfig

    from moeplace.placement.export.vllm_plugin import effective_strategy

    def par(backend, strategy="round_robin", dp=4):
        return ParallelConfig(enable_expert_parallel=True, data_parallel_size=dp, expert_placement_strategy=strategy,
                              all2all_backend=backend)

    assert effective_strategy(par("deepep_low_latency"), 4, None) == "round_robin"  # groups + DeepEP-LL
    assert effective_strategy(par("deepep_high_throughput"), 4, None) == "linear"  # no round-robin tables
    assert effective_strategy(par("deepep_low_latency"), 1, None) == "linear"  # K3 / Qwen3: one group
    assert effective_strategy(par("deepep_low_latency"), 4, "deep_gemm_mega_moe") == "linear"  # MegaMoE
    assert effective_strategy(par("deepep_low_latency", "linear"), 4, None) == "linear"


def test_vllm_reads_per_layer_only_the_rank_s_source_experts(ckpt, monkeypatch):
    """Through vLLM's own safetensors iterator and should_skip_weight: each layer's heavy expert tensors read
    are the rank's source experts of that layer only (not the union over layers)."""
    from vllm.model_executor.model_loader import weight_utils
    from vllm.model_executor.model_loader.ep_weight_filter import compute_local_expert_ids

    from moeplace.placement.record import load_placement
    from moeplace.placement.relabel import CONTIGUOUS, permutations

    loader = _plugin_on(ckpt / "p.json", monkeypatch)
    read: list[str] = []
    real = weight_utils.safe_open

    class Recording:
        def __init__(self, *a, **kw):
            self.f = real(*a, **kw)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *a):
            return self.f.__exit__(*a)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(weight_utils, "safe_open", Recording)
    n2o = permutations(load_placement(ckpt / "p.json"), CONTIGUOUS)
    for rank in range(kit.GPUS):
        read.clear()
        local = compute_local_expert_ids(kit.E, kit.GPUS, rank, "linear")
        _load(loader, ckpt / "src", local)
        for i, layer in enumerate(kit.moe_layers("deepseek_v3")):
            got = {int(k.split(".experts.")[1].split(".")[0]) for k in read
                   if f"layers.{layer}.mlp.experts." in k and k.endswith(".weight")}
            assert got == {int(x) for x in n2o[i, sorted(local)]}, (rank, layer)


def test_vllm_meets_the_refusals_and_the_ray_variable(ckpt, monkeypatch):
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from moeplace.placement.export.vllm_plugin import PluginRefused

    loader = _plugin_on(ckpt / "p.json", monkeypatch)
    # every loader but the default one refuses while the variable is set (vLLM's own registry builds them)
    with pytest.raises(PluginRefused, match="--load-format dummy loads through DummyModelLoader"):
        get_model_loader(LoadConfig(load_format="dummy"))
    assert isinstance(get_model_loader(LoadConfig(load_format="safetensors")), loader)
    # Ray DP actors get MOEPLACE_PLACEMENT (vLLM's own list of variables to copy)
    from vllm.ray.ray_env import get_env_vars_to_copy

    assert "MOEPLACE_PLACEMENT" in get_env_vars_to_copy()
    # EPLB with redundant experts: vLLM's real ParallelConfig / EPLBConfig
    from vllm.config import ModelConfig, ParallelConfig, set_current_vllm_config

    # (vLLM refuses to build an EPLB config off CUDA/ROCm/XPU: the real objects, switched on after validation)
    par = ParallelConfig(enable_expert_parallel=True, data_parallel_size=kit.GPUS)
    object.__setattr__(par, "enable_eplb", True)
    object.__setattr__(par.eplb_config, "num_redundant_experts", 4)
    with set_current_vllm_config(SimpleNamespace(parallel_config=par)), \
            pytest.raises(PluginRefused, match="--enable-eplb with 4 redundant experts"):
        dict(loader(LoadConfig()).get_all_weights(ModelConfig(model=str(ckpt / "src")), SimpleNamespace()))


def test_vllm_megamoe_experts_are_a_routed_experts_capture_source():
    """The capability table's 'statistics dump' for vLLM under --moe-backend deep_gemm_mega_moe: vLLM 0.34.0's
    bind_routed_experts_capturer binds DeepGemmMegaMoEExperts (a RoutedExpertsCaptureSource: layer_id and
    capture_fn) -- run on the class itself, built without its GPU checks."""
    from torch import nn
    from vllm.model_executor.layers.fused_moe.deep_gemm_mega_moe import DeepGemmMegaMoEExperts
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

    experts = DeepGemmMegaMoEExperts.__new__(DeepGemmMegaMoEExperts)
    nn.Module.__init__(experts)
    experts.prefix = "language_model.model.layers.7.mlp.experts"
    experts.capture_fn = None
    holder = nn.Module()
    holder.experts = experts
    got = []
    capturer = SimpleNamespace(capture=lambda layer, ids: got.append((layer, ids)), restore_rows=None)
    bind_routed_experts_capturer(holder, capturer)
    assert experts.capture_fn is not None
    experts.capture_fn("topk")
    assert got == [(7, "topk")]
