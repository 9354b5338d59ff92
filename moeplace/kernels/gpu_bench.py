"""Single-GPU calibration: expert GEMM time vs tokens per expert at BF16 and FP8 (and MXFP4 where the
installed torch has a kernel for this GPU), and the permutation (counting sort) time vs selections.
Writes one calibration profile per dtype (``sim/calibration.py`` schema).

Run by ``kernels/gpu_check.sh`` on a lent GPU (one short script, a few minutes). Runs on CPU too, with
small shapes, so the code path is tested without a GPU (``--device cpu``).

``python -m kernels.gpu_bench --out-dir DIR [--device cuda] [--hidden 3584 --intermediate 3072]``
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from moeplace.kernels.bench import _median_time
from moeplace.kernels.moe import sort_by_destination
from moeplace.sim.calibration import PROFILE_FORMAT, profile_from_dict

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def _timer(device: torch.device):
    if device.type == "cuda":
        def run(fn, reps):
            for _ in range(3):
                fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ts = []
            for _ in range(reps):
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                ts.append(start.elapsed_time(end) / 1e3)
            return float(np.median(ts))
    else:
        run = _median_time
    return run


def gemm_curve(dtype: str, hidden: int, inter: int, device: torch.device, tokens=TOKENS, reps: int = 20):
    """Seconds of one expert's gated MLP (gate+up GEMM, SiLU*up, down GEMM) vs tokens, or None when this
    device/torch has no kernel for ``dtype``."""
    run = _timer(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    if dtype == "bf16":
        wgu = torch.randn(2 * inter, hidden, generator=g).to(device, torch.bfloat16)
        wd = torch.randn(hidden, inter, generator=g).to(device, torch.bfloat16)

        def mlp(x):
            gate, up = (x @ wgu.T).chunk(2, dim=-1)
            return (F.silu(gate) * up) @ wd.T
        make = lambda n: torch.randn(n, hidden, generator=g).to(device, torch.bfloat16)
    elif dtype == "fp8":
        if device.type != "cuda" or not hasattr(torch, "float8_e4m3fn"):
            return None
        f8 = torch.float8_e4m3fn
        wgu = torch.randn(2 * inter, hidden, generator=g).to(device).to(f8)
        wd = torch.randn(hidden, inter, generator=g).to(device).to(f8)
        one = torch.ones((), device=device)

        def mlp(x):
            # per-tensor scaled FP8 GEMMs (torch._scaled_mm: the row-major A x column-major B that cuBLASLt wants)
            gu = torch._scaled_mm(x, wgu.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            gate, up = gu.chunk(2, dim=-1)
            h = (F.silu(gate) * up).to(f8)
            return torch._scaled_mm(h, wd.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        def make(n):
            m = max(16, (n + 15) // 16 * 16)  # FP8 GEMMs need multiples of 16
            return torch.randn(m, hidden, generator=g).to(device).to(f8)
        try:
            mlp(make(16))
        except (RuntimeError, TypeError):
            return None
    else:
        return None  # mxfp4: torch ships no block-scaled FP4 GEMM for this device here (Hopper has no FP4)
    pts = []
    for n in tokens:
        x = make(n)
        pts.append([n, run(lambda x=x: mlp(x), reps)])
    return pts


def permute_curve(device: torch.device, num_slots: int = 928, world_size: int = 32, top_k: int = 16, reps: int = 20):
    run = _timer(device)
    pts = []
    for n in (64, 256, 1024, 4096, 16384):
        slots = torch.randint(0, num_slots, (n, top_k), device=device)
        pts.append([n * top_k, run(lambda s=slots: sort_by_destination(s, num_slots, world_size), reps)])
    return pts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--max-tokens", type=int, default=max(TOKENS))
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tokens = tuple(t for t in TOKENS if t <= args.max_tokens)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    perm = permute_curve(device, reps=args.reps)
    summary = {"device": name, "torch": torch.__version__, "profiles": {}}
    for dtype in ("bf16", "fp8", "mxfp4"):
        pts = gemm_curve(dtype, args.hidden, args.intermediate, device, tokens, args.reps)
        if pts is None:
            summary["profiles"][dtype] = "no kernel on this device / torch"
            continue
        d = {"format": PROFILE_FORMAT, "device": name, "dtype": dtype, "world_size": 1,
             "ops": {"expert_gemm": {"x": "tokens_per_expert", "hidden": args.hidden,
                                     "intermediate": args.intermediate, "points": pts},
                     "permute": {"x": "selections", "points": perm}},
             "provenance": {"tool": "moeplace.kernels.gpu_bench", "torch": torch.__version__}}
        profile = profile_from_dict(d, f"gpu_bench {dtype}")
        path = out / f"profile-{name.replace(' ', '_').lower()}-{dtype}.json"
        profile.save(path)
        flops = 2 * 3 * args.hidden * args.intermediate
        summary["profiles"][dtype] = {
            "file": path.name,
            "us_at": {str(n): round(t * 1e6, 2) for n, t in pts},
            "tflops_at_max": round(flops * pts[-1][0] / pts[-1][1] / 1e12, 1),
        }
    summary["permute_us"] = {str(n): round(t * 1e6, 2) for n, t in perm}
    (out / "gpu_bench_summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
