"""TensorRT-LLM load-balancer export/import, and launch flags that realize a checked attention layout."""
from __future__ import annotations

import shlex

import numpy as np
import pytest
import yaml

from moeplace.cli.main import main
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import load_model
from moeplace.placement.export import export_placement, import_placement
from moeplace.placement.export.flags import FlagOptions, check_layout, launch_command
from moeplace.placement.record import Placement, load_placement


@pytest.fixture(scope="module")
def dsv3():
    return load_model("deepseek-v3")


def placement(model, G, R, seed=0, gpn=8):
    rng = np.random.default_rng(seed)
    E = model.num_experts
    rows = []
    for _ in range(model.num_moe_layers):
        row = np.concatenate([np.arange(E), rng.integers(0, E, R)])
        rng.shuffle(row)
        rows.append(row)
    return Placement.from_phy2log(np.array(rows), model, G, gpn, {"cluster": {"gpu": "h200"}})


def test_extra_options_file_is_the_load_balancer_config(dsv3, tmp_path):
    pl = placement(dsv3, 32, 32)
    out = tmp_path / "lb.yaml"
    warnings = export_placement(pl, dsv3, "trtllm", out)
    assert warnings == []  # DeepseekV3ForCausalLM is in TensorRT-LLM's load-balancer list
    lb = yaml.safe_load(out.read_text())["moe_config"]["load_balancer"]
    assert set(lb) == {"num_slots", "initial_global_assignments", "layer_updates_per_iter"}
    assert lb["num_slots"] == 288 and lb["layer_updates_per_iter"] == 0
    iga = lb["initial_global_assignments"]
    # keys are TensorRT-LLM's layer_idx: decoder-layer indices 3..60 for DeepSeek-V3
    assert sorted(iga) == list(range(3, 61))
    for i, d in enumerate(dsv3.moe_layers):
        assert len(iga[d]) == 288 and set(iga[d]) == set(range(256))
        # consecutive num_slots / ep_size slots per rank: rank r owns slots [9r, 9r + 9)
        for r in range(32):
            assert iga[d][9 * r:9 * r + 9] == pl.gpu_experts(i, r).tolist()


def test_bare_form_and_round_trips(dsv3, tmp_path):
    pl = placement(dsv3, 16, 16, seed=3)
    for fmt in ("trtllm", "trtllm-lb"):
        out = tmp_path / f"{fmt}.yaml"
        export_placement(pl, dsv3, fmt, out)
        back = import_placement(out, fmt, dsv3, num_gpus=16)
        assert np.array_equal(back.phy2log, pl.phy2log) and back.num_gpus == 16
    bare = yaml.safe_load((tmp_path / "trtllm-lb.yaml").read_text())
    assert set(bare) == {"num_slots", "initial_global_assignments", "layer_updates_per_iter"}
    # the inline form can be read by either name (both forms are recognized)
    assert np.array_equal(import_placement(tmp_path / "trtllm.yaml", "trtllm-lb", dsv3, 16).phy2log, pl.phy2log)


def _write(tmp_path, lb, wrap=True):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump({"moe_config": {"load_balancer": lb}} if wrap else lb))
    return p


@pytest.mark.parametrize("mutate, message", [
    (lambda lb: lb["initial_global_assignments"].pop(10), "lacks MoE layer 10"),
    (lambda lb: lb["initial_global_assignments"][5].pop(), "has 263 slots, num_slots is 264"),
    (lambda lb: lb.update(extra=1), "'moe_config.load_balancer.extra' is not a MoeLoadBalancerConfig field"),
    (lambda lb: lb["initial_global_assignments"].update({1: list(range(264))}), "layer 1 is not an MoE layer"),
    (lambda lb: lb["initial_global_assignments"][3].__setitem__(0, 1.5), "layer 3: slot 0"),
    (lambda lb: lb["initial_global_assignments"][3].__setitem__(7, 256), "expert id 256 out of range"),
    (lambda lb: lb["initial_global_assignments"].__setitem__(4, [1] * 264), "logical expert 0 has no physical slot"),
    (lambda lb: lb.update(num_slots=200), "fewer than the 256 experts"),
    (lambda lb: lb.pop("num_slots"), "'moe_config.load_balancer.num_slots' missing"),
])
def test_import_rejects_what_trtllm_would_fail_on(dsv3, tmp_path, mutate, message):
    lb = {"num_slots": 264, "layer_updates_per_iter": 0,
          "initial_global_assignments": {d: [i % 256 for i in range(264)] for d in dsv3.moe_layers}}
    mutate(lb)
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        import_placement(_write(tmp_path, lb), "trtllm", dsv3, num_gpus=8)


def test_import_needs_ep_size_and_divisibility(dsv3, tmp_path):
    lb = {"num_slots": 264, "initial_global_assignments": {d: [i % 256 for i in range(264)] for d in dsv3.moe_layers}}
    p = _write(tmp_path, lb, wrap=False)
    with pytest.raises(InputError, match="pass --gpus"):
        import_placement(p, "trtllm-lb", dsv3)
    with pytest.raises(InputError, match="do not divide over --gpus 16"):
        import_placement(p, "trtllm-lb", dsv3, num_gpus=16)
    assert import_placement(p, "trtllm-lb", dsv3, num_gpus=8).num_redundant == 8


def test_warns_when_trtllm_would_ignore_the_section(tmp_path):
    k3 = load_model("kimi-k3")
    pl = placement(k3, 32, 32)
    warnings = export_placement(pl, k3, "trtllm", tmp_path / "k3.yaml")
    assert len(warnings) == 1 and "silently ignored" in warnings[0] and "KimiK3" in warnings[0]
    # attention TP (DP off) with a balancer TensorRT-LLM builds: it would assert, so no command is printed
    dsv3 = load_model("deepseek-v3")
    with pytest.raises(InputError, match=r"ADP and EP > 1.*use --tp 1 --dp 8"):
        launch_command(placement(dsv3, 8, 8), dsv3, "trtllm", tmp_path / "d.yaml", FlagOptions(tp=8, dp=1))
    text = launch_command(placement(dsv3, 8, 8), dsv3, "trtllm", tmp_path / "d.yaml", FlagOptions(tp=1, dp=8))
    assert "enable_attention_dp: true" in text and "WARNING" not in text


def _cmd(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith(("python -m sglang", "vllm serve", "trtllm")))
    cmd = []
    for line in lines[start:]:
        cmd.append(line.rstrip("\\").strip())
        if not line.endswith("\\"):
            break
    return shlex.split(" ".join(cmd))


def _flag(args, name):
    assert args.count(name) == 1, name
    return args[args.index(name) + 1]


def test_flags_realize_the_attention_layout(tmp_path):
    k3 = load_model("kimi-k3")
    pl = placement(k3, 32, 32)
    opts, plan = check_layout(pl, k3, FlagOptions(tp=8, dp=4))
    assert (opts.tp, opts.dp) == (8, 4) and plan.fits and plan.layout.ep == 32
    sg = _cmd(launch_command(pl, k3, "sglang", tmp_path / "s.json", opts))
    assert (_flag(sg, "--tp-size"), _flag(sg, "--attn-dp-size"), _flag(sg, "--ep-size")) == ("32", "4", "32")
    assert "--enable-dp-attention" not in sg and "--dp-size" not in sg  # deprecated spelling in SGLang 0.5.23
    vl = _cmd(launch_command(pl, k3, "vllm-jsonl", tmp_path / "v.jsonl", opts))
    assert (_flag(vl, "--tensor-parallel-size"), _flag(vl, "--data-parallel-size")) == ("8", "4")
    assert _flag(vl, "--data-parallel-size-local") == "1" and "--enable-expert-parallel" in vl
    # vLLM 0.34.0 wires no K3 layer into EPLB: no --enable-eplb that would change nothing
    assert "--enable-eplb" not in vl and "--eplb-config" not in vl
    # plain TP: no DP-attention flags at all
    sg1 = _cmd(launch_command(pl, k3, "sglang", tmp_path / "s.json", FlagOptions(tp=32, dp=1)))
    assert "--attn-dp-size" not in sg1 and "--enable-dp-attention" not in sg1
    with pytest.raises(InputError, match="cannot be expressed"):
        launch_command(pl, k3, "trtllm", tmp_path / "t.yaml", opts)
    with pytest.raises(InputError, match=r"--tp 8 x --dp 2 = 16"):
        launch_command(pl, k3, "sglang", tmp_path / "s.json", FlagOptions(tp=8, dp=2))


def test_layout_that_does_not_fit_is_refused_with_the_plan_reason(tmp_path):
    k3 = load_model("kimi-k3")
    pl = placement(k3, 32, 32)
    with pytest.raises(InputError, match=r"attention TP1 x DP32 .* does not fit: weights .* exceed the usable"):
        check_layout(pl, k3, FlagOptions(tp=1, dp=32))


def test_cli_trtllm_flags_write_a_complete_file_and_refuse_bad_layouts(dsv3, tmp_path, capsys):
    pj = tmp_path / "pl.json"
    placement(dsv3, 32, 32).save(pj)
    out = tmp_path / "lb.yaml"
    assert main(["export", str(pj), "--format", "trtllm", "--out", str(out), "--flags", "--dp", "32"]) == 0
    text = capsys.readouterr().out
    cmd = _cmd(text)
    assert cmd[0] == "trtllm-llmapi-launch" and cmd[1] == "trtllm-serve"
    assert (_flag(cmd, "--tp_size"), _flag(cmd, "--ep_size")) == ("32", "32")
    assert _flag(cmd, "--extra_llm_api_options") == str(out.resolve())
    doc = yaml.safe_load(out.read_text())
    assert doc["enable_attention_dp"] is True and doc["moe_config"]["backend"] == "WIDEEP"
    assert doc["kv_cache_config"] == {"dtype": "fp8"} and doc["moe_expert_parallel_size"] == 32
    # the file records the EP size, so importing it needs no --gpus
    assert main(["import-placement", str(out), "--format", "trtllm", "--model", "deepseek-v3",
                 "--out", str(tmp_path / "back.json")]) == 0
    assert np.array_equal(load_placement(tmp_path / "back.json").phy2log, load_placement(pj).phy2log)
    # a layout TensorRT-LLM cannot express: refused before anything is written
    bad = tmp_path / "bad.yaml"
    assert main(["export", str(pj), "--format", "trtllm-lb", "--out", str(bad), "--flags", "--tp", "8",
                 "--dp", "4"]) == 2
    assert "cannot be expressed" in capsys.readouterr().err and not bad.exists()
    assert main(["export", str(pj), "--format", "trtllm", "--out", str(bad), "--tp", "8"]) == 2
    assert "add --flags" in capsys.readouterr().err and not bad.exists()


def test_cli_layout_from_a_plan_report(tmp_path, capsys):
    k3 = load_model("kimi-k3")
    pj = tmp_path / "pl.json"
    placement(k3, 32, 32).save(pj)
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    assert main(["plan", "--model", "kimi-k3", "--gpus", "32", "--tp", "8", "--dp", "4", "--redundant", "32",
                 "--report", str(good)]) == 0
    assert main(["plan", "--model", "kimi-k3", "--gpus", "32", "--tp", "1", "--dp", "32", "--redundant", "32",
                 "--report", str(bad)]) == 3
    capsys.readouterr()
    out = tmp_path / "s.json"
    assert main(["export", str(pj), "--format", "sglang", "--out", str(out), "--flags", "--plan", str(good)]) == 0
    cmd = _cmd(capsys.readouterr().out)
    assert (_flag(cmd, "--tp-size"), _flag(cmd, "--attn-dp-size")) == ("32", "4")
    out2 = tmp_path / "s2.json"
    assert main(["export", str(pj), "--format", "sglang", "--out", str(out2), "--flags", "--plan", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "does not fit: weights" in err and not out2.exists()
    r0 = tmp_path / "r0.json"
    assert main(["plan", "--model", "kimi-k3", "--gpus", "32", "--tp", "8", "--dp", "4", "--report", str(r0)]) == 0
    assert main(["export", str(pj), "--format", "sglang", "--out", str(out2), "--flags", "--plan", str(r0)]) == 2
    assert "--redundant 32" in capsys.readouterr().err


@pytest.mark.parametrize("planned, warned", [("vllm", True), ("trtllm", False), (None, False)])
def test_export_says_when_the_placement_was_optimized_for_another_rule(dsv3, tmp_path, capsys, planned, warned):
    pl = placement(dsv3, 8, 32)
    if planned is not None:
        pl.provenance["engine"] = planned
    pl.save(tmp_path / "p.json")
    assert main(["export", str(tmp_path / "p.json"), "--format", "trtllm", "--out", str(tmp_path / "lb.yaml")]) == 0
    err = capsys.readouterr().err
    assert ("optimized for the vLLM replica rule (--engine vllm); TensorRT-LLM routes tokens with its own" in err
            ) == warned
    assert ("re-run place optimize with --engine trtllm" in err) == warned
