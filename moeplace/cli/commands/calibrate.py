"""``place calibrate RESULT... --out CAL.json``: calibrate the cost model on a team's own measured serving
points (vLLM ``bench serve``, SGLang ``bench_serving``, AIPerf result files) of one deployment; ``place
simulate | sweep | rebalance --calibration CAL.json`` then price with the calibrated constants and print
the within-deployment interval (sim/calibrate.py says what changes and how)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from moeplace.cli import flags
from moeplace.cli.commands import add_force
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import Outputs
from moeplace.foundation.reading import read_yaml
from moeplace.placement.dispatch import ENGINE_RULES
from moeplace.sim.bench_results import read_results
from moeplace.sim.calibrate import (
    ANCHORED_PATH,
    REFIT,
    SERVING_CALIBRATION,
    deployment_of,
    interval_factors,
    load_anchored,
    within_residuals,
    write_calibration,
)

DEPLOYMENT_FILE = "deployment.yaml"
# from this many members on, the refit's prior widths are the members' own spread (sim.calibrate.
# calibrate_members), not the cross-validation folds' widths in the package's anchored summary
ENSEMBLE_PRIOR_MEMBERS = 32
# flag -> Deployment field (the flags override the YAML's values)
FLAGS = {"model": "model", "gpu": "gpu", "gpus": "gpus", "gpus_per_node": "gpus_per_node", "engine": "engine",
         "attention_tp": "attention_tp", "attention_dp": "attention_dp", "ep": "ep", "expert_dtype": "expert_dtype",
         "weight_dtype": "weight_dtype", "kv_dtype": "kv_dtype", "mtp": "mtp", "max_seqs": "max_seqs",
         "max_batched_tokens": "max_batched_tokens", "kernel_build": "kernel_build", "placement": "placement"}


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="calibrate the cost model on your own benchmark results (vLLM bench "
                       "serve, SGLang bench_serving, AIPerf) of one deployment",
                       description="Reads serving-benchmark result files, prices each run's load on the "
                       "deployment it came from, and refits the cost model's efficiency and overhead terms to "
                       "them (within their bounds, pulled towards the shipped values). Writes CAL.json for "
                       "place simulate / sweep / rebalance --calibration.")
    p.add_argument("results", nargs="+", metavar="RESULT",
                   help="vllm bench serve --save-result JSON, sglang bench_serving --output-file JSONL (one run "
                        "per line) or AIPerf profile_export_aiperf.json; all of one deployment")
    p.add_argument("--out", required=True, metavar="CAL.json", help="calibration file to write")
    p.add_argument("--deployment", default=None, metavar="YAML",
                   help=f"the deployment the results came from (default: {DEPLOYMENT_FILE} beside the first "
                        "result, if there is one); the flags below override its values")
    d = p.add_argument_group("deployment (or in --deployment)")
    d.add_argument("--model", default=None, help="model preset or config.json")
    d.add_argument("--gpu", default=None, help="GPU preset or spec file")
    d.add_argument("--gpus", type=flags.positive_int, default=None, help="GPUs of the deployment")
    d.add_argument("--gpus-per-node", type=flags.positive_int, default=None)
    d.add_argument("--engine", choices=ENGINE_RULES, default=None, help="serving engine (default vllm)")
    d.add_argument("--attention-tp", type=flags.positive_int, default=None, help="GPUs per attention-DP rank")
    d.add_argument("--attention-dp", type=flags.positive_int, default=None, help="attention-DP ranks (checked: "
                   "gpus / attention TP)")
    d.add_argument("--ep", type=flags.positive_int, default=None, help="GPUs the routed experts are spread over "
                   "(default all; fewer: each expert tensor-sharded over gpus / ep)")
    d.add_argument("--expert-dtype", default=None, help="routed experts' precision (e.g. fp8, nvfp4, int4_g32)")
    d.add_argument("--weight-dtype", default=None, help="dense weights' precision")
    d.add_argument("--kv-dtype", choices=("bf16", "fp8"), default=None)
    d.add_argument("--mtp", default=None, metavar="DRAFT:ACCEPT", help="speculative decoding, as place simulate --mtp")
    d.add_argument("--max-seqs", type=flags.positive_int, default=None)
    d.add_argument("--max-batched-tokens", type=flags.positive_int, default=None)
    d.add_argument("--kernel-build", choices=("unfused", "fused"), default=None)
    d.add_argument("--placement", default=None, help="expert placement policy the engine ran (default linear)")
    p.add_argument("--trace", default=None, help="routing trace of the served traffic (default: a synthetic "
                   "stationary trace of the model)")
    p.add_argument("--json", action="store_true", help="print the CAL.json document on stdout")
    add_force(p)
    p.set_defaults(func=run)


def deployment_settings(args) -> tuple[dict, str]:
    """The deployment mapping (YAML beside the results or --deployment, then the flags) and where it came
    from."""
    path = Path(args.deployment) if args.deployment else Path(args.results[0]).parent / DEPLOYMENT_FILE
    raw: dict = {}
    where = "flags"
    if args.deployment or path.is_file():
        raw = read_yaml(path)
        if not isinstance(raw, dict):
            raise InputError(f"{path}: expected a mapping of deployment settings (model, gpu, gpus, ...)")
        where = str(path)
    given = {field: getattr(args, flag) for flag, field in FLAGS.items() if getattr(args, flag) is not None}
    if given and raw:
        where = f"{where} and flags"
    raw.update(given)
    return raw, where


def run(args) -> int:
    raw, where = deployment_settings(args)
    if where == "flags" and not {"model", "gpu", "gpus"} <= set(raw):
        missing = ", ".join(f"--{k}" for k in ("model", "gpu", "gpus") if k not in raw)
        raise InputError(f"the deployment the results came from: give --deployment YAML, a {DEPLOYMENT_FILE} beside "
                         f"{args.results[0]}, or {missing}")
    dep = deployment_of(raw, where)
    points = [p for f in args.results for p in read_results(f)]
    check_speculation(dep, points)
    outs = Outputs(inputs=[*args.results, args.deployment, args.trace], force=args.force)
    outs.add(args.out, SERVING_CALIBRATION)
    anchored = load_anchored()
    from moeplace.sim.point import (  # the simulator and the shipped ensemble: heavy, only when calibrating
        calibrate_points,
        deployment_model,
        shipped_members,
        synthetic_trace,
    )

    members = shipped_members()
    if len(members) >= ENSEMBLE_PRIOR_MEMBERS:  # an ensemble: the refit's prior is the members' own spread
        prior_sd, prior_source = None, (f"the spread of the shipped ensemble's {len(members)} members (standard "
                                        "deviation of each constant's bound-scaled value, at least 0.05)")
    else:
        prior = anchored.get("prior_sd") or {}
        prior_sd = [float(prior.get(n, 0.25)) for n, _, _ in REFIT]
        prior_source = anchored.get("prior_source", "")
    lo, hi = interval_factors(anchored)
    interval = {"coverage": anchored["interval"]["coverage"], "log_lo": lo, "log_hi": hi,
                "measured_coverage": anchored["interval"].get("measured_coverage"),
                "source": anchored["interval"]["source"],
                "residuals_log": anchored["interval"].get("residuals_log")}
    within_residuals(interval, f"{ANCHORED_PATH}: interval")  # the package's summary holds them
    log = (lambda msg: print(msg, file=sys.stderr)) if not args.json else (lambda _m: None)
    log(f"{len(points)} measured point(s) of {dep.describe()}")
    if args.trace:
        from moeplace.sim.workload import load_trace_tokens  # a user trace, only when one is given

        trace = load_trace_tokens(args.trace)
        m = deployment_model(dep)
        got = (trace.model.num_experts, trace.model.top_k, tuple(trace.model.moe_layers))
        if got != (m.num_experts, m.top_k, tuple(m.moe_layers)):
            raise InputError(f"--trace {args.trace}: routing of {trace.model.name} ({got[0]} experts, top-{got[1]}, "
                             f"{len(got[2])} MoE layers), not of the deployment's {m.name} ({m.num_experts} experts, "
                             f"top-{m.top_k}, {len(m.moe_layers)} MoE layers)")
    else:
        log(f"  synthesizing a stationary {dep.model} routing trace ...")
        trace = synthetic_trace(deployment_model(dep))
    doc = calibrate_points(dep, points, trace, members=members, prior_sd=prior_sd, interval=interval,
                           prior_source=prior_source, log=log)
    outs.write(args.out, lambda: write_calibration(args.out, doc))
    if args.json:
        print(json.dumps(doc, indent=1, default=float))
    else:
        print(report(doc, args.out))
    outs.finish()
    return 0


def check_speculation(dep, points) -> None:
    """A run that reports a speculative-decoding acceptance length came from a deployment with speculative
    decoding: the deployment must say so (``mtp``), and its tokens per step should be the run's."""
    from moeplace.sim.point import engine_config  # the engine of the deployment, as the pricer builds it

    per_step = engine_config(dep).mtp_tokens_per_step()
    for p in points:
        field = "spec_decode_acceptance_length" if p.tool.startswith("vllm") else "accept_length"
        if p.accept_length is None or p.accept_length <= 1.0:
            continue
        if not dep.mtp:
            raise InputError(f"{p.source}: field '{field}' is {p.accept_length:.2f}: the run used speculative "
                             "decoding; give the deployment's mtp (DRAFT:ACCEPT, as place simulate --mtp)")
        if abs(per_step / p.accept_length - 1) > 0.1:
            print(f"place: warning: {p.source}: field '{field}' is {p.accept_length:.2f} tokens per step; the "
                  f"deployment's mtp {dep.mtp} gives {per_step:.2f}", file=sys.stderr)


def _pct(sim, meas) -> str:
    return f"{sim / meas - 1:+6.1%}" if sim and meas else "   n/a"


def priced_by(doc: dict) -> str:
    """The name of the calibrated member a run's event simulation runs on (sim.calibrate.median_member of
    CAL.json's members; every member re-prices it)."""
    from moeplace.sim.calibrate import Member, median_member  # the ensemble interface
    from moeplace.sim.config import CostConfig  # the members' constants

    return median_member([Member(CostConfig(**m["constants"]), float(m["weight"]), m["name"])
                          for m in doc["members"]]).name


def report(doc: dict, out: str) -> str:
    lines = [f"calibrated on {len(doc['points'])} measured point(s) of {doc['deployment_text']}",
             ("  before: as place simulate prints it uncalibrated (the shipped ensemble's median); after: as a "
              "run with this calibration prints it (the calibrated members' median)"),
             f"  {'point':48s} {'measured':>10s} {'before':>8s} {'after':>8s}   TPOT ms measured / before / after"]
    for r in doc["points"]:
        m, b, a = r["measured"], r["before"], r["after"]
        tp = (f"{m['tpot_s'] * 1e3:6.2f} / {(b['tpot_s'] or 0) * 1e3:6.2f} / {(a['tpot_s'] or 0) * 1e3:6.2f}"
              if m.get("tpot_s") else "n/a")
        lines.append(f"  {r['source'][-48:]:48s} {m['output_tok_s']:10,.1f} {_pct(b['output_tok_s'], m['output_tok_s'])} "
                     f"{_pct(a['output_tok_s'], m['output_tok_s'])}   {tp}")
    ch = doc["changes"]
    fits = ch["refit_detail"]
    priced = priced_by(doc)
    moved = next((f["moved"] for f in fits if f["member"] == priced), fits[0]["moved"] if fits else {})
    if len(doc["base_members"]) > 1:
        rw = ch["reweight"]
        lines.append(f"reweighted the {rw['members']} shipped members by the measured figures (effective sample size "
                     f"{rw['ess']:.1f}" + ("; the reweighting collapsed to about one member" if rw["ess"] < 1.5 else "")
                     + (f"); refitted the one that keeps weight ({priced}): a run is priced by it alone"
                        if len(fits) == 1 else
                        f"); refitted the {len(fits)} that keep weight: a run is priced by all {len(fits)}, their "
                        f"weighted median (one event simulation on {priced}, their weighted median member, re-priced "
                        f"by every one of them)") + ".")
    lines.append(f"what changed in {priced} ({ch['what']}; only {', '.join(ch['refit'])} may move, within their "
                 f"bounds, pulled towards the shipped values):")
    for n, v in moved.items():
        lines.append(f"  {n:22s} {v['from']:.4g} -> {v['to']:.4g}" + ("  (at its bound)" if v["bound"] else ""))
    if not moved:
        lines.append("  nothing: the shipped constants already explain the points")
    iv = doc["interval"]
    if iv:
        lines.append(f"interval of calibrated figures: nominal {iv['coverage']:.0%}, the calibrated members' spread plus "
                     f"the within-deployment error ({iv['source']})")
    lines.append(f"wrote {out}")
    return "\n".join(lines)
