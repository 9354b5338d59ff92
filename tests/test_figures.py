"""Figures in README.md and docs/ that bench/figures.py generates agree with the committed bench outputs
(bench/results/*.json)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIGURES = REPO / "bench" / "figures.py"


def _figures_module():
    spec = importlib.util.spec_from_file_location("bench_figures", FIGURES)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_docs_figures_match_the_committed_bench_results():
    r = subprocess.run([sys.executable, str(FIGURES), "--check"], check=False, capture_output=True, text=True,
                       cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_figure_edited_by_hand_is_rewritten():
    figures = _figures_module()
    text = "before\n<!-- figure: rebalance-summary -->\n| output tok/s | 1 | 2 | 3 |\n<!-- /figure -->\nafter\n"
    new = figures.render(text)
    assert new != text and new.startswith("before\n") and new.endswith("<!-- /figure -->\nafter\n")
    assert "output tok/s" in new and figures.render(new) == new


def test_results_files_carry_their_format_tag(tmp_path, monkeypatch):
    import json

    monkeypatch.setattr(sys, "path", list(sys.path))  # the module arranges sys.path for a bench script
    timing = _load_timing(monkeypatch)
    dest = timing.write_result("demo", {"x": 1}, tmp_path / "demo.json")
    doc = json.loads(dest.read_text())
    assert doc["format"] == "moeplace.bench.demo/1" and doc["bench"] == "demo" and doc["x"] == 1
    assert doc["machine"]["cpus"] >= 1 and len(doc["machine"]["loadavg"]) == 3
    runs = timing.repeat(lambda: sum(range(1000)), 3)
    assert runs.result == 499500 and len(runs.wall_s) == 3 and runs.wall_median in runs.wall_s


def _load_timing(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_timing", REPO / "bench" / "_timing.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_timing", mod)  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod
