"""``place demo``: the main job on the built-in default — a K3-shaped synthetic workload on a 32-GPU
H200 cluster. Each stage prints what it produced; artifacts go to ``--out``."""
from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("demo", help="run the whole pipeline on the built-in K3 / 32 x H200 default")
    p.add_argument("--out", default="run", help="directory for the artifacts (default: run/)")
    p.add_argument("--traces", default="traces/k3-default", help="where the default trace is synthesized")
    p.add_argument("--tokens", type=int, default=100_000, help="tokens of the synthetic trace")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raise SystemExit("demo: stages land with the foundation issues")
