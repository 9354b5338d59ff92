"""Expert relabelling (issue 33): a relabelled checkpoint is the same model -- identical logits, router
choices equal under the permutation -- for every supported layout; and the writer refuses what it cannot do
exactly (replicas, split routing groups, an existing output)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import relabelkit as kit

from moeplace.cli.main import main
from moeplace.foundation.errors import InputError
from moeplace.placement.record import Placement
from moeplace.placement.relabel import (
    CONTIGUOUS,
    ROUND_ROBIN,
    check_groups,
    classify,
    inverse,
    permutations,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _export(p: Placement, src, dst, *extra) -> int:
    p.save(src.parent / f"{src.name}.placement.json")
    return main(["export", str(src.parent / f"{src.name}.placement.json"), "--format", "checkpoint",
                 "--model-path", str(src), "--out", str(dst), *extra])


def _same_model(src, dst, ids):
    """``(max |logits diff|, router choices equal under new2old)`` of the source and relabelled models."""
    from transformers import AutoModelForCausalLM

    man = json.loads((dst / "moeplace-relabel.json").read_text())
    n2o = torch.tensor(man["new2old"])
    m0 = AutoModelForCausalLM.from_pretrained(src).eval()
    m1 = AutoModelForCausalLM.from_pretrained(dst).eval()
    l0, r0 = kit.routed(m0, ids)
    l1, r1 = kit.routed(m1, ids)
    assert sorted(r0) == sorted(r1) and len(r0) == len(man["moe_layers"])
    mapped = all(torch.equal(n2o[i][r1[d]].sort(-1).values, r0[d].sort(-1).values) for i, d in enumerate(sorted(r0)))
    moved = any(not torch.equal(r1[d], r0[d]) for d in r0)  # the renaming is visible in the engine's ids
    return float((l0 - l1).abs().max()), mapped and moved


@pytest.mark.parametrize("kind,how", [("mixtral", {}), ("qwen3_moe", {}), ("olmoe", {}),
                                      ("deepseek_v3", {"shard": "20KB"}), ("qwen3_moe", {"stacked": True})])
def test_relabelled_checkpoint_is_the_same_model(tmp_path, kind, how):
    src, dst = tmp_path / "src", tmp_path / "dst"
    kit.build(kind, src, **how)
    groups = 4 if kind == "deepseek_v3" else 1
    assert _export(kit.placement(kind, groups=groups), src, dst) == 0
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    diff, mapped = _same_model(src, dst, ids)
    # Mixtral sums its experts' outputs in expert-id order: the order changes, float rounding may (1e-8)
    assert diff <= 1e-6, diff
    assert mapped
    man = json.loads((dst / "moeplace-relabel.json").read_text())
    for s, rec in man["source_shards"].items():
        assert len(rec["header_sha256"]) == 64 and rec["bytes"] == (src / s).stat().st_size
    assert (dst / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert main(["export", "--verify", str(dst)]) == 0


def test_round_robin_layout_puts_the_placement_on_vllm_ranks():
    """vLLM round_robin: rank g holds ids g, g+G, ...; the ids a rank holds are the placement's experts."""
    rng = np.random.default_rng(3)
    E, G = 16, 4
    p = Placement(np.stack([rng.permutation(E) for _ in range(2)]), G, G, "m", E, (0, 1))
    for layout, ranks in ((CONTIGUOUS, lambda g: np.arange(g * 4, g * 4 + 4)), (ROUND_ROBIN, lambda g: np.arange(g, E, G))):
        n2o = permutations(p, layout)
        for g in range(G):
            assert sorted(n2o[1, ranks(g)]) == sorted(p.gpu_experts(1, g)), layout.name
        assert (inverse(n2o)[np.arange(2)[:, None], n2o] == np.arange(E)).all()


def test_unchanged_shards_are_hard_linked_or_copied(tmp_path):
    src = tmp_path / "src"
    kit.build("deepseek_v3", src, shard="20KB")
    ident = Placement(np.tile(np.arange(kit.E), (2, 1)), kit.GPUS, kit.GPUS, "deepseek_v3", kit.E, (1, 2))
    assert _export(ident, src, tmp_path / "linked") == 0
    assert _export(ident, src, tmp_path / "copied", "--copy") == 0
    shards = [f for f in os.listdir(src) if f.endswith(".safetensors")]
    assert len(shards) >= 2
    for s in shards:
        assert os.stat(tmp_path / "linked" / s).st_ino == os.stat(src / s).st_ino
        assert os.stat(tmp_path / "copied" / s).st_ino != os.stat(src / s).st_ino
        assert (tmp_path / "copied" / s).read_bytes() == (src / s).read_bytes()


def test_refusals_are_one_line_exit_2(tmp_path, capsys):
    src = tmp_path / "src"
    kit.build("deepseek_v3", src)
    capsys.readouterr()  # transformers' own progress bar
    # a placement that moves single experts across routing groups: group-limited top-k would change
    split = Placement(np.stack([np.roll(np.arange(kit.E), 1)] * 2), kit.GPUS, kit.GPUS, "d", kit.E, (1, 2))
    assert _export(split, src, tmp_path / "a") == 2
    err = capsys.readouterr().err
    assert "routing group" in err and "--keep-groups" in err and len(err.strip().splitlines()) == 1
    # replicas cannot be a renaming
    rep = Placement(np.stack([np.r_[np.arange(kit.E), 0, 1, 2, 3]] * 2), kit.GPUS, kit.GPUS, "d", kit.E, (1, 2))
    assert _export(rep, src, tmp_path / "b") == 2
    err = capsys.readouterr().err
    assert "4 redundant slots" in err and "--redundant 0" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    # an existing output that is not ours is never replaced
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep").write_text("x")
    assert _export(kit.placement("deepseek_v3", groups=4), src, tmp_path / "c") == 2
    assert (tmp_path / "c" / "keep").read_text() == "x"
    # another model: wrong expert count
    other = Placement(np.stack([np.arange(16)] * 2), kit.GPUS, kit.GPUS, "d", 16, (1, 2))
    assert _export(other, src, tmp_path / "d") == 2
    assert "16 experts" in capsys.readouterr().err
    assert not [f for f in os.listdir(tmp_path) if "moeplace-tmp" in f]


def test_group_check_accepts_whole_groups_and_names_the_first_split():
    n2o = np.array([[2, 3, 0, 1, 6, 7, 4, 5]])
    check_groups(n2o, 4, 2, "p")
    check_groups(np.array([[1, 2, 3, 4, 5, 6, 7, 0]]), 4, 4, "p")  # all groups kept: free
    with pytest.raises(InputError, match="layer 0: engine ids 0-1"):
        check_groups(np.array([[1, 2, 3, 4, 5, 6, 7, 0]]), 4, 2, "p")


@pytest.mark.parametrize("name,want", [
    ("model.layers.3.mlp.experts.17.w1.weight_packed", (3, 17, "expert", ".w1.weight_packed")),
    ("model.layers.3.mlp.experts.17.w2.weight_scale", (3, 17, "expert", ".w2.weight_scale")),
    ("model.layers.0.block_sparse_moe.experts.7.w3.weight", (0, 7, "expert", ".w3.weight")),
    ("language_model.model.layers.9.mlp.experts.0.down_proj.weight", (9, 0, "expert", ".down_proj.weight")),
    ("model.layers.5.mlp.experts.gate_up_proj", (5, None, "stacked", "")),
    ("model.layers.5.mlp.gate.weight", (5, None, "router", "")),
    ("model.layers.5.mlp.gate.e_score_correction_bias", (5, None, "bias", "")),
    ("model.layers.5.block_sparse_moe.gate.weight", (5, None, "router", "")),
])
def test_tensor_names(name, want):
    t = classify(name)
    assert (t.layer, t.expert, t.role, t.tail) == want
    if t.expert is not None:
        assert t.renamed(99) == name.replace(f".experts.{want[1]}.", ".experts.99.")


@pytest.mark.parametrize("name", ["model.layers.5.mlp.shared_experts.gate_proj.weight",
                                  "model.layers.5.mlp.shared_expert_gate.weight", "model.layers.0.mlp.gate_proj.weight",
                                  "model.embed_tokens.weight", "model.layers.2.self_attn.q_proj.weight"])
def test_other_tensors_are_left_alone(name):
    assert classify(name) is None


def test_optimizer_keeps_routing_groups_and_the_plan_relabels_exactly(tmp_path):
    """`place optimize --redundant 0 --keep-groups` on skewed loads of the tiny DeepSeek-V3 (4 groups of 2,
    top-2 groups): the plan moves experts (better balanced than the model's own order), keeps every group
    whole, and the relabelled checkpoint is the same model."""
    from moeplace.foundation.model import load_model
    from moeplace.placement.record import load_placement
    from moeplace.traces.loads import Loads

    src = tmp_path / "src"
    kit.build("deepseek_v3", src)
    model = load_model(src / "config.json")
    assert (model.n_group, model.topk_group) == (4, 2)
    rng = np.random.default_rng(0)
    counts = np.zeros((4, 2, kit.E), dtype=np.int64)
    for w in range(4):
        for li in range(2):
            counts[w, li] = rng.multinomial(200, rng.dirichlet(np.full(kit.E, 0.3)))
    Loads(counts, model, window_tokens=100).save(tmp_path / "l.npz")
    args = ["optimize", str(tmp_path / "l.npz"), "--gpus", "2", "--gpus-per-node", "2", "--redundant", "0",
            "--policy", "moeplace", "--no-shift", "--plan-fraction", "1", "--workers", "1",
            "--out", str(tmp_path / "p.json")]
    assert main([*args, "--keep-groups"]) == 0
    p = load_placement(tmp_path / "p.json")
    n2o = permutations(p, CONTIGUOUS)
    check_groups(n2o, 4, 2, "plan")
    assert (n2o != np.arange(kit.E)).any()
    total = counts.sum(axis=0)
    per_gpu = lambda order: total[np.arange(2)[:, None], order].reshape(2, 2, 4).sum(axis=2).max(axis=1)
    assert (per_gpu(n2o) <= per_gpu(np.tile(np.arange(kit.E), (2, 1)))).all()
    assert main(["export", str(tmp_path / "p.json"), "--format", "checkpoint", "--model-path", str(src),
                 "--out", str(tmp_path / "dst")]) == 0
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    diff, mapped = _same_model(src, tmp_path / "dst", ids)
    assert diff <= 1e-6 and mapped
    # with replicas --keep-groups refuses up front, before any planning
    assert main([*args, "--redundant", "4", "--keep-groups"]) == 2


def test_damaged_checkpoints_are_one_line_errors(tmp_path, capsys):
    src = tmp_path / "src"
    kit.build("olmoe", src)
    capsys.readouterr()
    p = kit.placement("olmoe")
    shard = src / "model.safetensors"
    data = shard.read_bytes()
    for damage, msg in ((data[: len(data) // 2], "data_offsets beyond the file"), (b"\x05", "not a safetensors file"),
                        (b"\xff" * 8 + data[8:], "not a safetensors file")):
        shard.write_bytes(damage)
        assert _export(p, src, tmp_path / "dst") == 2
        err = capsys.readouterr().err
        assert msg in err and "model.safetensors" in err and len(err.strip().splitlines()) == 1, err
    shard.unlink()
    assert _export(p, src, tmp_path / "dst") == 2
    assert "0 .safetensors files" in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()
