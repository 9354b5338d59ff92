"""The Placement record (docs/design.md "Contracts"; names as in DeepSeek EPLB and vLLM).

``phy2log[l, p]`` is the logical expert held by physical slot ``p`` of MoE layer ``l`` (``l`` indexes
``moe_layers``, the model's MoE decoder layers, in order). Slot ``p`` lives on GPU
``p // slots_per_gpu`` with ``slots_per_gpu = num_slots / num_gpus``; GPU ``g`` lives on node
``g // gpus_per_node``. Derived: ``logcnt[l, e]`` (replica count) and ``log2phy[l, e, r]`` (the slots of
expert ``e``, ascending, padded with -1 to the fixed width ``num_redundant + 1``).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.foundation.files import OutputKind, read_json, register_kind, tagged_artifact, write_text_atomic
from moeplace.foundation.formats import check, tag
from moeplace.foundation.model import ModelSpec, format_ranges
from moeplace.foundation.reading import quote

PLACEMENT_FORMAT = tag("placement")


@dataclass(frozen=True, eq=False)
class Placement:
    phy2log: np.ndarray  # int32 [L, P]
    num_gpus: int
    gpus_per_node: int
    model_name: str
    num_experts: int
    moe_layers: tuple[int, ...]
    provenance: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        p2l = np.asarray(self.phy2log)
        object.__setattr__(self, "phy2log", p2l.astype(np.int32, copy=False))
        self.phy2log.setflags(write=False)
        if p2l.ndim != 2:
            raise InputError(f"placement: phy2log must be [layers, slots], got shape {p2l.shape}")
        L, P = p2l.shape
        E, G = self.num_experts, self.num_gpus
        if L != len(self.moe_layers):
            raise InputError(f"placement: phy2log has {L} layers but the model has {len(self.moe_layers)} MoE layers")
        if G < 1 or P % G:
            raise InputError(f"placement: {P} slots do not divide evenly over {G} GPUs (P must be a multiple of G)")
        if self.gpus_per_node < 1 or G % self.gpus_per_node:
            raise InputError(f"placement: {G} GPUs is not a multiple of gpus_per_node={self.gpus_per_node}")
        if P < E:
            raise InputError(f"placement: {P} slots cannot hold {E} experts")
        bad = (p2l < 0) | (p2l >= E)
        if bad.any():
            l, p = map(int, np.argwhere(bad)[0])
            raise InputError(f"placement: layer {l} slot {p}: expert id {int(p2l[l, p])} out of range [0, {E})")
        cnt = self.logcnt
        if (cnt == 0).any():
            l, e = map(int, np.argwhere(cnt == 0)[0])
            raise InputError(f"placement: layer {l} (decoder layer {self.moe_layers[l]}): logical expert {e} has no "
                             "replica; every expert needs >= 1 slot in every layer")

    # ------------------------------------------------------------------ shape
    @property
    def num_layers(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def num_slots(self) -> int:
        return int(self.phy2log.shape[1])

    @property
    def num_redundant(self) -> int:
        return self.num_slots - self.num_experts

    @property
    def slots_per_gpu(self) -> int:
        return self.num_slots // self.num_gpus

    @property
    def num_nodes(self) -> int:
        return self.num_gpus // self.gpus_per_node

    @cached_property
    def slot_gpu(self) -> np.ndarray:
        """GPU of each slot, ``[P]``."""
        return np.arange(self.num_slots) // self.slots_per_gpu

    # ------------------------------------------------------------------ derived maps
    @cached_property
    def logcnt(self) -> np.ndarray:
        """Replica count per logical expert, int32 ``[L, E]``."""
        L = self.num_layers
        flat = (np.arange(L)[:, None] * self.num_experts + self.phy2log).ravel()
        return np.bincount(flat, minlength=L * self.num_experts).reshape(L, self.num_experts).astype(np.int32)

    @cached_property
    def log2phy(self) -> np.ndarray:
        """Slots of each logical expert, ascending, -1 padded: int32 ``[L, E, R + 1]``."""
        L, P, E = self.num_layers, self.num_slots, self.num_experts
        out = np.full((L, E, self.num_redundant + 1), -1, dtype=np.int32)
        order = np.argsort(self.phy2log, axis=1, kind="stable")  # slots grouped by expert, ascending
        experts = np.take_along_axis(self.phy2log, order, axis=1)
        first = np.zeros((L, E), dtype=np.int64)
        first[:, 1:] = np.cumsum(self.logcnt, axis=1)[:, :-1]
        rank = np.arange(P)[None, :] - np.take_along_axis(first, experts, axis=1)
        out[np.arange(L)[:, None], experts, rank] = order
        return out

    def gpu_experts(self, layer: int, gpu: int) -> np.ndarray:
        """Logical experts held by ``gpu`` in MoE layer ``layer`` (slot order)."""
        s = self.slots_per_gpu
        return self.phy2log[layer, gpu * s:(gpu + 1) * s]

    def duplicate_on_gpu(self) -> np.ndarray:
        """Bool ``[L]``: layers where some GPU holds two replicas of one expert (EPLB can do this)."""
        L, G, s = self.num_layers, self.num_gpus, self.slots_per_gpu
        per_gpu = np.sort(self.phy2log.reshape(L, G, s), axis=2)
        return (np.diff(per_gpu, axis=2) == 0).any(axis=(1, 2))

    # ------------------------------------------------------------------ checks against a model / cluster
    def check_model(self, model: ModelSpec, what: str = "placement") -> None:
        """The placement was made for ``model``: same name, expert count and MoE layers."""
        check_compatible(self, model, what=what)

    def held(self, model: ModelSpec, *, what: str = "placement") -> Placement:
        """This placement on the MoE layers ``model`` holds (a spec restricted to a partial trace's layers,
        :meth:`ModelSpec.restrict`): the rows of those layers when it covers more of them (a placement of
        the whole model scored on a log of 5 of its layers); itself when it covers exactly those."""
        held = tuple(model.moe_layers)
        if held == tuple(self.moe_layers) or model.name != self.model_name:
            return self
        missing = [d for d in held if d not in self.moe_layers]
        if missing:
            raise InputError(f"{what}: covers MoE layers {format_ranges(self.moe_layers)}, but the routing holds "
                             f"{format_ranges(held)} ({model.layers_label or 'every MoE layer'}): no placement for "
                             f"layer{'s' if len(missing) > 1 else ''} {format_ranges(missing)}")
        rows = [self.moe_layers.index(d) for d in held]
        return Placement(self.phy2log[rows], self.num_gpus, self.gpus_per_node, self.model_name, self.num_experts,
                         held, dict(self.provenance))

    @property
    def layers_label(self) -> str:
        """``"5 of 24 layers"`` for a placement planned on a log of some MoE layers only, else ``""``."""
        total = self.provenance.get("model_moe_layers")
        if isinstance(total, list) and len(total) > self.num_layers:
            return f"{self.num_layers} of {len(total)} layers"
        return ""

    def fingerprint(self) -> str:
        h = hashlib.sha256(self.phy2log.tobytes())
        h.update(f"{self.num_gpus}/{self.gpus_per_node}".encode())
        return h.hexdigest()[:16]

    # ------------------------------------------------------------------ constructors / IO
    @classmethod
    def from_phy2log(cls, phy2log: np.ndarray, model: ModelSpec, num_gpus: int, gpus_per_node: int,
                     provenance: dict[str, Any] | None = None) -> Placement:
        prov = dict(provenance or {})
        if model.is_partial:  # planned on some MoE layers only: the file says which of how many
            prov["model_moe_layers"] = list(model.model_moe_layers)
            prov["layers"] = model.layers_label
        return cls(np.asarray(phy2log), num_gpus, gpus_per_node, model.name, model.num_experts,
                   tuple(model.moe_layers), prov)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLACEMENT_FORMAT,
            "model": self.model_name,
            "num_experts": self.num_experts,
            "moe_layers": list(self.moe_layers),
            "num_gpus": self.num_gpus,
            "gpus_per_node": self.gpus_per_node,
            "num_slots": self.num_slots,
            "provenance": self.provenance,
            "phy2log": self.phy2log.tolist(),
        }

    def save(self, path: str | Path) -> None:
        d = self.to_dict()
        rows = ",\n  ".join(json.dumps(r, separators=(",", ":")) for r in d.pop("phy2log"))
        head = json.dumps(d, indent=1)[:-2]  # keep the big matrix one row per line
        write_text_atomic(path, f'{head},\n "phy2log": [\n  {rows}\n ]\n}}\n')


def check_compatible(placement: Placement, model: ModelSpec | None = None, cluster: Any = None, *,
                     num_redundant: int | None = None, what: str = "placement") -> None:
    """Refuse to use ``placement`` with inputs it was not made for (one check for every command that
    takes a placement next to other inputs): another model (by name, expert count or MoE layers),
    another cluster (GPU count or node size; ``cluster`` is a :class:`foundation.cluster.ClusterSpec`) or
    another slot budget (``num_redundant``). ``what`` names the placement in the message (its path)."""
    if model is not None:
        shape_ok = (model.num_experts == placement.num_experts
                    and tuple(model.moe_layers) == tuple(placement.moe_layers))
        if not shape_ok and model.name == placement.model_name and placement.layers_label \
                and tuple(model.model_moe_layers) == tuple(placement.provenance["model_moe_layers"]):
            raise InputError(
                f"{what}: planned on {placement.layers_label} of model '{model.name}' (MoE layers "
                f"{format_ranges(placement.moe_layers)}, the layers its routing log held), but these inputs need "
                f"{model.layers_label or 'every MoE layer'} ({format_ranges(model.moe_layers)})")
        # a placement names its model by a preset or by the config file it was planned from (a captured
        # trace's model is its config.json): a model loaded from that file is the same model
        same = model.name == placement.model_name or (bool(model.source) and model.source == placement.model_name)
        if not shape_ok or not same:
            raise InputError(
                f"{what}: made for model '{placement.model_name}' ({placement.num_experts} experts, "
                f"{len(placement.moe_layers)} MoE layers) but the other inputs are of model '{model.name}' "
                f"({model.num_experts} experts, {model.num_moe_layers} MoE layers)")
    if cluster is not None and (cluster.num_gpus, cluster.gpus_per_node) != (placement.num_gpus,
                                                                             placement.gpus_per_node):
        raise InputError(f"{what}: placement is for {placement.num_gpus} GPUs ({placement.gpus_per_node} per "
                         f"node), the cluster is {cluster.num_gpus} GPUs ({cluster.gpus_per_node} per node); "
                         "pass matching --gpus / --gpus-per-node")
    if num_redundant is not None and num_redundant != placement.num_redundant:
        raise InputError(f"{what}: has {placement.num_redundant} redundant slots ({placement.num_slots} "
                         f"slots) but --redundant {num_redundant} was given")


def load_placement(path: str | Path) -> Placement:
    p = Path(path)
    d = read_json(p, "no such placement file", "not a readable placement JSON")
    check(d, "placement", str(p), hint="engine files are read with `place import-placement`")
    missing = [k for k in ("phy2log", "num_gpus", "gpus_per_node", "model", "num_experts", "moe_layers") if k not in d]
    if missing:
        raise InputError(f"{p}: field '{missing[0]}' missing")

    def whole(key: str, v) -> int:  # JSON 1.5 or true is not a GPU count: no silent int()
        if isinstance(v, bool) or not isinstance(v, int):
            raise InputError(f"{p}: field '{key}' must be a whole number, got {quote(v)}")
        return v

    if not isinstance(d["model"], str):
        raise InputError(f"{p}: field 'model' must be the model's name, got {quote(d['model'])}")
    if not isinstance(d["moe_layers"], list):
        raise InputError(f"{p}: field 'moe_layers' must be a list of layer indices, got {quote(d['moe_layers'])}")
    if not isinstance(d.get("provenance", {}), dict):
        raise InputError(f"{p}: field 'provenance' must be an object, got {quote(d['provenance'])}")
    try:
        p2l = np.asarray(d["phy2log"])
    except (TypeError, ValueError, OverflowError):
        p2l = np.asarray(None)
    if p2l.ndim != 2 or p2l.dtype.kind not in "iu" or p2l.size == 0:  # ragged, floats, bools, huge ints
        raise InputError(f"{p}: field 'phy2log' must be a [layers][slots] matrix of expert ids (whole numbers)")
    for layer, row in enumerate(d["phy2log"]):  # numpy reads [0, true, 2] as [0, 1, 2]: a bool is no id
        if any(type(x) is bool for x in row):
            slot = next(i for i, x in enumerate(row) if type(x) is bool)
            raise InputError(f"{p}: field 'phy2log': layer {layer} slot {slot}: expected an expert id (a whole "
                             f"number), got {str(row[slot]).lower()}")
    try:
        placement = Placement(p2l.astype(np.int64), whole("num_gpus", d["num_gpus"]),
                              whole("gpus_per_node", d["gpus_per_node"]), d["model"],
                              whole("num_experts", d["num_experts"]),
                              tuple(whole("moe_layers", x) for x in d["moe_layers"]), dict(d.get("provenance", {})))
    except InputError as exc:
        raise InputError(f"{p}: {exc}") from None
    if "num_slots" in d and d["num_slots"] != placement.num_slots:  # hand-edited: header and matrix disagree
        raise InputError(f"{p}: field 'num_slots' is {quote(d['num_slots'])} but phy2log has {placement.num_slots} "
                         "slots per layer")
    return placement


PLACEMENT_JSON = register_kind(OutputKind("placement JSON", False, tagged_artifact("placement")))
