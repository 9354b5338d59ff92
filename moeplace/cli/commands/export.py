"""``place export PLACEMENT --format F --out PATH [--flags --tp T --dp D | --plan plan.json]``: write a
placement as a file a serving engine loads (SGLang, vLLM PRs #49572 / #41141, vllm-ascend, TensorRT-LLM)
and print the launch command that realizes the attention layout. With ``--flags`` the memory plan is run on
that layout first; a layout that does not fit is refused (exit 2) before anything is written."""
from __future__ import annotations

import sys
from pathlib import Path

from moeplace.cli import flags
from moeplace.cli.commands import add_force
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import OutputKind, Outputs
from moeplace.foundation.model import load_model
from moeplace.placement.export import export_placement, format_names, get_format
from moeplace.placement.export.flags import (
    ENGINE_OF_FORMAT,
    FlagOptions,
    check_layout,
    launch_command,
    trtllm_options,
)
from moeplace.placement.record import check_compatible, load_placement
from moeplace.traces.loads import Loads, is_loads_file, load_loads
from moeplace.traces.stats import trace_loads


def register(sub) -> None:
    p = sub.add_parser("export", help="write a placement as a file SGLang / vLLM / vllm-ascend / TensorRT-LLM loads",
                       description=__doc__)
    p.add_argument("placement", help="placement JSON (written by `place optimize` / `place import-placement`)")
    p.add_argument("--format", required=True, choices=format_names(), help="engine file format")
    p.add_argument("--out", required=True,
                   help="output file (suffix as the engine requires: .json, .pt, .jsonl, .yaml)")
    p.add_argument("--model", default=None,
                   help="model preset or config.json (default: the model named in the placement)")
    p.add_argument("--loads", default=None,
                   help="expert loads: a Loads .npz or a trace (needed by sglang-logical-count; vllm-jsonl "
                        "adds eplb_load_stats records from it)")
    p.add_argument("--window-tokens", type=flags.positive_int, default=65536,
                   help="tokens per window when --loads is a trace")
    p.add_argument("--flags", action="store_true",
                   help="print the launch command (checked against the memory plan) that goes with the file")
    add_force(p)
    g = p.add_argument_group("launch flags (with --flags)")
    g.add_argument("--tp", type=flags.positive_int, default=None,
                   help="attention tensor-parallel size per DP rank (default: GPUs / --dp, or the plan's default)")
    g.add_argument("--dp", type=flags.positive_int, default=None, help="attention data-parallel ranks (default: GPUs / --tp)")
    g.add_argument("--plan", default=None, metavar="PLAN_JSON",
                   help="take the layout (and GPU kind, KV dtype, context) from a `place plan --report` file")
    g.add_argument("--model-path", default=None, help="checkpoint path or HF id in the command")
    g.add_argument("--kv-cache-dtype", default="fp8", choices=["fp8", "bf16"])
    g.add_argument("--max-model-len", type=flags.positive_int, default=None, help="default: the model's max context")
    g.add_argument("--gpu", default=None, help="GPU kind (default: from the placement's cluster, else h200)")
    g.add_argument("--online-eplb", action="store_true",
                   help="keep the engine's online EPLB on (workloads drift; costs rearrangement time)")
    g.add_argument("--eplb-window", type=flags.positive_int, default=1000, help="EPLB load window in steps (vLLM window_size)")
    g.add_argument("--eplb-interval", type=flags.positive_int, default=3000,
                   help="steps between online rebalances (vLLM step_interval, SGLang "
                        "--eplb-rebalance-num-iterations)")
    g.add_argument("--moe-backend", default="WIDEEP",
                   help="TensorRT-LLM moe_config.backend (WIDEEP, CUTLASS, TRTLLM, ...; default WIDEEP)")
    p.set_defaults(func=run)


def read_loads(path: str, window_tokens: int) -> Loads:
    """A Loads ``.npz`` as is, or a trace reduced to loads by ``traces.stats.trace_loads``."""
    if is_loads_file(path):
        return load_loads(path)
    if not Path(path).exists():
        raise InputError(f"{path}: no such loads file or trace")
    return trace_loads(path, window_tokens)


def engine_file_kind(fmt: str, model, num_gpus: int, gpus_per_node: int) -> OutputKind:
    """An engine file of ``fmt`` is recognised as ours to replace when ``fmt``'s own reader accepts it
    for this model and cluster (the engine formats carry no moeplace marker)."""
    f = get_format(fmt)

    def recognise(path: Path) -> bool:
        if f.kind == "loads":
            f.read(path, model)
        else:
            f.read(path, model, num_gpus, gpus_per_node)
        return True

    return OutputKind(f"{fmt} file", False, recognise)


def run(args) -> int:
    placement = load_placement(args.placement)
    model = load_model(args.model or placement.model_name)
    check_compatible(placement, model, what=args.placement)
    outs = Outputs(inputs=[args.placement, args.loads, args.model, args.plan], force=args.force)
    outs.add(args.out, engine_file_kind(args.format, model, placement.num_gpus, placement.gpus_per_node))
    if not args.flags and (args.tp or args.dp or args.plan):
        raise InputError("--tp/--dp/--plan choose the launch layout: add --flags")
    opts = plan = command = None
    extra: dict = {}
    if args.flags:
        opts = FlagOptions(model_path=args.model_path, kv_cache_dtype=args.kv_cache_dtype,
                           max_model_len=args.max_model_len, gpu=args.gpu, online_eplb=args.online_eplb,
                           eplb_window=args.eplb_window, eplb_interval=args.eplb_interval, tp=args.tp, dp=args.dp,
                           moe_backend=args.moe_backend)
        # the plan runs before the file is written: a refused layout leaves nothing behind
        opts, plan = check_layout(placement, model, opts, args.plan)
        if ENGINE_OF_FORMAT[args.format] == "trtllm":
            layout_keys = trtllm_options(placement, opts)  # refuses a layout TensorRT-LLM cannot express
            extra = layout_keys if args.format == "trtllm" else {}
        command = launch_command(placement, model, args.format, args.out, opts)  # its checks too, before writing
    loads = read_loads(args.loads, args.window_tokens) if args.loads else None
    warnings = None

    def write():
        nonlocal warnings
        warnings = export_placement(placement, model, args.format, args.out, loads=loads, **extra)

    if not outs.write(args.out, write):
        outs.finish()
    for w in warnings:
        print(f"place: warning: {w}", file=sys.stderr)
    f = get_format(args.format)
    print(f"wrote {args.out} ({args.format}, {f.engine}): {model.name}, {placement.num_layers} MoE layers, "
          f"{placement.num_slots} slots ({placement.num_redundant} redundant) on {placement.num_gpus} GPUs")
    if args.flags:
        print(f"memory plan: {plan.layout.describe()} on {placement.num_gpus} x {plan.cluster.gpu.name} fits; "
              f"{plan.concurrency} sequences of {plan.context:,} tokens")
        print(command, end="")
    return 0
