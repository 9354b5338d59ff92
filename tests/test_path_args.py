"""Every path a command line names is checked like ``--out`` is, found systematically from the parsers.

The parsers are walked: every argument that takes a value must be classed in ``cli.paths`` (a path the
command reads, an output, or not a path), so a new flag cannot skip the checks. Then every path argument of
every command is given a name longer than the file system allows, a FIFO, the wrong kind (a directory for a
file, a file for a directory), a character device and a path that does not exist: each is one line naming
the flag (or the positional path), exit 2, no traceback, nothing written, and with ``--json`` one JSON
error object on stdout."""
from __future__ import annotations

import argparse
import json
import os

import pytest
from fuzzkit import assert_refused, make_inputs, run_place, snapshot

from moeplace.cli import paths
from moeplace.cli.main import build_parser

LONG = "x" * 300  # one name past NAME_MAX (255)


def _arguments():
    """``(command words, action)`` of every argument of every parser that takes a value."""
    def walk(parser, words):
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    yield from walk(sp, [*words, name])
            elif not isinstance(a, argparse._HelpAction) and a.nargs != 0:
                yield " ".join(words), a
    yield from walk(build_parser(), [])


def test_every_argument_is_classed_as_a_path_an_output_or_not_a_path():
    seen = set()
    for cmd, a in _arguments():
        key = (cmd, a.dest)
        seen.add(key)
        classed = [key in paths.PATH_ARGS, key in paths.OUTPUTS, a.dest in paths.NOT_PATHS.get(cmd, ())]
        assert sum(classed) == 1, f"place {cmd} {'/'.join(a.option_strings) or a.dest}: classed {classed}"
    stale = [k for k in [*paths.PATH_ARGS, *paths.OUTPUTS] if k not in seen]
    assert not stale, stale


# (command, dest) -> argv with {X} where the path goes; the other inputs are valid (fuzzkit.make_inputs)
GPUS = ["--gpus", "4", "--gpus-per-node", "2"]
SIM = [*GPUS, "--attention-tp", "2", "--duration", "0.1", "--concurrency", "4", "--no-progress"]
ARGV = {
    ("dashboard", "run_dir"): ["dashboard", "{X}"],
    ("demo", "gpu"): ["demo", "--gpu", "{X}", "--out", "demo-out", "--quick"],
    ("engines", "model"): ["engines", "--model", "{X}"],
    ("evaluate", "placement"): ["evaluate", "{X}", "trace"],
    ("evaluate", "routing"): ["evaluate", "placement.json", "{X}"],
    ("evaluate", "model"): ["evaluate", "placement.json", "trace", "--model", "{X}"],
    ("export", "placement"): ["export", "{X}", "--format", "sglang", "--out", "o.json"],
    ("export", "model"): ["export", "placement.json", "--format", "sglang", "--out", "o.json", "--model", "{X}"],
    ("export", "loads"): ["export", "placement.json", "--format", "vllm-jsonl", "--out", "o.jsonl", "--model",
                          "model.json", "--loads", "{X}"],
    ("export", "plan"): ["export", "placement.json", "--format", "sglang", "--out", "o.json", "--model",
                         "model.json", "--flags", "--plan", "{X}"],
    ("export", "model_path"): ["export", "placement.json", "--format", "checkpoint", "--out", "ck",
                               "--model-path", "{X}"],
    ("export", "gpu"): ["export", "placement.json", "--format", "sglang", "--out", "o.json", "--model",
                        "model.json", "--flags", "--tp", "1", "--gpu", "{X}"],
    ("import-placement", "file"): ["import-placement", "{X}", "--format", "sglang", "--model", "model.json",
                                   *GPUS, "--out", "p2.json"],
    ("import-placement", "model"): ["import-placement", "sglang.json", "--format", "sglang", "--model", "{X}",
                                    *GPUS, "--out", "p2.json"],
    ("import-placement", "relabel_manifest"): ["import-placement", "sglang.json", "--format", "sglang", "--model",
                                               "model.json", *GPUS, "--out", "p2.json", "--relabel-manifest", "{X}"],
    ("model show", "name"): ["model", "show", "{X}"],
    ("optimize", "inputs"): ["optimize", "{X}", *GPUS, "--policy", "linear", "--out", "p2.json"],
    ("optimize", "group"): ["optimize", "trace", *GPUS, "--policy", "linear", "--out", "p2.json", "--group", "g={X}"],
    ("optimize", "tag"): ["optimize", "trace", *GPUS, "--policy", "linear", "--out", "p2.json", "--tag", "{X}:lang=en"],
    ("optimize", "gpu"): ["optimize", "trace", *GPUS, "--policy", "linear", "--out", "p2.json", "--gpu", "{X}"],
    ("optimize", "model"): ["optimize", "trace", *GPUS, "--policy", "linear", "--out", "p2.json", "--model", "{X}"],
    ("optimize", "config"): ["optimize", "trace", *GPUS, "--policy", "linear", "--out", "p2.json", "--config", "{X}"],
    ("optimize", "from_placement"): ["optimize", "trace", *GPUS, "--out", "p2.json", "--from", "{X}"],
    ("plan", "model"): ["plan", "--model", "{X}", "--gpus", "4"],
    ("plan", "gpu"): ["plan", "--model", "model.json", "--gpus", "4", "--gpu", "{X}"],
    ("rebalance", "trace"): ["rebalance", "{X}", *GPUS],
    ("rebalance", "phases"): ["rebalance", "--phases", "{X}:60", *GPUS],
    ("rebalance", "gpu"): ["rebalance", "loads.npz", *GPUS, "--gpu", "{X}"],
    ("simulate", "traces"): ["simulate", "{X}", "--placement", "linear", *SIM],
    ("simulate", "phases"): ["simulate", "--phases", "{X}:60", "--placement", "linear", *SIM],
    ("simulate", "placement"): ["simulate", "trace", "--placement", "{X}", *SIM],
    ("simulate", "config"): ["simulate", "trace", "--placement", "linear", *SIM, "--config", "{X}"],
    ("simulate", "gpu"): ["simulate", "trace", "--placement", "linear", *SIM, "--gpu", "{X}"],
    ("simulate", "model"): ["simulate", "trace", "--placement", "linear", *SIM, "--model", "{X}"],
    ("simulate", "profile"): ["simulate", "trace", "--placement", "linear", *SIM, "--profile", "{X}"],
    ("sweep", "spec"): ["sweep", "{X}", "--out", "sw", "--local"],
    ("trace capture", "hf_config"): ["trace", "capture", "--hf-config", "{X}", "--prompts", "model.json",
                                     "--out", "cap", "--max-new-tokens", "2"],
    ("trace capture", "prompts"): ["trace", "capture", "--hf-config", "model.json", "--prompts", "{X}",
                                   "--out", "cap", "--max-new-tokens", "2"],
    ("trace capture", "weights"): ["trace", "capture", "--hf-config", "model.json", "--prompts", "model.json",
                                   "--out", "cap", "--max-new-tokens", "2", "--weights", "{X}"],
    ("trace capture", "tokenizer"): ["trace", "capture", "--hf-config", "model.json", "--prompts", "model.json",
                                     "--out", "cap", "--max-new-tokens", "2", "--tokenizer", "{X}"],
    ("trace import", "srcs"): ["trace", "import", "--format", "sglang", "{X}", "--out", "l.npz",
                               "--model", "model.json"],
    ("trace import", "model"): ["trace", "import", "--format", "sglang", "sglang.json", "--out", "l.npz",
                                "--model", "{X}"],
    ("trace import", "relabel_manifest"): ["trace", "import", "--format", "sglang", "sglang.json", "--out",
                                           "l.npz", "--model", "model.json", "--relabel-manifest", "{X}"],
    ("trace stats", "path"): ["trace", "stats", "{X}"],
    ("export", "verify"): ["export", "--verify", "{X}"],
    ("export", "check_logs"): ["export", "--check-logs", "{X}"],
    ("plan", "pools"): ["plan", "--model", "model.json", "--pools", "{X}"],
    ("optimize", "pools"): ["optimize", "trace", "--phase", "decode", "--pools", "{X}", "--policy", "linear",
                            "--out", "p2.json"],
    ("simulate", "pools"): ["simulate", "trace", "--placement", "linear", "--pools", "{X}", "--duration", "0.1",
                            "--concurrency", "4", "--no-progress"],
    ("export", "pools"): ["export", "placement.json", "--format", "vllm-expert-map", "--out", "o.json", "--model",
                          "model.json", "--flags", "--pools", "{X}"],
    ("trace synth", "model"): ["trace", "synth", "--model", "{X}", "--tokens", "8", "--out", "syn"],
    ("trace validate", "paths"): ["trace", "validate", "{X}"],
    ("calibrate", "results"): ["calibrate", "{X}", "--out", "cal.json", "--model", "model.json", "--gpu", "h200"],
    ("calibrate", "deployment"): ["calibrate", "model.json", "--out", "cal.json", "--deployment", "{X}"],
    ("calibrate", "model"): ["calibrate", "model.json", "--out", "cal.json", "--model", "{X}"],
    ("calibrate", "gpu"): ["calibrate", "model.json", "--out", "cal.json", "--gpu", "{X}"],
    ("calibrate", "trace"): ["calibrate", "model.json", "--out", "cal.json", "--trace", "{X}"],
    ("simulate", "calibration"): ["simulate", "trace", "--placement", "linear", *SIM, "--calibration", "{X}"],
    ("rebalance", "calibration"): ["rebalance", "loads.npz", *GPUS, "--calibration", "{X}"],
    ("sweep", "calibration"): ["sweep", "spec.yaml", "--out", "sw", "--calibration", "{X}"],
}


def test_every_path_argument_has_a_case():
    assert set(ARGV) == set(paths.PATH_ARGS)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The valid inputs (shared: no case writes anything, each checks that), an empty directory, and a FIFO
    outside them (the snapshot reads every file under them)."""
    root = tmp_path_factory.mktemp("paths")
    make_inputs(root / "w")
    (root / "w" / "emptydir").mkdir()
    os.mkfifo(root / "fifo")
    return root / "w"


@pytest.fixture
def w(base, monkeypatch):
    monkeypatch.chdir(base)
    return base


def _hostile(kind: str, arg: paths.PathArg) -> str:
    wants_dir = arg.kind in (paths.DIR, paths.NAME_OR_DIR)
    return {"long": f"{LONG}/{LONG}.json", "fifo": "../fifo", "device": "/dev/zero",
            "kind": "model.json" if wants_dir else "emptydir", "missing": "nowhere/absent.json"}[kind]


def _flag_or_path(key, value: str) -> str:
    cmd, dest = key
    return paths._flag(build_parser(), cmd, dest) or value


KINDS = ("long", "fifo", "device", "kind", "missing")


@pytest.mark.parametrize("key", list(ARGV), ids=[" ".join(k) for k in ARGV])
def test_hostile_path_is_one_line_naming_the_flag(w, capsys, key):
    arg = paths.PATH_ARGS[key]
    before = snapshot(w)
    for kind in KINDS:
        # a tree (a trace is a file or a directory) has no wrong kind of the two
        if kind == "kind" and arg.kind in (paths.TREE, paths.PHASES, paths.GROUPS, paths.TAGS):
            continue
        value = _hostile(kind, arg)
        res = run_place([a.replace("{X}", value) for a in ARGV[key]], capsys)
        # a missing path: the command's reader says what it looked for, naming the path
        name = value if kind == "missing" else _flag_or_path(key, value)
        line = assert_refused(res, name if kind != "long" else name[:40])
        if kind == "long":
            assert "300 bytes long" in line, line
        if kind in ("fifo", "device"):
            assert "FIFO" in line or "device" in line or "not a directory" in line, line
        assert snapshot(w) == before, f"{kind}: wrote or changed something"


JSON_CASES = [k for k in ARGV if any("--json" in a.option_strings for a in
                                     paths.subparser(build_parser(), k[0])._actions)]


@pytest.mark.parametrize("key", JSON_CASES, ids=[" ".join(k) for k in JSON_CASES])
def test_json_error_object_for_a_long_name(w, capsys, key):
    argv = [a.replace("{X}", f"{LONG}.json") for a in ARGV[key]] + ["--json"]
    res = run_place(argv, capsys)
    assert res.rc == 2
    doc = json.loads(res.out)
    assert doc["ok"] is False and doc["exit_code"] == 2 and "bytes long, more than" in doc["error"]


def test_phases_entries_are_checked_each(w, capsys):
    line = assert_refused(run_place(["simulate", "--phases", "loads.npz:60,../fifo:60", "--placement", "linear",
                                     *SIM], capsys), "--phases entry ../fifo")
    assert "FIFO" in line


def test_a_name_is_not_taken_for_a_path(w, capsys):
    """A preset, a GPU kind, a policy or a Hugging Face id is not a path: never refused as one."""
    args = build_parser().parse_args(["plan", "--model", "kimi-k3", "--gpu", "h200"])
    paths.check_args(build_parser(), args)
    args = build_parser().parse_args(["export", "placement.json", "--format", "sglang", "--out", "o.json",
                                      "--model-path", "moonshotai/Kimi-K3"])
    paths.check_args(build_parser(), args)
