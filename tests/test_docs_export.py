"""The ``$ place ...`` commands of docs/export.md run verbatim.

Every line of a fenced block in docs/export.md that starts with ``$ place `` is run with the CLI's ``main``
in a scratch directory, in document order. A command whose shown output is ``place: error: ...`` must
exit 2 with that error; every other one must exit 0. The files the commands read and that no command of
the document writes (``run/placement.json`` and the rest of a ``place demo`` run) are made small here:
a Kimi K3 placement on 32 GPUs, Loads of two windows. A block preceded by ``<!-- doc-test: slow -->``
runs only in the slow test (the DeepSeek-V3 path from a trace, at the document's sizes), one preceded by
``<!-- doc-test: hardware -->`` needs a GPU cluster and is only listed. The fast test stands in for the
slow block's outputs with a DeepSeek-V3 placement of the same shape.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from moeplace.cli.main import main
from moeplace.foundation.model import load_model
from moeplace.placement.record import Placement
from moeplace.traces.loads import Loads

DOC = Path(__file__).resolve().parent.parent / "docs" / "export.md"


def doc_commands(path: Path = DOC) -> list[dict]:
    """``{"line", "argv", "error", "mark"}`` per ``$ place`` command of a fenced block, in order. ``error``:
    the shown output's ``place: error:`` text (None when it shows none); ``mark``: the block's
    ``doc-test`` marker (``None``, ``"slow"`` or ``"hardware"``)."""
    lines = path.read_text().splitlines()
    out, in_block, mark, pending = [], False, None, None
    for i, line in enumerate(lines):
        m = re.match(r"<!-- doc-test: (\w+) -->", line.strip())
        if m and not in_block:
            pending = m.group(1)
            continue
        if line.startswith("```"):
            in_block = not in_block
            mark, pending = (pending, None) if in_block else (None, None)
            continue
        if in_block and line.startswith("$ place "):
            text = line[2:]
            j = i
            while text.endswith("\\"):
                j += 1
                text = text[:-1] + " " + lines[j].strip()
            argv = shlex.split(text, comments=True)
            nxt = lines[j + 1] if j + 1 < len(lines) else ""
            error = nxt[len("place: error: "):] if nxt.startswith("place: error: ") else None
            out.append({"line": i + 1, "argv": argv[1:], "error": error, "mark": mark})
    return out


def _placement(model, G, R, path: Path, gpn: int = 8) -> None:
    """A valid placement: every expert once, the R replicas on GPUs that do not hold them (no GPU holds
    one expert twice, which vllm-ascend requires)."""
    row = np.concatenate([np.arange(model.num_experts), np.arange(R)])
    pl = Placement.from_phy2log(np.tile(row, (model.num_moe_layers, 1)), model, G, gpn, {"cluster": {"gpu": "h200"}})
    path.parent.mkdir(parents=True, exist_ok=True)
    pl.save(path)


def _demo_run(tmp_path: Path) -> Path:
    """What the commands read from a `place demo` run, small."""
    k3 = load_model("kimi-k3")
    _placement(k3, 32, 32, tmp_path / "run" / "placement.json")
    for name in ("linear", "round_robin", "moeplace"):
        _placement(k3, 32, 32, tmp_path / "run" / "placements" / f"placement-{name}.json")
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 50, (2, k3.num_moe_layers, k3.num_experts)).astype(np.int64)
    Loads(counts, k3, 4096, ("w0", "w1")).save(tmp_path / "run" / "loads.npz")
    return tmp_path


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    d = _demo_run(tmp_path_factory.mktemp("docs"))
    _placement(load_model("deepseek-v3"), 16, 32, d / "run" / "dsv3" / "placement.json")  # the slow block's
    return d


@pytest.fixture
def demo_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return _demo_run(tmp_path)


def _run(cmd: dict, capsys) -> None:
    capsys.readouterr()
    rc = main(list(cmd["argv"]))
    err = capsys.readouterr().err
    where = f"docs/export.md:{cmd['line']}: place {shlex.join(cmd['argv'])}"
    if cmd["error"] is None:
        assert rc == 0, f"{where} exited {rc}: {err.strip()}"
    else:
        assert rc == 2, f"{where} exited {rc}, the doc shows an error"
        assert cmd["error"][:60] in err, f"{where}: {err.strip()}"


def test_the_doc_shows_commands_and_marks():
    cmds = doc_commands()
    assert len(cmds) >= 10 and len(FAST) >= 8
    assert any(c["error"] for c in cmds)  # the refused layout
    slow = [c["argv"][:2] for c in cmds if c["mark"] == "slow"]
    assert ["trace", "synth"] in slow and ["optimize", "data/dsv3"] in slow  # the DeepSeek-V3 path
    assert any(c["argv"][:1] == ["export"] and "sglang" in c["argv"] and c["mark"] == "slow" for c in cmds)


FAST = [c for c in doc_commands() if c["mark"] is None]


@pytest.mark.parametrize("cmd", FAST, ids=[f"line{c['line']}-{c['argv'][0]}" for c in FAST])
def test_doc_command_runs_verbatim(shared_run, monkeypatch, capsys, cmd):
    monkeypatch.chdir(shared_run)
    _run(cmd, capsys)


@pytest.mark.slow
def test_doc_deepseek_v3_path_runs_verbatim(demo_run, capsys):
    """The DeepSeek-V3 path at the document's sizes: synth, optimize, export (~1 minute on 2 cores)."""
    for cmd in doc_commands():
        if cmd["mark"] == "slow":
            _run(cmd, capsys)
    text = (demo_run / "run" / "dsv3" / "sglang-expert-location.json").read_text()
    assert text.startswith('{"physical_to_logical_map"')
