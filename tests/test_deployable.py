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
