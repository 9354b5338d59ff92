"""``place export PLACEMENT --format F --out PATH [--flags --tp T --dp D | --plan plan.json]``: write a
placement as a file a serving engine loads (SGLang, vLLM PRs #49572 / #41141, vllm-ascend, TensorRT-LLM)
and print the launch command that realizes the attention layout. With ``--flags`` the memory plan is run on
that layout first; a layout that does not fit is refused (exit 2) before anything is written."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path, PurePosixPath

from moeplace.cli import flags
from moeplace.cli import relabel as export_checkpoint
from moeplace.cli.commands import add_force
from moeplace.foundation.deployment import parse_pools, pools_help
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import OutputKind, Outputs, write_text_atomic
from moeplace.foundation.memory.planner import pool_layout
from moeplace.foundation.model import format_ranges, load_model
from moeplace.placement.export import deploy, export_placement, format_names, get_format
from moeplace.placement.export.engines import VLLM_PRS, checked_versions
from moeplace.placement.export.flags import FlagOptions, build_launch, launch_spec, rule_mismatch
from moeplace.placement.record import check_compatible, load_placement
from moeplace.traces.loads import Loads, is_loads_file, load_loads
from moeplace.traces.stats import trace_loads


def register(sub) -> None:
    p = sub.add_parser("export", help="write a placement as a file SGLang / vLLM / vllm-ascend / TensorRT-LLM loads",
                       description=__doc__)
    p.add_argument("placement", nargs="?", default=None,
                   help="placement JSON (written by `place optimize` / `place import-placement`)")
    p.add_argument("--format", default=None, choices=[*format_names(), export_checkpoint.FORMAT],
                   help="engine file format, or checkpoint: a relabelled copy of --model-path (required but "
                        "with --verify)")
    p.add_argument("--out", default=None,
                   help="output file (suffix as the engine requires: .json, .pt, .jsonl, .yaml; a directory for "
                        "--format checkpoint)")
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
    export_checkpoint.add_arguments(p)
    g = p.add_argument_group("launch flags (with --flags)")
    g.add_argument("--tp", type=flags.positive_int, default=None,
                   help="attention tensor-parallel size per DP rank (default: GPUs / --dp, or the plan's default)")
    g.add_argument("--dp", type=flags.positive_int, default=None, help="attention data-parallel ranks (default: GPUs / --tp)")
    g.add_argument("--plan", default=None, metavar="PLAN_JSON",
                   help="take the layout (and GPU kind, KV dtype, context) from a `place plan --report` file")
    g.add_argument("--model-path", default=None, help="checkpoint path or HF id in the command (--format checkpoint: the "
                        "source checkpoint directory)")
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
    k = p.add_argument_group("Kubernetes pods (with --target k8s; docs/export.md#kubernetes)")
    k.add_argument("--image", default=None,
                   help="container image (default: the engine's published image of the version)")
    k.add_argument("--k8s-rdma", default=None, metavar="RESOURCE[=N]|none|auto",
                   help="RDMA resource each pod requests (default auto: rdma/ib=1 when the group has more than one "
                        "pod, none for one)")
    k.add_argument("--k8s-host-network", default=None, action=argparse.BooleanOptionalAction,
                   help="run the pods on the nodes' network (default: on for more than one pod)")
    k.add_argument("--k8s-ipc-lock", default=None, action=argparse.BooleanOptionalAction,
                   help="add the IPC_LOCK capability RDMA needs to pin memory (default: on for more than one pod)")
    k.add_argument("--k8s-shm-size", default=None, metavar="QUANTITY",
                   help="size limit of the in-memory /dev/shm (default: none)")
    k.add_argument("--k8s-weights", default=None, metavar="pvc:CLAIM|host:/PATH|none",
                   help="volume with the model weights (default pvc:model-weights)")
    k.add_argument("--k8s-weights-mount", default=None, metavar="PATH",
                   help="where the weights volume is mounted; HF_HOME is PATH/huggingface (default /models)")
    k.add_argument("--k8s-hf-secret", default=None, metavar="NAME[:KEY]|none",
                   help="Secret holding HF_TOKEN for gated weights (default hf-token:token, optional)")
    p.add_argument("--pools", nargs="+", default=None, metavar="ROLE:KEY=V,...|FILE",
                   help=pools_help("with --flags: one command per pool (PLACEMENT is prefill=FILE,decode=FILE, or "
                                   "one FILE for both; --model-path likewise per pool, e.g. each pool's relabelled "
                                   "checkpoint); the engine files go to --out with .prefill / .decode before the "
                                   "suffix; --target writes one launch file that starts both pools"))
    p.add_argument("--json", action="store_true",
                   help="print what was written, the warnings and the launch arguments as JSON")
    p.set_defaults(func=run)


K8S_FLAGS = ("image", "k8s_rdma", "k8s_host_network", "k8s_ipc_lock", "k8s_shm_size", "k8s_weights",
             "k8s_weights_mount", "k8s_hf_secret")


def k8s_options(args) -> deploy.K8sOptions:
    """The pods' options: the defaults of :class:`deploy.K8sOptions` where a flag is not given."""
    d = deploy.K8sOptions()
    return deploy.K8sOptions(
        rdma=d.rdma if args.k8s_rdma is None else deploy.parse_rdma(args.k8s_rdma),
        host_network=d.host_network if args.k8s_host_network is None else args.k8s_host_network,
        ipc_lock=d.ipc_lock if args.k8s_ipc_lock is None else args.k8s_ipc_lock,
        shm_size=args.k8s_shm_size and deploy.parse_quantity(args.k8s_shm_size, "--k8s-shm-size"),
        weights=d.weights if args.k8s_weights is None else deploy.parse_weights(args.k8s_weights),
        weights_mount=d.weights_mount if args.k8s_weights_mount is None else deploy.parse_mount(args.k8s_weights_mount),
        hf_secret=d.hf_secret if args.k8s_hf_secret is None else deploy.parse_secret(args.k8s_hf_secret),
        image=args.image)


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


# formats that write a directory from a source checkpoint rather than an engine file from the placement
DIRECTORY_FORMATS = {export_checkpoint.FORMAT: export_checkpoint.run}


def run(args) -> int:
    if args.check_logs is not None:
        if args.verify is not None or args.format or args.out or args.flags:
            raise InputError("--check-logs LOG... reads a deployment's logs: --verify / --format / --out / --flags "
                             "do not go with it")
        return export_checkpoint.run_check_logs(args)
    if args.verify is not None:
        if args.format not in (None, export_checkpoint.FORMAT) or args.out or args.flags:
            raise InputError("--verify DST checks a relabelled checkpoint: --out / --flags / another --format do "
                             "not go with it")
        return export_checkpoint.run_verify(args)
    if args.pools:
        if args.placement is None or args.format is None or args.out is None:
            raise InputError("place export --pools needs PLACEMENT (one file, or prefill=A,decode=B), --format and "
                             "--out")
        return run_pools(args)
    if args.placement is None or args.format is None or args.out is None:
        raise InputError("place export needs PLACEMENT, --format and --out (or --verify DST)")
    if args.format in DIRECTORY_FORMATS:
        return DIRECTORY_FORMATS[args.format](args)
    if args.layout is not None or not args.link or args.dry_run or args.full_hash or args.pool:
        raise InputError("--layout / --copy / --dry-run / --hash / --pool go with --format checkpoint")
    placement = load_placement(args.placement)
    if placement.layers_label:
        # Every engine format maps every MoE layer (vLLM/SGLang/TensorRT-LLM index a full [layers, slots]
        # table); the layers the log did not hold have no traffic to plan on, and filling them with a
        # default layout would ship a placement nobody planned. Refused, saying what to do.
        raise InputError(f"{args.placement}: planned on {placement.layers_label} (MoE layers "
                         f"{format_ranges(placement.moe_layers)}, the ones its routing log held); an engine "
                         "placement file needs every MoE layer, so a partial placement is not exported: log every "
                         "layer (or the engine's own statistics, which cover all) and plan on that")
    model = load_model(args.model or placement.model_name)
    check_compatible(placement, model, what=args.placement)
    outs = Outputs(inputs=[args.placement, args.loads, args.model, args.plan], force=args.force)
    outs.add(args.out, engine_file_kind(args.format, model, placement.num_gpus, placement.gpus_per_node))
    pod_flags = [f"--{k.replace('_', '-')}" for k in K8S_FLAGS if getattr(args, k) is not None]
    launch_choices = (args.tp or args.dp or args.plan or args.target or args.launch_out or args.engine_version
                      or args.vllm_pr or args.vllm_static or pod_flags)
    if not args.flags and launch_choices:
        raise InputError("--tp/--dp/--plan/--engine-version/--vllm-pr/--vllm-static/--target/--launch-out/--image "
                         "choose the launch: add --flags")
    if (args.launch_out or pod_flags) and not args.target:
        raise InputError("--launch-out/--image/--k8s-* go with --target shell|slurm|k8s")
    if pod_flags and args.target != "k8s":
        raise InputError(f"{pod_flags[0]} is for --target k8s")
    k8s = k8s_options(args) if args.target == "k8s" else None
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
                          file_bytes=b"", k8s=k8s)  # refuses an engine/target mismatch before writing
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
            # the engine in the name: an SGLang and a vLLM deployment of one model can share a namespace
            text = deploy.render(args.target, target_launch, memory, name=f"moeplace-{model.name}-{launch.engine}",
                                 file_name=Path(args.out).name, file_bytes=Path(args.out).read_bytes(), k8s=k8s)
            _write_launch(outs, launch_out, text, args.target, wrote)
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


def _per_pool(text: str | None, what: str) -> dict[str, str | None]:
    """``prefill=A,decode=B`` -> one value per pool; a plain value is both pools'; ``None`` stays ``None``."""
    if text is None or "=" not in text:
        return {"prefill": text, "decode": text}
    out: dict[str, str | None] = {}
    for part in text.split(","):
        role, eq, value = part.partition("=")
        role = role.strip()
        if not eq or role not in ("prefill", "decode") or role in out or not value.strip():
            raise InputError(f"{what} {text!r}: expected prefill=...,decode=... (or one value for both pools)")
        out[role] = value.strip()
    if set(out) != {"prefill", "decode"}:
        raise InputError(f"{what} {text!r}: give both pools (prefill=...,decode=...)")
    return out


def pool_out(out: str, role: str) -> str:
    """``loc.json`` -> ``loc.prefill.json``: a pool's engine file next to ``--out``."""
    p = Path(out)
    return str(p.with_name(f"{p.stem}.{role}{p.suffix}"))


def run_pools(args) -> int:
    """``--pools --flags``: each pool's placement exported to its own engine file and its command printed
    (each checked against its memory plan and the engine release's parser), and with ``--target`` one launch
    file that starts both pools."""
    if not args.flags:
        raise InputError("--pools prints each pool's launch command: add --flags")
    if args.format in DIRECTORY_FORMATS:
        raise InputError("--pools with --format checkpoint: write each pool's relabelled checkpoint with its own "
                         "`place export POOL.json --format checkpoint`, then give them as --model-path "
                         "prefill=DIR,decode=DIR with an engine format")
    if args.tp or args.dp or args.plan:
        raise InputError("--tp/--dp/--plan: with --pools each pool's layout comes from its pool word")
    dep = parse_pools(args.pools)
    files = _per_pool(args.placement, "PLACEMENT")
    paths = _per_pool(args.model_path, "--model-path")
    placements = {role: load_placement(f) for role, f in files.items()}
    model = load_model(args.model or placements["decode"].model_name)
    outs = Outputs(inputs=[*files.values(), args.loads, args.model], force=args.force)
    k8s = k8s_options(args) if args.target == "k8s" else None
    pools = []
    for pool in dep.pools:
        pl = placements[pool.role]
        check_compatible(pl, model, what=files[pool.role])
        if pl.num_gpus != pool.gpus:
            raise InputError(f"{files[pool.role]}: a placement for {pl.num_gpus} GPUs, the {pool.role} pool has {pool.gpus} "
                             "(plan it with place optimize --phase " + pool.role + " --pools ...)")
        lay = pool_layout(model, pool)
        out = pool_out(args.out, pool.role)
        opts = FlagOptions(model_path=paths[pool.role], kv_cache_dtype=args.kv_cache_dtype,
                           max_model_len=args.max_model_len, gpu=dep.gpu or args.gpu, online_eplb=args.online_eplb,
                           eplb_window=args.eplb_window, eplb_interval=args.eplb_interval, tp=lay.tp, dp=lay.dp,
                           moe_backend=args.moe_backend, engine_version=args.engine_version,
                           vllm_pr=int(args.vllm_pr) if args.vllm_pr else None, vllm_static=args.vllm_static,
                           placement_path=files[pool.role], pool=pool.role, max_seqs=pool.max_seqs,
                           max_batched_tokens=pool.max_batched_tokens)
        try:
            built = build_launch(pl, model, args.format, out, opts)
            if built.launch.engine not in deploy.PORTS:
                raise InputError(f"--format {args.format}: disaggregated pools are launched for vLLM and SGLang (the "
                                 "NIXL connector / --disaggregation-mode); the other formats print no pool command")
            launch = built.launch
            if args.target == "k8s":
                launch = launch_spec(pl, model, args.format, PurePosixPath(deploy.MOUNT_DIR) / Path(out).name,
                                     built.opts)
        except InputError as exc:
            raise InputError(f"--pools {pool.role}: {exc}") from None
        launch.layout = f"# {pool.role} pool: " + launch.layout.lstrip("# ")
        built.launch.layout = launch.layout
        outs.add(out, engine_file_kind(args.format, model, pl.num_gpus, pl.gpus_per_node), flag="--out")
        pools.append((pool, pl, out, built, launch))
    launch_out = None
    if args.target:
        launch_out = args.launch_out or str(Path(args.out).with_suffix("")) + deploy.default_suffix(args.target)
        outs.add(launch_out, OutputKind(f"{args.target} launch file", False, deploy.is_launch_file), flag="--launch-out")
    loads = read_loads(args.loads, args.window_tokens) if args.loads else None
    wrote, warnings = [], []
    for pool, pl, out, built, _ in pools:
        def write(pl=pl, out=out, built=built, role=pool.role):
            w = export_placement(pl, model, args.format, out, loads=loads, **built.extra)
            mismatch = rule_mismatch(pl, args.format)
            warnings.extend(f"{role}: {x}" for x in ([mismatch] if mismatch else []) + list(w))
        if outs.write(out, write):
            wrote.append(out)
    if launch_out is not None and len(wrote) == len(pools):
        text = deploy.render_pools(args.target, [(pool.role, launch, built.memory_line(), Path(out).name,
                                                  Path(out).read_bytes()) for pool, _, out, built, launch in pools],
                                   name=f"moeplace-{model.name}-{pools[0][3].launch.engine}", k8s=k8s)
        _write_launch(outs, launch_out, text, args.target, wrote)
    outs.finish()
    if args.json:
        print(json.dumps({"wrote": wrote, "format": args.format, "model": model.name, "deployment": dep.to_dict(),
                          "warnings": warnings, "pools": {
                              pool.role: {"placement": files[pool.role], "file": out, "gpus": pl.num_gpus,
                                          "memory_plan": {"fits": True, "layout": built.plan.layout.describe(),
                                                          "concurrency": built.plan.concurrency},
                                          "launch": {"engine": built.launch.engine, "engine_version": built.launch.version,
                                                     "nodes": built.launch.nodes, "env": built.launch.env,
                                                     "argv": built.launch.argv(),
                                                     "worker_argv": (built.launch.argv(worker=True)
                                                                     if built.launch.worker_extra else None),
                                                     "command": built.launch.text()}}
                              for pool, pl, out, built, _ in pools}}, indent=1))
        return 0
    for w in warnings:
        print(f"place: warning: {w}", file=sys.stderr)
    for pool, pl, out, built, _ in pools:
        print(f"== {pool.role} pool: wrote {out} ({args.format}): {pl.num_slots} slots on {pl.num_gpus} GPUs ==")
        print(built.memory_line())
        print(built.launch.text(), end="")
    print(f"KV cache from prefill to decode over {dep.kv_link} (NIXL); the placements differ per pool, the KV cache does "
          "not depend on expert ids")
    if launch_out is not None and launch_out in wrote:
        print(f"wrote {launch_out} ({args.target}): both pools")
    return 0


def _write_launch(outs, launch_out: str, text: str, target: str, wrote: list[str]) -> None:
    """The launch file ``launch_out`` (executable unless a Kubernetes manifest), through ``outs``; its path
    appended to ``wrote`` when written."""
    def write_launch():
        write_text_atomic(launch_out, text)
        if target != "k8s":
            Path(launch_out).chmod(0o755)

    if outs.write(launch_out, write_launch):
        wrote.append(launch_out)
