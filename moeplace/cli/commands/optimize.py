"""``place optimize TRACES_OR_LOADS [...] --gpus 32``: plan every placement policy on the first part of
the routing, score it there and on the windows it did not see, print one comparison table and write the
chosen policy's placement. The work is :func:`placement.compare.compare_policies`."""
from __future__ import annotations

import json
import math
import re
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

from moeplace.cli import flags
from moeplace.cli.commands import add_force, add_progress
from moeplace.cli.run_config import add_config, settings_record
from moeplace.foundation import progress
from moeplace.foundation.cluster import gpu_preset_names, make_cluster
from moeplace.foundation.deployment import parse_pools, pools_help
from moeplace.foundation.errors import InputError, MoeplaceError
from moeplace.foundation.files import (
    OutputKind,
    Outputs,
    atomic_path,
    register_kind,
    tagged_artifact,
    write_text_atomic,
)
from moeplace.foundation.formats import tagged
from moeplace.foundation.memory.planner import pool_layout
from moeplace.foundation.model import load_model
from moeplace.placement.compare import compare_policies
from moeplace.placement.dispatch import ENGINES
from moeplace.placement.export import capabilities
from moeplace.placement.phase import DecodePool, compare_phase, format_decode
from moeplace.placement.policies import policy_names
from moeplace.placement.record import PLACEMENT_JSON
from moeplace.placement.relabel import splits_groups
from moeplace.placement.report import format_shift, format_table
from moeplace.placement.windows import DEFAULT_WINDOW_TOKENS, default_redundant, routing_windows
from moeplace.traces.validate import read_trace_meta

COMPARISON_REPORT = register_kind(OutputKind("comparison report", False, tagged_artifact(
    "comparison", "engine", "cluster", "rows", "written")))  # --report, the --json document


def register(sub) -> None:
    p = sub.add_parser("optimize", help="compare placement policies on traces / Loads and write a placement",
                       description="Plans on the first --plan-fraction of the windows, scores on the rest "
                                   "(nothing of the rest, token sample included, is seen by planning); then "
                                   "estimates balancedness under workload shift by leave-one-scenario-out.")
    p.add_argument("inputs", nargs="*", metavar="TRACES_OR_LOADS",
                   help="trace files/directories or Loads .npz files (windows are concatenated)")
    p.add_argument("--group", action="append", default=None, metavar="NAME=PATH[,PATH...]",
                   help="related inputs (e.g. one dataset in two languages) that the shift estimate leaves out "
                        "together; repeatable; paths not among the inputs are added to them, inputs in no "
                        "group are groups of their own. Default: inputs are grouped by the similarity of "
                        "their expert loads (docs/placement.md)")
    p.add_argument("--tag", action="append", default=None, metavar="PATH:KEY=VALUE[,KEY=VALUE]",
                   help="tag an input (e.g. --tag gsm_he.npz:dataset=gsm,lang=he); repeatable; overrides the "
                        "same key in the input's metadata ('tags'); paths not among the inputs are added. The shift "
                        "estimate leaves out each value of each tag in turn and reports per tag ('a new dataset', "
                        "'a new language'); every planning input must carry every key used")
    p.add_argument("--gpus", type=flags.positive_int, default=32, help="GPUs (= EP ranks), default 32")
    p.add_argument("--gpus-per-node", type=flags.positive_int, default=None, help="default: the GPU preset's node size")
    p.add_argument("--gpu", default="h200", help=f"GPU preset ({', '.join(gpu_preset_names())})")
    p.add_argument("--redundant", type=flags.nonneg_int, default=None,
                   help="redundant slots R (E + R must be a multiple of --gpus); default: 0 for a model the "
                        "engines serve only replica-free (place engines: K3 today; a second row shows what "
                        "replicas would add), else the smallest R >= 0 that makes E + R divisible, plus one slot "
                        "per GPU when that is 0")
    p.add_argument("--policy", action="append", default=None,
                   help="policy to run (repeatable; default: all registered). The first one is written "
                        "to --out (default written: moeplace if registered, else eplb)")
    p.add_argument("--engine", choices=ENGINES, default="vllm",
                   help="replica-choice rule to plan and score for")
    p.add_argument("--model", default=None, help="model preset / config overriding the one in the inputs")
    p.add_argument("--plan-fraction", type=flags.fraction, default=0.5,
                   help="share of windows planned on (default 0.5; 1 = plan on all, the shift estimate "
                        "replaces the held-out columns)")
    p.add_argument("--no-shift", action="store_true",
                   help="skip the leave-one-scenario-out shift estimate (one extra plan per scenario and "
                        "policy)")
    p.add_argument("--shift-layers", type=_shift_layers, default=None, metavar="N|all",
                   help="MoE layers the shift estimate plans and scores, a sample drawn by --seed (default: as "
                        "many as keep its work within the main plan's, at least 3; 'all': every layer)")
    p.add_argument("--window-tokens", type=flags.positive_int, default=DEFAULT_WINDOW_TOKENS,
                   help=f"tokens per window when reading traces (default {DEFAULT_WINDOW_TOKENS})")
    p.add_argument("--seed", type=flags.seed, default=0)
    p.add_argument("--time-limit", type=flags.seconds, default=None,
                   help="wall-clock budget of the whole command in seconds (reading, every policy, scoring); "
                        "what it skips is printed and recorded in the placement's provenance")
    p.add_argument("--out", default="placement.json",
                   help="where the chosen placement goes (default placement.json)")
    p.add_argument("--no-out", action="store_true", help="do not write a placement")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument("--save-all", metavar="DIR", default=None,
                   help="also write every policy's placement as DIR/placement-<policy>.json")
    p.add_argument("--report", metavar="FILE", default=None,
                   help="also write the comparison as JSON (what --json prints) to FILE")
    add_force(p)
    add_config(p)
    add_progress(p)
    ph = p.add_argument_group("per-phase traffic (disaggregated pools)")
    ph.add_argument("--phase", choices=("prefill", "decode"), default=None,
                    help="plan on the trace's prompt (prefill) or generated (decode) tokens only; decode also scores "
                         "every policy on held-out decode steps (the slots the busiest GPU reads per step) and adds "
                         "the moeplace-decode policy, which plans on that figure")
    ph.add_argument("--pools", nargs="+", default=None, metavar="ROLE:KEY=V,...|FILE",
                    help=pools_help("--phase takes the GPU count, redundant slots, attention layout and batch of its "
                                    "pool from it"))
    ph.add_argument("--batch", type=flags.positive_int, default=None,
                    help="--phase decode: running sequences per attention-DP rank (default: the decode pool's, else "
                         f"{DEFAULT_DECODE_BATCH})")
    ph.add_argument("--attention-tp", type=flags.positive_int, default=None,
                    help="--phase decode: GPUs per attention-DP rank (default: the decode pool's, else 1: DP over all "
                         "GPUs)")
    ph.add_argument("--max-trace-tokens", type=flags.positive_int, default=100_000,
                    help="--phase: tokens of the phase read from each trace (memory: tokens x MoE layers x top-k x 2 B)")
    g = p.add_argument_group("optimizer options (used by the moeplace policy)")
    g.add_argument("--robust", action="store_true", help="maximize the worst planning window, not the mean")
    g.add_argument("--objective", choices=("balance", "traffic", "balance+traffic"), default="balance")
    g.add_argument("--traffic-weight", type=flags.nonneg_float, default=None)
    g.add_argument("--pareto", action="store_true", help="print the balance-vs-traffic frontier")
    g.add_argument("--from", dest="from_placement", default=None, metavar="CURRENT.json",
                   help="current placement for migration-budget mode")
    g.add_argument("--max-moves", type=flags.nonneg_int, default=None,
                   help="experts moved per layer at most (with --from)")
    g.add_argument("--workers", type=flags.positive_int, default=None, help="parallel worker processes")
    g.add_argument("--keep-groups", action="store_true",
                   help="keep the model's routing groups (DeepSeek-V3 n_group) whole on contiguous blocks of "
                        "slots, with --redundant 0: a placement `place export --format checkpoint` can serve "
                        "exactly under group-limited top-k")
    p.set_defaults(func=run)


def run(args) -> int:
    deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
    if args.window_tokens < 1:
        raise InputError(f"--window-tokens must be >= 1, got {args.window_tokens}")
    if args.phase is None and (args.pools or args.batch or args.attention_tp):
        raise InputError("--pools/--batch/--attention-tp choose the pool a --phase plans for: add --phase prefill|decode")
    names = args.policy or policy_names(args.phase)
    groups = parse_groups(args.group or [])
    tags = parse_tags(args.tag or [])
    for path in [*(q for paths in groups.values() for q in paths), *tags]:
        if not any(_same(path, x) for x in args.inputs):
            args.inputs.append(path)
    if not args.inputs:
        raise InputError("no traces or Loads files given (positional TRACES_OR_LOADS or --group NAME=PATH)")
    outs = Outputs(inputs=[*args.inputs, args.from_placement, args.model], force=args.force)
    if not args.no_out:
        outs.add(args.out, PLACEMENT_JSON)
    outs.add(args.report, COMPARISON_REPORT, "--report")
    for name in dict.fromkeys(names) if args.save_all else ():
        outs.add(Path(args.save_all) / f"placement-{name}.json", PLACEMENT_JSON, "--save-all")
    model = load_model(args.model) if args.model else None
    if args.phase:
        return run_phase(args, names, model, outs, deadline, tags)
    loads = routing_windows(args.inputs, model=model, window_tokens=args.window_tokens, tags=tags)
    if groups:
        loads.provenance["input_groups"] = [next((g for g, paths in groups.items() if any(_same(x, q) for q in paths)),
                                                 Path(x).name) for x in args.inputs]
    cluster = make_cluster(args.gpus, args.gpu, args.gpus_per_node)
    E = loads.model.num_experts
    R, replica_row = planned_redundant(loads.model, cluster.num_gpus, args.redundant)
    if R < 0:
        raise InputError(f"--redundant must be >= 0, got {R}")
    if (E + R) % cluster.num_gpus:
        raise InputError(f"--redundant {R}: {E} experts + {R} = {E + R} slots is not a multiple of --gpus "
                         f"{cluster.num_gpus}; use e.g. --redundant {default_redundant(E, cluster.num_gpus)}")
    keep = None
    if args.keep_groups:
        m = loads.model
        if m.n_group <= 1 or m.topk_group >= m.n_group:
            raise InputError(f"--keep-groups: model '{m.name}' routes without group limits (n_group {m.n_group}, "
                             f"topk_group {m.topk_group}); every replica-free placement relabels exactly")
        if R:
            raise InputError(f"--keep-groups plans a replica-free placement: add --redundant 0 (not {R})")
        keep = m.n_group
    options = {"keep_groups": keep, "robust": args.robust, "objective": args.objective,
               "traffic_weight": args.traffic_weight, "pareto": args.pareto, "from": args.from_placement, "max_moves": args.max_moves,
               "workers": args.workers}
    cmp = compare_policies(loads, cluster, num_redundant=R, policies=names, rule=args.engine,
                           plan_fraction=args.plan_fraction, seed=args.seed, deadline=deadline,
                           options=options, shift=not args.no_shift, shift_sample=args.shift_layers or "auto",
                           announce=_announce)
    chosen = args.policy[0] if args.policy else ("moeplace" if "moeplace" in names else "eplb")
    if replica_row and any(r.policy == chosen for r in cmp.results):
        cmp = with_replica_row(cmp, loads, cluster, chosen, replica_row, args, options, deadline)
    result = next((r for r in cmp.results if r.policy == chosen), None)
    if result is None:  # the limit left out the policy to write: say so instead of writing another
        print(format_table(cmp), file=sys.stderr)
        raise MoeplaceError(f"--time-limit {args.time_limit:g}: policy '{chosen}' did not finish, nothing written "
                            "(raise --time-limit or choose another --policy)")
    wrote = _write(args, outs, cmp, result, chosen)
    if not args.json:
        print(format_table(cmp))
        for line in format_shift(cmp, chosen):
            print(line)
        if result.shift:
            # the file the line talks about: --out, else --save-all's copy, else none (said so)
            saved = Path(args.save_all) / f"placement-{chosen}.json" if args.save_all else None
            where = args.out if wrote else (str(saved) if saved is not None and saved.exists() else None)
            # the commands' defaults are 32 GPUs and attention TP 8: the advice names the cluster planned for
            tp = math.gcd(8, cluster.num_gpus)
            on = (f"--gpus {cluster.num_gpus} --gpus-per-node {cluster.gpus_per_node} --gpu {shlex.quote(args.gpu)}"
                  + (f" --attention-tp {tp}" if tp != 8 else ""))
            print(shift_advice(result, where, args.inputs, on))
        _print_moeplace_extras(cmp, keep)
        if keep:
            for line in keep_groups_lines(cmp, keep):
                print(line)
        if R:  # the one plan every engine can serve today, as a relabelled checkpoint (docs/export.md)
            print(f"replica-free: these plans use {R} redundant slots per layer, which an engine must load as a "
                  "placement; for a relabelled checkpoint any engine serves (place export --format checkpoint) "
                  "plan with --redundant 0" + (" --keep-groups" if loads.model.n_group > 1
                                                and loads.model.topk_group < loads.model.n_group else ""))
        if wrote:
            print(f"wrote {args.out} (policy {chosen})")
        # how each engine serves what was written: one line per engine (place engines --reasons: the reasons)
        for line in capabilities.serving_lines(loads.model, R, result.placement):
            print(line)
    outs.finish()
    return 0


DEFAULT_DECODE_BATCH = 64  # running sequences per DP rank when neither --batch nor a decode pool says


def run_phase(args, names: list[str], model, outs: Outputs, deadline: float | None,
              tags: dict[str, dict[str, str]] | None = None) -> int:
    """``--phase``: plan on one phase's tokens (:func:`placement.phase.compare_phase`), print the table and,
    for decode, every policy's decode figure; write the chosen placement."""
    if args.group or args.from_placement or args.keep_groups:
        raise InputError("--group/--from/--keep-groups are not taken with --phase")
    read_model = model or read_trace_meta(args.inputs[0])[0]
    gpus, gpu, redundant, batch, tp = args.gpus, args.gpu, args.redundant, args.batch, args.attention_tp
    dp = None
    if args.pools:
        dep = parse_pools(args.pools)
        pool = dep.pool(args.phase)
        if pool.moe_tp_size > 1:
            raise InputError(f"--pools {pool.role}: ep {pool.ep_size} < gpus {pool.gpus} (MoE TP {pool.moe_tp_size}): "
                             "placements here spread experts over EP ranks of one GPU each; plan with ep = gpus")
        lay = pool_layout(read_model, pool)
        gpus, gpu = pool.gpus, dep.gpu_kind(args.gpu)
        redundant = pool.redundant if redundant is None else redundant
        batch = batch or pool.max_seqs
        tp, dp = tp or lay.tp, lay.dp if tp is None else pool.gpus // tp
    cluster = make_cluster(gpus, gpu, args.gpus_per_node)
    E = read_model.num_experts
    R = planned_redundant(read_model, cluster.num_gpus, redundant)[0]  # replica-free where engines serve only that
    if (E + R) % cluster.num_gpus:
        raise InputError(f"--redundant {R}: {E} experts + {R} = {E + R} slots is not a multiple of {cluster.num_gpus} "
                         f"GPUs; use e.g. --redundant {default_redundant(E, cluster.num_gpus)}")
    tp = tp or 1
    if cluster.num_gpus % tp:
        raise InputError(f"--attention-tp {tp} does not divide the {cluster.num_gpus} GPUs")
    pool_d = DecodePool(dp or cluster.num_gpus // tp, batch or DEFAULT_DECODE_BATCH, tp) if args.phase == "decode" else None
    options = {"robust": args.robust, "objective": args.objective, "traffic_weight": args.traffic_weight,
               "pareto": args.pareto, "max_moves": args.max_moves, "workers": args.workers}
    pc = compare_phase(args.inputs, args.phase, cluster, num_redundant=R, policies=names, rule=args.engine,
                       plan_fraction=args.plan_fraction, seed=args.seed, options=options, model=model,
                       window_tokens=args.window_tokens, max_tokens=args.max_trace_tokens, pool=pool_d,
                       shift=not args.no_shift, deadline=deadline, shift_sample=args.shift_layers or "auto",
                       tags=tags)
    cmp = pc.comparison
    chosen = args.policy[0] if args.policy else next(
        (n for n in ("moeplace-decode" if args.phase == "decode" else "moeplace", "moeplace", "eplb") if n in names),
        names[0])
    result = next((r for r in cmp.results if r.policy == chosen), None)
    if result is None:
        print(format_table(cmp), file=sys.stderr)
        raise MoeplaceError(f"--time-limit: policy '{chosen}' did not finish, nothing written (raise --time-limit or "
                            "choose another --policy)")
    wrote = _write(args, outs, cmp, result, chosen, pc.to_dict())
    if not args.json:
        print(f"phase {args.phase}: planned on the {args.phase} tokens only"
              + (f"; {pc.note}" if pc.note else ""))
        print(format_table(cmp))
        for line in format_decode(pc):
            print(line)
        for line in format_shift(cmp, chosen):
            print(line)
        _print_moeplace_extras(cmp)
        if wrote:
            print(f"wrote {args.out} (policy {chosen}, {args.phase} pool)")
    outs.finish()
    return 0


def planned_redundant(model, num_gpus: int, given: int | None) -> tuple[int, int]:
    """``(R, replica_row)``: the redundant slots to plan with and, when the default is the replica-free plan
    because the engines serve the model no other way (the capability table; K3 today), the slots of the
    second row that shows what replicas would add (0: no such row)."""
    usual = default_redundant(model.num_experts, num_gpus)
    if given is not None:
        return given, 0
    if model.num_experts % num_gpus == 0 and capabilities.replica_free_only(model):
        return 0, usual
    return usual, 0


def with_replica_row(cmp, loads, cluster, policy: str, slots: int, args, options, deadline):
    """``cmp`` with a second row for ``policy``: the same plan with ``slots`` redundant slots per layer,
    planned and scored on the same windows (what replicas would add; no engine serves it for the model)."""
    if deadline is not None and deadline - time.monotonic() <= 0:
        return replace(cmp, notes=(*cmp.notes, f"{policy} +{slots} replicas: skipped (time limit)"))
    alt = compare_policies(loads, cluster, num_redundant=slots, policies=[policy], rule=args.engine,
                           plan_fraction=args.plan_fraction, seed=args.seed, deadline=deadline,
                           options={**options, "keep_groups": None}, shift=False)
    if not alt.results:
        return replace(cmp, notes=(*cmp.notes, *alt.notes))
    label = f"{policy} +{slots} replicas"
    why = (f"{label}: the same policy with {slots} redundant slots per layer, planned and scored on the same "
           f"windows -- what replicas would add; no engine serves it for {loads.model.name} (serving lines below)")
    return replace(cmp, replica_rows=((label, alt.results[0], slots),), notes=(*cmp.notes, why))


def _write(args, outs: Outputs, cmp, result, chosen: str, extra: dict | None = None) -> bool:
    """Write the chosen placement (``--out``, with the settings ``--config`` reads back), ``--save-all`` and the
    comparison (``--report``; ``--json`` prints it), ``extra`` merged into it; whether ``--out`` was written."""
    settings = settings_record(args, {"inputs": args.inputs})  # what --config reads back
    result.placement.provenance["settings"] = settings
    wrote = not args.no_out and outs.write(args.out, lambda: result.placement.save(args.out))
    if args.save_all:
        _save_all(outs, Path(args.save_all), cmp.results)
    d = tagged("comparison", cmp.to_dict())
    d.update(extra or {})
    d["written"] = {"policy": chosen, "path": args.out} if wrote else None
    d["settings"] = settings
    if args.report:
        outs.write(args.report, lambda: write_text_atomic(args.report, json.dumps(d, indent=1) + "\n"))
    if args.json:
        print(json.dumps(d, indent=1))
    return wrote


def _announce(line: str) -> None:
    """The shift estimate's cost, before it starts: on stderr beside the progress bars, when they are drawn
    (a terminal; the same line heads the estimate in the output and is ``shift_cost`` in ``--json``)."""
    if progress.is_enabled():
        print(f"place optimize: {line}", file=sys.stderr, flush=True)


def _save_all(outs: Outputs, d: Path, results) -> None:
    """``--save-all DIR``: every policy's placement. A new directory appears whole or not at all (its
    files are written into a temporary sibling that is renamed to ``DIR`` when all are there: a full disk
    leaves nothing, not an empty or half-filled directory); into an existing one each file is written
    atomically on its own."""
    if d.is_dir():
        for r in results:
            path = d / f"placement-{r.policy}.json"
            outs.write(path, lambda r=r, path=path: r.placement.save(path))
        return

    def write_dir() -> None:
        with atomic_path(d, directory=True) as tmp:
            for r in results:
                r.placement.save(tmp / f"placement-{r.policy}.json")

    outs.write(d, write_dir)


def parse_groups(specs: list[str]) -> dict[str, list[str]]:
    """``--group NAME=PATH[,PATH...]`` values -> ``{name: [paths]}``; one-line errors for a malformed
    value, a repeated name or a path in two groups."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, rest = spec.partition("=")
        paths = [x for x in rest.split(",") if x]
        if not sep or not name.strip() or not paths:
            raise InputError(f"--group {spec!r}: expected NAME=PATH[,PATH...]")
        if name in out:
            raise InputError(f"--group {name}: given twice (list all its paths in one --group)")
        for q in paths:
            for other, held in out.items():
                if any(_same(q, x) for x in held):
                    raise InputError(f"--group {name}: {q} is already in group {other}")
        out[name] = paths
    return out


TAG_KEY = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")


def parse_tags(specs: list[str]) -> dict[str, dict[str, str]]:
    """``--tag PATH:KEY=VALUE[,KEY=VALUE]`` values -> ``{path: {key: value}}``; one-line errors for a
    malformed value, a bad key, an empty value or a key given twice for one path."""
    out: dict[str, dict[str, str]] = {}
    for spec in specs:
        eq = spec.find("=")
        colon = spec.rfind(":", 0, eq) if eq > 0 else -1
        path, body = (spec[:colon], spec[colon + 1:]) if colon > 0 else ("", "")
        if not path or not body:
            raise InputError(f"--tag {spec!r}: expected PATH:KEY=VALUE[,KEY=VALUE] (e.g. gsm_he.npz:dataset=gsm,lang=he)")
        same = next((q for q in out if _same(q, path)), path)
        mine = out.setdefault(same, {})
        for item in body.split(","):
            key, sep, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not TAG_KEY.match(key) or not value:
                raise InputError(f"--tag {spec!r}: {item!r} is not KEY=VALUE (a key of letters, digits, '_', '.', "
                                 "'-' starting with a letter; a non-empty value)")
            if key in mine:
                raise InputError(f"--tag {spec!r}: {path} has tag '{key}' twice ({mine[key]!r} and {value!r})")
            mine[key] = value
    return out


def _same(a: str, b: str) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def _shift_layers(text: str) -> int | str:
    """``all`` or a whole number >= 1."""
    return "all" if text.lower() == "all" else flags.positive_int(text)


def keep_groups_lines(cmp, n_group: int) -> list[str]:
    """Under ``--keep-groups``: which rows keep the routing groups whole (servable by relabelling) and which are
    the unconstrained baselines they are (the table scores every row as it was planned)."""
    split = [r.policy for r in cmp.results if splits_groups(r.placement, n_group)]
    kept = [r.policy for r in cmp.results if r.policy not in split]
    if not split:
        return [f"--keep-groups: every row keeps the {n_group} routing groups whole"]
    line = (f"--keep-groups: {', '.join(kept) or 'no row'} keep the {n_group} routing groups whole; "
            f"{', '.join(split)} split them -- unconstrained baselines, scored as planned, which no relabelling "
            "serves exactly under group-limited routing")
    return [line]


def _print_moeplace_extras(cmp, keep_groups: int | None = None) -> None:
    """The optimizer's own report (from the placement's provenance): its gap to its proven bound on what
    it optimizes, its in-sample traffic figures and the --pareto frontier."""
    for r in cmp.results:
        summary = r.placement.provenance.get("params", {}).get("summary")
        if r.policy != "moeplace" or not summary:
            continue
        config = r.placement.provenance.get("params", {}).get("config", {})
        what = ("the worst planning window" if config.get("robust")
                else "the sum of the planning windows (not each window)")
        within = (" -- the bound ignores the routing groups, so under --keep-groups the gap includes what keeping "
                  "them costs" if keep_groups else "")
        print(f"moeplace: on {what}, which it optimizes, max/mean is within {summary['max_gap']:.3%} "
              f"(worst layer; mean {summary['mean_gap']:.3%}) of a proven lower bound for any placement "
              f"with this slot budget{within}")
        if "nodes_per_token_after" in summary:
            print(f"moeplace: nodes touched per token of its planning sample (in-sample) "
                  f"{summary['nodes_per_token_before']:.3f} -> {summary['nodes_per_token_after']:.3f}")
        for pt in summary.get("pareto", []):
            print(f"  frontier (in-sample): balancedness floor -{pt['floor_slack']:.2%}: balancedness "
                  f"{pt['balancedness']:.4f}, nodes per token {pt['nodes_per_token']:.3f}")


def shift_advice(result, out: str | None, inputs: list[str], cluster_flags: str = "") -> str:
    """What to do about workload shift, for the chosen placement: its held-out figure against the shift
    estimate of the first grouping (planned with the placement's own settings) and its 80 % range, and the
    commands that check online rebalancing, with ``cluster_flags`` (the flags that make those commands run on
    the cluster planned for). ``out``: where that placement was written (``None``: nowhere, ``--no-out``)."""
    sh = result.shift
    first = next(iter(sh["by_tag"].values()))
    seen = (f"{result.held_out.balancedness:.4f} on the held-out windows of this input but "
            if result.held_out is not None else "")
    mean = f"{sh['mean']:.4f}"
    worst = f"{sh['worst']:.4f}"
    if sh.get("mean_range") is not None:
        mean += f" ({sh.get('coverage', 0.8):.0%} range {sh['mean_range'][0]:.2f}-{sh['mean_range'][1]:.2f})"
    else:
        mean += " (no range: too few groups to leave out)"
    # both commands take a trace or a Loads file; several inputs become phases without seconds: each lasts in
    # proportion to its traffic over the horizon the comparison chooses, as one input's windows do (fixed
    # seconds, an hour each, fixed the horizon too: 734 minutes of simulation for K3, over the default budget)
    workload = shlex.quote(inputs[0]) if len(inputs) == 1 else "--phases " + shlex.quote(",".join(inputs))
    workload += f" {cluster_flags}" if cluster_flags else ""
    which = (f"the {result.policy} placement written to {out}" if out is not None
             else f"the {result.policy} placement (not written: --no-out)")
    placement = shlex.quote(out) if out is not None else "PLACEMENT.json (rerun without --no-out to write it)"
    return (f"what to expect: {which} keeps {seen}about {mean}, worst group {worst}, on {first['what']}. If the "
            "production mix differs, plan on every workload you have (all as inputs, --plan-fraction 1, tagged; "
            f"--robust to hedge) and check online rebalancing: place simulate {workload} --placement {placement} "
            f"--recommend, or tune the engine's own: place rebalance {workload} --quick")
