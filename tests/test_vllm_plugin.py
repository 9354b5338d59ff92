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
    """DeepSeek-V3 (routing groups, sharded) relabelled contiguously; DeepSeek-V3 whose tokens keep every group
    (any renaming exact; several groups, so vLLM lays it out round-robin where asked) relabelled round_robin."""
    root = tmp_path_factory.mktemp("plugin")
    for kind, layout, sub in (("deepseek_v3", "contiguous", ""), ("deepseek_v3_rr", "round_robin", "rr/")):
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


def test_the_filter_reads_per_layer_only_the_rank_s_source_experts():
    """K3 on EP32: a rank's 28 engine ids per layer come from 28 source ids per layer; the union over 92 layers
    (what vLLM's filter held before) is nearly every expert."""
    from moeplace.placement.export.vllm_plugin import LayerFilter, rank_experts, skip_like_vllm
    from moeplace.placement.relabel import CONTIGUOUS, Relabel

    rng = np.random.default_rng(0)
    layers = tuple(range(1, 93))
    rel = Relabel(np.stack([rng.permutation(896) for _ in layers]), layers, CONTIGUOUS)
    local = rank_experts(rel, 32, 5)
    assert local == set(range(140, 168))
    f = LayerFilter(rel, local)
    assert len(f) > 800  # the union: what reading by id alone would let through
    for i, d in enumerate(layers[:5]):
        ids = f.ids_for(f"language_model.model.layers.{d}.mlp.experts.0.w1.weight_packed")
        assert ids == {int(x) for x in rel.new2old[i, sorted(local)]} and len(ids) == 28
        name = lambda e, d=d: f"language_model.model.layers.{d}.mlp.experts.{e}.w1.weight_packed"
        read = [e for e in range(896) if not skip_like_vllm(name(e), f.ids_for(name(e)))]
        assert len(read) == 28  # per layer: the rank's own 28 source experts
    assert f.ids_for("model.layers.0.self_attn.q_proj.weight") is f
    assert f.ids_for("model.layers.99.mlp.experts.3.w1.weight") == local  # a layer outside the placement
    # vLLM's rule: only heavy tensors are skipped; every expert's scales pass (some backends need them all)
    assert skip_like_vllm("x.layers.1.mlp.experts.7.w1.weight_packed", {1})
    assert not skip_like_vllm("x.layers.1.mlp.experts.7.w1.weight_scale", {1})


def test_the_layout_vllm_uses_and_the_new_refusals(ds, tmp_path):
    src, p = ds / "src", str(ds / "p.json")
    # vLLM asked for round_robin places experts linearly (DeepSeek-V3 has groups, but e.g. an all-to-all kernel
    # without round-robin tables): a placement JSON is relabelled for the layout vLLM uses
    rel = resolve(p, _facts(src, strategy="round_robin", effective="linear"))
    assert rel.layout.name == "contiguous"
    with pytest.raises(PluginRefused, match="places experts linear: determine_expert_placement_strategy"):
        resolve(str(ds / "rr" / "round_robin" / "moeplace-relabel.json"),
                _facts(ds / "rr" / "src", strategy="round_robin", effective="linear"))
    with pytest.raises(PluginRefused, match="--enable-eplb with 8 redundant experts"):
        resolve(p, _facts(src, eplb=True, redundant=8))
    resolve(p, _facts(src, eplb=True, redundant=0))  # EPLB without redundant experts starts from this layout
    with pytest.raises(PluginRefused, match="loads through RunaiModelStreamerLoader, which the plugin does not wrap"):
        resolve(p, _facts(src, loader="RunaiModelStreamerLoader"))
    # a relabelled copy without its manifest: its shards' __metadata__ still say so
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(ds / "contiguous", bare)
    (bare / "moeplace-relabel.json").unlink()
    with pytest.raises(PluginRefused, match="already a relabelled checkpoint .*__metadata__ names a relabelling"):
        resolve(p, _facts(src, model_dir=str(bare)))
    # quantization entries that name an expert the renaming moves: too late to rename them at load
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {},
                                  "ignore": ["model.layers.1.mlp.experts.0.gate_proj"]}
    with pytest.raises(PluginRefused, match="names 1 expert module"):
        resolve(p, _facts(src, hf_config=cfg))
    cfg["quantization_config"]["ignore"] = ["re:.*experts\\.(0|1)\\..*"]
    with pytest.raises(PluginRefused, match="names some experts of MoE layer"):
        resolve(p, _facts(src, hf_config=cfg))
    cfg["quantization_config"]["ignore"] = ["re:.*shared_experts.*", "lm_head"]
    resolve(p, _facts(src, hf_config=cfg))  # entries no renaming changes


def test_check_logs_finds_a_mixed_deployment(tmp_path, capsys):
    from moeplace.placement.export.vllm_plugin import applied_line, check_logs
    from moeplace.placement.relabel import CONTIGUOUS, Relabel

    rel = Relabel(np.stack([np.random.default_rng(1).permutation(8)]), (1,), CONTIGUOUS)
    good = {f"r{r}": f"INFO 12-06 vllm.moeplace: {applied_line(rel, 'fp1', r, 4, 2)}\n" for r in range(4)}
    assert check_logs(good).problems == []
    assert check_logs(good, "fp1").problems == [] and check_logs(good, "fp2").problems
    missing = dict(good)
    del missing["r2"]
    assert "1 of 4 EP ranks logged no placement (ranks 2)" in check_logs(missing).problems[0]
    other = {**good, "r3": applied_line(Relabel(np.arange(8)[None], (1,), CONTIGUOUS), "fp1", 3, 4, 2)}
    assert "different placements" in check_logs(other).problems[0]
    assert "relabelled nothing" in check_logs({"x": "no plugin here"}).problems[0]
    for name, text in missing.items():
        (tmp_path / name).write_text(text)
    logs = [str(tmp_path / n) for n in missing]
    assert main(["export", "--check-logs", *logs]) == 1
    assert "a mixed model" in capsys.readouterr().err
    (tmp_path / "r2").write_text(good["r2"])
    assert main(["export", "--check-logs", *logs, str(tmp_path / "r2")]) == 0
    assert "every EP rank (4) applied placement fp1" in capsys.readouterr().out
