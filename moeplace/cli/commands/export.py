"""``place export PLACEMENT --format F --out PATH [--flags --tp T --dp D | --plan plan.json]``: write a
placement as a file a serving engine loads (SGLang, vLLM PRs #49572 / #41141, vllm-ascend, TensorRT-LLM)
and print the launch command that realizes the attention layout. With ``--flags`` the memory plan is run on
that layout first; a layout that does not fit is refused (exit 2) before anything is written."""
from __future__ import annotations

import json
import sys
from pathlib import Path, PurePosixPath

from moeplace.cli import flags
from moeplace.cli.commands import add_force
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import OutputKind, Outputs, write_text_atomic
from moeplace.foundation.model import load_model
from moeplace.placement.export import deploy, export_placement, format_names, get_format
from moeplace.placement.export.engines import VLLM_PRS, checked_versions
from moeplace.placement.export.flags import FlagOptions, build_launch, launch_spec, rule_mismatch
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
    g.add_argument("--engine-version", default=None, metavar="V",
                   help="vLLM / SGLang release the command is for: only options its own parser accepts are "
                        f"printed (checked: vLLM {', '.join(checked_versions('vllm'))}, SGLang "
                        f"{', '.join(checked_versions('sglang'))}; default the newest)")
    g.add_argument("--vllm-pr", default=None, choices=[str(n) for n in sorted(VLLM_PRS)],
                   help="print the --eplb-config keys of this open vLLM PR, which loads the file (49572: "
                        "vllm-expert-map, 41141: vllm-jsonl); released vLLM rejects them, so without this flag "
                        "the vLLM command runs vLLM's own online EPLB")
    g.add_argument("--vllm-static", default=None, choices=["linear", "round_robin"],
                   help="vLLM without EPLB: --expert-placement-strategy linear|round_robin (no replicas)")
    g.add_argument("--target", default=None, choices=deploy.TARGETS,
                   help="also write the launch as a file: a shell script, a Slurm batch script or a Kubernetes "
                        "LeaderWorkerSet manifest (SGLang and vLLM formats)")
    g.add_argument("--launch-out", default=None, metavar="PATH",
                   help="where --target writes (default: --out with .launch.sh / .sbatch / .lws.yaml)")
    g.add_argument("--image", default=None,
                   help="container image for --target k8s (default: the engine's published image of the version)")
    p.add_argument("--json", action="store_true",
                   help="print what was written, the warnings and the launch arguments as JSON")
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
    launch_choices = (args.tp or args.dp or args.plan or args.target or args.launch_out or args.engine_version
                      or args.vllm_pr or args.vllm_static or args.image)
    if not args.flags and launch_choices:
        raise InputError("--tp/--dp/--plan/--engine-version/--vllm-pr/--vllm-static/--target/--launch-out/--image "
                         "choose the launch: add --flags")
    if (args.launch_out or args.image) and not args.target:
        raise InputError("--launch-out/--image go with --target shell|slurm|k8s")
    if args.image and args.target != "k8s":
        raise InputError("--image is for --target k8s")
    opts = plan = launch = target_launch = None
    launch_out = None
    extra: dict = {}
    if args.flags:
        opts = FlagOptions(model_path=args.model_path, kv_cache_dtype=args.kv_cache_dtype,
                           max_model_len=args.max_model_len, gpu=args.gpu, online_eplb=args.online_eplb,
                           eplb_window=args.eplb_window, eplb_interval=args.eplb_interval, tp=args.tp, dp=args.dp,
                           moe_backend=args.moe_backend, engine_version=args.engine_version,
                           vllm_pr=int(args.vllm_pr) if args.vllm_pr else None,
                           vllm_static=args.vllm_static, placement_path=args.placement)
        # the plan runs before the file is written: a refused layout leaves nothing behind
        built = build_launch(placement, model, args.format, args.out, opts, args.plan)
        opts, plan, extra, launch = built.opts, built.plan, built.extra, built.launch
        if args.target:
            target_launch = launch
            if args.target == "k8s":  # the command loads the file where the ConfigMap is mounted
                target_launch = launch_spec(placement, model, args.format,
                                            PurePosixPath(deploy.MOUNT_DIR) / Path(args.out).name, opts)
            deploy.render(args.target, target_launch, "check", name="x", file_name=Path(args.out).name,
                          file_bytes=b"", image=args.image)  # refuses an engine/target mismatch before writing
            launch_out = args.launch_out or str(Path(args.out).with_suffix("")) + deploy.default_suffix(args.target)
            outs.add(launch_out, OutputKind(f"{args.target} launch file", False, deploy.is_launch_file),
                     flag="--launch-out")
    loads = read_loads(args.loads, args.window_tokens) if args.loads else None
    warnings = None

    def write():
        nonlocal warnings
        warnings = export_placement(placement, model, args.format, args.out, loads=loads, **extra)
        mismatch = rule_mismatch(placement, args.format)
        if mismatch:
            warnings = [mismatch, *warnings]

    f = get_format(args.format)
    memory = None
    if args.flags:
        memory = built.memory_line()
    wrote = []
    if outs.write(args.out, write):
        wrote.append(args.out)
        if launch_out is not None:
            text = deploy.render(args.target, target_launch, memory, name=f"moeplace-{model.name}",
                                 file_name=Path(args.out).name, file_bytes=Path(args.out).read_bytes(),
                                 image=args.image)

            def write_launch():
                write_text_atomic(launch_out, text)
                if args.target != "k8s":
                    Path(launch_out).chmod(0o755)

            if outs.write(launch_out, write_launch):
                wrote.append(launch_out)
    if args.json:
        doc = {"wrote": wrote, "format": args.format, "engine": f.engine, "model": model.name,
               "layers": placement.num_layers, "slots": placement.num_slots, "redundant": placement.num_redundant,
               "gpus": placement.num_gpus, "warnings": warnings or []}
        if args.flags:
            doc["memory_plan"] = {"fits": True, "layout": plan.layout.describe(), "gpu": plan.cluster.gpu.name,
                                  "concurrency": plan.concurrency, "context": plan.context}
            doc["launch"] = {"engine": launch.engine, "engine_version": launch.version, "nodes": launch.nodes,
                             "gpus_per_node": launch.gpus_per_node, "env": launch.env,
                             "applies_placement": launch.applies_placement, "argv": launch.argv(),
                             "worker_argv": launch.argv(worker=True) if launch.worker_extra else None,
                             "notes": [n.lstrip("# ") for n in launch.notes], "command": launch.text()}
            if launch_out is not None:
                doc["launch_file"] = {"target": args.target, "path": launch_out}
        print(json.dumps(doc, indent=1))
        outs.finish()
        return 0
    outs.finish()
    for w in warnings:
        print(f"place: warning: {w}", file=sys.stderr)
    print(f"wrote {args.out} ({args.format}, {f.engine}): {model.name}, {placement.num_layers} MoE layers, "
          f"{placement.num_slots} slots ({placement.num_redundant} redundant) on {placement.num_gpus} GPUs")
    if args.flags:
        print(memory)
        print(launch.text(), end="")
        if launch_out is not None:
            where = {"shell": "run it on each node with NODE_RANK and MASTER_ADDR set",
                     "slurm": "submit it with sbatch", "k8s": "apply it with kubectl apply -f"}[args.target]
            print(f"wrote {launch_out} ({args.target}, {launch.nodes} node(s)): {where}")
    return 0
