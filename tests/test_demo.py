"""The README's main command, end to end (`place demo --quick`: a 20k-token K3 trace, 60 simulated s)."""
from __future__ import annotations

import json

import pytest

from moeplace.cli.main import main


# slow: a K3 trace synthesized, planned with its shift estimate, simulated; K3's 742,165 tensor names relabelled
# and verified (minutes on 2 cores)
@pytest.mark.slow
def test_demo_runs_every_stage_and_writes_the_run(tmp_path, capsys):
    run, traces = tmp_path / "run", tmp_path / "traces"
    assert main(["demo", "--quick", "--out", str(run), "--traces", str(traces)]) == 0
    out = capsys.readouterr().out
    stages = [line for line in out.splitlines() if line.startswith("== ")]
    assert len(stages) == 8 and stages[-2].startswith("== 7. simulate") and stages[-1].startswith("== 8. the engines'")
    # the side-by-side simulation table
    tail = out[out.index("== 7. simulate"):out.index("== 8. ")]
    assert "placement-moeplace" in tail and "placement-eplb" in tail and "placement-linear" in tail
    assert "straggler total (s)" in tail
    # K3's engines serve only a replica-free placement: the plan certifies that one, the table shows what
    # replicas would add in a labelled row
    plan = json.loads((run / "plan.json").read_text())["layout"]
    assert (plan["tp"], plan["dp"], plan["num_redundant"]) == (8, 4, 0)
    opt = out[out.index("== 4. "):out.index("== 5. ")]
    assert "0 redundant slots" in opt.splitlines()[2] and "moeplace +32 replicas" in opt
    cmp = json.loads((run / "comparison.json").read_text())
    assert cmp["num_redundant"] == 0 and cmp["replica_rows"][0]["num_redundant"] == 32
    # every serving fact once: one line per engine, the long reasons left to place engines --reasons
    assert out.count("serving a kimi-k3 placement") == 1 and out.count("  vLLM 0.34.0: ") == 1
    assert "does not wire K3 into EPLB" not in out and "lacks get_model_config_for_expert_location" not in out
    # the relabelled K3-shaped checkpoint, its launches (the layout stage 3 certified), verified
    dep = out[out.index("== 5. "):out.index("== 6. ")]
    assert "741888 per-expert tensors renamed" in dep
    vllm, sglang = dep[dep.index("vllm serve"):], dep[dep.index("python -m sglang.launch_server"):]
    assert "--tensor-parallel-size 8" in vllm and "--data-parallel-size 4" in vllm and "--enable-expert-parallel" in vllm
    assert "--tp-size 32" in sglang and "--attn-dp-size 4" in sglang and "--init-expert-location" not in sglang
    assert f"vllm serve {run.resolve() / 'k3-relabelled'}" in dep
    assert "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY=MOEPLACE_PLACEMENT" in dep and f"{run.resolve() / 'k3-checkpoint'}" in dep
    assert "verified " in out[out.index("== 6. "):out.index("== 7. ")]
    # no engine's online rebalancer acts on K3: nothing tuned, no long reasons repeated
    assert "nothing to tune" in out[out.index("== 8. "):] and not (run / "rebalance.json").exists()
    for rel in ("loads.npz", "plan.json", "placement.json", "comparison.json", "sim/summary.json",
                "k3-relabelled/moeplace-relabel.json"):
        assert (run / rel).is_file(), rel
    rows = {r["policy"]: r for r in cmp["rows"]}
    assert set(rows) >= {"linear", "round_robin", "eplb", "moeplace"}
    held = {p: r["held_out"]["balancedness"] for p, r in rows.items()}
    # on traffic it did not plan on, the optimizer's placement beats vLLM's static layouts and EPLB
    assert held["moeplace"] > held["eplb"] > held["linear"]
    sims = {s["placement"]["policy"]: s for s in json.loads((run / "sim" / "summary.json").read_text())["summaries"]}
    assert set(sims) == {"moeplace", "eplb", "linear"}
    # the straggler GPU of vLLM's linear layout costs more than the balanced placements' (same workload)
    assert sims["linear"]["straggler_share"] > 2 * sims["moeplace"]["straggler_share"]
    assert sims["linear"]["mean_imbalance"] > sims["moeplace"]["mean_imbalance"]
    # a second run reuses the validated trace instead of synthesizing it again
    assert main(["demo", "--quick", "--out", str(run), "--traces", str(traces)]) == 0
    assert "reusing" in capsys.readouterr().out


def test_demo_reuses_only_a_trace_of_this_generator_tokens_and_seed(tmp_path):
    from moeplace.cli.commands.demo import _valid_trace
    from moeplace.foundation.model import load_model
    from moeplace.traces.synth import SynthConfig, synthesize

    path = tmp_path / "t"
    synthesize(load_model("qwen3-30b-a3b"), SynthConfig(num_tokens=300, seed=1), path)
    assert _valid_trace(path, 300, 1)
    assert not _valid_trace(path, 300, 0)       # another seed
    assert not _valid_trace(path, 1000, 1)      # another size
    assert not _valid_trace(tmp_path / "missing", 300, 1)
