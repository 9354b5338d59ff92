"""The kernels' calibration benchmark of docs/kernels.md: runs ``place kernels bench --world-size 4`` (real
EP dispatch / expert GEMMs / combine over torch.distributed, then the simulator's prediction of each
held-out MoE layer time), records what it printed and its validation table, and writes
bench/results/kernels.json; ``python bench/figures.py`` renders docs/kernels.md's table from it.

    .venv/bin/python bench/kernels.py [-- EXTRA place kernels bench FLAGS, e.g. --reps 3]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _timing import ROOT, timed, write_result

COMMAND = ["kernels", "bench", "--world-size", "4"]


def main() -> int:
    extra = [a for a in sys.argv[1:] if a != "--"]
    argv = [*COMMAND, *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with tempfile.TemporaryDirectory(prefix="bench-kernels-") as tmp:
        with timed() as t:
            res = subprocess.run([sys.executable, "-m", "moeplace.cli", *argv, "--out", str(Path(tmp) / "profile.json"),
                                  "--report", str(Path(tmp) / "report.json")], env=env, capture_output=True, text=True,
                                 check=False)
        if res.returncode:
            sys.exit(f"place {' '.join(argv)} exited with {res.returncode}:\n{res.stderr[-4000:]}")
        validation = json.loads((Path(tmp) / "report.json").read_text())["validation"]
        profile = json.loads((Path(tmp) / "profile.json").read_text())
    # the first printed line names the temporary profile; the table and the verdict follow
    printed = "\n".join(res.stdout.splitlines()[1:])
    print(printed)
    write_result("kernels", {"command": "place " + " ".join(argv), "printed": printed, "validation": validation,
                             "device": profile.get("device"), "dtype": profile.get("dtype"), "wall_s": t.wall_s,
                             "cpu_s": t.cpu_s})
    return 0


if __name__ == "__main__":
    sys.exit(main())
