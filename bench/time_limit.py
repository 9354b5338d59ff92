"""How well `place optimize --time-limit S` keeps its limit: wall time of the whole command (a subprocess,
Python start-up included) against S, on a synthetic K3 trace (92 MoE layers, 32 GPUs), for every policy,
EPLB alone and moeplace with the traffic objective; and what each run reported as skipped.

Prints one row per run and writes bench/results/time_limit.json.

    .venv/bin/python bench/time_limit.py [--tokens 20000] [--limits 0.01,1,5,20]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _timing import RESULTS, ROOT, timed, write_result

CASES = {
    "all policies": [],
    "eplb": ["--policy", "eplb"],
    "moeplace traffic": ["--policy", "moeplace", "--objective", "traffic"],
}


def place(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeplace.cli", *args], check=False, capture_output=True, text=True,
                          cwd=ROOT)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--limits", default="0.01,1,5,20")
    ap.add_argument("--out", default=str(RESULTS / "time_limit.json"))
    args = ap.parse_args()
    limits = [float(x) for x in args.limits.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "k3"
        r = place("trace", "synth", "--tokens", str(args.tokens), "--out", str(trace))
        if r.returncode:
            print(r.stderr, file=sys.stderr)
            return 1
        with timed() as t:
            r = place("trace", "validate", str(trace))  # start-up + one pass: the floor no limit can cut
        floor = t.wall_s
        print(f"K3 trace of {args.tokens} tokens; start-up + one validation pass: {floor:.2f} s")
        print(f"{'case':<18} {'limit s':>8} {'wall s':>8} {'over s':>7}  notes")
        for case, extra in CASES.items():
            for limit in limits:
                out = Path(tmp) / "p.json"
                with timed() as t:
                    r = place("optimize", str(trace), "--time-limit", str(limit), "--out", str(out), *extra)
                wall = t.wall_s
                notes = [line[6:] for line in r.stdout.splitlines() if line.startswith("note: ")]
                if r.returncode:
                    notes.append(r.stderr.strip())
                summary = {}
                if out.exists():
                    prov = json.loads(out.read_text())["provenance"]
                    summary = (prov.get("params") or {}).get("summary") or {}
                    out.unlink()
                rows.append({"case": case, "limit_s": limit, "wall_s": round(wall, 2),
                             "over_limit_s": round(wall - limit, 2), "exit_code": r.returncode,
                             "reproducible": summary.get("reproducible"),
                             "time_limited": summary.get("time_limited"), "notes": notes})
                short = "; ".join(n for n in notes if "time limit" in n)[:150]
                print(f"{case:<18} {limit:>8g} {wall:>8.2f} {wall - limit:>7.2f}  {short}")
    result = {"tokens": args.tokens, "model": "kimi-k3", "gpus": 32, "startup_and_one_pass_s": round(floor, 2),
              "runs": rows}
    write_result("time_limit", result, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
