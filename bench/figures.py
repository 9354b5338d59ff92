"""Regenerate the figures in README.md and docs/*.md from the committed bench outputs (bench/results/*.json).

A figure sits between ``<!-- figure: NAME -->`` and ``<!-- /figure -->`` in a Markdown file; NAME picks a
renderer below, which reads one results file. ``python bench/figures.py`` rewrites every figure from the
results; ``--check`` changes nothing and exits 1 when a figure differs from what its results give (the
test suite runs it, so a figure edited by hand or a result re-measured without regenerating fails).

    .venv/bin/python bench/figures.py [--check]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # before bench/, where sim.py would shadow the sim package

from sim.results import format_table

RESULTS = ROOT / "bench" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- figure: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figure -->)", re.DOTALL)


def _results(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


# ---------------------------------------------------------------------------- online rebalancing
REBALANCE_COLUMNS = {"static": "static `linear`", "eplb": "+ EPLB every 100 iterations",
                     "moeplace": "+ moeplace migration, 16 moves/layer"}


def _num(v, fmt: str, scale: float) -> str:
    """``v * scale`` formatted; a dash for a figure the run does not have (no rebalancing)."""
    if not v:
        return "–"
    return format(int(v) if fmt == "d" else v * scale, fmt)


def rebalance_summary() -> str:
    """README: the three runs' key figures, one column each, and the sentence that reads them."""
    runs = {k: r["summary"] for k, r in _results("rebalance")["runs"].items()}
    rows = [("output tok/s", "output_tok_s", ",.0f", 1), ("TPOT p50 (ms)", "tpot_p50_s", ".1f", 1e3),
            ("MoE max/mean tokens", "mean_imbalance", ".3f", 1), ("straggler total (s)", "straggler_s", ".2f", 1),
            ("rebalances", "rebalances", "d", 1), ("expert weights moved (GB)", "moved_bytes", ",.1f", 1e-9),
            ("stall: decision + transfer (s)", "stall_s", ".2f", 1)]
    lines = ["| | " + " | ".join(REBALANCE_COLUMNS[k] for k in runs) + " |", "|---" * (len(runs) + 1) + "|"]
    for name, key, fmt, scale in rows:
        vals = [_num(s.get(key), fmt, scale) for s in runs.values()]
        lines.append(f"| {name} | " + " | ".join(vals) + " |")
    st, ep, mo = runs["static"], runs["eplb"], runs["moeplace"]
    sentence = (f"EPLB moves {ep['moved_bytes'] / 1e12:.1f} TB of MXFP4 weights in {ep['rebalances']} rebalances "
                f"and stalls the cluster for {ep['stall_s']:.2f} of the 20 s: output tok/s "
                f"{_change(ep['output_tok_s'], st['output_tok_s'])} against static. The migration mode moves "
                f"{mo['moved_bytes'] / 1e9:,.0f} GB ({mo['stall_s']:.2f} s of stall) for max/mean "
                f"{mo['mean_imbalance']:.3f} (EPLB {ep['mean_imbalance']:.3f}, static "
                f"{st['mean_imbalance']:.3f}): output tok/s {_change(mo['output_tok_s'], st['output_tok_s'])}.")
    lines += ["", sentence]
    return "\n".join(lines) + "\n"


def _change(new: float, old: float) -> str:
    pct = (new / old - 1) * 100
    return f"{'+' if pct >= 0 else '−'}{abs(pct):.1f} %"


def rebalance_tables() -> str:
    """docs/simulate.md: the three commands and the `place simulate` table of the three runs."""
    res = _results("rebalance")
    runs = res["runs"]
    labels = {"static": "static", "eplb": "EPLB", "moeplace": "moeplace 16 moves"}
    header = next(line for line in runs["static"]["printed"].splitlines() if " simulated s, " in line)
    table = format_table([SimpleNamespace(label=labels[k], summary=r["summary"]) for k, r in runs.items()])
    cmds = "\n".join(r["command"] for r in runs.values())
    return (f"```\n{cmds}\n```\n```\n{header}\n{table}\n```\n"
            f"(`bench/rebalance.py` runs these and writes `bench/results/rebalance.json`; wall time "
            + ", ".join(f"{labels[k]} {r['wall_s']:.0f} s" for k, r in runs.items())
            + f" on {(res.get('machine') or res)['cpus']} shared cores.)\n")


RENDERERS = {"rebalance-summary": rebalance_summary, "rebalance-tables": rebalance_tables}


def render(text: str) -> str:
    """``text`` with every figure block re-rendered (an unknown figure name is an error)."""
    def one(m: re.Match) -> str:
        name = m["name"]
        if name not in RENDERERS:
            raise SystemExit(f"unknown figure '{name}' (known: {', '.join(RENDERERS)})")
        return m.group(1) + RENDERERS[name]() + m.group(4)
    return BLOCK.sub(one, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="report figures that differ; change nothing")
    args = ap.parse_args(argv)
    stale = []
    for doc in DOCS:
        text = doc.read_text()
        new = render(text)
        if new != text:
            stale.append(doc.relative_to(ROOT))
            if not args.check:
                doc.write_text(new)
    verb = "differ from bench/results" if args.check else "regenerated"
    print(f"{verb}: {', '.join(map(str, stale))}" if stale else "figures match bench/results")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
