"""Figures in README.md and docs/ that bench/figures.py generates agree with the committed bench outputs
(bench/results/*.json)."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from benchkit import load_bench

REPO = Path(__file__).resolve().parent.parent
FIGURES = REPO / "bench" / "figures.py"


def _figures_module():
    return load_bench("figures")


def _blocks() -> list[tuple[Path, str]]:
    figures = _figures_module()
    return [(doc, m["name"]) for doc in figures.DOCS for m in figures.BLOCK.finditer(doc.read_text())]


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


def test_every_renderer_has_a_figure_and_its_results_file():
    figures = _figures_module()
    used = {name for _doc, name in _blocks()}
    assert used == set(figures.RENDERERS), (used ^ set(figures.RENDERERS))
    for name in figures.RENDERERS:  # every renderer reads committed results only, and they are there
        assert figures.RENDERERS[name]().strip(), name


@pytest.mark.parametrize("doc,name", _blocks(), ids=lambda x: x if isinstance(x, str) else x.name)
def test_a_changed_number_in_a_figure_is_caught(doc, name):
    """Every figure's body is what its results give, digit for digit: a number edited in any block is a
    difference (--check fails) and regenerating puts the results' number back."""
    figures = _figures_module()
    text = doc.read_text()
    m = next(m for m in figures.BLOCK.finditer(text) if m["name"] == name)
    body = m["body"]
    digit = re.search(r"\d", body)
    assert digit, f"{doc.name}: figure {name} quotes no number"
    i = digit.start()
    tampered = text[:m.start("body") + i] + str((int(body[i]) + 1) % 10) + text[m.start("body") + i + 1:]
    assert figures.render(tampered) == text


def test_results_files_carry_their_format_tag(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the module arranges sys.path for a bench script
    spec = importlib.util.spec_from_file_location("bench_timing", REPO / "bench" / "_timing.py")
    timing = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_timing", timing)  # its dataclasses look their module up there
    spec.loader.exec_module(timing)
    dest = timing.write_result("demo", {"x": 1}, tmp_path / "demo.json")
    doc = json.loads(dest.read_text())
    assert doc["format"] == "moeplace.bench.demo/1" and doc["bench"] == "demo" and doc["x"] == 1
    assert doc["machine"]["cpus"] >= 1 and len(doc["machine"]["loadavg"]) == 3
    runs = timing.repeat(lambda: sum(range(1000)), 3)
    assert runs.result == 499500 and len(runs.wall_s) == 3 and runs.wall_median in runs.wall_s
