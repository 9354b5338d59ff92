"""The vLLM load-time plugin (issue 33 item 2) without vLLM: its wrapper renames and permutes the
checkpoint's ``(name, tensor)`` stream into exactly what the checkpoint writer writes, keeps vLLM's EP weight
filter right, and refuses what it was not checked for with one line. (`make check-engines` runs it inside
released vLLM's own loader.)"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import relabelkit as kit

from moeplace.cli.main import main
from moeplace.placement.export.vllm_plugin import (
    EngineFacts,
    PluginRefused,
    register,
    relabel_weights,
    resolve,
    source_ids,
)

torch = pytest.importorskip("torch")


def _tensors(d):
    from safetensors import safe_open

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118 (not iterable)
    return out


def _facts(src, **kw):
    cfg = json.loads((src / "config.json").read_text())
    d = {"version": "0.34.0", "hf_config": cfg, "model_dir": str(src), "expert_parallel": True, "ep_size": kit.GPUS,
             "strategy": "linear"}
    d.update(kw)
    return EngineFacts(**d)


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    """DeepSeek-V3 (routing groups, sharded) relabelled contiguously; Qwen3-MoE (no groups: a group-keeping
    placement under contiguous ids is not one under round_robin's interleaved ids) relabelled round_robin."""
    root = tmp_path_factory.mktemp("plugin")
    for kind, layout, sub in (("deepseek_v3", "contiguous", ""), ("qwen3_moe", "round_robin", "rr/")):
        src = root / sub / "src"
        kit.build(kind, src, shard="20KB")
        p = kit.placement(kind, seed=5, groups=4 if kind == "deepseek_v3" else 1)
        p.save(root / sub / "p.json")
        assert main(["export", str(root / sub / "p.json"), "--format", "checkpoint", "--model-path", str(src),
                     "--out", str(root / sub / layout), "--layout", layout]) == 0
    return root


@pytest.mark.parametrize("strategy,written", [("linear", "contiguous"), ("round_robin", "rr/round_robin")])
def test_wrapper_yields_what_the_writer_wrote(ds, strategy, written):
    root = (ds / written).parent
    rel = resolve(str(root / "p.json"), _facts(root / "src", strategy=strategy))
    got = dict(relabel_weights(_tensors(root / "src").items(), rel))
    want = _tensors(ds / written)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert any(not torch.equal(got[k], _tensors(root / "src")[k]) for k in want)
    # the manifest the writer left names the same renaming
    rel2 = resolve(str(ds / written / "moeplace-relabel.json"), _facts(root / "src", strategy=strategy))
    assert (rel2.new2old == rel.new2old).all()


def test_ep_weight_filter_sees_source_ids_and_keeps_only_local_ones(ds):
    rel = resolve(str(ds / "p.json"), _facts(ds / "src"))
    local = {2, 3}  # EP rank 1 of 4, contiguous
    need = source_ids(rel, local)
    src = {k: v for k, v in _tensors(ds / "src").items()
           if ".experts." not in k or int(k.split(".experts.")[1].split(".")[0]) in need}  # vLLM's filter
    got = dict(relabel_weights(src.items(), rel, local))
    ids = {int(k.split(".experts.")[1].split(".")[0]) for k in got if ".experts." in k and "shared" not in k}
    assert ids == local
    want = _tensors(ds / "contiguous")
    assert all(torch.equal(got[k], want[k]) for k in got)
    n_expert = sum(1 for k in want if ".mlp.experts." in k and int(k.split(".experts.")[1].split(".")[0]) in local)
    assert sum(1 for k in got if ".mlp.experts." in k) == n_expert


def test_refusals(ds, tmp_path):
    src = ds / "src"
    p = str(ds / "p.json")
    cases = [
        ({"version": "0.33.1"}, "vLLM 0.33.1 is not a release"),
        ({"ep_size": 8}, "the placement is for 4 EP ranks but vLLM runs with EP size 8"),
        ({"expert_parallel": False}, "expert parallelism off"),
        ({"model_dir": str(ds / "contiguous")}, "already a relabelled checkpoint"),
        ({"hf_config": {**json.loads((src / "config.json").read_text()), "n_routed_experts": 16}}, "16 experts"),
    ]
    for kw, msg in cases:
        with pytest.raises(PluginRefused, match=msg) as e:
            resolve(p, _facts(src, **kw))
        assert "\n" not in str(e.value)
    with pytest.raises(PluginRefused, match="layout is round_robin, the engine's is contiguous"):
        resolve(str(ds / "rr" / "round_robin" / "moeplace-relabel.json"), _facts(ds / "rr" / "src"))
    with pytest.raises(PluginRefused, match="routing group 0 of 4"):  # interleaved ids split DeepSeek's groups
        resolve(p, _facts(src, strategy="round_robin"))
    bad = json.loads((ds / "contiguous" / "moeplace-relabel.json").read_text())
    bad["new2old"][0][0] = bad["new2old"][0][1]
    (tmp_path / "m.json").write_text(json.dumps(bad))
    with pytest.raises(PluginRefused, match="layer 0: not a permutation"):
        resolve(str(tmp_path / "m.json"), _facts(src))


def test_plugin_is_inert_without_the_variable_and_imports_no_engine(monkeypatch):
    monkeypatch.delenv("MOEPLACE_PLACEMENT", raising=False)
    register()  # vLLM is not installed here: returning at all shows it was not imported
    code = ("import sys, moeplace.placement.export.vllm_plugin as m, moeplace.cli.main; "
            "assert not {'vllm', 'torch'} & set(sys.modules), sorted({'vllm', 'torch'} & set(sys.modules))")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_source_ids_cover_every_layer():
    from moeplace.placement.relabel import CONTIGUOUS, Relabel

    rel = Relabel(np.array([[3, 2, 1, 0], [0, 1, 2, 3]]), (1, 2), CONTIGUOUS)
    assert source_ids(rel, {0}) == {3, 0}


def test_wrapper_permutes_stacked_experts_like_the_writer(tmp_path, capsys):
    """Fused ``experts.gate_up_proj [E, 2I, H]`` / ``down_proj`` tensors: rows gathered by new2old, by the
    plugin as by the writer (whose --json summary counts them)."""
    src = tmp_path / "src"
    kit.build("qwen3_moe", src, stacked=True)
    kit.placement("qwen3_moe", seed=9).save(tmp_path / "p.json")
    capsys.readouterr()
    assert main(["export", str(tmp_path / "p.json"), "--format", "checkpoint", "--model-path", str(src),
                 "--out", str(tmp_path / "dst"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tensors_relabelled"] == {"expert": 0, "stacked": 4, "router": 2, "bias": 0}
    assert doc["shards"] == {"model.safetensors": "rewritten"}
    rel = resolve(str(tmp_path / "p.json"), _facts(src))
    got = dict(relabel_weights(_tensors(src).items(), rel))
    want = _tensors(tmp_path / "dst")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
