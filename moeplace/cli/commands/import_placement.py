"""``place import-placement FILE --format F --out placement.json``: read an engine placement file (SGLang,
vLLM PRs #49572 / #41141, vllm-ascend) back into a moeplace Placement. The SGLang ``logical_count`` form
holds expert loads; it is read into a Loads ``.npz`` (``--out x.npz``), as are the ``eplb_load_stats``
records of a ``vllm-jsonl`` file (``--format vllm-jsonl --out x.npz``)."""
from __future__ import annotations

import json
from pathlib import Path

from moeplace.cli import flags, relabel
from moeplace.cli.commands import add_force, add_json, add_model
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import Outputs
from moeplace.foundation.formats import tagged
from moeplace.foundation.model import load_model
from moeplace.placement.export import format_names, get_format, import_loads, import_placement
from moeplace.placement.export.vllm import read_load_stats
from moeplace.placement.record import PLACEMENT_JSON
from moeplace.traces.loads import LOADS_FILE
from moeplace.traces.relabel import loads_to_original


def register(sub) -> None:
    p = sub.add_parser("import-placement", help="read an SGLang / vLLM / vllm-ascend placement file",
                       description=__doc__)
    p.add_argument("file", help="engine file")
    p.add_argument("--format", required=True, choices=format_names(), help="its format")
    add_model(p)
    p.add_argument("--gpus", type=flags.positive_int, default=None,
                   help="EP size (required unless the file records it: vllm-ascend, vllm-jsonl with load records)")
    p.add_argument("--gpus-per-node", type=flags.positive_int, default=None, help="default: 8 if it divides --gpus, else --gpus")
    p.add_argument("--out", required=True, help="placement JSON (or Loads .npz for sglang-logical-count)")
    add_force(p)
    add_json(p, "what was written (path, kind) and what it holds (layers, slots, GPUs or windows, selections)")
    relabel.add_manifest_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    outs = Outputs(inputs=[args.file, args.model], force=args.force)
    outs.add(args.out, LOADS_FILE if args.out.endswith(".npz") else PLACEMENT_JSON)
    model = load_model(args.model)
    new2old = relabel.manifest_map(args, model)
    if get_format(args.format).kind == "loads":
        if not args.out.endswith(".npz"):
            raise InputError(f"--out {args.out}: --format {args.format} holds expert loads; write them to a .npz")
        loads = import_loads(args.file, args.format, model)
        if new2old is not None:
            loads = loads_to_original(loads, new2old, args.relabel_manifest)
        outs.write(args.out, lambda: loads.save(args.out))
        outs.finish()
        return _done(args, model, loads=loads, text=f"wrote {args.out}: loads of {model.name}, "
                     f"{loads.num_windows} windows, {int(loads.counts.sum())} expert selections")
    if args.format == "vllm-jsonl" and args.out.endswith(".npz"):
        loads = read_load_stats(Path(args.file), model)
        if new2old is not None:
            loads = loads_to_original(loads, new2old, args.relabel_manifest)
        outs.write(args.out, lambda: loads.save(args.out))
        outs.finish()
        return _done(args, model, loads=loads, text=f"wrote {args.out}: loads of {model.name} from "
                     f"{loads.num_windows} eplb_load_stats records")
    if not args.out.endswith(".json"):
        raise InputError(f"--out {args.out}: a placement is written as .json")
    placement = import_placement(args.file, args.format, model, args.gpus, args.gpus_per_node)
    if new2old is not None:
        placement = relabel.placement_to_original(placement, new2old, args.relabel_manifest)
    outs.write(args.out, lambda: placement.save(args.out))
    outs.finish()
    return _done(args, model, placement=placement, text=(
        f"wrote {args.out}: {model.name}, {placement.num_layers} MoE layers, {placement.num_slots} slots "
        f"({placement.num_redundant} redundant) on {placement.num_gpus} GPUs x {placement.gpus_per_node} per node"))


def _done(args, model, text: str, placement=None, loads=None) -> int:
    """Print the one-line summary, or with ``--json`` one object: what was written and what it holds."""
    if not args.json:
        print(text)
        return 0
    doc = {"written": [{"path": args.out, "kind": "placement JSON" if placement is not None else "Loads .npz"}],
           "source": {"path": args.file, "format": args.format}, "model": model.name, "warnings": []}
    if placement is not None:
        doc["placement"] = {"moe_layers": placement.num_layers, "slots": placement.num_slots,
                            "redundant": placement.num_redundant, "gpus": placement.num_gpus,
                            "gpus_per_node": placement.gpus_per_node}
    else:
        doc["loads"] = {"windows": loads.num_windows, "selections": int(loads.counts.sum())}
    print(json.dumps(tagged("placement-import", doc), indent=1))
    return 0
