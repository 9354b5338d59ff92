"""CLI habits: ``--json`` on the commands that write or check a file (one object on stdout, read back
with json.loads: what was written, the warnings, the key figures) and progress bars on stderr for the long
steps (drawn on a terminal or with MOEPLACE_PROGRESS=1, never with --no-progress or into a pipe)."""

from __future__ import annotations

import base64
import fcntl
import io
import json
import os
import pty
import struct
import sys
import termios
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from moeplace.cli.main import main
from moeplace.foundation.model import load_model
from moeplace.placement.export import export_placement
from moeplace.placement.record import Placement, load_placement
from moeplace.traces.loads import Loads

TINY = Path(__file__).parent / "data" / "tiny-moe-config.json"


def _npy_b64(arr) -> str:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def _routed_jsonl(path: Path, bad_second: bool = False) -> Path:
    """Two vLLM responses (main form: prompt + generated - 1 rows over 4 decoder layers, dense row 0)."""
    rng = np.random.default_rng(0)
    lines = []
    for i in range(2):
        prompt, gen = [1, 2, 3], [4, 5, 6]
        arr = np.zeros((5, 4, 2), dtype=np.int16)
        for t in range(5):
            for layer in (1, 2, 3):
                arr[t, layer] = rng.choice(8, 2, replace=False)
        if bad_second and i == 1:
            arr = arr[:4]
        lines.append(json.dumps({"id": f"r{i}", "prompt_token_ids": prompt,
                                 "choices": [{"token_ids": gen, "routed_experts": _npy_b64(arr)}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


# --------------------------------------------------------------------------------------------- --json
def test_trace_import_json_names_what_was_written(tmp_path, capsys):
    src = _routed_jsonl(tmp_path / "routed.jsonl")
    out = tmp_path / "trace"
    assert main(["trace", "import", "--format", "vllm-routed-experts", str(src), "--model", str(TINY),
                 "--out", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "moeplace.import-summary/1"
    assert doc["written"] == [{"path": str(out), "kind": "trace directory"}]
    assert doc["model"] == "tiny-moe" and doc["warnings"] == []
    assert doc["summary"]["tokens"] == 10 and doc["summary"]["rows_written"] == 30
    assert doc["summary"]["layers_covered"] == [1, 2, 3]
    assert out.is_dir()


def test_trace_import_json_carries_the_warnings(tmp_path, capsys):
    from tests.test_import_engines import _ExpertStatisticMirror  # the TensorRT-LLM raw writer

    d = tmp_path / "stat"
    w = _ExpertStatisticMirror(0, 1, 1, d)
    rng = np.random.default_rng(1)
    for it in (1, 2):
        w.set_iter(it)
        for n in (2, 3):  # a chunked MoE forward: the raw record keeps the second chunk only
            for layer in (1, 2, 3):
                w.set_layer(layer)
                w.maybe_add_info(8, np.stack([rng.choice(8, 2, replace=False) for _ in range(n)]).astype(np.int32))
    assert main(["trace", "import", "--format", "trtllm-stats", str(d), "--model", str(TINY),
                 "--out", str(tmp_path / "t"), "--json"]) == 0
    cap = capsys.readouterr()
    doc = json.loads(cap.out)
    assert len(doc["warnings"]) == 1 and doc["warnings"][0].startswith("the raw ids hold 2 tokens fewer")
    assert f"place: warning: {doc['warnings'][0]}" in cap.err  # still said on stderr
    assert doc["summary"]["raw_tokens_short_of_counts"] == 2 and doc["summary"]["tokens"] == 3


def test_trace_validate_json_ok_and_problems(tmp_path, capsys):
    src = _routed_jsonl(tmp_path / "routed.jsonl")
    out = tmp_path / "trace"
    assert main(["trace", "import", "--format", "vllm-routed-experts", str(src), "--model", str(TINY),
                 "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["trace", "validate", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "moeplace.trace-validation/1" and doc["ok"] is True
    (t,) = doc["traces"]
    assert (t["path"], t["ok"], t["rows"], t["tokens"], t["problems"]) == (str(out), True, 30, 10, [])
    assert t["model"] == {"name": "tiny-moe", "moe_layers": 3, "experts": 8, "top_k": 2}
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet")
    assert main(["trace", "validate", str(out), str(bad), "--json"]) == 2
    cap = capsys.readouterr()
    doc = json.loads(cap.out)
    assert doc["ok"] is False and [t["ok"] for t in doc["traces"]] == [True, False]
    first = doc["traces"][1]["problems"][0]
    assert first["path"] == str(bad) and first["line"] in cap.err


def test_import_placement_json(tmp_path, capsys):
    model = load_model(TINY)  # MoE layers 1..3, 8 experts
    rng = np.random.default_rng(2)
    p2l = np.stack([rng.permutation(np.concatenate([np.arange(8), rng.choice(8, 4, replace=False)]))
                    for _ in range(3)])
    pl = Placement.from_phy2log(p2l, model, 4, 2, {"cluster": {"gpu": "h200"}})
    src = tmp_path / "map.json"
    export_placement(pl, model, "vllm-expert-map", src)
    out = tmp_path / "pl.json"
    rc = main(["import-placement", str(src), "--format", "vllm-expert-map", "--model", str(TINY), "--gpus", "4",
               "--gpus-per-node", "2", "--out", str(out), "--json"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    doc = json.loads(cap.out)
    assert doc["format"] == "moeplace.placement-import/1"
    assert doc["written"] == [{"path": str(out), "kind": "placement JSON"}] and doc["warnings"] == []
    assert doc["placement"] == {"moe_layers": 3, "slots": 12, "redundant": 4, "gpus": 4, "gpus_per_node": 2}
    assert np.array_equal(load_placement(out).phy2log, pl.phy2log)


# ------------------------------------------------------------------------------------------ progress
def _small_loads(k3, tmp_path) -> Path:
    model = replace(k3, name="small", num_layers=4, moe_layers=(1, 2, 3), num_experts=30, top_k=4,
                    attention=("kda",) * 4, mla=None)
    rng = np.random.default_rng(0)
    counts = rng.poisson(rng.gamma(0.5, 30.0, (1, 3, 30)), (4, 3, 30)).astype(np.int64)
    path = tmp_path / "loads.npz"
    Loads(counts, model, 1000, tuple(f"w{i}" for i in range(4))).save(path)
    return path


def _command(step: str, tmp_path: Path, k3) -> tuple[list[str], str]:
    """(argv, the description of the bar its long step draws) for synth, stats, import and optimize."""
    tiny_synth = ["trace", "synth", "--model", str(TINY), "--tokens", "1000", "--no-progress"]
    if step == "synth":
        return [*tiny_synth[:-1], "--out", str(tmp_path / "synth")], "synth"
    if step == "stats":
        assert main([*tiny_synth, "--out", str(tmp_path / "t")]) == 0
        return ["trace", "stats", str(tmp_path / "t")], "stats pass"
    if step == "import":
        src = _routed_jsonl(tmp_path / "routed.jsonl")
        return (["trace", "import", "--format", "vllm-routed-experts", str(src), "--model", str(TINY), "--out",
                 str(tmp_path / "imported")], "read routed.jsonl")
    return (["optimize", str(_small_loads(k3, tmp_path)), "--gpus", "8", "--gpus-per-node", "4", "--policy", "moeplace",
             "--policy", "eplb", "--time-limit", "2", "--no-shift", "--no-out"], "layers solved")


@pytest.mark.parametrize("step", ["synth", "stats", "import", "optimize"])
def test_progress_forced_on_drawn_and_off_with_no_progress(step, k3, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MOEPLACE_PROGRESS", "1")
    argv, desc = _command(step, tmp_path, k3)
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"{desc}:" in err and "\r" in err, err
    if step in ("synth", "import"):  # a second run writes elsewhere
        argv[argv.index("--out") + 1] += "-2"
    assert main([*argv, "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"{desc}:" not in err and "\r" not in err, err


def test_progress_follows_the_terminal(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MOEPLACE_PROGRESS", raising=False)
    argv = ["trace", "synth", "--model", str(TINY), "--tokens", "1000"]
    assert main([*argv, "--out", str(tmp_path / "pipe")]) == 0  # stderr captured: not a terminal
    assert "synth:" not in capsys.readouterr().err
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal has a width
    got: list[bytes] = []

    def drain():  # a pty holds a few KiB: read it while the command writes, or the write blocks
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                return
            if not chunk:
                return
            got.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    tty = os.fdopen(slave, "w", buffering=1)
    try:
        with monkeypatch.context() as m:
            m.setattr(sys, "stderr", tty)
            assert main([*argv, "--out", str(tmp_path / "tty")]) == 0
            tty.flush()
            time.sleep(0.2)
            drawn, got[:] = b"".join(got).decode(errors="replace"), []
            assert main([*argv, "--out", str(tmp_path / "tty-off"), "--no-progress"]) == 0
            tty.flush()
            time.sleep(0.2)
            quiet = b"".join(got).decode(errors="replace")
    finally:
        tty.close()
        reader.join(timeout=2)
        os.close(master)
    assert "synth:" in drawn and "tok" in drawn
    assert "synth:" not in quiet


@pytest.mark.parametrize("env, tty, flag, want", [
    ("1", False, False, True), ("0", True, False, False), ("", True, False, True), ("", False, False, False),
    ("1", True, True, False)])
def test_wanted_rules(monkeypatch, env, tty, flag, want):
    from moeplace.foundation.progress import wanted

    monkeypatch.setenv("MOEPLACE_PROGRESS", env)

    class Stream:
        def isatty(self):
            return tty

    assert wanted(flag, Stream()) is want


def test_library_calls_draw_nothing(tmp_path, capsys):
    from moeplace.traces.synth import SynthConfig, synthesize

    synthesize(load_model(TINY), SynthConfig(num_tokens=1000), tmp_path / "t")
    assert capsys.readouterr().err == ""


@pytest.mark.slow  # torch + transformers import: ~15-20 s on a loaded 2-core machine
def test_trace_capture_json(tmp_path, capsys):
    pytest.importorskip("transformers")
    from tests.test_capture import write_config

    cfg = write_config(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nab\n")
    out = tmp_path / "trace"
    assert main(["trace", "capture", "--hf-config", str(cfg), "--prompts", str(prompts), "--max-new-tokens", "2",
                 "--ignore-eos", "--out", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "moeplace.capture-summary/1"
    assert doc["written"] == [{"path": str(out), "kind": "trace directory"}] and doc["warnings"] == []
    s = doc["summary"]
    assert s["num_requests"] == 2 and s["num_prompt_tokens"] == len(b"hello world") + len(b"ab")
    assert main(["trace", "validate", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["traces"][0]["rows"] == s["num_rows"]
