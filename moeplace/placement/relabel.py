"""Expert relabelling: serve a replica-free placement with any engine by renumbering each MoE layer's experts.

Every engine puts a layer's experts on its EP ranks in a fixed order: contiguous blocks (rank ``r`` holds ids
``r*E/G .. (r+1)*E/G - 1``; vLLM ``linear``, SGLang, TensorRT-LLM) or vLLM's ``round_robin`` (rank ``r`` holds
``r, r+G, r+2G, ...``). Renaming expert ``old`` to ``new`` in one layer -- its weights, and in the same order
its router's output rows and any per-expert bias (``e_score_correction_bias``) -- changes no output of the
model: the router scores the same experts with the same numbers, top-k picks the same experts under new
names, and each new name holds the old expert's weights. So a placement whose ``phy2log`` is a permutation
per layer is realized by an engine's fixed layout on a relabelled checkpoint.

One module answers "which id goes where" for everyone (the checkpoint writer, the vLLM load-time plugin and
the statistics importers): :func:`permutations` gives ``new2old [L, E]`` (engine id -> original id),
:func:`classify` maps a checkpoint tensor name to its MoE layer, expert and role. Pure functions, no torch.

Routing groups: DeepSeek-V3's group-limited top-k scores groups of ``E / n_group`` consecutive ids and keeps
the best ``topk_group`` groups. A renaming is exact there only if it maps each group onto one group as a
whole (:func:`check_groups`); the optimizer plans under that constraint with ``--keep-groups``.
"""
from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.foundation.files import read_json
from moeplace.foundation.formats import check, kind_of
from moeplace.foundation.model import ModelSpec, format_ranges
from moeplace.foundation.reading import is_int, quote
from moeplace.placement.record import Placement, load_placement


# ---------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class Layout:
    """An engine's fixed order of expert ids over EP ranks. ``slot_ids(P, G)`` is the engine id at each
    placement slot ``p`` (GPU ``p // (P/G)``, local position ``p % (P/G)``), ``[P]`` int64."""

    name: str
    engines: str  # who uses it (for messages and docs)
    interleaved: bool  # rank r holds ids r, r+G, ... (else a contiguous block)

    def slot_ids(self, num_slots: int, num_gpus: int) -> np.ndarray:
        p = np.arange(num_slots, dtype=np.int64)
        if not self.interleaved:
            return p
        per = num_slots // num_gpus
        return (p % per) * num_gpus + p // per  # local position i on GPU g is id g + i*G


CONTIGUOUS = Layout("contiguous", "vLLM --expert-placement-strategy linear (default), SGLang, TensorRT-LLM", False)
ROUND_ROBIN = Layout("round_robin", "vLLM --expert-placement-strategy round_robin", True)
LAYOUTS = {lay.name: lay for lay in (CONTIGUOUS, ROUND_ROBIN)}
# vLLM's own names for them (ParallelConfig.expert_placement_strategy)
VLLM_STRATEGY = {"linear": CONTIGUOUS, "round_robin": ROUND_ROBIN}


def get_layout(name: str) -> Layout:
    if name not in LAYOUTS:
        raise InputError(f"--layout must be one of {', '.join(LAYOUTS)}, got {name!r}")
    return LAYOUTS[name]


# ---------------------------------------------------------------------------- permutations
def replicas_reason(placement: Placement) -> str | None:
    """Why ``placement`` cannot be served as a relabelled model (``None`` when it can): a renaming moves
    experts, it cannot copy one into two slots."""
    if placement.num_redundant:
        return (f"the placement has {placement.num_redundant} redundant slots per layer ({placement.num_slots} "
                f"slots for {placement.num_experts} experts); a relabelled checkpoint holds each expert once: "
                "plan with --redundant 0")
    return None


def permutations(placement: Placement, layout: Layout) -> np.ndarray:
    """``new2old`` int64 ``[L, E]``: the original expert id that engine id ``n`` of MoE layer ``l`` must hold
    so that ``layout`` over ``placement.num_gpus`` ranks puts on every GPU exactly the experts the placement
    gives it (in slot order). Raises :class:`InputError` for a placement with replicas."""
    why = replicas_reason(placement)
    if why:
        raise InputError(why)
    ids = layout.slot_ids(placement.num_slots, placement.num_gpus)
    new2old = np.empty(placement.phy2log.shape, dtype=np.int64)
    new2old[:, ids] = placement.phy2log
    return new2old


def inverse(new2old: np.ndarray) -> np.ndarray:
    """``old2new [L, E]`` of a ``new2old [L, E]`` permutation."""
    L, E = new2old.shape
    old2new = np.empty_like(new2old)
    old2new[np.arange(L)[:, None], new2old] = np.arange(E)[None, :]
    return old2new


def check_permutations(new2old: np.ndarray, num_experts: int, where: str) -> None:
    """Each row of ``new2old`` is a permutation of ``0..E-1`` (a hand-edited manifest may not be)."""
    if new2old.ndim != 2 or new2old.shape[1] != num_experts:
        raise InputError(f"{where}: permutation must be [layers][{num_experts}], got shape {new2old.shape}")
    ok = (np.sort(new2old, axis=1) == np.arange(num_experts)[None, :]).all(axis=1)
    if not ok.all():
        raise InputError(f"{where}: layer {int(np.argmin(ok))}: not a permutation of 0..{num_experts - 1}")


def splits_groups(placement: Placement, n_group: int) -> bool:
    """A replica-free ``placement`` whose contiguous relabelling splits one of ``n_group`` routing groups
    (:func:`group_breaks`): no relabelling serves it exactly under group-limited routing."""
    return (not placement.num_redundant
            and group_breaks(permutations(placement, CONTIGUOUS), n_group) is not None)


def group_breaks(new2old: np.ndarray, n_group: int) -> tuple[int, int] | None:
    """``(layer, new group)`` of the first routing group that the renaming does not map onto one original
    group as a whole; ``None`` when every group stays whole (``n_group`` groups of ``E / n_group``
    consecutive ids, as DeepSeek-V3's group-limited top-k scores them)."""
    L, E = new2old.shape
    if n_group <= 1:
        return None
    size = E // n_group
    groups = (new2old // size).reshape(L, n_group, size)
    mixed = (groups != groups[:, :, :1]).any(axis=2)
    if not mixed.any():
        return None
    layer, grp = np.argwhere(mixed)[0]
    return int(layer), int(grp)


def check_groups(new2old: np.ndarray, n_group: int, topk_group: int, where: str) -> None:
    """Refuse a renaming that splits a routing group: with group-limited top-k the router would pick other
    experts than the original model (the group scores change)."""
    if n_group <= 1 or topk_group >= n_group:
        return  # every group is always kept: ids may move freely
    E = new2old.shape[1]
    if E % n_group:
        raise InputError(f"{where}: {E} experts do not split into n_group={n_group} routing groups")
    bad = group_breaks(new2old, n_group)
    if bad:
        layer, grp = bad
        size = E // n_group
        got = sorted({int(x) // size for x in new2old[layer, grp * size:(grp + 1) * size]})
        raise InputError(
            f"{where}: MoE layer {layer}: engine ids {grp * size}-{(grp + 1) * size - 1} (routing group {grp} of "
            f"{n_group}, top-{topk_group} groups) would hold experts of original groups {got}; group-limited "
            "routing is exact only when each group moves as a whole: plan with `place optimize --keep-groups`")


# ---------------------------------------------------------------------------- checkpoint tensor names
class ExpertTensor(NamedTuple):
    """What a checkpoint tensor is to the relabelling. ``layer``: decoder layer index from the name;
    ``expert``: the id in the name (per-expert tensors) or ``None``; ``role``: ``expert`` (one expert's
    tensor: renamed), ``stacked`` (all experts along dim 0: rows permuted), ``router`` (router output rows
    along dim 0) or ``bias`` (a per-expert vector such as ``e_score_correction_bias``). A named tuple: K3
    has ~0.7 M expert tensors."""

    layer: int
    expert: int | None
    role: str
    head: str  # name up to and including "experts." (per-expert) -- for renaming
    tail: str  # the rest after the id (".w1.weight_packed")

    def renamed(self, new_id: int) -> str:
        return f"{self.head}{new_id}{self.tail}"


# The MoE block's attribute names across the supported layouts: DeepSeek-V3 / Kimi K2 / K3, Qwen3-MoE and
# OLMoE ("mlp"), Mixtral ("block_sparse_moe"), Llama-4 style ("feed_forward"). Any prefix before "layers."
# (``model.``, ``language_model.model.``) is kept.
_BLOCK = r"(?P<pre>(?:^|.*\.)layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe|feed_forward)\.)"
_PER_EXPERT = re.compile(_BLOCK + r"(?P<x>experts\.)(?P<id>\d+)(?P<tail>\..+)$")
_EXPERT_PREFIX = re.compile(_BLOCK + r"experts\.")
_PREFIX_LAYER: dict[str, int | None] = {}  # "...layers.5.mlp.experts." -> 5 (None: not an MoE block's)
_STACKED = re.compile(_BLOCK + r"experts\.(?P<rest>[A-Za-z_][\w.]*)$")
_ROUTER = re.compile(_BLOCK + r"(?:gate|router)\.(?P<rest>weight|bias|e_score_correction_bias)$")
_BIAS = re.compile(_BLOCK + r"(?:experts\.)?e_score_correction_bias$")


def classify(name: str) -> ExpertTensor | None:
    """The relabelling role of checkpoint tensor ``name``; ``None`` for everything the renaming leaves
    alone (attention, norms, embeddings, shared experts, dense MLPs). Covers per-expert tensors with any
    suffix (``experts.7.w1.weight``, ``experts.7.gate_proj.weight``, K3's ``experts.7.w1.weight_packed`` /
    ``weight_scale``), stacked ones (``experts.gate_up_proj`` ``[E, ...]``), router rows (``gate.weight``
    ``[E, H]``, ``gate.bias``) and per-expert biases (``gate.e_score_correction_bias``)."""
    i = name.find(".experts.")
    if i >= 0:  # the fast path (K3 has ~0.7 M per-expert names): the prefix is checked once per layer
        j = i + 9
        k = name.find(".", j)
        if k > j and name[j:k].isascii() and name[j:k].isdigit():
            head = name[:j]
            layer = _PREFIX_LAYER.get(head, -1)
            if layer == -1:
                m = _EXPERT_PREFIX.fullmatch(head)
                layer = int(m["layer"]) if m else None
                if len(_PREFIX_LAYER) > 65536:
                    _PREFIX_LAYER.clear()
                _PREFIX_LAYER[head] = layer
            if layer is not None and k + 1 < len(name):
                return ExpertTensor(layer, int(name[j:k]), "expert", head, name[k:])
    if "experts" not in name and "gate" not in name and "router" not in name and "bias" not in name:
        return None  # attention, norms, embeddings: no regex
    m = _PER_EXPERT.match(name)
    if m:
        return ExpertTensor(int(m["layer"]), int(m["id"]), "expert", m["pre"] + m["x"], m["tail"])
    m = _ROUTER.match(name)
    if m:
        role = "bias" if m["rest"] == "e_score_correction_bias" else "router"
        return ExpertTensor(int(m["layer"]), None, role, name, "")
    m = _BIAS.match(name)
    if m:
        return ExpertTensor(int(m["layer"]), None, "bias", name, "")
    m = _STACKED.match(name)
    if m:
        return ExpertTensor(int(m["layer"]), None, "stacked", name, "")
    return None


@dataclass(frozen=True)
class Relabel:
    """A renaming of experts ready to apply to tensor names: ``new2old [L, E]`` over the MoE decoder layers
    ``moe_layers`` (in order). Built from a placement (:func:`from_placement`) or read from a manifest."""

    new2old: np.ndarray
    moe_layers: tuple[int, ...]
    layout: Layout

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {d: i for i, d in enumerate(self.moe_layers)})
        object.__setattr__(self, "old2new", inverse(self.new2old))

    @property
    def num_experts(self) -> int:
        return int(self.new2old.shape[1])

    def moe_index(self, decoder_layer: int) -> int | None:
        """Index into ``new2old`` of a decoder layer; ``None`` for a layer outside the plan (DeepSeek-V3's
        multi-token-prediction layer 61 is not one of the 58 MoE layers engines place: left as it is)."""
        return self._index.get(decoder_layer)

    def source_name(self, t: ExpertTensor) -> str | None:
        """For a per-expert tensor of the relabelled checkpoint, the source tensor it holds; ``None`` when
        its layer is not relabelled."""
        i = self.moe_index(t.layer)
        return None if i is None or t.expert is None else t.renamed(int(self.new2old[i, t.expert]))

    def target_name(self, t: ExpertTensor) -> str | None:
        """For a per-expert tensor of the source checkpoint, its name in the relabelled one."""
        i = self.moe_index(t.layer)
        return None if i is None or t.expert is None else t.renamed(int(self.old2new[i, t.expert]))

    def rows(self, t: ExpertTensor) -> np.ndarray | None:
        """``new2old`` of ``t``'s layer for a tensor whose dim 0 runs over experts (stacked, router, bias):
        row ``n`` of the relabelled tensor is row ``rows[n]`` of the source. ``None`` when not relabelled."""
        i = self.moe_index(t.layer)
        return None if i is None or t.role == "expert" else self.new2old[i]


def from_placement(placement: Placement, layout: Layout) -> Relabel:
    return Relabel(permutations(placement, layout), tuple(placement.moe_layers), layout)


def to_original(new2old_row: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Engine (relabelled) expert ids -> original ids for one layer: ``new2old_row[ids]`` (``-1`` padding,
    as routing records use it, stays ``-1``)."""
    ids = np.asarray(ids)
    out = new2old_row[np.clip(ids, 0, None)]
    return np.where(ids < 0, ids, out)


# ---------------------------------------------------------------------------- reading what names a renaming
def read_relabel(path: str, layout: Layout | None = None) -> tuple[Relabel, dict]:
    """The renaming a file names: a relabel manifest (``moeplace-relabel.json``: its own permutation and
    layout) or a placement JSON (its permutation under ``layout``, contiguous by default). Returns the
    :class:`Relabel` and the file's facts (``model``, ``num_experts``, ``moe_layers``, ``num_gpus``,
    ``kind``)."""
    doc = read_json(path, "no such placement or relabel manifest", "not a readable JSON")
    if kind_of(doc) == "placement":
        placement = load_placement(path)
        lay = layout or CONTIGUOUS
        try:
            rel = from_placement(placement, lay)
        except InputError as exc:
            raise InputError(f"{path}: {exc}") from None
        return rel, {"kind": "placement", "model": placement.model_name, "num_experts": placement.num_experts,
                     "moe_layers": list(placement.moe_layers), "num_gpus": placement.num_gpus,
                     "layers": placement.layers_label}
    check(doc, "relabel-manifest", str(path), hint="or a placement JSON")
    for key in ("new2old", "layout", "num_experts", "moe_layers", "num_gpus", "model"):
        if key not in doc:
            raise InputError(f"{path}: field '{key}' missing")
    if doc["layout"] not in LAYOUTS:
        raise InputError(f"{path}: field 'layout' is {quote(doc['layout'])}, expected one of {', '.join(LAYOUTS)}")
    lay = LAYOUTS[doc["layout"]]
    if layout is not None and layout != lay:
        raise InputError(f"{path}: the manifest's layout is {lay.name}, the engine's is {layout.name}")
    new2old, moe_layers, E, G = _manifest_numbers(doc, str(path))
    check_permutations(new2old, E, str(path))
    facts = {"model": doc["model"], "num_experts": E, "moe_layers": list(moe_layers), "num_gpus": G}
    return Relabel(new2old, moe_layers, lay), {"kind": "manifest", **facts}


def _manifest_numbers(doc: dict, path: str) -> tuple[np.ndarray, tuple[int, ...], int, int]:
    """``(new2old, moe_layers, num_experts, num_gpus)`` of a manifest, checked as strictly as a placement's
    fields: whole numbers (never a bool or a float such as 0.5), the layers strictly increasing, one
    permutation row per layer, GPUs that divide the experts (a renaming holds each expert once)."""
    def whole(key: str, v, lo: int = 0) -> int:
        if not is_int(v) or v < lo:
            raise InputError(f"{path}: field '{key}' must be a whole number >= {lo}, got {quote(v)}")
        return int(v)

    if not isinstance(doc["model"], str) or not doc["model"]:
        raise InputError(f"{path}: field 'model' must be the model's name, got {quote(doc['model'])}")
    E = whole("num_experts", doc["num_experts"], 1)
    G = whole("num_gpus", doc["num_gpus"], 1)
    if E % G:
        raise InputError(f"{path}: field 'num_gpus' is {G}, which does not divide the {E} experts (a relabelled "
                         "model holds each expert once, the same number on every GPU)")
    if "gpus_per_node" in doc:
        gpn = whole("gpus_per_node", doc["gpus_per_node"], 1)
        if G % gpn:
            raise InputError(f"{path}: field 'gpus_per_node' is {gpn}, which does not divide num_gpus {G}")
    layers = doc["moe_layers"]
    if not isinstance(layers, list) or not layers:
        raise InputError(f"{path}: field 'moe_layers' must be a list of decoder-layer indices, got {quote(layers)}")
    moe_layers = tuple(whole(f"moe_layers[{i}]", x) for i, x in enumerate(layers))
    if list(moe_layers) != sorted(set(moe_layers)):
        raise InputError(f"{path}: field 'moe_layers' must be strictly increasing, got {quote(layers)}")
    rows = doc["new2old"]
    if not isinstance(rows, list) or len(rows) != len(moe_layers):
        got = f"{len(rows)} rows" if isinstance(rows, list) else quote(rows)
        raise InputError(f"{path}: field 'new2old' must hold one row per MoE layer ({len(moe_layers)}), got {got}")
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != E:
            raise InputError(f"{path}: field 'new2old': layer {i} must be a list of {E} expert ids, got "
                             f"{quote(row)}")
        bad = next((j for j, x in enumerate(row) if not is_int(x)), None)
        if bad is not None:
            raise InputError(f"{path}: field 'new2old': layer {i} position {bad}: expected an expert id (a whole "
                             f"number), got {quote(row[bad])}")
    return np.asarray(rows, dtype=np.int64), moe_layers, E, G


def check_for_model(facts: dict, model: ModelSpec, where: str, against: str) -> None:
    """The renaming :func:`read_relabel` read (``facts``) was made for ``model``: the same name, expert count
    and MoE layers, as a placement is checked against the inputs it goes with. ``where`` names the file,
    ``against`` what ``model`` came from (``--model 'kimi-k3'``). A placement planned on a log of some MoE
    layers says so and names both sets of layer ids."""
    layers, E = tuple(facts["moe_layers"]), int(facts["num_experts"])
    want = tuple(model.moe_layers)
    if facts.get("layers") and layers != want:  # a placement planned on some MoE layers only
        raise InputError(f"{where}: planned on {facts['layers']} of model '{facts['model']}' (MoE layers "
                         f"{format_ranges(layers)}, the ones its routing log held), but {against} has MoE layers "
                         f"{format_ranges(want)}: a renaming planned on some layers cannot map the others; plan on "
                         "a log of every MoE layer")
    if E != model.num_experts or layers != want:
        if E == model.num_experts and len(layers) == len(want):
            raise InputError(f"{where}: made for MoE layers {format_ranges(layers)} of '{facts['model']}', but "
                             f"{against} has MoE layers {format_ranges(want)} (the same count, other layers)")
        raise InputError(f"{where}: made for '{facts['model']}' ({E} experts, {len(layers)} MoE layers: "
                         f"{format_ranges(layers)}); {against} has {model.num_experts} experts and "
                         f"{model.num_moe_layers} MoE layers ({format_ranges(want)})")
    if facts["model"] != model.name:
        raise InputError(f"{where}: made for model '{facts['model']}', but {against} is model '{model.name}' (the "
                         f"same shape, {E} experts x {len(layers)} MoE layers, is not the same model: its experts "
                         "are others); give the model the renaming was made for")


# ---------------------------------------------------------------------------- per-expert quantization entries
def quantization_config(config: dict) -> dict | None:
    """The ``quantization_config`` of a Hugging Face ``config.json`` (top level, or a multimodal model's
    ``text_config``, as Kimi K3 nests it); ``None`` when there is none."""
    for holder in (config, config.get("text_config")):
        if isinstance(holder, dict) and isinstance(holder.get("quantization_config"), dict):
            return holder["quantization_config"]
    return None


def _name_lists(q: dict) -> list[tuple[str, list]]:
    """``(where, list)`` of every list of module names in a compressed-tensors style ``quantization_config``
    (``ignore``, ``config_groups.*.targets``; also ``modules_to_not_convert`` of other quantizers)."""
    out = []
    for key in ("ignore", "modules_to_not_convert"):
        if isinstance(q.get(key), list):
            out.append((key, q[key]))
    groups = q.get("config_groups")
    if isinstance(groups, dict):
        for g, spec in groups.items():
            if isinstance(spec, dict) and isinstance(spec.get("targets"), list):
                out.append((f"config_groups.{g}.targets", spec["targets"]))
    return out


def relabel_quantization(q: dict, rel: Relabel, modules: Callable[[], dict[int, list[tuple[int, str]]]],
                         where: str) -> tuple[dict, int]:
    """``q`` with every entry that names one expert's module renamed through ``rel`` (an exact name
    ``...layers.5.mlp.experts.17.w1`` becomes ``...experts.{old2new[17]}.w1``), and the number renamed.
    A regular expression (``re:...``) cannot be renamed: it is kept when the set of expert modules it
    matches in every relabelled layer is the same after the renaming (``re:.*experts.*``, or all ``w1``
    modules), and refused (:class:`InputError`) when it picks out some experts and not their new names.
    ``modules()``: per decoder layer, ``(expert id, module name)`` of the checkpoint's per-expert modules
    (called once, only when a pattern is to be checked)."""
    out = copy.deepcopy(q)
    renamed = 0
    mods: list = []

    def get_modules():
        if not mods:
            mods.append(modules())
        return mods[0]

    for key, names in _name_lists(out):
        for i, entry in enumerate(names):
            if not isinstance(entry, str):
                continue
            if entry.startswith("re:"):
                bad = _regex_moves(entry[3:], rel, get_modules())
                if bad:
                    raise InputError(f"{where}: quantization_config.{key}[{i}] {entry!r} names some experts of MoE "
                                     f"layer {bad[0]} ({bad[1]}) but not what they are renamed to; a pattern "
                                     "cannot be renamed: list those modules by name")
                continue
            t = classify(entry)
            if t is None or t.expert is None or rel.moe_index(t.layer) is None:
                continue
            if t.expert >= rel.num_experts:
                raise InputError(f"{where}: quantization_config.{key}[{i}] {entry!r}: expert id {t.expert} out of "
                                 f"range [0, {rel.num_experts})")
            new = rel.target_name(t)
            if new != entry:
                names[i] = new
                renamed += 1
    return out, renamed


def _regex_moves(pattern: str, rel: Relabel, modules: dict[int, list[tuple[int, str]]]) -> tuple[int, str] | None:
    """``(layer, module)`` of the first per-expert module that ``pattern`` matches while its renamed
    counterpart does not (or the reverse); ``None`` when the renaming maps the matched set onto itself."""
    try:
        rx = re.compile(pattern)
    except re.error as exc:
        raise InputError(f"quantization_config: pattern {pattern!r} is not a regular expression ({exc})") from None
    for layer, mods in modules.items():
        i = rel.moe_index(layer)
        if i is None:
            continue
        hit = {(e, name[name.index(f"experts.{e}.") + len(f"experts.{e}."):]) for e, name in _matching(rx, mods)}
        if not hit:
            continue
        moved = {(int(rel.old2new[i, e]), tail) for e, tail in hit}
        if moved != hit:
            e, tail = min(hit ^ moved)
            return layer, f"experts.{e}.{tail}"
    return None


# what in a pattern could match across a newline or anchor at the text's ends: such patterns are matched
# name by name, the others against all names at once
_MULTILINE_UNSAFE = re.compile(r"\\[AZszSWDn]|\[\^|\(\?[a-zA-Z]*s|\\x0[aA]|\\012")


def _matching(rx: re.Pattern, mods: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The ``(expert, module)`` pairs whose module ``rx.match``es: one scan of all names joined by newlines
    (a zero-width lookahead at each line start) where the pattern cannot see past a line, each candidate
    then confirmed on its own; name by name otherwise."""
    if _MULTILINE_UNSAFE.search(rx.pattern) or rx.flags & re.DOTALL:
        return [(e, m) for e, m in mods if rx.match(m)]
    text = "\n".join(m for _, m in mods)
    starts = {}
    pos = 0
    for k, (_, m) in enumerate(mods):
        starts[pos] = k
        pos += len(m) + 1
    joined = re.compile(f"^(?=(?:{rx.pattern}))", rx.flags | re.MULTILINE)
    cand = [mods[starts[m.start()]] for m in joined.finditer(text) if m.start() in starts]
    return [(e, m) for e, m in cand if rx.match(m)]
