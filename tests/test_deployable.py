"""The deployable plan first (issue 41 item 1): for a model whose engines serve only a replica-free placement
(the capability table: K3 today) `place optimize` plans without redundant slots by default and shows what
replicas would add as a second, labelled row; every serving fact once, one line per engine."""
from __future__ import annotations

import json

import numpy as np
import pytest

from moeplace.cli.main import main
from moeplace.foundation.model import load_model
from moeplace.placement.export import capabilities
from moeplace.placement.record import load_placement
from moeplace.traces.loads import Loads


@pytest.fixture(scope="module")
def k3_loads(tmp_path_factory):
    k3 = load_model("kimi-k3")
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(k3.num_experts, 0.3), size=k3.num_moe_layers)
    counts = np.stack([np.stack([rng.multinomial(2048, p[i]) for i in range(k3.num_moe_layers)]) for _ in range(4)])
    path = tmp_path_factory.mktemp("k3") / "k3.npz"
    Loads(counts=counts, model=k3, window_tokens=128, labels=tuple("abcd")).save(path)
    return path


def _optimize(loads, out, *extra):
    return main(["optimize", str(loads), "--gpus", "32", "--policy", "linear", "--no-shift", "--out", str(out),
                 *extra])


def test_k3_is_planned_replica_free_with_the_replica_row_labelled(k3_loads, tmp_path, capsys):
    assert _optimize(k3_loads, tmp_path / "p.json", "--report", str(tmp_path / "c.json")) == 0
    out = capsys.readouterr().out.splitlines()
    assert "0 redundant slots" in out[0]
    assert load_placement(tmp_path / "p.json").num_redundant == 0
    row = next(line for line in out if line.startswith("linear +32 replicas "))
    assert len(row.split()) == len(next(line for line in out if line.startswith("linear ")).split()) + 2
    assert any(line.startswith("note: linear +32 replicas: the same policy with 32 redundant slots") for line in out)
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["num_redundant"] == 0 and doc["replica_rows"][0]["num_redundant"] == 32
    assert doc["replica_rows"][0]["label"] == "linear +32 replicas"
    # one header and one line per engine, nothing else about serving
    i = next(i for i, line in enumerate(out) if line.startswith("serving a kimi-k3 placement with 0 redundant"))
    assert out[i:i + 4] == capabilities.serving_lines(load_model("kimi-k3"), 0)
    assert len(out) == i + 4
    assert "load-time plugin" in out[i + 1] and "relabelled checkpoint" in out[i + 2]


def test_an_explicit_redundant_and_other_models_keep_their_plan(k3_loads, tmp_path, capsys):
    assert _optimize(k3_loads, tmp_path / "p.json", "--redundant", "0") == 0
    assert "+32 replicas" not in capsys.readouterr().out
    assert _optimize(k3_loads, tmp_path / "p.json", "--redundant", "32", "--force") == 0
    out = capsys.readouterr().out
    assert "32 redundant slots" in out.splitlines()[0] and "serving a kimi-k3 placement with 32" in out
    assert "not with replicas; a replica-free plan (--redundant 0)" in out
    from moeplace.cli.commands.optimize import planned_redundant

    assert planned_redundant(load_model("kimi-k3"), 32, None) == (0, 32)
    assert planned_redundant(load_model("deepseek-v3"), 32, None) == (32, 0)  # SGLang applies its file
    assert planned_redundant(load_model("kimi-k3"), 48, None)[1] == 0  # 896 on 48 GPUs: slots must be added


def test_a_plan_that_splits_routing_groups_is_not_said_to_be_served(tmp_path, capsys):
    """Group-limited DeepSeek-V3 routing: a replica-free plan that splits a group is served by no relabelling --
    the serving lines say so (plan with --keep-groups), where they used to offer the plugin; under
    --keep-groups a line says which rows keep the groups and that the bound ignores them."""
    from dataclasses import replace

    ds = load_model("deepseek-v3")
    small = replace(ds, name="ds-small", num_layers=5, moe_layers=(3, 4), num_experts=16, n_group=4, topk_group=2,
                    attention=("mla",) * 5)
    rng = np.random.default_rng(2)
    counts = np.stack([rng.multinomial(4000, rng.dirichlet(np.full(16, 0.3)), size=2) for _ in range(4)])
    Loads(counts=counts, model=small, window_tokens=500, labels=tuple("abcd")).save(tmp_path / "l.npz")
    base = ["optimize", str(tmp_path / "l.npz"), "--gpus", "4", "--gpus-per-node", "4", "--redundant", "0",
            "--no-shift", "--workers", "1", "--seed", "1"]
    assert main([*base, "--policy", "eplb", "--out", str(tmp_path / "e.json")]) == 0
    out = capsys.readouterr().out
    vllm = next(line for line in out.splitlines() if line.startswith("  vLLM"))
    assert "not served -- the plan splits DeepSeek-style routing groups" in vllm and "--keep-groups" in vllm
    assert "load-time plugin" not in vllm
    assert main([*base, "--policy", "moeplace", "--policy", "eplb", "--keep-groups", "--out",
                 str(tmp_path / "m.json")]) == 0
    out = capsys.readouterr().out
    vllm = next(line for line in out.splitlines() if line.startswith("  vLLM"))
    assert "load-time plugin" in vllm and "not served" not in vllm
    assert "--keep-groups: moeplace keep the 4 routing groups whole; eplb split them" in out
    assert "the bound ignores the routing groups" in out
