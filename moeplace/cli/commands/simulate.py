"""``place simulate TRACES --placement A [--placement B ...]``: run the discrete-event cluster simulator
(sim/) on a routing trace for one or more placements and print them side by side."""
from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from typing import Any

from moeplace.cli import flags
from moeplace.cli.commands import NO_PROGRESS_HELP, add_force, add_workload_input
from moeplace.cli.run_config import add_config, settings_record
from moeplace.cli.sim_settings import SimSettings, build_sim_config
from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.deployment import parse_pools, pools_help
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import Outputs
from moeplace.foundation.memory.planner import pool_cluster, pool_layout
from moeplace.foundation.progress import wanted
from moeplace.placement.dispatch import ENGINE_RULES
from moeplace.sim.calibrate import Calibration, calibration_run, check_applies, load_calibration
from moeplace.sim.calibration import load_profile
from moeplace.sim.config import COST_ENGINES, COST_MODELS, PREFILL_BATCHES, SimConfig, parse_mtp
from moeplace.sim.fidelity import fidelity_doc, run_context
from moeplace.sim.inputs import parse_phases, workload_of
from moeplace.sim.measured import cost_source_line
from moeplace.sim.online import DEFAULT_BUDGET_S, Candidate, check_deployments, compare, verdict
from moeplace.sim.rebalance import REPLAN_TIME_LIMIT, recommend_configs
from moeplace.sim.results import (
    CHROME_TRACE,
    SIM_OUTPUT,
    format_table,
    summaries_doc,
    write_chrome_trace,
    write_outputs,
)
from moeplace.sim.runner import RunInputs, prepare_run, resolved_config, simulate
from moeplace.sim.tune import unavailable


def register(sub) -> None:
    p = sub.add_parser("simulate", help="simulate serving on a cluster: throughput, latency, straggler cost")
    add_workload_input(p, "traces", ": Loads are routed from their per-window expert distributions",
                       " (--duration defaults to their sum)")
    p.add_argument("--placement", action="append", metavar="FILE|POLICY",
                   help="placement JSON (Placement.save) or a policy name computed on the trace; repeatable "
                   "(required, on the command line or in --config)")
    add_config(p)
    c = p.add_argument_group("cluster")
    c.add_argument("--gpus", type=flags.positive_int, default=32)
    c.add_argument("--gpu", default="h200", help="GPU preset (h200, h100, h800, b200, b300, gb200-nvl72, "
                   "gb300-nvl72) or a JSON spec file with the same fields")
    c.add_argument("--gpus-per-node", type=flags.positive_int, default=None)
    c.add_argument("--model", default=None, help="model preset/config overriding the trace's spec "
                   "(same layers and experts)")
    c.add_argument("--redundant", type=flags.nonneg_int, default=None,
                   help="redundant slots for policy-named placements (default 0); a placement file must have "
                        "this many when given")
    c.add_argument("--prefill-gpus", type=flags.positive_int, default=None, help="with --disaggregated: GPUs of the prefill "
                   "pool (its own placement from the policy); --gpus is the decode pool")
    c.add_argument("--pools", nargs="+", default=None, metavar="ROLE:KEY=V,...|FILE",
                   help=pools_help("simulates the two pools as deployed: each its own GPUs, attention layout, "
                                   "batching limits and placement (--placement FILE|POLICY for both, or "
                                   "prefill=FILE|POLICY,decode=FILE|POLICY), the KV cache handed over the kv_link"))
    c.add_argument("--expert-dtype", default=None, help="override the model's routed-expert dtype (e.g. nvfp4)")
    c.add_argument("--weight-dtype", default=None, help="override the model's dense-weight dtype (e.g. fp8)")
    w = p.add_argument_group("workload")
    g = w.add_mutually_exclusive_group()
    g.add_argument("--rate", type=flags.positive_float, default=None, help="open-loop arrivals, requests/s")
    g.add_argument("--concurrency", type=flags.positive_int, default=None, help="closed loop: requests kept in the system "
                   "(default 256)")
    w.add_argument("--arrival", choices=("poisson", "gamma", "ramp"), default="poisson",
                   help="open-loop process (with --rate)")
    w.add_argument("--rate-end", type=flags.positive_float, default=None, help="ramp: final rate")
    w.add_argument("--burstiness", type=flags.positive_float, default=2.0, help="gamma: coefficient of variation of gaps")
    w.add_argument("--context-mix", default=None, help="prompt lengths, e.g. 8k:0.7,128k:0.25,1M:0.05 "
                   "(default: the trace's own request lengths)")
    w.add_argument("--output-len", type=flags.positive_int, default=512, help="mean output length with --context-mix")
    w.add_argument("--isl", type=flags.positive_int, default=None, help="benchmark input length (fixed, as vllm bench serve / "
                   "trtllm-bench); needs --osl")
    w.add_argument("--osl", type=flags.positive_int, default=None, help="benchmark output length (fixed)")
    w.add_argument("--random-range-ratio", type=flags.float_range(0.0, 1.0, hi_open=True), default=0.0,
                   help="with --isl/--osl: lengths uniform in [n (1-r), n (1+r)]")
    w.add_argument("--max-requests", type=flags.positive_int, default=None)
    w.add_argument("--max-trace-tokens", type=flags.positive_int, default=100_000,
                   help="tokens of the trace loaded for routing (memory: tokens x MoE layers x top-k x 2 B)")
    e = p.add_argument_group("engine")
    e.add_argument("--engine", choices=ENGINE_RULES, default="vllm", help="replica-choice rule")
    e.add_argument("--attention-tp", type=flags.positive_int, default=8, help="GPUs per attention-DP rank")
    e.add_argument("--max-batched-tokens", type=flags.positive_int, default=8192)
    e.add_argument("--max-seqs", type=flags.positive_int, default=256)
    e.add_argument("--no-chunked-prefill", action="store_true")
    e.add_argument("--disaggregated", action="store_true", help="separate prefill and decode pools (2 x GPUs)")
    e.add_argument("--dbo", action="store_true", help="dual-batch overlap of all-to-all and compute")
    e.add_argument("--kv-dtype", default="fp8", choices=("bf16", "fp8"))
    e.add_argument("--preemption", choices=("recompute", "swap"), default="recompute")
    e.add_argument("--pool-split", default="shared", help="place plan --pool-split: shared | ratio[:R] | slots:N")
    e.add_argument("--gpu-memory-utilization", type=flags.fraction, default=0.9)
    e.add_argument("--deepep-mode", choices=("auto", "normal", "low_latency", "allgather"), default="auto",
                   help="MoE all-to-all kernels: auto = DeepEP normal with prefill tokens, low-latency for decode; "
                   "allgather = all-gather tokens + reduce-scatter outputs (TensorRT-LLM CUTLASS MoE)")
    e.add_argument("--cuda-graph-max-bs", type=flags.nonneg_int, default=512, help="decode batches up to this size per rank "
                   "replay CUDA graphs (0 = eager)")
    e.add_argument("--kernel-build", choices=("unfused", "fused"), default="unfused",
                   help="engine build whose kernels per layer kind pay the fitted per-kernel gap: unfused (FP8 "
                   "block-scale paths of TensorRT-LLM / SGLang / vLLM) or fused (TensorRT-LLM's NVFP4 "
                   "min-latency build); docs/simulate.md lists the counts")
    e.add_argument("--kernels-per-layer", type=flags.float_range(0.0), default=None,
                   help="one kernel count for every decoder layer instead of the build's counts by layer kind "
                   "(a what-if)")
    e.add_argument("--mtp", default=None, metavar="DRAFT:ACCEPT", help="MTP / speculative decoding: draft tokens "
                   "per step and per-token acceptance probability, e.g. 1:0.85, or one conditional "
                   "acceptance per draft position, e.g. 3:0.92,0.72,0.36")
    e.add_argument("--prefix-hit", type=flags.float_range(0.0, 1.0, hi_open=True), default=0.0, help="share of each prompt served from the prefix cache")
    e.add_argument("--moe-tp", type=flags.positive_int, default=1, help="TEP: GPUs each routed expert is tensor-sharded across")
    e.add_argument("--attention-dtype", choices=("bf16", "fp8"), default="bf16", help="attention core compute dtype")
    e.add_argument("--admission", choices=("on_demand", "reserve"), default="on_demand",
                   help="KV admission: on_demand (vLLM/SGLang: preempt the newest when the pool fills) or reserve "
                   "(TensorRT-LLM GUARANTEED_NO_EVICT: admit only when prompt + output fit, never preempt)")
    e.add_argument("--prefill-batches", choices=PREFILL_BATCHES, default=None,
                   help="how prompts share iterations with decoding: mixed (prefill chunks join the decode "
                        "iteration: vLLM, TensorRT-LLM, SGLang --enable-mixed-chunk) or separate (a rank with a "
                        "prompt to start runs a prefill-only iteration, its decodes wait: SGLang's default); "
                        "default: separate with --engine sglang, else mixed")
    e.add_argument("--dp-balance", choices=("round_robin", "tokens"), default="round_robin",
                   help="new requests to attention-DP ranks: round robin or fewest outstanding tokens")
    e.add_argument("--phase", choices=("both", "prefill", "decode"), default="both",
                   help="benchmark one phase alone: prefill (1-token outputs) or decode (prompt KV given)")
    r = p.add_argument_group("run")
    r.add_argument("--duration", type=flags.seconds, default=None,
                   help="simulated seconds (default 600, or the --phases' sum; past the last phase its last window "
                        "goes on)")
    r.add_argument("--warmup", type=flags.nonneg_float, default=None, help="simulated seconds excluded from throughput and "
                   "latency (default 20%% of --duration)")
    r.add_argument("--mode", choices=("replay", "stat"), default="stat")
    r.add_argument("--profile", default=None, help="calibration profile JSON (kernels/)")
    r.add_argument("--calibration", default=None, metavar="CAL.json",
                   help="price with the constants place calibrate fitted on your measured points of this model "
                        "and GPU; the ranges become the within-deployment interval")
    r.add_argument("--cost-model", choices=COST_MODELS, default="roofline",
                   help="kernel costs: roofline (default) = the fitted roofline; measured = NVIDIA "
                        "aiconfigurator's silicon tables (by GPU and engine release; roofline for what they do "
                        "not hold); auto = measured where the tables cover the GPU, engine and expert shape/dtype. "
                        "The roofline is the default because it is closer to the published deployments today "
                        "(bench/fidelity.py's measured column)")
    r.add_argument("--cost-engine", choices=COST_ENGINES, default=None,
                   help="serving engine whose tables price the run (default: --engine's)")
    r.add_argument("--rebalance", default=None, metavar="every=N,window=W,moves=K[,policy=P,time=S,async=1]")
    r.add_argument("--recommend", action="store_true",
                   help="also simulate the first placement under vLLM's EPLB (window 1000, every 3000, async), "
                        "SGLang's EPLB (every 1000, blocking) and moeplace's migration mode, and say whether "
                        "a static placement suffices")
    r.add_argument("--recommend-splits", type=flags.positive_int, default=1, metavar="N",
                   help="--recommend: the input is cut into N+1 parts in time; each rebalancer observes part j "
                        "and is scored on part j+1, which it never saw (default 1)")
    r.add_argument("--recommend-budget", type=flags.seconds, default=DEFAULT_BUDGET_S, metavar="S",
                   help="--recommend: wall seconds the comparison may take (default %(default)g); each "
                        "rebalancer is simulated for 5 of its intervals after warm-up, and a comparison that "
                        "would take longer is refused, saying what to change")
    r.add_argument("--recommend-moves", type=flags.nonneg_int, default=16, metavar="K",
                   help="moeplace migration budget per layer for --recommend (default 16)")
    r.add_argument("--recommend-time", type=flags.seconds, default=REPLAN_TIME_LIMIT, metavar="S",
                   help=f"moeplace decision time limit per rebalance for --recommend (default {REPLAN_TIME_LIMIT:g} s; "
                        "the decision's measured time is charged)")
    r.add_argument("--route-all", action="store_true",
                   help="route on the whole trace even when a placement was planned on its first part "
                        "(default: route on the held-out part only)")
    r.add_argument("--seed", type=flags.seed, default=0)
    r.add_argument("--json", action="store_true", help="print the summaries as JSON")
    r.add_argument("--out", default=None, help="directory for Parquet/JSON outputs")
    r.add_argument("--chrome-trace", default=None, metavar="FILE", help="Chrome trace-event JSON (Perfetto)")
    r.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    add_force(r)
    p.set_defaults(func=run)


def run(args) -> int:
    if not args.placement:
        raise InputError("--placement FILE|POLICY is required (on the command line or in --config)")
    phases = parse_phases(args.phases) if args.phases else ()
    if (args.traces is None) == (not phases):
        raise InputError("give TRACES (a trace or a Loads .npz) or --phases SRC:SECONDS,... (one of the two)")
    timed = bool(phases) and phases[0].seconds is not None  # the phases fix the time (else: by traffic)
    if args.duration is None:  # the phases' seconds (when they give them), else 600
        args.duration = float(sum(ph.seconds for ph in phases)) if timed else 600.0
    source = args.traces or f"--phases {args.phases}"
    outs = Outputs(inputs=[args.traces, *(ph.source for ph in phases), *args.placement, args.profile, args.model,
                           args.calibration], force=args.force)
    cal = calibration_of(args)
    outs.add(args.out, SIM_OUTPUT)
    outs.add(args.chrome_trace, CHROME_TRACE, "--chrome-trace")
    dep = pools_deployment(args)
    cluster = (make_cluster(args.gpus, args.gpu, args.gpus_per_node) if dep is None else
               pool_cluster(dep, dep.decode, args.gpu, args.gpus_per_node))
    # the run's bounds and memory estimate before the trace is read (the model's context only narrows
    # the length checks, redone below)
    simulation_config(args, None)
    prep = prepare_run(RunInputs(
        trace=source, phases=phases, duration=args.duration, placements=tuple(args.placement),
        max_trace_tokens=args.max_trace_tokens,
        route_all=args.route_all, model=args.model, expert_dtype=args.expert_dtype, weight_dtype=args.weight_dtype,
        num_redundant=args.redundant, rule=args.engine, seed=args.seed, prefill_gpus=args.prefill_gpus,
        pools=dep, gpu=args.gpu, gpus_per_node=args.gpus_per_node),
        cluster, make_cluster=lambda g: make_cluster(g, args.gpu, args.gpus_per_node),
        check=lambda t: simulation_config(args, t.model.max_context))  # the settings, before any placement
    trace, placements = prep.trace, prep.placements
    config = simulation_config(args, trace.model.max_context)
    if cal is not None:
        check_applies(cal, trace.model.name, cluster.gpu.name)
        config = dataclasses.replace(config, cost=cal.cost)
    if dep is not None:  # the run's engine settings as the decode pool has them (each pool gets its own)
        lay = pool_layout(trace.model, dep.decode)
        config = dataclasses.replace(config, engine=dataclasses.replace(
            config.engine, disaggregated=True, attention_tp=lay.tp, max_seqs=dep.decode.max_seqs,
            max_batched_tokens=dep.decode.max_batched_tokens, kv_link=dep.kv_link))
    rec_plan = None
    if args.recommend:  # what --recommend would refuse is refused before anything is simulated
        rec_plan = recommend_plan(workload_of(trace, timed, source), placements[0], cluster, config,
                                  args.recommend_moves, args.recommend_time, args.recommend_splits)
    profile = load_profile(args.profile) if args.profile else None
    progress = wanted(args.no_progress)
    results = simulate(trace, placements, cluster, config, profile, chrome=bool(args.chrome_trace),
                       progress=progress, prefill=prep.prefill, deployment=dep, pool_placements=prep.pool_placements,
                       gpu=args.gpu, gpus_per_node=args.gpus_per_node,
                       ensemble=None if cal is None else cal.ensemble())  # a calibration's members price it
    for r in results:  # a table of zeros is no result: say why instead, before any output is written
        sm = r.summary
        if sm["requests_finished"] == 0:
            wl = config.workload
            load = (f"{wl.concurrency} concurrent requests" if wl.arrival == "closed" else f"{wl.rate:g} req/s")
            fit = ", check that they fit the memory plan" if sm["iterations"] == 0 else ""
            raise InputError(f"{r.label}: the run completed no request in {config.duration:g} simulated s "
                             f"({sm['iterations']} iterations, {load}, {sm['requests_rejected']} rejected): "
                             "lengthen --duration, shorten the requests (--context-mix, --output-len)"
                             f"{fit}, or check that the trace can supply the workload (--concurrency, "
                             "--max-trace-tokens)")
    # what priced the run: "auto" ends on the measured tables only where they cover it
    run = run_context(config, cluster.num_gpus, trace.model.name, cluster.gpu.name,
                      cost="profile" if profile is not None else results[0].summary["cost_model"]["source"],
                      summary=results[0].summary)
    if cal is not None:
        run["calibration"] = calibration_run(cal, cluster.num_gpus, config.engine.attention_tp, args.engine)
        for r in results:  # each summary says what priced it (summary.json, the dashboard)
            r.summary["calibration"] = run["calibration"]
    if args.out:
        resolved = {**resolved_config(config, cluster, trace, placements, profile),
                    "settings": settings_record(args, {"traces": args.traces})}
        outs.write(args.out, lambda: write_outputs(args.out, results, resolved, run))
    if args.chrome_trace:
        outs.write(args.chrome_trace, lambda: write_chrome_trace(args.chrome_trace, results))
    rec = None
    if rec_plan is not None:
        rec = recommend(rec_plan, cluster, config, profile, args.recommend_splits, args.recommend_budget)
        results[0].summary["recommendation"] = rec
    routing_note = prep.routing_note
    for r in results:
        r.summary["routing"] = {"from_token": prep.from_token, "note": routing_note}
    for r in results:
        if r.summary.get("trace_note"):
            print(f"warning: {r.label}: {r.summary['trace_note']}", file=sys.stderr)
    if args.json:
        print(json.dumps(summaries_doc(results, run, settings_record(args, {"traces": args.traces})), indent=1))
    else:
        print(routing_note)
        where = (f"{cluster.name}, attention TP{config.engine.attention_tp}" if dep is None else
                 "; ".join(f"{p.role} pool {pool_cluster(dep, p, args.gpu, args.gpus_per_node).name}, "
                           f"{pool_layout(trace.model, p).describe()}, {p.max_seqs} seqs / {p.max_batched_tokens} "
                           "tokens per DP rank" for p in dep.pools) + f"; KV over {dep.kv_link}")
        print(f"{trace.model.name} on {where} ({results[0].summary['num_gpus']} GPUs in all), "
              f"{args.engine} replica rule, {args.mode} mode, {args.duration:g} simulated s, "
              + (f"{args.rate:g} req/s {args.arrival}" if args.rate is not None else
                 f"{config.workload.concurrency} concurrent requests")
              + f"; steady state after {config.warmup_s:g} s warm-up")
        print(cost_source_line(results[0].summary["cost_model"])
              + (f"; corrected by the calibration profile {args.profile} ({profile.device}, {', '.join(sorted(profile.ops))})"
                 if profile is not None else "")
              + (f"; constants calibrated by {args.calibration}" if cal is not None else ""))
        print(format_table(results, run))
        print(fidelity_doc(run)["note"])
        if rec is not None:
            print(format_recommendation(rec))
        walls = ", ".join(f"{r.label} {r.summary['wall_s']:.1f} s" for r in results)
        print(f"wall time: {walls}", file=sys.stderr)
    outs.finish()
    return 0


# flags a pool word sets for its own pool (ambiguous next to --pools)
_POOL_FLAGS = (("gpus", 32, "--gpus"), ("attention_tp", 8, "--attention-tp"), ("max_seqs", 256, "--max-seqs"),
               ("max_batched_tokens", 8192, "--max-batched-tokens"), ("moe_tp", 1, "--moe-tp"),
               ("disaggregated", False, "--disaggregated"), ("prefill_gpus", None, "--prefill-gpus"),
               ("phase", "both", "--phase"), ("redundant", None, "--redundant"), ("recommend", False, "--recommend"))


def pools_deployment(args):
    """The ``--pools`` deployment (``None`` without it); the flags its pool words set are refused next to it."""
    if not args.pools:
        return None
    for dest, default, flag in _POOL_FLAGS:
        if getattr(args, dest) != default:
            raise InputError(f"{flag} does not go with --pools (the pool words set gpus, tp/dp, ep, redundant, "
                             "batch and tokens per pool; the deployment is disaggregated)")
    return parse_pools(args.pools)


def calibration_of(args) -> Calibration | None:
    """The ``--calibration`` file, read before any work; it calibrates the roofline cost model, so it does
    not combine with a kernel profile or the measured tables."""
    if not args.calibration:
        return None
    if args.profile:
        raise InputError("--calibration and --profile are alternatives (a calibration refits the roofline cost "
                         "model on measured serving points; a profile replaces its kernel times)")
    if args.cost_model != "roofline":
        raise InputError(f"--calibration calibrates the roofline cost model; drop --cost-model {args.cost_model}")
    return load_calibration(args.calibration)


def simulation_config(args, max_context: int | None) -> SimConfig:
    """The :class:`SimConfig` of the flags, for a model of ``max_context`` tokens: the flags' own checks,
    then the mapping ``place sweep`` shares (:func:`moeplace.sim_settings.build_sim_config`)."""
    if args.prefill_gpus is not None and not args.disaggregated:
        raise InputError("--prefill-gpus needs --disaggregated")
    if (args.isl is None) != (args.osl is None):
        raise InputError("--isl and --osl go together (fixed benchmark lengths)")
    if args.isl is not None:
        if args.context_mix:
            raise InputError("--isl/--osl and --context-mix are alternatives")
        if args.isl < 1 or args.osl < 1:
            raise InputError(f"--isl and --osl must be >= 1, got {args.isl}, {args.osl}")
    mtp_draft, mtp_acceptance = parse_mtp(args.mtp) if args.mtp else (0, 0.0)
    open_loop = args.rate is not None
    settings = SimSettings(
        attention_tp=args.attention_tp, engine=args.engine, kv_dtype=args.kv_dtype,
        max_batched_tokens=args.max_batched_tokens, max_seqs=args.max_seqs,
        chunked_prefill=not args.no_chunked_prefill, disaggregated=args.disaggregated, dual_batch_overlap=args.dbo,
        preemption=args.preemption, pool_split=args.pool_split, gpu_memory_utilization=args.gpu_memory_utilization,
        deepep_mode=args.deepep_mode, cuda_graph_max_bs=args.cuda_graph_max_bs,
        kernels_per_layer=args.kernels_per_layer, kernel_build=args.kernel_build, mtp_draft=mtp_draft,
        mtp_acceptance=mtp_acceptance, prefix_hit=args.prefix_hit, moe_tp=args.moe_tp,
        attention_dtype=args.attention_dtype, dp_balance=args.dp_balance, admission=args.admission,
        prefill_batches=args.prefill_batches, prefill_gpus=args.prefill_gpus, phase=args.phase,
        arrival=args.arrival if open_loop else "closed",
        concurrency=256 if args.concurrency is None else args.concurrency, rate=args.rate,
        rate_end=args.rate_end, burstiness=args.burstiness, context_mix=args.context_mix,
        output_len=args.output_len, isl=args.isl, osl=args.osl, random_range_ratio=args.random_range_ratio,
        max_requests=args.max_requests,
        duration=600.0 if args.duration is None else args.duration, mode=args.mode, seed=args.seed, rebalance=args.rebalance, warmup=args.warmup,
        cost_model=args.cost_model, cost_engine=args.cost_engine)
    return build_sim_config(settings, max_context)


@dataclass(frozen=True)
class RecommendPlan:
    """What ``--recommend`` compares, settled before any simulation: the workload, the placement (label,
    Placement), the candidates (static first) and the rebalancers left out, with the capability table's
    reason (an engine's own rebalancer that does nothing for this model in its checked release)."""

    wl: Any
    placement: tuple[str, Any]
    candidates: list[Candidate]
    left_out: list[dict[str, str]]


def recommend_plan(wl, placement, cluster, config, moves: int, time_limit: float, splits: int) -> RecommendPlan:
    """The comparison :func:`recommend` runs, after every check that needs no simulation: no ``--rebalance``
    next to it, the engines' rebalancers the capability table says serve the model (the same facts
    ``place rebalance`` reads: :func:`sim.tune.unavailable`), an input long enough to cut into the parts the
    splits need, and each candidate's deployment (the GPU count, attention TP, the memory plan)."""
    if config.rebalance is not None:
        raise InputError("--recommend compares its own rebalancers with a static placement; drop --rebalance")
    rule, model = config.engine.replica_rule, wl.trace.model
    R = placement[1].num_redundant
    cands, left_out = [Candidate("static", None, R, rule)], []
    for name, (engine, rb) in recommend_configs(moves, time_limit).items():
        why = unavailable(engine, model) if engine is not None else None
        if why:
            left_out.append({"name": name, "engine": engine, "why": why})
        else:
            cands.append(Candidate(name, rb, R, rule))
    check_deployments(model, cands, cluster, config)
    if splits < 1:
        raise InputError(f"--recommend-splits must be >= 1, got {splits}")
    wl.timeline.blocks(splits + 1, wl.what, "--recommend-splits")
    return RecommendPlan(wl, placement, cands, left_out)


def recommend(plan: RecommendPlan, cluster, config, profile, splits: int = 1,
              budget_s: float = DEFAULT_BUDGET_S) -> dict:
    """Simulate the plan's placement static and under each of its candidates on its workload, each for at
    least five of its rebalance intervals after warm-up on routing it had not observed
    (:func:`sim.online.compare`), and recommend from the gains' interval (:func:`sim.online.verdict`)."""
    placement = plan.placement
    out = compare(plan.wl, plan.candidates, lambda r, observed, j: placement[1], cluster, config, profile, splits,
                  budget_s, splits_flag="--recommend-splits")
    out["placement"] = placement[0]
    out["verdict"] = verdict(out["rows"])
    out["not_simulated"] = plan.left_out
    return out


def format_recommendation(rec: dict) -> str:
    hz = rec["horizon"]
    head = (f"static vs online rebalancing for {rec['placement']} on traffic the rebalancer had not observed "
            f"({rec['routing']}; stat mode, {hz['text']}; decision = the policy's measured time):")
    w = max(len(r["name"]) for r in rec["rows"])
    lines = [head, (f"  {'':{w}s}         tok/s  gain (80 % interval)   straggler  rebalances  stall s  decision s  "
                    "transfer s  a2a slowdown s")]
    for r in rec["rows"]:
        gain = (f"{r['gain']:+6.1%} ({r['gain_lo']:+.1%}, {r['gain_hi']:+.1%})" if r["online"] else "")
        lines.append(f"  {r['name']:{w}s}  {r['tok_s']:12,.0f}  {gain:21s}  {r['straggler_share']:9.1%}  "
                     f"{r['rebalances']:10d}  {r['stall_s']:7.2f}  {r['decision_s']:10.2f}  {r['transfer_s']:10.2f}  "
                     f"{r['a2a_slowdown_s']:14.2f}")
        if r.get("why_unranked"):
            lines.append(f"    not ranked: {r['why_unranked']}")
    for left in rec.get("not_simulated", []):
        lines.append(f"  {left['name']}: not simulated -- {left['why']}")
    lines.append(f"  (tok/s: tokens processed per simulated s after the warm-up, prompt chunks + decode steps, means over "
                 f"the splits; rebalances: after the warm-up; {rec['interval']}; stall: every rank "
                 "waits for a blocking rebalance; a2a slowdown: what async transfers, sharing the links, added to "
                 "the steps they overlapped; transfer: with free links)")
    lines.append(f"recommendation: {rec['verdict']}")
    return "\n".join(lines)
