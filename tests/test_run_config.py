"""A run in one file (cli/run_config.py): ``--config`` takes a command's flags from a file, the command
line overrides it, the output records the resolved flags and ``--config <record>`` repeats the run; typed
settings (foundation/settings.py) refuse unknown keys with the nearest valid one, in files, sweep specs and
the optimizer's options alike."""
from __future__ import annotations

import json

import pytest
import yaml
from simkit import linear_placement, mini_model, write_trace

from moeplace.cli.main import main
from moeplace.foundation.errors import InputError
from moeplace.foundation.settings import build, parse_keys
from moeplace.placement.policies import check_options
from moeplace.traces.synth import SynthConfig


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("runcfg")
    return write_trace(d / "trace", mini_model(), num_requests=6, prompt=32, output=8, skew=1.2)


def test_config_file_flags_override_and_record_replays(trace_dir, tmp_path, capsys):
    pfile = tmp_path / "lin.json"
    linear_placement(mini_model(), 4, 2).save(pfile)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"gpus": 4, "gpus-per-node": 2, "attention_tp": 2, "duration": 0.1,
                                   "concurrency": 8, "max-seqs": 16, "placement": [str(pfile)],
                                   "no_progress": True, "mode": "replay"}))
    out = tmp_path / "a"
    assert main(["simulate", trace_dir, "--config", str(cfg), "--concurrency", "4", "--out", str(out)]) == 0
    rec = json.loads((out / "config.json").read_text())["settings"]
    assert rec["flags"]["max_seqs"] == 16 and rec["flags"]["mode"] == "replay"  # from the file
    assert rec["flags"]["concurrency"] == 4  # the command line wins
    assert rec["flags"]["placement"] == [str(pfile)] and rec["inputs"] == {"traces": str(trace_dir)}
    # the record is itself a --config: the same settings again
    again = tmp_path / "b"
    assert main(["simulate", trace_dir, "--config", str(out / "config.json"), "--out", str(again)]) == 0
    rec2 = json.loads((again / "config.json").read_text())["settings"]
    assert rec2["flags"] == {**rec["flags"], "out": str(again)}
    capsys.readouterr()


@pytest.mark.parametrize("content, message", [
    ({"max_seq": 3}, "max_seq: unknown flag of 'place simulate'; did you mean 'max_seqs'?"),
    ({"max-seqs": "many"}, "max-seqs: expected a whole number"),
    ({"mode": "exact"}, "mode: expected one of"),
    ({"route_all": "yes"}, "route_all: expected true or false"),
])
def test_config_file_errors_name_the_key(trace_dir, tmp_path, capsys, content, message):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump(content))
    assert main(["simulate", trace_dir, "--config", str(cfg), "--placement", "linear"]) == 2
    assert message in capsys.readouterr().err


def test_placement_is_required_somewhere(trace_dir, capsys):
    assert main(["simulate", trace_dir, "--gpus", "4"]) == 2
    assert "--placement FILE|POLICY is required" in capsys.readouterr().err


def test_optimizer_options_refuse_typos_and_wrong_types():
    with pytest.raises(InputError, match=r"optimize\.options\.robsut: unknown option; did you mean 'robust'\?"):
        check_options("optimize.options", {"robsut": True, "lns_round": 0})
    with pytest.raises(InputError, match=r"lns_rounds: expected a whole number, got 0.5"):
        check_options("o", {"lns_rounds": 0.5})
    with pytest.raises(InputError, match="robust: expected true or false, got 1"):
        check_options("o", {"robust": 1})
    assert check_options("o", {"robust": True, "cvar": 0, "workers": None}) == {"robust": True, "cvar": 0.0}


def test_sweep_spec_with_a_misspelt_option_exits_2_before_any_work(tmp_path, capsys):
    spec = tmp_path / "typo.yaml"
    spec.write_text("name: typo\nworkloads:\n  - name: w\n    synth: {num_tokens: 2000}\n"
                    "optimize: {options: {robsut: true, lns_round: 0}}\n")
    assert main(["sweep", str(spec), "--out", str(tmp_path / "sw")]) == 2
    assert "optimize.options.robsut: unknown option; did you mean 'robust'?" in capsys.readouterr().err
    assert not (tmp_path / "sw").exists()


def test_typed_build_checks_fields_and_types():
    cfg = build(SynthConfig, "synth", {"num_tokens": 2000, "skew": 3})
    assert cfg.num_tokens == 2000 and cfg.skew == 3.0
    with pytest.raises(InputError, match="synth.num_tokns: unknown key; did you mean 'num_tokens'"):
        build(SynthConfig, "synth", {"num_tokns": 2000})
    with pytest.raises(InputError, match="synth.num_tokens: expected a whole number, got '1e12'"):
        build(SynthConfig, "synth", {"num_tokens": "1e12"})
    with pytest.raises(InputError, match="synth.gate_weights: expected true or false, got 1"):
        build(SynthConfig, "synth", {"gate_weights": 1})
    with pytest.raises(InputError, match="expected a mapping"):
        parse_keys("x", [1, 2], {"a": int})
