"""``place export PLACEMENT --format checkpoint --model-path SRC --out DST [--layout contiguous|round_robin]
[--copy]``: write a relabelled copy of a safetensors checkpoint whose engine layout is the placement
(docs/export.md "A relabelled checkpoint")."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.foundation.files import Outputs
from moeplace.foundation.model import format_ranges
from moeplace.placement.export.checkpoint import RELABELLED_CHECKPOINT, plan, scan, write_checkpoint
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
                     help="hard-link the shards no expert moves in (default; copied where linking fails)")
    how.add_argument("--copy", dest="link", action="store_false", help="copy them byte for byte instead")


def run(args) -> int:
    if not args.model_path:
        raise InputError("--format checkpoint needs --model-path SRC (the safetensors checkpoint to relabel)")
    if args.flags or args.loads:
        raise InputError("--format checkpoint writes a checkpoint: --flags / --loads do not apply")
    args.layout = args.layout or "contiguous"
    placement = load_placement(args.placement)
    if placement.layers_label:  # the checkpoint holds every MoE layer; the renaming would cover some
        raise InputError(f"{args.placement}: planned on {placement.layers_label} (MoE layers "
                         f"{format_ranges(placement.moe_layers)}, the ones its routing log held); a relabelled "
                         "checkpoint renames the experts of every MoE layer: plan on a log of every layer")
    src = Path(args.model_path)
    outs = Outputs(inputs=[args.placement, src], force=args.force)
    outs.add(args.out, RELABELLED_CHECKPOINT)
    ck = scan(src)
    p = plan(ck, placement, get_layout(args.layout), placement_name=args.placement)
    total = sum((src / s).stat().st_size for s in ck.shards)
    rewrite = sum(1 for v in p.pieces.values() if v is not None)
    print(f"relabelling {src}: {len(ck.shards)} shard(s), {total / 1e6:,.1f} MB; {rewrite} to rewrite, "
          f"{len(ck.shards) - rewrite} to {'link' if args.link else 'copy'}", file=sys.stderr)
    manifest = {}

    def write():
        manifest.update(write_checkpoint(ck, p, placement, Path(args.placement), args.out, link=args.link,
                                         progress=lambda s: print(s, file=sys.stderr)))

    ok = outs.write(args.out, write)
    outs.finish()
    if not ok:
        return 1
    mbs = manifest["rewritten_bytes"] / 1e6 / max(manifest["seconds"], 1e-9)
    doc = {"wrote": args.out, "format": FORMAT, "layout": args.layout, "model": placement.model_name,
           "layers": placement.num_layers, "experts": placement.num_experts, "gpus": placement.num_gpus,
           "tensors_relabelled": manifest["tensors_relabelled"],
           "shards": {k: v["how"] for k, v in manifest["shards"].items()},
           "untouched_moe_layers": manifest["untouched_moe_layers"], "seconds": round(manifest["seconds"], 3),
           "rewritten_mb_per_s": round(mbs, 1), "manifest": str(Path(args.out) / "moeplace-relabel.json")}
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    c = manifest["tensors_relabelled"]
    print(f"wrote {args.out} (relabelled checkpoint, {args.layout} layout): {placement.model_name}, "
          f"{placement.num_layers} MoE layers x {placement.num_experts} experts on {placement.num_gpus} GPUs; "
          f"{c['expert']} per-expert, {c['stacked']} stacked, {c['router']} router and {c['bias']} bias tensors; "
          f"{manifest['seconds']:.2f} s ({mbs:,.0f} MB/s rewritten)")
    if manifest["untouched_moe_layers"]:
        print(f"  left as they are: expert tensors of decoder layers {manifest['untouched_moe_layers']} "
              "(not MoE layers of the placement, e.g. a multi-token-prediction layer)")
    print(f"  serve DST as the model as it is; the manifest maps its expert ids back: {doc['manifest']}")
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
