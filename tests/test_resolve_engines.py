"""pip's resolver accepts moeplace[capture] beside the checked engine releases (bench/resolve_engines.py).

Slow (a few minutes: pip fetches the metadata of ~200 distributions per engine) and needs the package
index; run with `make test-slow`."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_moeplace_resolves_beside_sglang_and_vllm(tmp_path):
    out = tmp_path / "resolve.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "resolve_engines.py"), "--out", str(out)],
                       check=False, capture_output=True, text=True, timeout=3600)
    doc = json.loads(out.read_text())
    assert p.returncode == 0, p.stdout + p.stderr
    assert doc["no_conflict"] and {r["engine"] for r in doc["results"]} == {"sglang==0.5.23", "vllm==0.34.0"}
    torch = {r["engine"]: r.get("torch") for r in doc["results"]}
    # pip chose the torch each engine pins, with moeplace[capture] in the same environment
    assert torch == {"sglang==0.5.23": "2.14.1", "vllm==0.34.0": "2.14.0"}
