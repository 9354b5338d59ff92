"""``place trace synth``: write a synthetic K3-shaped routing trace (traces/synth/)."""
from __future__ import annotations

import dataclasses
import json
import sys

from moeplace.cli import flags
from moeplace.cli.commands import add_force, add_model, add_progress
from moeplace.foundation.files import Outputs
from moeplace.foundation.formats import tagged
from moeplace.foundation.model import load_model
from moeplace.traces.format import TRACE_DIRECTORY
from moeplace.traces.synth import SynthConfig, synthesize
from moeplace.traces.synth.config import DEFAULT_DRIFT_PHASES, check_resources

GROUP = "trace"

_DEFAULTS = SynthConfig()


def register(sub) -> None:
    p = sub.add_parser(
        "synth", help="write a synthetic routing trace shaped like a real router",
        description="Synthesizes a routing trace with per-layer popularity skew (growing with depth), workload "
                    "domains with their own hot experts and a drifting mix, inter-layer affinity, token-identity "
                    "and temporal-locality structure, and a request/engine-loop structure (prefill + decode, "
                    "long-context tail). --skew, --cv, --domain-correlation and --locality are targets: the "
                    "generator solves its internal parameters so that the trace's realized statistics match them "
                    "(see `place trace stats`); --affinity, --token-effect and --theme are the probabilities "
                    "that a slot follows those sources. Deterministic per --seed.")
    d = _DEFAULTS
    add_model(p)
    p.add_argument("--tokens", type=flags.positive_int, default=d.num_tokens, help=f"tokens in the trace (default {d.num_tokens})")
    p.add_argument("--out", required=True, help="output trace directory (written atomically; an existing one only "
                   "replaced with --force, and only when it is a moeplace trace)")
    add_force(p)
    add_progress(p)
    p.add_argument("--seed", type=flags.seed, default=d.seed)
    p.add_argument("--workers", type=flags.positive_int, default=None,
                   help="sampling processes, each drawing a range of the MoE layers (default: one per core); "
                        "the trace is the same bytes whatever the number")
    g = p.add_argument_group("routing statistics (targets)")
    g.add_argument("--skew", type=flags.float_range(1.0), default=d.skew,
                   help=f"median over layers of the trace's per-layer max/mean expert load (default {d.skew}; "
                        "Mixtral-like flat: 1.2 with --cv none --skew-depth-ratio 1)")
    g.add_argument("--skew-depth-ratio", type=flags.positive_float, default=d.skew_depth_ratio,
                   help=f"skew of the last MoE layer / the first (default {d.skew_depth_ratio})")
    g.add_argument("--cv", type=flags.optional(flags.positive_float, "none", "off"), default=d.cv,
                   help=f"median per-layer std/mean of expert load, or 'none' for a plain lognormal (default {d.cv})")
    g.add_argument("--domains", type=flags.int_range(1, 64), default=d.num_domains, help=f"workload domains (default {d.num_domains})")
    g.add_argument("--domain-correlation", type=flags.probability, default=d.domain_correlation,
                   help=f"mean correlation of two domains' per-layer loads, 0..1 (default {d.domain_correlation})")
    g.add_argument("--drift", type=flags.probability, default=d.drift,
                   help=f"0: constant even domain mix; 1: each phase a single domain (default {d.drift})")
    g.add_argument("--drift-phases", type=flags.positive_int, default=None,
                   help=f"(default {DEFAULT_DRIFT_PHASES}, or one per token for a trace of fewer tokens)")
    g.add_argument("--affinity", type=flags.float_range(0.0, 1.0, hi_open=True), default=d.affinity,
                   help=f"probability a slot follows its previous-layer expert's successors (default {d.affinity})")
    g.add_argument("--token-effect", type=flags.float_range(0.0, 1.0, hi_open=True), default=d.token_effect,
                   help=f"probability a slot is set by the token id (default {d.token_effect})")
    g.add_argument("--theme", type=flags.float_range(0.0, 1.0, hi_open=True), default=d.theme,
                   help="probability a slot comes from the token's theme, one of --themes equal-load groups of "
                        f"experts (within-layer co-activation; default {d.theme})")
    g.add_argument("--themes", type=flags.int_range(1, 256), default=d.themes,
                   help="theme groups per layer (default: the largest power of two with >= 7 x top-k experts "
                        "per group; 8 for K3)")
    g.add_argument("--locality", type=flags.optional(flags.float_range(0.0, 0.9, hi_open=True), "none", "off"), default=d.locality,
                   help="top-k share of consecutive tokens of a request, or 'none' for no copying "
                        f"(default {d.locality})")
    g = p.add_argument_group("requests")
    g.add_argument("--arrival-rate", type=flags.positive_float, default=d.arrival_rate, help="requests per second")
    g.add_argument("--prompt-median", type=flags.positive_int, default=d.prompt_median)
    g.add_argument("--output-median", type=flags.positive_int, default=d.output_median)
    g.add_argument("--long-fraction", type=flags.probability, default=d.long_fraction,
                   help="share of prompts from the long-context (Pareto, up to the model's context) tail")
    g.add_argument("--max-prefill-tokens", type=flags.positive_int, default=d.max_prefill_tokens,
                   help="represented prompt tokens per request (longer prompts: evenly spaced sample)")
    g.add_argument("--max-decode-tokens", type=flags.positive_int, default=d.max_decode_tokens,
                   help="represented decode tokens per request (the first ones)")
    g.add_argument("--gate-weights", action="store_true", help="also write gate weights")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def config_from_args(args) -> SynthConfig:
    return SynthConfig(
        num_tokens=args.tokens, seed=args.seed, skew=args.skew, skew_depth_ratio=args.skew_depth_ratio,
        cv=args.cv, num_domains=args.domains, domain_correlation=args.domain_correlation, drift=args.drift,
        drift_phases=args.drift_phases, affinity=args.affinity, token_effect=args.token_effect,
        theme=args.theme, themes=args.themes, locality=args.locality, arrival_rate=args.arrival_rate,
        prompt_median=args.prompt_median, output_median=args.output_median, long_fraction=args.long_fraction,
        max_prefill_tokens=args.max_prefill_tokens, max_decode_tokens=args.max_decode_tokens,
        gate_weights=args.gate_weights)


def run(args) -> int:
    outs = Outputs(inputs=[args.model], force=args.force)
    outs.add(args.out, TRACE_DIRECTORY)
    model = load_model(args.model)
    cfg = config_from_args(args)
    check_resources(cfg, model.num_moe_layers, model.top_k, args.out)  # before any work (also in synthesize)
    done = {}
    # the trace is the work: a failed write (disk full) has no results to print, only the reason
    if not outs.write(args.out, lambda: done.update(s=synthesize(model, cfg, args.out, workers=args.workers))):
        outs.finish()
    s = done["s"]
    for note in s["solved"].get("unreached", []):  # a target the generator cannot reach, with what it reached
        print(f"place: warning: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(tagged("synth-summary", {**s, "config": dataclasses.asdict(cfg)}), indent=1))
        return 0
    r = s["solved"]
    print(f"wrote {s['out']}: {s['tokens']:,} tokens, {s['requests']:,} requests, {s['rows']:,} rows, "
          f"{s['selections']:,} selections")
    print(f"  {s['bytes'] / 1e6:.1f} MB on disk = {s['bytes_per_selection']:.2f} B/selection; "
          f"{s['seconds']:.1f} s = {s['selections_per_s'] / 1e6:.1f} M selections/s")
    print(f"  pilot: median layer skew {r['pilot_skew']:.2f}, CV {r['pilot_cv']:.2f} (designed "
          f"{r['design_trace_skew_median']:.2f} / {r['design_trace_cv_median']:.2f}: distinct top-k flattens the "
          f"hottest experts), domain correlation "
          f"{r['design_domain_correlation']:.2f}; copy probability {r['copy_prob']:.3f} "
          f"(pilot locality {r['pilot_locality']:.3f})")
    return 0
