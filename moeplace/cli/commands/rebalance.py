"""``place rebalance TRACE --gpus 32``: tune each serving engine's own online rebalancer (vLLM's EPLB, SGLang's
EPLB, TensorRT-LLM's load balancer) on the routing of TRACE and print the best settings as launch flags, with
the gain over a static placement and its interval. The work is :func:`moeplace.sim.tune.tune`."""
from __future__ import annotations

import dataclasses
import json
import sys

from moeplace.cli import flags
from moeplace.cli.commands import add_force, add_workload_input
from moeplace.cli.sim_settings import SimSettings, build_sim_config
from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.files import OutputKind, Outputs, register_kind, tagged_artifact, write_text_atomic
from moeplace.foundation.formats import tagged
from moeplace.sim.calibrate import calibration_note, calibration_run, check_applies, load_calibration
from moeplace.sim.inputs import parse_phases, read_workload
from moeplace.sim.online import DEFAULT_BUDGET_S
from moeplace.sim.tune import ENGINE_NAMES, format_tune, tune

REBALANCE_REPORT = register_kind(OutputKind("rebalance report", False, tagged_artifact("rebalance-report")))


def register(sub) -> None:
    p = sub.add_parser("rebalance", help="tune the engines' own online rebalancers on a trace (launch flags)",
                       description="Searches vLLM's --eplb-config, SGLang's EPLB flags and TensorRT-LLM's load "
                                   "balancer on the routing of TRACE, each scored only on routing it has not "
                                   "observed, and prints the best settings as launch flags with the gain over "
                                   "a static placement.")
    add_workload_input(p, "trace", "", "; the first part is observed, the rest scored at the phases' own durations")
    p.add_argument("--gpus", type=flags.positive_int, default=32)
    p.add_argument("--gpu", default="h200", help="GPU preset")
    p.add_argument("--gpus-per-node", type=flags.positive_int, default=None)
    p.add_argument("--engine", action="append", choices=tuple(ENGINE_NAMES), default=None,
                   help="engine to tune (repeatable; default all three)")
    p.add_argument("--attention-tp", type=flags.positive_int, default=8)
    p.add_argument("--concurrency", type=flags.positive_int, default=256)
    p.add_argument("--context-mix", default=None, help="prompt lengths, e.g. 2k:0.9,16k:0.1 (default: the trace's)")
    p.add_argument("--output-len", type=flags.positive_int, default=512)
    p.add_argument("--splits", type=flags.positive_int, default=1,
                   help="parts each candidate observes and is then scored after (default 1: observe the first "
                        "half, score the second)")
    p.add_argument("--budget", type=flags.seconds, default=DEFAULT_BUDGET_S,
                   help="wall seconds the search may take (default %(default)g): every candidate is simulated for "
                        "5 of its rebalance intervals after warm-up, and a search that would take longer is refused "
                        "with what to change")
    p.add_argument("--max-trace-tokens", type=flags.positive_int, default=100_000)
    p.add_argument("--quick", action="store_true", help="each engine's defaults and one alternative only")
    p.add_argument("--what-if", action="store_true",
                   help="also simulate an engine whose rebalancer does not serve this model in its checked release "
                        "(`place engines`), as it would behave once it does; labelled what-if in every output")
    p.add_argument("--seed", type=flags.seed, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--calibration", default=None, metavar="CAL.json",
                   help="price the candidates with the constants place calibrate fitted on your measured points of "
                        "this model and GPU (the tok/s figures; the gains are ratios either way)")
    p.add_argument("--report", default=None, metavar="FILE", help="also write the result as JSON")
    add_force(p)
    p.set_defaults(func=run)


def run(args) -> int:
    phases = parse_phases(args.phases) if args.phases else ()
    outs = Outputs(inputs=[args.trace, *(ph.source for ph in phases), args.calibration], force=args.force)
    outs.add(args.report, REBALANCE_REPORT, "--report")
    cluster = make_cluster(args.gpus, args.gpu, args.gpus_per_node)
    wl = read_workload(args.trace, phases, args.max_trace_tokens, args.seed)
    settings = SimSettings(attention_tp=args.attention_tp, concurrency=args.concurrency, context_mix=args.context_mix,
                           output_len=args.output_len, seed=args.seed)
    config = build_sim_config(settings, wl.trace.model.max_context)
    cal = load_calibration(args.calibration) if args.calibration else None
    if cal is not None:
        check_applies(cal, wl.trace.model.name, cluster.gpu.name)
        config = dataclasses.replace(config, cost=cal.cost)
    engines = args.engine or list(ENGINE_NAMES)
    progress = (lambda s: print(f"  {s}", file=sys.stderr, flush=True)) if sys.stderr.isatty() else None
    res = tune(wl, cluster, config, None, engines, args.splits, args.quick, progress, args.budget,
               what_if=args.what_if)
    note = wl.trace.layers_note
    res = tagged("rebalance-report", {"trace": args.trace or f"--phases {args.phases}", **res,
                                      **({"layers": note} if note else {}),
                                      **({"calibration": calibration_run(cal, cluster.num_gpus, args.attention_tp,
                                                                         cal.deployment.engine, priced="event")} if cal else {})})
    if args.report:
        outs.write(args.report, lambda: write_text_atomic(args.report, json.dumps(res, indent=1) + "\n"))
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        hz = res["horizon"]
        if hz is not None:
            print(f"online rebalancers for {wl.trace.model.name} on {cluster.name} ({cluster.num_gpus} GPUs), "
                  f"{args.concurrency} concurrent requests; {res['routing']}; each candidate observes one part and "
                  f"is scored on the next ({args.splits} split(s)), stat mode, {hz['text']}; decision time "
                  "measured, weight transfer charged:")
        if note:
            print(f"note: {note}")
        if cal is not None:
            print(f"tok/s: {calibration_note(res['calibration'])}")
        for line in format_tune(res):
            print(line)
        if hz is not None:
            print(f"(interval: {res['interval']})")
    outs.finish()
    return 0
