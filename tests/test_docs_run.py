"""Every command of README.md and docs/*.md runs verbatim, or is marked in the doc and parsed.

The commands are read from the docs' fenced blocks by tests/dockit.py (its docstring has the rules and the
``<!-- doc-test: KIND -->`` markers). Per doc, in one scratch directory and in document order:

- the default suite runs every unmarked ``place`` command with the CLI's ``main`` and checks the exit code
  (and error) the doc shows, and parses every marked one;
- the slow test (``make test-slow``) runs the unmarked and the ``slow`` commands, in order, of each doc
  that has slow ones.

A command neither run nor marked fails the test. Files a doc's commands read that none of the commands
being run writes are made small here ("stand-ins", listed in ``STANDINS``): the K3 trace of ``make demo``
(``data/k3-default``: 3,000 synthetic tokens instead of 100,000), valid but unplanned placements, Loads of
two random windows, the repository's ``examples/`` and ``tests/data/``. The docs' figures come from the real runs
(bench/figures.py); these tests check that the commands themselves work as written.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import shutil

import numpy as np
import pytest
from dockit import (
    DOCS,
    ROOT,
    blocks,
    commands,
    doc_name,
    engine_problems,
    make_problem,
    parse_problem,
    run_place,
    stray_command_lines,
    synopsis_problems,
)

from moeplace.cli.main import main
from moeplace.foundation.model import load_model
from moeplace.placement.export.sample_checkpoint import write_k3_like
from moeplace.placement.record import Placement, load_placement
from moeplace.traces.loads import Loads

ALL = {doc_name(d): commands(d) for d in DOCS}
PARSED = ("slow", "hardware", "external", "server")  # marks whose place commands are parsed, not run here
NOT_PLACE = ("hardware", "external", "server")       # marks under which other programs may appear


def _runs(doc: str, slow: bool):
    return [c for c in ALL[doc] if c.program == "place" and (c.mark is None or (slow and c.mark == "slow"))]


# --------------------------------------------------------------------------------------------- stand-ins
def _placement(model, G, R, path, gpn=8):
    """A valid placement: every expert once, the R replicas on GPUs that do not hold them (no GPU holds
    one expert twice, which vllm-ascend requires)."""
    row = np.concatenate([np.arange(model.num_experts), np.arange(R)])
    pl = Placement.from_phy2log(np.tile(row, (model.num_moe_layers, 1)), model, G, gpn, {"cluster": {"gpu": "h200"}})
    path.parent.mkdir(parents=True, exist_ok=True)
    pl.save(path)


def _k3_placements(d, trace):
    for name in ("linear", "round_robin", "moeplace", "eplb"):
        _placement(load_model("kimi-k3"), 32, 32, d / "run" / "placements" / f"placement-{name}.json")


def _loads(d, trace):
    k3 = load_model("kimi-k3")
    counts = np.random.default_rng(0).integers(0, 50, (2, k3.num_moe_layers, k3.num_experts)).astype(np.int64)
    (d / "run").mkdir(exist_ok=True)
    Loads(counts, k3, 4096, ("w0", "w1")).save(d / "run" / "loads.npz")


STANDINS = {  # path a doc reads -> how to make a small one
    "data/k3-default": lambda d, trace: shutil.copytree(trace(), d / "data" / "k3-default"),
    # K3's deployable plan, replica-free, as `place optimize` writes by default (the demo's run/placement.json)
    "run/placement.json": lambda d, trace: _placement(load_model("kimi-k3"), 32, 0, d / "run" / "placement.json"),
    # the demo's K3-shaped checkpoint (K3's tensor names, tiny tensors): README's relabel and --verify steps
    "run/k3-checkpoint": lambda d, trace: write_k3_like(d / "run" / "k3-checkpoint", load_model("kimi-k3")),
    "run/placement-r0.json":
        lambda d, trace: _placement(load_model("kimi-k3"), 32, 0, d / "run" / "placement-r0.json"),
    "run/placements": _k3_placements,
    # a disaggregated K3 deployment's two pools (docs/export.md): TEP8 prefill, DEP16 decode on GB300
    "run/placement-prefill.json":
        lambda d, trace: _placement(load_model("kimi-k3"), 8, 0, d / "run" / "placement-prefill.json"),
    "run/placement-decode.json":
        lambda d, trace: _placement(load_model("kimi-k3"), 16, 0, d / "run" / "placement-decode.json", gpn=16),
    "run/loads.npz": _loads,
    "run/dsv3/placement.json":
        lambda d, trace: _placement(load_model("deepseek-v3"), 16, 32, d / "run" / "dsv3" / "placement.json"),
    "examples": lambda d, trace: shutil.copytree(ROOT / "examples", d / "examples"),
    "tests/data": lambda d, trace: shutil.copytree(ROOT / "tests" / "data", d / "tests" / "data"),
}


def _make_standins(d, cmds, trace) -> list[str]:
    """The stand-ins the commands read and none of them writes."""
    made = []
    for path, make in STANDINS.items():
        # an argument may name several paths (prefill=A.json,decode=B.json)
        read = any(a == path or a.startswith(path + "/") for c in cmds for arg in c.argv
                   for a in re.split(r"[=,]", arg))
        written = any(path == w or path.startswith(w.rstrip("/") + "/") for c in cmds for w in c.writes())
        if read and not written:
            make(d, trace)
            made.append(path)
    return made


@pytest.fixture(scope="session")
def k3_trace(tmp_path_factory):
    """A callable giving a small K3 trace directory, synthesized on first use."""
    out = tmp_path_factory.mktemp("k3trace") / "k3-default"

    def get():
        if not out.exists():
            assert main(["trace", "synth", "--model", "kimi-k3", "--tokens", "3000", "--out", str(out),
                         "--seed", "0"]) == 0
        return out
    return get


# ------------------------------------------------------------------------------------- after the commands
def check_dsv3_sglang_file(d):
    """docs/export.md's DeepSeek-V3 path wrote the file SGLang's --init-expert-location loads: one row per
    decoder layer of the deepseek-v3 preset (dense rows trivial), E + R slots each, the MoE rows those of
    the placement, and the numbers the doc states."""
    model = load_model("deepseek-v3")
    pl = load_placement(d / "run" / "dsv3" / "placement.json")
    data = json.loads((d / "run" / "dsv3" / "sglang-expert-location.json").read_text())
    assert list(data) == ["physical_to_logical_map"]  # SGLang calls init_by_mapping(**data)
    rows = np.asarray(data["physical_to_logical_map"])
    P = model.num_experts + pl.num_redundant
    assert rows.shape == (model.num_layers, P) == (61, 288)
    for k, layer in enumerate(model.moe_layers):
        assert np.array_equal(rows[layer], pl.phy2log[k])
        assert set(rows[layer].tolist()) == set(range(model.num_experts))
    for layer in sorted(set(range(model.num_layers)) - set(model.moe_layers)):
        assert np.array_equal(rows[layer], np.arange(P) % model.num_experts)
    text = (ROOT / "docs" / "export.md").read_text()
    m = re.search(r"The file has (\d+) rows \(every decoder layer; the (\d+) dense ones trivial\) of (\d+) slots", text)
    assert m and [int(x) for x in m.groups()] == [model.num_layers, model.num_layers - model.num_moe_layers, P]
    assert f"deepseek-v3, {model.num_moe_layers} MoE layers, {P} slots" in text


AFTER = {"docs/export.md": check_dsv3_sglang_file}


# ------------------------------------------------------------------------------------------------- tests
def test_every_doc_command_is_run_or_marked():
    """Each command is a ``place`` command the default suite runs, or sits in a marked block; no line of a
    block that looks like a command escapes the reader; the docs hold the commands this file expects."""
    problems = []
    for doc, cmds in ALL.items():
        problems += stray_command_lines(ROOT / doc)
        for c in cmds:
            if c.program not in ("place", "make") and c.mark not in NOT_PLACE:
                problems.append(f"{c.where}\n  neither run (not a place or make command) nor marked hardware/"
                                f"external/server")
    assert not problems, "\n".join(problems)
    counts = {doc: len(c) for doc, c in ALL.items()}
    assert counts["README.md"] >= 15 and counts["docs/export.md"] >= 14 and counts["docs/traces.md"] >= 10
    assert sum(len(_runs(d, False)) for d in ALL) >= 20  # the default suite runs most of them
    dsv3 = [(c.argv[1:3], c.mark) for c in ALL["docs/export.md"] if any("dsv3" in a for a in c.argv)]
    assert dsv3[:3] == [(["trace", "synth"], "slow"), (["optimize", "data/dsv3"], "slow"),  # the DeepSeek-V3 path
                        (["export", "run/dsv3/placement.json"], None)]


def test_reader_rules_on_a_sample(tmp_path):
    doc = tmp_path / "sample.md"
    doc.write_text(
        "```\n$ place plan --model kimi-k3 --gpus 8 \\\n    --context 128k   # last lines\nverdict: DOES NOT FIT\n"
        "# exit code 3\n$ place export a.json --out b.json\nplace: error: no such file\n```\n"
        "```\noutput only\n```\n"
        "<!-- doc-test: hardware (a GPU) -->\n\n```bash\n# comment\ncurl -X POST http://x\nplace kernels verify\n```\n"
        "```python\nplace = 1\n```\n"
        "1. in a list:\n\n   ```bash\n   place model show kimi-k3\n   ```\n")
    cmds = commands(doc)
    assert [(c.line, c.argv[:2], c.mark, c.rc, c.error) for c in cmds] == [
        (2, ["place", "plan"], None, 3, None), (6, ["place", "export"], None, 2, "no such file"),
        (16, ["curl", "-X"], "hardware", 0, None), (17, ["place", "kernels"], "hardware", 0, None),
        (25, ["place", "model"], None, 0, None)]
    assert cmds[0].argv[-2:] == ["--context", "128k"]
    doc.write_text("<!-- doc-test: slow -->\n\n\n\n\n\n```\nplace model show kimi-k3\n```\n")
    with pytest.raises(ValueError, match="lines above the next block"):
        blocks(doc)
    doc.write_text("<!-- doc-test: quick -->\n```\nplace model show kimi-k3\n```\n")
    with pytest.raises(ValueError, match="unknown doc-test kind"):
        blocks(doc)


@pytest.mark.parametrize("doc", list(ALL))
def test_doc_marked_commands_parse(doc):
    """Marked ``place`` commands parse with the CLI's parser, a synopsis names only real flags, an engine
    launch line only options of the checked release, ``make`` only real targets."""
    problems = []
    for c in ALL[doc]:
        if c.program == "make":
            p = make_problem(c)
            problems += [f"{c.where}\n  {p}"] if p else []
        elif c.program == "place" and c.mark == "synopsis":
            problems += [f"{c.where}\n  {p}" for p in synopsis_problems(c)]
        elif c.program == "place" and c.mark in PARSED:
            p = parse_problem(c.argv[1:])
            problems += [f"{c.where}\n  {p}"] if p else []
        elif c.program != "place":
            problems += [f"{c.where}\n  {p}" for p in engine_problems(c) or []]
    assert not problems, "\n".join(problems)


FAST = [d for d in ALL if _runs(d, False)]


def _run_doc(doc, slow, tmp_path, monkeypatch, capsys, k3_trace):
    """The doc's commands (with its slow ones when ``slow``) in order in one directory, then its checks."""
    cmds = _runs(doc, slow=slow)
    _make_standins(tmp_path, cmds, k3_trace)
    monkeypatch.chdir(tmp_path)
    for c in cmds:
        run_place(c, capsys)
    if doc in AFTER:
        AFTER[doc](tmp_path)


@pytest.mark.parametrize("doc", FAST)
def test_doc_commands_run_verbatim(doc, tmp_path, monkeypatch, capsys, k3_trace):
    _run_doc(doc, False, tmp_path, monkeypatch, capsys, k3_trace)


SLOW = [d for d in ALL if any(c.mark == "slow" for c in ALL[d])]


@pytest.mark.slow
@pytest.mark.parametrize("doc", SLOW)
def test_doc_commands_run_verbatim_with_slow_ones(doc, tmp_path, monkeypatch, capsys, k3_trace):
    """The doc's unmarked and slow commands, in order, at the doc's sizes (README.md: the whole demo on
    100,000 tokens, 21 minutes on 2 cores at load average ~5; docs/sweep.md: the example sweep twice, 3.5
    minutes)."""
    _run_doc(doc, True, tmp_path, monkeypatch, capsys, k3_trace)


def _python_blocks():
    return [b for d in DOCS for b in blocks(d) if b.tag == "python"]


@pytest.mark.parametrize("block", _python_blocks(), ids=lambda b: f"{b.doc}:{b.line}")
def test_doc_python_blocks_compile_and_import(block):
    """A ``python`` block compiles, its moeplace imports resolve (module and names), other modules exist."""
    tree = ast.parse("\n".join(block.lines), f"{block.doc}:{block.line}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods = [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mods = [(node.module, [a.name for a in node.names])]
        else:
            continue
        for mod, names in mods:
            where = f"{block.doc}:{block.line + node.lineno}: import {mod}"
            if mod.split(".")[0] == "moeplace":
                m = importlib.import_module(mod)
                assert all(hasattr(m, n) for n in names), f"{where}: no {names}"
            else:
                assert importlib.util.find_spec(mod.split(".")[0]) is not None, f"{where}: no such module"
