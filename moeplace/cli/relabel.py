"""``place export PLACEMENT --format checkpoint --model-path SRC --out DST [--layout contiguous|round_robin]
[--copy] [--dry-run] [--hash]``: write a relabelled copy of a safetensors checkpoint whose engine layout is the
placement; ``place export --verify DST``: prove one against its source (docs/export.md "A relabelled
checkpoint")."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import numpy as np

from moeplace.foundation.checkpoint_files import check_not_relabelled
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import Outputs
from moeplace.foundation.model import format_ranges, load_model
from moeplace.placement.export.checkpoint import (
    MANIFEST,
    RELABELLED_CHECKPOINT,
    Planner,
    check_space,
    fits,
    needs,
    open_checkpoint,
    relabel_checkpoint,
    relabelled_reason,
    space_bound,
    write_checkpoint,
)
from moeplace.placement.export.flags import FlagOptions, relabelled_launches
from moeplace.placement.export.verify import verify
from moeplace.placement.export.vllm_plugin import check_logs
from moeplace.placement.record import Placement, load_placement
from moeplace.placement.relabel import LAYOUTS, check_for_model, get_layout, read_relabel

FORMAT = "checkpoint"


def add_arguments(p) -> None:
    g = p.add_argument_group("relabelled checkpoint (with --format checkpoint; --model-path is the source)")
    g.add_argument("--layout", default=None, choices=list(LAYOUTS),
                   help="the engine's fixed expert order: contiguous blocks per EP rank (vLLM linear, SGLang, "
                        "TensorRT-LLM; the default) or vLLM's round_robin")
    how = g.add_mutually_exclusive_group()
    how.add_argument("--link", dest="link", action="store_true", default=True,
                     help="hard-link the shards nothing in changes (default; copied where linking fails)")
    how.add_argument("--copy", dest="link", action="store_false", help="copy them instead (reflinked where the "
                     "file system shares blocks)")
    g.add_argument("--dry-run", action="store_true",
                   help="check everything and print the bytes to write and to link (reflink), and the space free "
                        "on DST's file system; write nothing")
    g.add_argument("--hash", dest="full_hash", action="store_true",
                   help="also record the sha256 of every source byte in the manifest (read in parallel with the "
                        "copy; the source's identity is otherwise its shards' sizes and header sha256)")
    g.add_argument("--verify", metavar="DST", default=None,
                   help="prove the relabelled checkpoint DST against its source (the manifest's, or --model-path) "
                        "and manifest, byte for byte, without torch; exit 1 at the first mismatch (PLACEMENT, if "
                        "given, must be the manifest's permutation)")
    g.add_argument("--pool", default=None, metavar="NAME",
                   help="the serving pool this relabelled checkpoint is for (a prefill / decode deployment serves "
                        "each pool its own placement); recorded in the manifest")
    g.add_argument("--check-logs", nargs="+", metavar="LOG", default=None,
                   help="read the vLLM logs of a deployment served through the moeplace plugin and check that every "
                        "EP rank applied the same placement (PLACEMENT, if given, that one); exit 1 on a mixed or "
                        "partly relabelled deployment")


def run(args) -> int:
    if not args.model_path:
        raise InputError("--format checkpoint needs --model-path SRC (the safetensors checkpoint to relabel)")
    if args.loads:
        raise InputError("--format checkpoint writes a checkpoint: --loads does not apply")
    args.layout = args.layout or "contiguous"
    placement = load_placement(args.placement)
    if placement.layers_label:  # the checkpoint holds every MoE layer; the renaming would cover some
        raise InputError(f"{args.placement}: planned on {placement.layers_label} (MoE layers "
                         f"{format_ranges(placement.moe_layers)}, the ones its routing log held); a relabelled "
                         "checkpoint renames the experts of every MoE layer: plan on a log of every layer")
    src = Path(args.model_path)
    outs = Outputs(inputs=[args.placement, src], force=args.force)
    outs.add(args.out, RELABELLED_CHECKPOINT)
    if src.is_dir():  # a relabelled source is refused, as the vLLM plugin refuses one
        check_not_relabelled(src, MANIFEST)
    ck, _ = open_checkpoint(src)
    why = relabelled_reason(src)  # a DST whose manifest is gone still names the relabelling in its headers
    if why:
        raise InputError(f"--model-path {why}: its expert ids are not the model's own, and relabelling it again "
                         "would lose that mapping: relabel the original checkpoint instead, or serve it as it is")
    planner = Planner(ck, placement, get_layout(args.layout), placement_name=args.placement)
    mem, launches = _launches(args, placement, src)  # before writing: a refused layout leaves nothing
    total = sum((src / s).stat().st_size for s in ck.shards)
    bound = None if args.dry_run else space_bound(ck, args.out, planner.relabel)
    if bound is not None and fits(bound):
        # room for every shard rewritten: each is planned while the one before it is copied
        head = [(f"relabelling {src}: {len(ck.shards)} shard(s), {total / 1e6:,.1f} MB, each planned while the one "
                 f"before it is copied; at most {bound.write / 1e9:,.2f} GB to write (every shard rewritten), "
                 f"{bound.free / 1e9:,.2f} GB free on DST's file system")]

        def say(line: str) -> None:  # the headline with the first shard written: a refusal before it is one line
            while head:
                print(head.pop(), file=sys.stderr)
            print(line, file=sys.stderr)

        manifest = {}

        def write():
            manifest.update(relabel_checkpoint(ck, planner, placement, Path(args.placement), args.out,
                                               link=args.link, full_hash=args.full_hash, space=bound, pool=args.pool,
                                               progress=say)[1])
    else:  # plan first: the exact bytes to write and to link (hard links, reflinks) are checked before writing
        p = planner.plan_all()
        space = needs(ck, p, args.out, args.link)
        rewrite = sum(1 for s in ck.shards if p.changed(s))
        if args.dry_run:
            doc = {"dry_run": True, "source": str(src), "out": args.out, "layout": args.layout,
                   "shards": len(ck.shards), "shards_rewritten": rewrite, "checkpoint_bytes": total,
                   "write_bytes": space.write, "reflink_bytes": space.reflink, "hardlink_bytes": space.hardlink,
                   "free_bytes": space.free, "reflinks": space.reflinks, "tensors_relabelled": p.counts,
                   "quantization_config_renamed": p.quantization is not None}
            if args.json:
                print(json.dumps(doc, indent=1))
            else:
                print(f"dry run: relabelling {src} ({len(ck.shards)} shard(s), {total / 1e9:,.2f} GB, {rewrite} with "
                      f"renamed tensors) into {args.out} takes {space.line()}")
            check_space(space, args.out)
            return 0
        check_space(space, args.out)  # before the headline: a refusal is one line
        print(f"relabelling {src}: {len(ck.shards)} shard(s), {total / 1e6:,.1f} MB; {rewrite} with renamed tensors, "
              f"{len(ck.shards) - rewrite} to {'link' if args.link else 'copy'}; {space.line()}", file=sys.stderr)
        manifest = {}

        def write():
            manifest.update(write_checkpoint(ck, p, placement, Path(args.placement), args.out, link=args.link,
                                             full_hash=args.full_hash, space=space, pool=args.pool,
                                             progress=lambda s: print(s, file=sys.stderr)))

    ok = outs.write(args.out, write)
    outs.finish()
    if not ok:
        return 1
    secs = max(manifest["seconds"], 1e-9)
    doc = {"wrote": args.out, "format": FORMAT, "layout": args.layout, "model": placement.model_name,
           "layers": placement.num_layers, "experts": placement.num_experts, "gpus": placement.num_gpus,
           "tensors_relabelled": manifest["tensors_relabelled"],
           "shards": {k: v["how"] for k, v in manifest["shards"].items()},
           "untouched_moe_layers": manifest["untouched_moe_layers"], "seconds": round(manifest["seconds"], 3),
           "checkpoint_mb_per_s": round(total / 1e6 / secs, 1), "written_bytes": manifest["written_bytes"],
           "reflinked_bytes": manifest["reflinked_bytes"],
           "quantization_config_renamed": manifest["quantization_config_renamed"],
           "manifest": str(Path(args.out) / MANIFEST)}
    if launches:
        doc["memory_plan"] = {"layout": mem.layout.describe(), "gpu": mem.cluster.gpu.name,
                              "concurrency": mem.concurrency, "context": mem.context}
        doc["launches"] = [{"engine": x.engine, "engine_version": x.version, "env": x.env, "argv": x.argv(),
                            "model_path": x.model_path, "command": x.text()} for x in launches]
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    c = manifest["tensors_relabelled"]
    print(f"wrote {args.out} (relabelled checkpoint, {args.layout} layout): {placement.model_name}, "
          f"{placement.num_layers} MoE layers x {placement.num_experts} experts on {placement.num_gpus} GPUs; "
          f"{c['expert']} per-expert tensors renamed, {c['stacked']} stacked, {c['router']} router and {c['bias']} "
          f"bias tensors permuted; {manifest['seconds']:.2f} s ({total / 1e6 / secs:,.0f} MB/s of checkpoint; "
          f"{manifest['written_bytes'] / 1e6:,.1f} MB written, {manifest['reflinked_bytes'] / 1e6:,.1f} MB shared "
          "by reflink)")
    if manifest["quantization_config_renamed"]:
        print("  config.json: quantization_config entries that name experts renamed through the permutation")
    if manifest["untouched_moe_layers"]:
        print(f"  left as they are: expert tensors of decoder layers {manifest['untouched_moe_layers']} "
              "(not MoE layers of the placement, e.g. a multi-token-prediction layer)")
    print(f"  check it before serving: place export --verify {shlex.quote(args.out)}")
    if launches:
        print(f"memory plan: {mem.layout.describe()} on {mem.cluster.num_gpus} x {mem.cluster.gpu.name} fits; "
              f"{mem.concurrency} sequences of {mem.context:,} tokens")
        for x in launches:
            what = ("the original checkpoint through the load-time plugin" if x.env
                    else f"the relabelled checkpoint on {ENGINE_TITLES[x.engine]}")
            print(f"# --- {what}")
            print(x.text(), end="")
    return 0


ENGINE_TITLES = {"vllm": "vLLM", "sglang": "SGLang"}


def _launches(args, placement, src: Path):
    """``--flags``: the memory plan and the launches that serve DST (and SRC through the plugin)."""
    if not args.flags:
        if args.tp or args.dp or args.plan:
            raise InputError("--tp/--dp/--plan choose the launch: add --flags")
        return None, []
    if args.vllm_pr or args.vllm_static or args.online_eplb or args.target:
        raise InputError("--format checkpoint --flags prints the engines' own layout on the relabelled checkpoint "
                         "(and the plugin on SRC): --vllm-pr / --vllm-static / --online-eplb / --target do not apply")
    model = load_model(args.model or placement.model_name)
    opts = FlagOptions(kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len, gpu=args.gpu,
                       tp=args.tp, dp=args.dp, engine_version=args.engine_version, placement_path=args.placement)
    return relabelled_launches(placement, model, src, args.out, opts, args.plan)


def run_check_logs(args) -> int:
    """``place export --check-logs LOG... [PLACEMENT]``."""
    texts = {}
    for path in args.check_logs:
        try:
            texts[path] = Path(path).read_text(errors="replace")
        except OSError as exc:
            raise InputError(f"--check-logs {path}: cannot read ({exc.strerror})") from None
    fp = load_placement(args.placement).fingerprint() if args.placement else None
    res = check_logs(texts, fp)
    kinds = sorted(set(res.applied.values()))
    if args.json:
        print(json.dumps({"lines": res.lines, "ranks": len(res.applied),
                          "placements": [{"fingerprint": a, "new2old": b, "layout": c} for a, b, c in kinds],
                          "problems": res.problems}, indent=1))
    elif not res.problems:
        fp0, h, lay = kinds[0]
        print(f"every EP rank ({len(res.applied)}) applied placement {fp0} (new2old {h}, layout {lay}); "
              f"{res.lines} plugin line(s) in {len(texts)} log(s)")
    else:
        for p in res.problems:
            print(f"place: {p}", file=sys.stderr)
    return 1 if res.problems else 0


def run_verify(args) -> int:
    """``place export --verify DST [PLACEMENT] [--model-path SRC]``."""
    placement = load_placement(args.placement) if args.placement else None
    res = verify(args.verify, args.model_path, placement, args.placement or "placement",
                 progress=None if args.json else (lambda s: print(s, file=sys.stderr)))
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    c = res["tensors"]
    print(f"verified {args.verify} against {res['source']} ({res['layout']} layout): {c['expert']:,} per-expert "
          f"tensors hold their source expert's bytes, {c['rows']:,} router / bias / stacked tensors hold the "
          f"permuted rows, {c['other']:,} others identical; {res['bytes'] / 1e9:,.2f} GB in {res['seconds']:.1f} s")
    return 0


# ---------------------------------------------------------------------------- statistics in original ids
def add_manifest_arguments(p) -> None:
    """``--relabel-manifest`` of the commands that read statistics from a deployment (trace import,
    import-placement): map the engine's expert ids back to the original model's."""
    p.add_argument("--relabel-manifest", default=None, metavar="M",
                   help="the deployment served a relabelled model: M is its moeplace-relabel.json (or the placement "
                        "JSON given to the vLLM plugin); expert ids are mapped back to the original model's, so "
                        "re-planning never mixes id spaces")
    p.add_argument("--relabel-layout", default=None, choices=list(LAYOUTS),
                   help="with a placement JSON as --relabel-manifest: vLLM's --expert-placement-strategy layout "
                        "(default contiguous = linear); a manifest records its own")


def manifest_map(args, model) -> np.ndarray | None:
    """``new2old [L, E]`` named by ``--relabel-manifest`` for ``model``, or ``None`` when not given."""
    if args.relabel_manifest is None:
        if args.relabel_layout is not None:
            raise InputError("--relabel-layout goes with --relabel-manifest")
        return None
    layout = get_layout(args.relabel_layout) if args.relabel_layout else None
    rel, facts = read_relabel(args.relabel_manifest, layout)
    if facts["kind"] == "manifest" and layout is not None:
        raise InputError("--relabel-layout: the manifest records its own layout")
    check_for_model(facts, model, f"--relabel-manifest {args.relabel_manifest}", f"--model '{model.name}'")
    return rel.new2old


def placement_to_original(placement: Placement, new2old: np.ndarray, source: str) -> Placement:
    """An engine placement dump (its logical ids are the relabelled ones) in the original ids."""
    p2l = new2old[np.arange(placement.num_layers)[:, None], placement.phy2log]
    return Placement(p2l, placement.num_gpus, placement.gpus_per_node, placement.model_name,
                     placement.num_experts, placement.moe_layers,
                     {**placement.provenance, "relabelled_ids_mapped": source})
