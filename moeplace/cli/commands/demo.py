"""``place demo``: the main job on the built-in default — a K3-shaped synthetic workload on a 32-GPU H200
cluster (4 nodes x 8), end to end. Every stage is an ordinary ``place`` command, printed before it runs,
so each can be rerun by hand with other settings; the artifacts land in ``--out`` (``place dashboard``
opens them).
"""
from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

from moeplace.cli import flags
from moeplace.cli.commands.optimize import planned_redundant
from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.errors import MoeplaceError
from moeplace.foundation.files import (
    OutputKind,
    Outputs,
    WriteFailed,
    clean_stale_temps,
    register_kind,
    remove_path,
    tagged_artifact,
    temp_sibling,
)
from moeplace.foundation.formats import tagged
from moeplace.foundation.limits import check_sim_duration
from moeplace.foundation.model import load_model
from moeplace.placement.export.capabilities import SERVING_ENGINES
from moeplace.placement.export.sample_checkpoint import write_k3_like
from moeplace.sim.tune import unavailable
from moeplace.traces.format import TRACE_DIRECTORY
from moeplace.traces.synth import SYNTH_VERSION, SynthConfig
from moeplace.traces.validate import read_trace_meta, validate_trace

RUN_MARKER = ".moeplace-run"  # the tagged file that marks a directory `place demo` made


def _is_run_dir(p: Path) -> bool:
    """A directory ``place demo`` made: its marker file is tagged ``run`` (untagged, the previous release's
    ``{"written_by": "place demo"}``)."""
    return tagged_artifact("run", "written_by")(p / RUN_MARKER)


RUN_DIRECTORY = register_kind(OutputKind("demo run directory", True, _is_run_dir))


def register(sub) -> None:
    p = sub.add_parser("demo", help="run the whole pipeline on the built-in K3 / 32 x H200 default")
    p.add_argument("--out", default="run",
                   help="directory for the artifacts (default: run/); a run directory an earlier `place demo` "
                        "wrote is replaced when the new run completes, any other existing path is refused")
    p.add_argument("--traces", default="data/k3-default",
                   help="where the default trace is synthesized, outside the run directory so later runs reuse "
                        "it (default: data/k3-default; reused when it exists and validates; a "
                        "moeplace trace of other settings is replaced, any other existing path refused)")
    p.add_argument("--tokens", type=flags.positive_int, default=None,
                   help="tokens of the synthetic trace (default 100000; 20000 with --quick)")
    p.add_argument("--gpus", type=flags.positive_int, default=32)
    p.add_argument("--gpu", default="h200")
    p.add_argument("--duration", type=flags.seconds, default=None,
                   help="simulated seconds (default 600; 60 with --quick)")
    p.add_argument("--seed", type=flags.seed, default=0)
    p.add_argument("--quick", action="store_true", help="small trace and short simulation (a smoke run; "
                   "--tokens and --duration, when given, still apply)")
    p.set_defaults(func=run)


def _stage(place, title: str, argv: list[str], ok_codes=(0,), before=None) -> int:
    """Print the stage's title and command and run it; ``before`` (a callable) runs between the two."""
    print(f"\n== {title}", flush=True)
    t0 = time.perf_counter()
    if before is not None:
        before()
    print(f"$ place {shlex.join(argv)}", flush=True)
    rc = place(argv)
    print(f"({time.perf_counter() - t0:.1f} s)", flush=True)
    if rc not in ok_codes:
        raise MoeplaceError(f"demo stopped: `place {shlex.join(argv)}` exited with {rc}")
    return rc


SAMPLE_CHECKPOINT = "k3-checkpoint"  # the demo's stand-in for the K3 weights (inside the run directory)
RELABELLED = "k3-relabelled"


def _deploy_relabelled(args, out: Path, model, launches: bool) -> None:
    """Stages 5 and 6 of a replica-free plan: a small checkpoint in K3's shape, relabelled as the placement
    with the launches that serve it (the relabelled checkpoint on vLLM and SGLang, the original through the
    plugin), then verified byte for byte."""
    src = out / SAMPLE_CHECKPOINT

    def make() -> None:
        t0 = time.perf_counter()
        write_k3_like(src, model)
        print(f"(made {src}: the demo's stand-in for the K3 weights -- K3's tensor names and MXFP4 layout at every "
              f"MoE layer and expert, tiny random tensors; {time.perf_counter() - t0:.1f} s)", flush=True)
        if not launches:
            print("(the memory plan does not fit this cluster: the relabelled checkpoint comes without launch flags)")

    layout = ["--flags", "--plan", str(out / "plan.json")] if launches else []
    _stage(args.place, "5. relabel a small K3-shaped checkpoint as the placement; the launches that serve it",
           ["export", str(out / "placement.json"), "--format", "checkpoint", "--model-path", str(src), "--out",
            str(out / RELABELLED), *layout], before=make)
    _stage(args.place, "6. prove the relabelled checkpoint against its source before serving it",
           ["export", "--verify", str(out / RELABELLED)])


def _valid_trace(path: Path, tokens: int, seed: int) -> bool:
    """The default trace can be reused: it validates and was written by this generator version with
    the demo's token count and seed (an older generator's trace would give other numbers)."""
    try:
        if not path.exists() or validate_trace(path):
            return False
        _model, prov = read_trace_meta(path)
    except MoeplaceError:
        return False
    cfg = prov.get("config", {})
    return (prov.get("generator") == f"moeplace.synth/{SYNTH_VERSION}" and cfg.get("num_tokens") == tokens
            and cfg.get("seed") == seed)


def run(args) -> int:
    out = Path(args.out)
    traces = Path(args.traces)
    # everything a stage could refuse late is checked before the run directory is touched
    make_cluster(args.gpus, args.gpu)
    tokens, duration = demo_sizes(args)
    if duration <= 0:
        raise MoeplaceError(f"--duration must be > 0, got {duration}")
    # the bounds the stages would meet (docs/design.md, Resource bounds), before anything is written
    SynthConfig(num_tokens=tokens, seed=args.seed)
    check_sim_duration(duration)
    outs = Outputs()
    outs.add(out, RUN_DIRECTORY, replace_own=True)
    outs.add(traces, TRACE_DIRECTORY, "--traces", replace_own=True)
    clean_stale_temps(out)
    return _run_in(out, lambda: _pipeline(args, out, traces))


def _run_in(out: Path, pipeline) -> int:
    """Run ``pipeline`` writing into a fresh ``out`` (marked as a demo run directory); an earlier run there
    is moved aside and removed only when the new one completes. On any failure (a stage's error, Ctrl-C,
    SIGTERM) the partial directory is removed and the earlier run put back."""
    old = None
    if out.exists():
        old = temp_sibling(out, "-old")
        out.rename(old)
    try:
        try:
            out.mkdir(parents=True)
            (out / RUN_MARKER).write_text(json.dumps(tagged("run", {"written_by": "place demo"})) + "\n")
        except OSError as exc:  # a full or read-only disk: one line (the stages' writes say so themselves)
            raise WriteFailed(exc.errno, exc.strerror or str(exc), str(out / RUN_MARKER)) from None
        rc = pipeline()
    except BaseException:
        remove_path(out)
        if old is not None:
            old.rename(out)
        raise
    if old is not None:
        remove_path(old)
    return rc


def demo_sizes(args) -> tuple[int, float]:
    """Trace tokens and simulated seconds: what was given, else the defaults (smaller with ``--quick``)."""
    tokens = args.tokens if args.tokens is not None else (20_000 if args.quick else 100_000)
    duration = args.duration if args.duration is not None else (60.0 if args.quick else 600.0)
    return tokens, duration


def _pipeline(args, out: Path, traces: Path) -> int:
    tokens, duration = demo_sizes(args)
    gpus = str(args.gpus)
    # attention TP within a node and DP across nodes: the layout `place simulate` models by default
    tp = min(8, args.gpus)
    print(f"moeplace demo: Kimi K3 (synthetic routing, {tokens:,} tokens) on {args.gpus} x {args.gpu}; "
          f"artifacts in {out}/", flush=True)

    if _valid_trace(traces, tokens, args.seed):
        print(f"\n== 1. trace: reusing {traces} (delete it to synthesize anew)")
    else:
        # an existing --traces is a moeplace trace of other settings (run() refused anything else)
        _stage(args.place, "1. synthesize a K3-shaped routing trace",
               ["trace", "synth", "--model", "kimi-k3", "--tokens", str(tokens), "--out", str(traces),
                "--seed", str(args.seed), *(["--force"] if traces.exists() else [])])
    _stage(args.place, "2. trace statistics (Loads per window, skew, drift, affinity)",
           ["trace", "stats", str(traces), "--out", str(out / "loads.npz")])
    # planned with the redundant slots the placement will have (place optimize's default: none for K3, whose
    # engines serve only a replica-free placement), so the plan certifies the deployment the launches start
    model = load_model("kimi-k3")
    redundant, _ = planned_redundant(model, args.gpus, None)
    plan_rc = _stage(args.place, "3. memory plan: does K3 fit, and how many sequences at which context",
                     ["plan", "--model", "kimi-k3", "--gpus", gpus, "--gpu", args.gpu, "--tp", str(tp), "--dp",
                      str(args.gpus // tp), "--redundant", str(redundant), "--context-mix",
                      "8k:0.7,128k:0.25,1M:0.05", "--report", str(out / "plan.json")], ok_codes=(0, 3))
    _stage(args.place, "4. placement: every policy planned on the first half of the trace, scored on the second",
           ["optimize", str(traces), "--gpus", gpus, "--gpu", args.gpu, "--out", str(out / "placement.json"),
            "--save-all", str(out / "placements"), "--report", str(out / "comparison.json"),
            "--seed", str(args.seed)])
    if redundant == 0:
        _deploy_relabelled(args, out, model, plan_rc == 0)
    else:  # a model an engine applies a placement file for: that file and its launch
        layout = ["--flags", "--plan", str(out / "plan.json")] if plan_rc == 0 else []
        _stage(args.place, "5. export the moeplace placement for SGLang, with its launch flags",
               ["export", str(out / "placement.json"), "--format", "sglang", "--out",
                str(out / "export" / "sglang-expert-location.json"), *layout])
    # Prompt lengths from a chat-like mixture (routing still from the trace): the trace's own long-context
    # tail (a 1M-token prompt) would set the pace of every step and hide the placements' differences;
    # docs/simulate.md shows that scenario on its own.
    # --quick's short run completes requests only if they are short: 1,024-token answers need ~1,000 decode
    # steps, more than a minute of simulated K3 serving holds (a run that completes nothing is refused)
    output_len = "64" if args.quick and args.duration is None else "1024"
    sim_argv = ["simulate", str(traces), "--gpus", gpus, "--gpu", args.gpu, "--duration", str(duration),
                "--concurrency", "1024", "--context-mix", "2k:0.9,16k:0.1", "--output-len", output_len,
                "--out", str(out / "sim"), "--seed", str(args.seed)]
    for policy in ("moeplace", "eplb", "linear"):
        sim_argv += ["--placement", str(out / "placements" / f"placement-{policy}.json")]
    if not sys.stderr.isatty():
        sim_argv.append("--no-progress")
    _stage(args.place, "7. simulate serving with each placement (straggler cost in seconds and tokens/s)", sim_argv)
    # The engines' own online rebalancers, tuned on the trace (each candidate scored on routing its window has
    # not seen, for >= 5 of its rebalance intervals after warm-up) where the capability table says they act on
    # the model (for K3 none does in the checked releases: stage 4's serving lines said so, once). Short prompts
    # and few requests in flight keep the iterations short; the smallest search (--quick) and a larger wall
    # budget keep the step affordable.
    acting = [e for e in (["vllm"] if args.quick else list(SERVING_ENGINES))
              if unavailable(e, model) is None]
    if not acting:
        print(f"\n== 8. the engines' own online rebalancers: none acts on {model.name} in the checked releases "
              "(stage 4's serving lines), nothing to tune")
    else:
        _stage(args.place, "8. the engines' own online rebalancers, tuned on the trace",
               ["rebalance", str(traces), "--gpus", gpus, "--gpu", args.gpu, "--quick",
                *[x for e in acting for x in ("--engine", e)], "--max-trace-tokens", "20000", "--concurrency", "64",
                "--context-mix", "512:1", "--output-len", "512", "--seed", str(args.seed), "--budget", "7200",
                "--report", str(out / "rebalance.json")])
    print(f"\nDone. Explore the run: place dashboard {out}")
    return 0
