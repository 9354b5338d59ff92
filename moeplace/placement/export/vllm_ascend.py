"""vllm-ascend static EPLB map: ``--additional-config '{"eplb_config": {"expert_map_path": "x.json", ...}}'``.

Confirmed in vllm-ascend (github main, 2026-08-22):

- ``vllm_ascend/ascend_config.py`` ``EplbConfig._validate_config``: ``expert_map_path[-5:] != ".json"``
  raises ``TypeError``; the file must exist and be readable.
- ``vllm_ascend/eplb/core/eplb_utils.py`` ``expert_file_to_tensor(path, layer_id)``: reads
  ``data["layer_list"][layer_id]["device_list"]`` **by list position** (the ``layer_id`` / ``device_id``
  fields are not read), sums ``len(device_expert)`` into ``physical_count`` and stacks the lists with
  ``torch.tensor(device_data, dtype=torch.int32)`` (all devices must hold equally many experts).
  ``layer_id`` is ``AscendRoutedExperts.moe_counter`` (``ops/fused_moe/routed_experts.py``), the
  construction index of the MoE layer: 0..moe_layer_count-1, dense layers excluded; ``layer_id ==
  moe_layer_count`` is the MTP layer, which reuses layer 0's slot count.
- ``init_eplb_config``: ``n_redundant = physical_count - n_experts``; per rank
  ``expert_map[local_placement] = arange(len)`` and ``generate_log2phy_map`` numbers physical slots as
  ``local_index + rank * valid_count`` with ``valid_count`` = the number of *distinct* experts on rank 0.
  A device holding two replicas of one expert therefore shifts every slot id: such placements are
  refused. An expert with no replica leaves a hole in ``log2phy`` (``torch.scatter`` over
  ``len(log2phy_map)`` entries): refused too.
- ``init_eplb`` checks the redundancy vLLM allocated against ``physical_count`` ("EPLB local expert capacity
  mismatch"), and ``patch_fused_moe`` takes the allocation from ``eplb_config.num_redundant_experts``; so
  the launch flags must pass ``num_redundant_experts`` = R next to ``expert_map_path``.
- Docs (``user_guide/feature_guide/expert_parallelism_load_balancer.md``): static ``expert_map_path`` is
  Model Runner V1 only and "scheduled for removal in v0.25.1"; ``(E + R) % EP == 0``.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.foundation.files import read_json, write_text_atomic
from moeplace.foundation.model import ModelSpec
from moeplace.foundation.reading import quote
from moeplace.placement.export import ExportFormat, check_matrix, register_format
from moeplace.placement.record import Placement


def _names(model: ModelSpec) -> list[str]:
    return [f"MoE layer {i} (decoder layer {d})" for i, d in enumerate(model.moe_layers)]


def _validate(placement: Placement, model: ModelSpec) -> None:
    check_matrix("vllm-ascend export", placement.phy2log.astype(np.int64), model.num_experts, "device_expert",
                 _names(model))
    dup = placement.duplicate_on_gpu()
    if dup.any():
        l = int(np.argmax(dup))
        s = placement.slots_per_gpu
        per_gpu = placement.phy2log[l].reshape(placement.num_gpus, s)
        g = next(g for g in range(placement.num_gpus) if len(set(per_gpu[g].tolist())) < s)
        e = next(e for e in per_gpu[g].tolist() if per_gpu[g].tolist().count(e) > 1)
        raise InputError(f"vllm-ascend: MoE layer {l} (decoder layer {model.moe_layers[l]}): device {g} holds "
                         f"expert {e} twice; vllm-ascend numbers slots by the count of distinct experts per "
                         "device and would route to wrong slots. Re-plan with replicas on distinct GPUs.")


def to_dict(placement: Placement) -> dict:
    G, s = placement.num_gpus, placement.slots_per_gpu
    per = placement.phy2log.reshape(placement.num_layers, G, s).tolist()
    return {"moe_layer_count": placement.num_layers,
            "layer_list": [{"layer_id": l, "device_count": G,
                            "device_list": [{"device_id": g, "device_expert": per[l][g]} for g in range(G)]}
                           for l in range(placement.num_layers)]}


def write(placement: Placement, model: ModelSpec, out: Path, **_: object) -> list[str]:
    _validate(placement, model)
    d = to_dict(placement)
    # One device per line keeps a 92-layer x 32-device file readable and diffable.
    layers = []
    for layer in d["layer_list"]:
        devs = ",\n     ".join(json.dumps(x, separators=(",", ":")) for x in layer["device_list"])
        layers.append(f'  {{"layer_id": {layer["layer_id"]}, "device_count": {layer["device_count"]}, '
                      f'"device_list": [\n     {devs}\n   ]}}')
    text = f'{{"moe_layer_count": {d["moe_layer_count"]},\n "layer_list": [\n' + ",\n".join(layers) + "\n ]}\n"
    write_text_atomic(out, text)
    return [("vllm-ascend: static expert_map_path is Model Runner V1 only and scheduled for removal in v0.25.1 "
            "(vllm-ascend EPLB docs)")]


def read(path: Path, model: ModelSpec, num_gpus: int | None, gpus_per_node: int | None) -> Placement:
    d = read_json(path)
    if not isinstance(d, dict) or "layer_list" not in d or "moe_layer_count" not in d:
        raise InputError(f"{path}: expected an object with fields 'moe_layer_count' and 'layer_list'")
    L = model.num_moe_layers
    if d["moe_layer_count"] != L or not isinstance(d["layer_list"], list) or len(d["layer_list"]) != L:
        n = len(d["layer_list"]) if isinstance(d["layer_list"], list) else None
        raise InputError(f"{path}: field 'moe_layer_count' is {quote(d['moe_layer_count'])} with {n} entries in "
                         f"'layer_list', expected {L} (model '{model.name}' MoE layers)")
    rows, G, width = [], None, None
    for l, layer in enumerate(d["layer_list"]):
        at = f"{path}: layer_list[{l}]"
        if not isinstance(layer, dict) or not isinstance(layer.get("device_list"), list):
            raise InputError(f"{at}: field 'device_list' missing or not a list")
        # vllm-ascend reads entries by position; an id that disagrees means the file is not what it says.
        if layer.get("layer_id", l) != l:
            raise InputError(f"{at}: field 'layer_id' is {quote(layer['layer_id'])} but vllm-ascend uses the list "
                             f"position {l}")
        devs = layer["device_list"]
        if G is None:
            G = len(devs)
        if len(devs) != G or layer.get("device_count", G) != G:
            raise InputError(f"{at}: field 'device_list' has {len(devs)} devices (device_count "
                             f"{quote(layer.get('device_count'))}), expected {G} as in layer 0")
        row = []
        for g, dev in enumerate(devs):
            if not isinstance(dev, dict) or not isinstance(dev.get("device_expert"), list):
                raise InputError(f"{at}: device_list[{g}]: field 'device_expert' missing or not a list")
            if dev.get("device_id", g) != g:
                raise InputError(f"{at}: device_list[{g}]: field 'device_id' is {quote(dev['device_id'])} but "
                                 f"vllm-ascend uses the list position {g}")
            ex = dev["device_expert"]
            if width is None:
                width = len(ex)
            if len(ex) != width:
                raise InputError(f"{at}: device_list[{g}]: field 'device_expert' has {len(ex)} experts, expected "
                                 f"{width} (torch.tensor needs equal lengths)")
            for v in ex:
                if isinstance(v, bool) or not isinstance(v, int):
                    raise InputError(f"{at}: device_list[{g}]: field 'device_expert': expected integer expert "
                                     f"ids, got {quote(v)}")
            if len(set(ex)) != len(ex):
                raise InputError(f"{at}: device_list[{g}]: field 'device_expert' lists an expert twice; "
                                 "vllm-ascend cannot serve two replicas on one device")
            row += ex
        rows.append(row)
    p2l = np.asarray(rows, dtype=np.int64)
    check_matrix(path, p2l, model.num_experts, "device_expert", _names(model))
    if num_gpus is not None and num_gpus != G:
        raise InputError(f"{path}: file has {G} devices per layer but --gpus is {num_gpus}")
    if gpus_per_node is None:
        gpus_per_node = 8 if G % 8 == 0 else G
    try:
        return Placement.from_phy2log(p2l, model, G, gpus_per_node, {"imported_from": str(path),
                                                                    "format": "vllm-ascend"})
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None


register_format(ExportFormat(
    "vllm-ascend", "vllm-ascend", (".json",),
    "additional_config.eplb_config.expert_map_path JSON: moe_layer_count, layer_list[].device_list[].device_expert",
    write, read, carries_gpus=True))
