"""Inputs and checks for the fuzz tests (tests/test_fuzz_cli.py): one small valid file of every kind the
CLI reads, byte- and field-level corruptions of them, and the contract every command must keep on bad
input. Not a test file."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from simkit import linear_placement, mini_model, write_trace

from moeplace.cli.main import main


# ------------------------------------------------------------------ the contract
def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file (bytes) and directory (None) under ``root``, by relative path."""
    out: dict[str, bytes | None] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_dir():
            out[rel] = None
        elif p.is_file() or not p.exists():  # a dangling link: its target's name
            out[rel] = p.read_bytes() if p.is_file() else os.readlink(p).encode()
        else:  # a FIFO or a device (a case's hostile input) is never opened: its kind and identity
            st = p.stat()
            out[rel] = f"special {st.st_mode:o} {st.st_ino}".encode()
    return out


@dataclass
class Outcome:
    rc: int
    out: str
    err: str


def run_place(argv: list[str], capsys) -> Outcome:
    """``place argv`` in this process (an exception that is not a user error propagates: a traceback)."""
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    o, e = capsys.readouterr()
    return Outcome(rc, o, e)


def assert_refused(res: Outcome, *names: str) -> str:
    """Exit 2, one line ``place: error: ...`` naming every one of ``names`` (a file, a field), no
    traceback. Returns the line."""
    lines = res.err.strip().splitlines()
    assert res.rc == 2, (res.rc, res.err[-2000:])
    assert len(lines) == 1, res.err[-2000:]
    assert lines[0].startswith("place: error: "), lines[0]
    assert "Traceback" not in res.err
    for n in names:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def assert_ok_or_refused(res: Outcome, *names: str) -> None:
    """A corrupted input may still be valid (a flipped byte inside a value): then exit 0; otherwise the
    refusal contract."""
    if res.rc != 0:
        assert_refused(res, *names)


def assert_untouched(root: Path, before: dict, *allowed_new: str) -> None:
    """Every file and directory that existed is byte-identical and nothing new appeared (no temp files),
    except paths in ``allowed_new`` (a command's own outputs on success)."""
    after = snapshot(root)
    for k, v in before.items():
        assert k in after, f"{k} was deleted"
        assert after[k] == v, f"{k} was modified"
    extra = [k for k in after if k not in before and not any(k == a or k.startswith(a + "/") for a in allowed_new)]
    assert not extra, f"left behind: {extra}"


# ------------------------------------------------------------------ valid inputs of every kind
GPUS = ["--gpus", "4", "--gpus-per-node", "2"]
SIM = [*GPUS, "--attention-tp", "2", "--duration", "0.1", "--concurrency", "4", "--no-progress"]


def make_inputs(root: Path) -> dict[str, Path]:
    """Small valid inputs under ``root``: a trace, a placement, a Loads file, engine files, a model spec,
    a sweep spec, a plan report. Returns name -> path."""
    root.mkdir(parents=True, exist_ok=True)
    m = mini_model()
    f = {"trace": Path(write_trace(root / "trace", m, num_requests=4, prompt=16, output=4, skew=1.0))}
    pl = linear_placement(m, 4, 2)
    f["placement"] = root / "placement.json"
    pl.save(f["placement"])
    spec = root / "model.json"
    spec.write_text(json.dumps(m.to_dict()))
    f["model"] = spec
    assert main(["trace", "stats", str(f["trace"]), "--out", str(root / "loads.npz")]) == 0
    f["loads"] = root / "loads.npz"
    for fmt, name in (("sglang", "sglang.json"), ("vllm-expert-map", "vllm-map.json"),
                      ("vllm-ascend", "ascend.json"), ("vllm-jsonl", "eplb.jsonl")):
        assert main(["export", str(f["placement"]), "--format", fmt, "--out", str(root / name),
                     "--model", str(spec)]) == 0, fmt
        f[fmt] = root / name
    f["sweep"] = root / "sweep.yaml"
    f["sweep"].write_text(f"model: {spec}\nworkloads:\n  - name: w\n    trace: trace\n"
                          "axes:\n  gpus: 4\n")
    assert main(["plan", "--model", str(spec), "--gpus", "4", "--gpus-per-node", "2", "--report",
                 str(root / "plan.json")]) in (0, 3)
    f["plan"] = root / "plan.json"
    return f


def fresh_copy(src_root: Path, dst_root: Path) -> None:
    if dst_root.exists():
        shutil.rmtree(dst_root)
    shutil.copytree(src_root, dst_root)


def corrupt(data: bytes, kind: str, pos: float, value: int) -> bytes:
    """``kind``: ``truncate`` at ``pos`` (0..1 of the length), ``flip`` the byte there to ``value``,
    ``insert`` ``value`` there, ``empty``."""
    if kind == "empty" or not data:
        return b""
    i = min(int(pos * len(data)), len(data) - 1)
    if kind == "truncate":
        return data[:i]
    if kind == "flip":
        return data[:i] + bytes([value if value != data[i] else (value + 1) % 256]) + data[i + 1:]
    return data[:i] + bytes([value]) + data[i:]


# ------------------------------------------------------------------ trace rows, cell by cell
TINY = Path(__file__).parent / "data" / "tiny-moe-config.json"  # 3 MoE layers (1..3), 8 experts, top-2


def trace_columns(tokens: int = 8) -> dict:
    """``tokens`` tokens (two requests, one engine step per token) x 3 MoE layers, all valid."""
    import numpy as np
    n = tokens * 3
    tok = np.repeat(np.arange(tokens), 3)
    return {
        "request_id": (tok % 2).astype(np.int64),
        "position": (tok // 2).astype(np.int32),
        "phase": np.zeros(n, np.uint8),
        "step": tok.astype(np.int64),
        "layer": np.tile(np.array([1, 2, 3], np.uint16), tokens),
        "expert_ids": np.stack([np.arange(n) % 8, (np.arange(n) + 3) % 8], axis=1).astype(np.uint16),
    }


def write_columns(path: Path, model, cols: dict) -> Path:
    """A one-file trace of ``cols`` with the model's metadata, written as given (no checks)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tracekit import id_arrays

    from moeplace.traces.format import WRITE_CHECKSUMS, arrow_schema, file_metadata
    arrays = {}
    for name, v in cols.items():
        if name == "expert_ids":
            arrays.update(id_arrays(v, 2))
        else:
            arrays[name] = pa.array(v)
    schema = pa.schema([f for f in arrow_schema(model.top_k) if f.name in arrays])
    table = pa.table(arrays).select(schema.names).cast(schema)
    pq.write_table(table.replace_schema_metadata(file_metadata(model, {"kind": "synthetic"})), path, **WRITE_CHECKSUMS)
    return path


def size_inputs(root: Path) -> Path:
    """The inputs the size and bound cases start from: a tiny trace, its linear placement and model spec, and
    a two-window K3 Loads file (``k3.npz``)."""
    import numpy as np

    from moeplace.foundation.model import load_model
    from moeplace.traces.loads import Loads

    m = mini_model()
    write_trace(root / "trace", m, num_requests=4, prompt=16, output=4)
    linear_placement(m, 4, 2).save(root / "placement.json")
    (root / "model.json").write_text(json.dumps(m.to_dict()))
    k3 = load_model("kimi-k3")
    counts = np.random.default_rng(0).integers(0, 50, size=(2, k3.num_moe_layers, k3.num_experts))
    Loads(counts=counts, model=k3, window_tokens=4096, labels=("a", "b")).save(root / "k3.npz")
    return root


def work_copy(inputs: Path, tmp_path: Path, monkeypatch) -> Path:
    """A fresh copy of ``inputs`` to work in (the current directory), so no case sees another's outputs."""
    w = tmp_path / "w"
    shutil.copytree(inputs, w)
    monkeypatch.chdir(w)
    return w
