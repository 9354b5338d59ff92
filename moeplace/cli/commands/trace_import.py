"""``place trace import --format F SRC... --out PATH --model NAME``: engine dumps / routing logs -> a
validated trace directory or a Loads ``.npz``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from moeplace.cli import flags, relabel
from moeplace.cli.commands import add_force, add_json, add_model, add_progress
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import Outputs, remove_path, temp_sibling
from moeplace.foundation.formats import tagged
from moeplace.foundation.model import format_ranges, load_model
from moeplace.traces.format import TRACE_DIRECTORY
from moeplace.traces.importers import FORMATS, import_source
from moeplace.traces.importers.vllm_jsonl import DEFAULT_WARMUP_MIN_RUN, NUMBERINGS
from moeplace.traces.loads import LOADS_FILE
from moeplace.traces.relabel import loads_to_original, trace_to_original

GROUP = "trace"


def register(sub) -> None:
    p = sub.add_parser(
        "import",
        help="import engine dumps (SGLang, vLLM, TensorRT-LLM) and public routing-trace datasets",
        description="sglang: expert-distribution-recorder dumps (.pt/.json); stat mode -> Loads .npz, "
        "per_token mode -> trace directory. vllm-jsonl: per-token routing log (meta + route lines) -> trace "
        "directory. vllm-eplb: eplb_load_stats JSONL records -> Loads .npz. trtllm-stats: an "
        "EXPERT_STATISTIC_PATH directory -> Loads .npz (counts) or a trace directory (raw ids). "
        "vllm-routed-experts: saved responses of a server run with --enable-return-routed-experts (JSON / "
        "JSONL) -> trace directory. flame-moe: a FLAME-MoE traces model or actives/iter_N directory -> trace "
        "directory. moe-selection-json: per-query JSON files (or their directory tree) of the MoE expert "
        "selection trace dataset -> trace directory.",
    )
    p.add_argument("--format", required=True, choices=list(FORMATS), help="input format")
    p.add_argument("srcs", nargs="+", metavar="SRC",
                   help="input files (several: ranks / runs of one model) or a directory (trtllm-stats, flame-moe, "
                        "moe-selection-json)")
    p.add_argument(
        "--out",
        required=True,
        help="output: a .npz for Loads (sglang stat, vllm-eplb, trtllm-stats counts), "
        "a directory for traces (the others; trtllm-stats raw ids); an existing one is replaced only with "
        "--force and only when moeplace wrote it",
    )
    add_force(p)
    add_model(p)
    p.add_argument(
        "--layer-numbering",
        choices=NUMBERINGS,
        default="auto",
        help="vllm-jsonl: 'layer' is the MoE-layer ordinal (moe) or decoder-layer index (decoder); "
        "auto detects it from the values",
    )
    p.add_argument(
        "--warmup-min-run",
        type=flags.nonneg_int,
        default=DEFAULT_WARMUP_MIN_RUN,
        help="vllm-jsonl: drop runs of at least this many identical consecutive rows of one layer "
        f"(engine warm-up); 0 keeps all (default {DEFAULT_WARMUP_MIN_RUN})",
    )
    p.add_argument("--layers", type=flags.layer_list, default=None, metavar="LAYERS",
                   help="vllm-jsonl: the MoE layers the log holds, as decoder-layer indices (e.g. 0,5,11,17,23 or "
                   "0-4); a log of some layers only must declare them (this, or its meta record's layers_logged)")
    p.add_argument("--iteration", type=flags.nonneg_int, default=None,
                   help="flame-moe: training checkpoint (actives/iter_N; default the latest)")
    p.add_argument("--max-tokens", type=flags.positive_int, default=None,
                   help="flame-moe: keep the first N tokens (a capture holds 52M)")
    add_json(p, "what was written (path, kind), the warnings and the import's figures")
    add_progress(p)
    relabel.add_manifest_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    model = load_model(args.model)
    out = Path(args.out)
    options = {}
    if args.format == "vllm-jsonl":
        options = {"layer_numbering": args.layer_numbering, "warmup_min_run": args.warmup_min_run,
                   "layers": args.layers}
        if args.warmup_min_run < 0:
            raise InputError(f"--warmup-min-run must be >= 0, got {args.warmup_min_run}")
    elif args.layers is not None:
        raise InputError("--layers applies to --format vllm-jsonl only (the other formats say which layers they hold)")
    if args.format == "flame-moe":
        options = {"iteration": args.iteration, "max_tokens": args.max_tokens}
    elif args.iteration is not None or args.max_tokens is not None:
        raise InputError("--iteration / --max-tokens apply to --format flame-moe only")
    loads_out = out.suffix == ".npz"
    if args.format == "vllm-eplb" and not loads_out:
        raise InputError(f"--out {out}: vllm-eplb produces Loads; give a path ending in .npz")
    if args.format in ("vllm-jsonl", "vllm-routed-experts", "flame-moe", "moe-selection-json") and loads_out:
        raise InputError(f"--out {out}: {args.format} produces a trace directory, not a .npz")
    outs = Outputs(inputs=[*args.srcs, args.model], force=args.force)
    outs.add(out, LOADS_FILE if loads_out else TRACE_DIRECTORY)
    done = {}
    new2old = relabel.manifest_map(args, model)

    def write():
        if new2old is None:
            done.update(r=import_source(args.format, args.srcs, model, out, **options))
        elif loads_out:  # engine ids -> original ids before anything is saved
            r = import_source(args.format, args.srcs, model, None, **options)
            r.loads = loads_to_original(r.loads, new2old, args.relabel_manifest)
            r.loads.save(out)
            done.update(r=r)
        else:  # the importer's own validated trace, then the same rows with the original ids
            stage = temp_sibling(out, "-engine-ids")
            try:
                r = import_source(args.format, args.srcs, model, stage, **options)
                trace_to_original(stage, out, new2old, model, args.relabel_manifest)
            finally:
                remove_path(stage)
            r.trace = out
            done.update(r=r)

    if not outs.write(out, write):
        outs.finish()
    notes = done["r"].summary.get("notes", [])
    for note in notes:  # data the import left out, said where it is not missed
        print(f"place: warning: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(json_doc(done["r"], out, model.name), indent=1))
    else:
        print(format_summary(done["r"].summary, out, model.name))
    return 0


def json_doc(result, out: Path, model_name: str) -> dict:
    """``--json``: what was written, the warnings and the import's figures (the text summary's fields)."""
    s = {k: v for k, v in result.summary.items() if k != "notes"}
    return tagged("import-summary", {
        "written": [{"path": str(out), "kind": "trace directory" if result.kind == "trace" else "Loads .npz"}],
        "model": model_name, "warnings": list(result.summary.get("notes", [])), "summary": s})


def format_summary(s: dict, out: Path, model_name: str) -> str:
    lines = [
        f"imported {s['format']}{' ' + s['mode'] if 'mode' in s else ''} for model '{model_name}' -> {out}"
    ]
    lines.append(f"  records read           {s['records_read']:,}")
    for key, label in (
        ("meta_records", "meta records"),
        ("other_records_skipped", "other records skipped"),
        ("warmup_rows_dropped", "warm-up rows dropped"),
        ("zero_steps_dropped", "zero steps dropped"),
        ("idle_records_dropped", "idle records dropped"),
        ("incomplete_tokens_dropped", "partial tokens dropped"),
        ("raw_tokens_short_of_counts", "raw short of counts"),
        ("ranks", "ranks"),
        ("mtp_layers_skipped", "MTP records skipped"),
        ("requests", "requests"),
        ("rows_written", "rows written"),
        ("tokens", "tokens"),
        ("windows", "windows"),
        ("selections", "expert selections"),
    ):
        if key in s:
            lines.append(f"  {label:<22} {s[key]:,}")
    if "layer_numbering" in s:
        lines.append(f"  layer numbering        {s['layer_numbering']}")
    cov = s.get("layers_covered", [])
    of = f" of {s['model_moe_layers']}" if s.get("model_moe_layers", len(cov)) != len(cov) else ""
    lines.append(f"  layers covered         {len(cov)}{of}: {format_ranges(cov)}"
                 + (f" (declared by {s['layers_declared_by']})" if of else ""))
    lines.append(f"  throughput             {s['records_per_s']:,.0f} records/s ({s['seconds']:.2f} s)")
    return "\n".join(lines)


