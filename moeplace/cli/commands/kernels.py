"""``place kernels bench`` (time the real EP MoE, write the calibration profile, validate the simulator on
held-out configurations) and ``place kernels verify`` (distributed == single-process reference)."""
from __future__ import annotations

import json
from pathlib import Path

from moeplace.cli import flags
from moeplace.cli.commands import add_force
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import Outputs, write_text_atomic
from moeplace.foundation.formats import tagged
from moeplace.sim.calibration import CALIBRATION_PROFILE, KERNEL_REPORT

GROUP = "kernels"


def _ints(text: str) -> tuple[int, ...]:
    """Comma-separated batch sizes, each >= 1."""
    return tuple(flags.positive_int(v) for v in text.split(",") if v)


def _floats(text: str) -> tuple[float, ...]:
    """Comma-separated routing skews, each >= 0."""
    return tuple(flags.nonneg_float(v) for v in text.split(",") if v)


def register(sub) -> None:
    p = sub.add_parser("bench", help="time dispatch / expert GEMMs / combine, write a calibration profile")
    p.add_argument("--world-size", type=flags.positive_int, default=4, help="EP ranks (processes; default 4)")
    p.add_argument("--out", default="profile.json", help="calibration profile to write (default profile.json)")
    p.add_argument("--report", help="also write the validation table and raw timings as JSON here")
    add_force(p)
    p.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl when enough GPUs, else gloo")
    p.add_argument("--hidden", type=flags.positive_int, default=512)
    p.add_argument("--intermediate", type=flags.positive_int, default=256)
    p.add_argument("--experts", type=flags.positive_int, default=32)
    p.add_argument("--top-k", type=flags.positive_int, default=4)
    p.add_argument("--redundant", type=flags.nonneg_int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--train-tokens", type=_ints, default=(64, 256, 1024), help="calibration batch sizes per rank")
    p.add_argument("--test-tokens", type=_ints, default=(128, 512), help="held-out batch sizes per rank")
    p.add_argument("--test-skews", type=_floats, default=(0.0, 1.0, 1.6), help="held-out routing skews")
    p.add_argument("--reps", type=flags.positive_int, default=7)
    p.add_argument("--seed", type=flags.seed, default=0)
    p.set_defaults(func=bench)
    p = sub.add_parser("verify", help="check distributed dispatch/experts/combine against the reference")
    p.add_argument("--world-size", type=flags.positive_int, default=2)
    p.add_argument("--backend", choices=["gloo", "nccl"])
    p.set_defaults(func=verify)


def _check(args) -> None:
    if args.world_size < 1:
        raise InputError(f"--world-size must be >= 1, got {args.world_size}")
    if getattr(args, "experts", 1) and (args.experts + args.redundant) % args.world_size:
        raise InputError(f"--experts {args.experts} + --redundant {args.redundant} must be a multiple of "
                         f"--world-size {args.world_size}")
    if getattr(args, "top_k", 1) > getattr(args, "experts", 1):
        raise InputError("--top-k must not exceed --experts")


def bench(args) -> int:
    from moeplace.kernels.bench import (  # kernels/ imports torch (~3 s): only these commands pay
        BenchConfig,
        run_bench,
    )

    _check(args)
    outs = Outputs(force=args.force)
    outs.add(args.out, CALIBRATION_PROFILE)
    outs.add(args.report, KERNEL_REPORT, "--report")
    cfg = BenchConfig(world_size=args.world_size, hidden=args.hidden, intermediate=args.intermediate,
                      num_experts=args.experts, top_k=args.top_k, num_redundant=args.redundant, dtype=args.dtype,
                      train_tokens=args.train_tokens, test_tokens=args.test_tokens, test_skews=args.test_skews,
                      reps=args.reps, seed=args.seed)
    profile, val, raw = run_bench(cfg, backend=args.backend)
    outs.write(args.out, lambda: profile.save(args.out))
    print(f"calibration profile: {args.out} ({profile.device}, {cfg.dtype}, world size {cfg.world_size})")
    print(f"{'split':<6} {'tok/rank':>8} {'skew':>5} {'max/mean':>8} {'measured ms':>12} {'predicted ms':>13} "
          f"{'error':>7}")
    for r in val["table"]:
        print(f"{r['split']:<6} {r['tokens_per_rank']:>8} {r['skew']:>5.1f} {r['max_over_mean']:>8.2f} "
              f"{r['measured_s'] * 1e3:>12.3f} {r['predicted_s'] * 1e3:>13.3f} {r['rel_error'] * 100:>6.1f}%")
    print(f"held-out: median error {val['test_median_rel_error'] * 100:.1f}%, "
          f"p90 {val['test_p90_rel_error'] * 100:.1f}% (calibration set median "
          f"{val['train_median_rel_error'] * 100:.1f}%)")
    if args.report:
        outs.write(args.report, lambda: write_text_atomic(Path(args.report), json.dumps(
            tagged("kernel-report", {"validation": val, "raw": raw}), indent=1, default=str)))
    outs.finish()
    return 0


def verify(args) -> int:
    from moeplace.kernels.launch import (
        run_distributed,  # kernels/ imports torch (~3 s): only these commands pay
    )
    from moeplace.kernels.verify import VerifyCase, verify_rank  # (torch, as above)

    if args.world_size < 1:
        raise InputError(f"--world-size must be >= 1, got {args.world_size}")
    W = args.world_size
    cases = [VerifyCase(num_experts=4 * W, num_redundant=W, top_k=3, tokens_per_rank=tuple(7 + 3 * r for r in range(W)),
                        rule=rule, seed=s) for s, rule in enumerate(("vllm", "sglang"))]
    cases.append(VerifyCase(num_experts=4 * W, num_redundant=0, top_k=2,
                            tokens_per_rank=(0,) + tuple(9 for _ in range(W - 1)), unused_experts=2, seed=7))
    results = run_distributed(verify_rank, W, cases, backend=args.backend)
    worst = max(r["max_abs_err"] for per in results for r in per)
    ok = all(r["max_abs_err"] <= 1e-5 * max(1.0, r["ref_scale"]) for per in results for r in per)
    print(f"{len(cases)} cases x {W} ranks: max |distributed - reference| = {worst:.2e} -> "
          f"{'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1
