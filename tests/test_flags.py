"""Numeric flags are range-checked at the flag, and inputs that do not belong together are refused: every
case exits 2 with one line naming the flag / file / field, no traceback, and writes nothing."""
from __future__ import annotations

import argparse
import json
import shutil

import numpy as np
import pytest
from simkit import linear_placement, mini_model, write_trace

from moeplace.cli import flags
from moeplace.cli.main import build_parser, main
from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.errors import InputError
from moeplace.foundation.memory import GiB, MemoryConfig, parse_context_mix
from moeplace.placement.policies import PlacementProblem
from moeplace.placement.record import check_compatible, load_placement
from moeplace.placement.windows import routing_windows


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("flags")
    return write_trace(d / "trace", mini_model(), num_requests=6, prompt=32, output=8, skew=1.2)


def one_line_error(capsys, argv, *needles):
    """Run ``place argv``; assert exit 2 and one stderr line containing every needle."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("place: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# ------------------------------------------------------------------ every numeric flag has a range
def _numeric_actions():
    seen = []

    def walk(p: argparse.ArgumentParser, prog: str):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    walk(sp, f"{prog} {name}")
            elif a.option_strings:
                seen.append((prog, a.option_strings[-1], a.type))
    walk(build_parser(), "place")
    return seen


def test_no_flag_is_a_bare_int_or_float():
    bare = [(prog, flag) for prog, flag, typ in _numeric_actions() if typ in (int, float)]
    assert not bare, f"flags parsed without a range check: {bare}"


@pytest.mark.parametrize("typ, good, bad", [
    (flags.seed, ["0", "2147483647"], ["-1", "2147483648", "1.5", "x"]),
    (flags.positive_int, ["1", "64"], ["0", "-3", "nan"]),
    (flags.nonneg_int, ["0"], ["-1"]),
    (flags.fraction, ["1", "0.5"], ["0", "1.01", "nan", "inf"]),
    (flags.seconds, ["0.01"], ["0", "-1", "inf", "nan"]),
    (flags.gib, ["0", "1.5"], ["-100", "-inf"]),
])
def test_flag_types(typ, good, bad):
    for g in good:
        typ(g)
    for b in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=repr(b)):
            typ(b)


# ------------------------------------------------------------------ the reported cases
@pytest.mark.parametrize("argv", [
    ["trace", "synth", "--out", "{tmp}/t", "--seed", "-1"],
    ["optimize", "{trace}", "--seed", "-1"],
    ["simulate", "{trace}", "--placement", "linear", "--seed", "-1"],
    ["trace", "stats", "{trace}", "--seed", "-1"],
])
def test_negative_seed(argv, trace_dir, tmp_path, capsys):
    argv = [a.format(tmp=tmp_path, trace=trace_dir) for a in argv]
    one_line_error(capsys, argv, "--seed", "'-1'")
    assert not (tmp_path / "t").exists()


def test_redundant_beyond_one_replica_per_gpu(trace_dir, capsys):
    # 16 experts on 4 GPUs: at most 16 * 3 = 48 redundant slots (one replica of each expert per GPU)
    one_line_error(capsys, ["optimize", trace_dir, "--gpus", "4", "--gpus-per-node", "2", "--redundant", "4000",
                            "--no-out", "--policy", "moeplace"], "--redundant 4000", "--redundant <= 48")
    prob = {"loads": np.ones((1, 3, 16)), "model": mini_model(), "cluster": make_cluster(4, gpus_per_node=2)}
    PlacementProblem(**prob, num_redundant=48)
    with pytest.raises(InputError, match="<= 48"):
        PlacementProblem(**prob, num_redundant=52)


def test_concurrency_zero_is_refused_not_256(trace_dir, capsys):
    one_line_error(capsys, ["simulate", trace_dir, "--placement", "linear", "--concurrency", "0"], "--concurrency")


@pytest.mark.parametrize("cmd", [["optimize", "{trace}", "--no-out"], ["plan"],
                                 ["simulate", "{trace}", "--placement", "linear"]])
def test_gpus_per_node_zero_is_refused_not_8(cmd, trace_dir, capsys):
    one_line_error(capsys, [a.format(trace=trace_dir) for a in cmd] + ["--gpus-per-node", "0"], "--gpus-per-node")
    with pytest.raises(InputError, match="--gpus-per-node must be >= 1"):
        make_cluster(8, gpus_per_node=0)


def test_other_reserve_is_reported_in_gib(capsys):
    line = one_line_error(capsys, ["plan", "--other-reserve", "-100"], "--other-reserve", "GiB", "-100")
    assert "107374182400" not in line
    with pytest.raises(InputError, match=r"--other-reserve must be >= 0 GiB, got -100 GiB"):
        MemoryConfig(other_reserve_bytes=-100 * GiB)


@pytest.mark.parametrize("field, flag", [("min_concurrency", "--min-seqs"), ("state_slots_per_seq", "--state-slots"),
                                         ("max_num_seqs", "--max-num-seqs")])
def test_plan_errors_name_plan_flags(field, flag, capsys):
    with pytest.raises(InputError) as exc:
        MemoryConfig(**{field: 0})
    assert str(exc.value).startswith(flag)
    one_line_error(capsys, ["plan", flag, "0"], flag)


@pytest.mark.parametrize("extra, needle", [(["--max-model-len", "0"], "--max-model-len"),
                                           (["--max-model-len", "2000000"], "maximum context"),
                                           (["--eplb-window", "0"], "--eplb-window")])
def test_export_flags_fail_before_the_file_is_written(extra, needle, tmp_path, capsys):
    from moeplace.foundation.model import load_model
    k3 = load_model("kimi-k3")
    pl = linear_placement(k3, 32, 8)
    src = tmp_path / "p.json"
    pl.save(src)
    out = tmp_path / "expert_map.json"
    one_line_error(capsys, ["export", str(src), "--format", "sglang", "--out", str(out), "--flags", *extra], needle)
    assert not out.exists()


def test_model_spec_field_of_the_wrong_type(tmp_path, capsys):
    d = mini_model().to_dict()
    d["hidden_size"] = "big"
    f = tmp_path / "m.json"
    f.write_text(json.dumps(d))
    one_line_error(capsys, ["model", "show", str(f)], str(f), "hidden_size", "'big'")
    d = mini_model().to_dict()
    d["kda"]["num_heads"] = 2.5
    f.write_text(json.dumps(d))
    one_line_error(capsys, ["model", "show", str(f)], str(f), "num_heads")


def test_hf_config_field_of_the_wrong_type(tmp_path, capsys):
    cfg = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "hidden_size": "big", "num_experts": 8,
           "num_experts_per_tok": 2, "moe_intermediate_size": 64, "intermediate_size": 128, "vocab_size": 100,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096}
    f = tmp_path / "config.json"
    f.write_text(json.dumps(cfg))
    one_line_error(capsys, ["model", "show", str(f)], str(f))


def test_sweep_spec_not_utf8(tmp_path, capsys):
    f = tmp_path / "s.yaml"
    f.write_bytes(b"model: kimi-k3\n# caf\xe9\n")
    one_line_error(capsys, ["sweep", str(f), "--local"], str(f), "line 2", "UTF-8")


# ------------------------------------------------------------------ one context-mix check
@pytest.mark.parametrize("mix, needle", [("8k:0.5", "sum to 0.5"), ("8k:0.5,2M:0.5", "maximum context"),
                                         ("8k:0.7,1k:0.7", "sum to 1.4")])
def test_context_mix_checked_alike_by_simulate_and_plan(mix, needle, trace_dir, capsys):
    # mini_model's maximum context is 1M, as K3's
    sim = one_line_error(capsys, ["simulate", trace_dir, "--placement", "linear", "--context-mix", mix], needle)
    plan = one_line_error(capsys, ["plan", "--context-mix", mix], needle)
    assert sim.split("--context-mix")[1] == plan.split("--context-mix")[1]  # the same check, word for word


def test_context_mix_within_the_model():
    assert parse_context_mix("8k:0.5,1M:0.5", 1 << 20) == ((8192, 0.5), (1 << 20, 0.5))
    with pytest.raises(InputError, match="exceeds the model's maximum context 8k"):
        parse_context_mix("8k:0.5,16k:0.5", 8192)


# ------------------------------------------------------------------ inputs that do not belong together
@pytest.fixture()
def other_model_placement(tmp_path):
    """A placement of mini_model's shape but made for another model (name)."""
    pl = linear_placement(mini_model(), 4, 2)
    d = json.loads(json.dumps(pl.to_dict()))
    d["model"] = "other-model"
    f = tmp_path / "other.json"
    f.write_text(json.dumps(d))
    return f


def test_placement_for_another_model(other_model_placement, trace_dir, capsys):
    f = str(other_model_placement)
    one_line_error(capsys, ["evaluate", f, trace_dir], f, "other-model", "mini-k3")
    one_line_error(capsys, ["simulate", trace_dir, "--placement", f, "--gpus", "4", "--gpus-per-node", "2",
                            "--attention-tp", "2"], f, "other-model")


def test_placement_for_another_gpu_count(trace_dir, tmp_path, capsys):
    f = tmp_path / "p4.json"
    linear_placement(mini_model(), 4, 2).save(f)
    one_line_error(capsys, ["simulate", trace_dir, "--placement", str(f), "--gpus", "8", "--gpus-per-node", "2"],
                   str(f), "placement is for 4 GPUs")


def test_placement_with_another_slot_count(trace_dir, tmp_path, capsys):
    f = tmp_path / "p4.json"
    linear_placement(mini_model(), 4, 2).save(f)
    one_line_error(capsys, ["simulate", trace_dir, "--placement", str(f), "--gpus", "4", "--gpus-per-node", "2",
                            "--attention-tp", "2", "--redundant", "4"], str(f), "0 redundant", "--redundant 4")
    pl = load_placement(f)
    check_compatible(pl, mini_model(), make_cluster(4, gpus_per_node=2), num_redundant=0)


def test_num_slots_inconsistent_with_the_matrix(trace_dir, tmp_path, capsys):
    f = tmp_path / "p.json"
    linear_placement(mini_model(), 4, 2).save(f)
    d = json.loads(f.read_text())
    d["num_slots"] = 32
    f.write_text(json.dumps(d))
    before = f.read_bytes()
    for argv in (["evaluate", str(f), trace_dir], ["export", str(f), "--format", "sglang", "--out",
                                                    str(tmp_path / "x.json"), "--model", "kimi-k3"]):
        one_line_error(capsys, argv, str(f), "num_slots")
    assert f.read_bytes() == before and not (tmp_path / "x.json").exists()


def test_export_with_another_model(trace_dir, tmp_path, capsys):
    f = tmp_path / "p.json"
    linear_placement(mini_model(), 4, 2).save(f)
    one_line_error(capsys, ["export", str(f), "--format", "sglang", "--out", str(tmp_path / "x.json"),
                            "--model", "kimi-k3"], "mini-k3", "kimi-k3")
    assert not (tmp_path / "x.json").exists()


def test_same_trace_twice_is_not_held_out(trace_dir, tmp_path, capsys):
    one_line_error(capsys, ["optimize", trace_dir, trace_dir, "--no-out"], "given twice")
    copy = tmp_path / "copy"
    shutil.copytree(trace_dir, copy)
    one_line_error(capsys, ["optimize", trace_dir, str(copy), "--no-out"], str(copy), "same expert counts")
    with pytest.raises(InputError, match="given twice"):
        routing_windows([trace_dir, trace_dir + "/."])
