"""vLLM's static strategies as policies (placement/policies/linear.py, round_robin.py), checked
against the rules of vLLM's determine_expert_map and initial EPLB map."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from moeplace.foundation.cluster import make_cluster
from moeplace.placement.policies import PlacementProblem, get_policy, policy_names
from moeplace.placement.policies.linear import linear_phy2log, vllm_initial_map
from moeplace.placement.policies.round_robin import round_robin_phy2log


def vllm_linear_rank_experts(E, G, r):
    """determine_expert_map(linear) over global_num_experts = E: rank r's logical-id block."""
    base, rem = divmod(E, G)
    start = r * base + min(r, rem)
    return list(range(start, start + base + (1 if r < rem else 0)))


def test_initial_map():
    assert vllm_initial_map(5, 7).tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]


def test_linear_matches_vllm_blocks():
    E, G, R = 12, 4, 4
    p2l = linear_phy2log(1, E, R)[0]
    init = vllm_initial_map(E, R)
    S = (E + R) // G
    for r in range(G):
        want = [int(init[p]) for p in vllm_linear_rank_experts(E + R, G, r)]
        assert p2l[r * S:(r + 1) * S].tolist() == want
    assert p2l.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2, 3]


def test_round_robin_matches_vllm_rule():
    E, G = 12, 4
    p2l = round_robin_phy2log(2, E, 0, G)
    assert p2l[0].reshape(G, -1).tolist() == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]
    assert (p2l[1] == p2l[0]).all()
    # with redundant slots: rank r gets physical r, r+G, ... of the initial map
    p2l = round_robin_phy2log(1, 6, 2, 4)[0].reshape(4, 2)
    assert p2l.tolist() == [[0, 4], [1, 5], [2, 0], [3, 1]]


def test_registered_and_flag_vllm_fallback(k3):
    assert {"linear", "round_robin", "eplb"} <= set(policy_names())
    loads = np.ones((1, k3.num_moe_layers, k3.num_experts))
    pr = PlacementProblem(loads, k3, make_cluster(32), 32)
    rr = get_policy("round_robin")(pr)
    assert rr.provenance["params"]["vllm_falls_back_to_linear"] is True  # K3: n_group = 1, R > 0
    assert rr.provenance["params"]["duplicate_on_gpu"] is True  # 896 % 32 == 0: redundant 0 lands on GPU 0
    assert rr.gpu_experts(0, 0)[:3].tolist() == [0, 32, 64]
    lin = get_policy("linear")(pr)
    assert lin.gpu_experts(0, 0).tolist() == list(range(29))
    assert lin.gpu_experts(5, 31).tolist() == list(range(899, 896, -1))[:0] + list(range(3, 32))
    grouped = replace(k3, n_group=8, topk_group=4)
    rr0 = get_policy("round_robin")(PlacementProblem(loads, grouped, make_cluster(32), 0))
    assert rr0.provenance["params"]["vllm_falls_back_to_linear"] is False


# ---------------------------------------------------------------------------- `place optimize`
def _loads_file(tmp_path, model, windows=4, seed=0):
    from moeplace.traces.loads import Loads

    rng = np.random.default_rng(seed)
    counts = rng.poisson(rng.gamma(0.5, 30.0, (1, model.num_moe_layers, model.num_experts)),
                         (windows, model.num_moe_layers, model.num_experts))
    path = tmp_path / "loads.npz"
    Loads(counts.astype(np.int64), model, 1000, tuple(f"w{i}" for i in range(windows))).save(path)
    return path


def _small(k3):
    return replace(k3, name="small", num_layers=4, moe_layers=(1, 2, 3), num_experts=30, top_k=4,
                   attention=("kda",) * 4, mla=None)


def test_optimize_cli_table_and_output(k3, tmp_path, capsys):
    import json

    from moeplace.cli.main import main
    from moeplace.placement.record import load_placement

    path = _loads_file(tmp_path, _small(k3))
    out = tmp_path / "pl.json"
    rc = main(["optimize", str(path), "--gpus", "8", "--gpus-per-node", "4", "--policy", "eplb",
               "--policy", "linear", "--policy", "round_robin", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "plan windows 0-1, held-out windows 2-3" in text
    assert all(p in text for p in ("eplb", "linear", "round_robin", "held max/mean", "shift estimate"))
    pl = load_placement(out)
    assert pl.provenance["policy"] == "eplb" and pl.num_slots == 32  # default R: 30 -> 32 = 4 x 8
    rc = main(["optimize", str(path), "--gpus", "8", "--gpus-per-node", "4", "--policy", "linear", "--json",
               "--no-out", "--redundant", "10"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and d["num_redundant"] == 10 and d["rows"][0]["policy"] == "linear"
    assert d["written"] is None and 0 < d["rows"][0]["held_out"]["balancedness"] <= 1


def test_optimize_cli_errors(k3, tmp_path, capsys):
    from moeplace.cli.main import main

    path = _loads_file(tmp_path, _small(k3))
    assert main(["optimize", str(path), "--gpus", "8", "--redundant", "3", "--no-out"]) == 2
    assert "not a multiple of --gpus 8" in capsys.readouterr().err
    assert main(["optimize", str(path), "--gpus", "8", "--policy", "nope", "--no-out"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["optimize", str(empty), "--no-out"]) == 2
    assert "no .parquet trace files" in capsys.readouterr().err
    assert main(["optimize", str(tmp_path / "missing.npz"), "--no-out"]) == 2
    assert "no such file" in capsys.readouterr().err
