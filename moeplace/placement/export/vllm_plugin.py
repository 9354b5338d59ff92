"""A vLLM general plugin that relabels experts while vLLM loads the weights: a placement served without
writing a relabelled copy of the checkpoint (docs/export.md "Without copying: the vLLM plugin").

Declared in the wheel as entry point ``vllm.general_plugins`` / ``moeplace`` (``pip install 'moeplace[vllm]'``
next to vLLM); vLLM's ``load_general_plugins`` calls :func:`register` in every process. It does nothing
unless ``MOEPLACE_PLACEMENT`` names a placement JSON (relabelled for the expert layout vLLM will actually
use) or a relabel manifest (its permutation and layout). Then it wraps ``DefaultModelLoader.get_all_weights``
(vLLM 0.34.0, ``model_executor/model_loader/default_loader.py``) so every ``(name, tensor)`` the checkpoint
yields is renamed / row-permuted exactly as ``place export --format checkpoint`` would have written it
(:func:`relabel_weights`, the same :mod:`moeplace.placement.relabel` maps).

It fails closed: where it cannot relabel exactly it stops the load with one line (a :class:`PluginRefused`
vLLM prints as the cause), never loads the original layout quietly.

- The layout: vLLM 0.34.0 honours ``--expert-placement-strategy round_robin`` only for models with several
  expert groups, no redundant experts, no EPLB and an all-to-all kernel that has round-robin routing tables
  (``determine_expert_placement_strategy``), and MegaMoE (``--moe-backend deep_gemm_mega_moe``) places
  experts contiguously whatever the strategy; the plugin asks vLLM's own function and relabels for the
  layout it answers (a manifest of another layout is refused).
- Refused at load: a vLLM release not checked here; EPLB with redundant experts (EPLB's initial split
  shifts every rank's block); a loader other than ``DefaultModelLoader`` (runai_streamer, sharded_state,
  tensorizer, ipc_cache, modelexpress, dummy: they never call the wrapped iterator); a checkpoint that is
  already relabelled (manifest, or ``__metadata__`` naming a relabelling); ``quantization_config`` entries
  that name experts (``ignore``, ``config_groups.*.targets``: vLLM built its quantized layers from them
  before the weights are read, so they cannot be renamed now -- the relabelled checkpoint renames them);
  a model or EP size other than the file's.
- vLLM's EP weight filter (``--enable-ep-weight-filter``: each rank skips other ranks' heavy expert
  tensors before reading them) reads per layer only the source experts that layer's new ids need (K3 on
  EP32: 28 of 896 per layer, not the union over 92 layers): the filter set the plugin installs knows the
  layer of each name, and vLLM's ``should_skip_weight`` is wrapped to ask it by name.
- ``--data-parallel-backend ray``: vLLM's Ray actors receive only some variables (``vllm/ray/ray_env.py``);
  the plugin adds ``MOEPLACE_PLACEMENT`` to ``VLLM_RAY_EXTRA_ENV_VARS_TO_COPY`` in the process that has it
  (and the printed launches set it too), so no rank loads the original layout.
- Every rank logs what it applied: ``moeplace-plugin: rank R/G applied placement <fingerprint> ...``;
  ``place export --check-logs LOG...`` finds a deployment in which ranks differ or some applied nothing.

Nothing here imports vLLM or torch at moeplace import time: vLLM is imported inside :func:`register`.
"""
from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.foundation.model import from_hf_config
from moeplace.foundation.reading import read_json
from moeplace.placement.export.capabilities import PLUGIN_ENV, RAY_ENV_COPY
from moeplace.placement.export.checkpoint import expert_module_names, relabelled_reason
from moeplace.placement.record import load_placement
from moeplace.placement.relabel import (
    VLLM_STRATEGY,
    Relabel,
    check_groups,
    classify,
    quantization_config,
    read_relabel,
    relabel_quantization,
)

ENV = PLUGIN_ENV
LOG_TAG = "moeplace-plugin"
# vLLM releases whose loader this plugin was read against (DefaultModelLoader.get_all_weights, the EP
# weight filter's local_expert_ids and should_skip_weight, determine_expert_placement_strategy, FusedMoE's
# per-expert checkpoint names).
CHECKED_VLLM = ("0.34.0",)


class PluginRefused(RuntimeError):
    """The plugin will not relabel this deployment; the message is one line."""


@dataclass(frozen=True)
class EngineFacts:
    """What the plugin checks against the file, gathered from vLLM at load time (or by a test).
    ``strategy``: the requested ``--expert-placement-strategy``; ``effective``: the layout vLLM's FusedMoE
    will use (its ``determine_expert_placement_strategy``; ``None``: the requested one)."""

    version: str
    hf_config: dict[str, Any]
    model_dir: str | None
    expert_parallel: bool
    ep_size: int
    strategy: str  # ParallelConfig.expert_placement_strategy: "linear" | "round_robin"
    effective: str | None = None
    eplb: bool = False
    redundant: int = 0
    loader: str = "DefaultModelLoader"


def check_version(version: str) -> None:
    if version not in CHECKED_VLLM:
        raise PluginRefused(f"moeplace: {ENV} is set but vLLM {version} is not a release this plugin was checked "
                            f"against ({', '.join(CHECKED_VLLM)}); unset {ENV} or serve a relabelled checkpoint "
                            "(place export --format checkpoint)")


def refuse_loader(loader: str, load_format: str) -> None:
    """The plugin relabels only what ``DefaultModelLoader`` reads: any other loader would load the original
    layout."""
    raise PluginRefused(f"moeplace: {ENV} is set but --load-format {load_format} loads through {loader}, which "
                        f"the plugin does not wrap (it would load the original expert layout): use the default "
                        "loader (safetensors) or serve a relabelled checkpoint (place export --format checkpoint)")


def resolve(path: str, facts: EngineFacts) -> Relabel:
    """The renaming to apply for this deployment, after every check (:class:`PluginRefused` otherwise)."""
    check_version(facts.version)
    where = f"{ENV}={path}"
    if facts.loader != "DefaultModelLoader":
        refuse_loader(facts.loader, "?")
    if facts.eplb and facts.redundant:
        raise PluginRefused(f"moeplace: {where}: --enable-eplb with {facts.redundant} redundant experts: EPLB's "
                            "initial split shifts every rank's block of experts, so the relabelled layout is not the "
                            "placement; serve it without EPLB (or with num_redundant_experts 0)")
    strategy = facts.effective or facts.strategy
    if strategy not in VLLM_STRATEGY:
        raise PluginRefused(f"moeplace: {where}: vLLM expert placement strategy {strategy!r} unknown to moeplace")
    layout = VLLM_STRATEGY[strategy]
    if facts.model_dir:
        why = relabelled_reason(facts.model_dir)
        if why:
            raise PluginRefused(f"moeplace: {where}: {why}; serve it without {ENV} (relabelling it again would "
                                "move every expert twice)")
    try:
        rel, info = read_relabel(path, layout)
        spec = from_hf_config(facts.hf_config, source="the served model's config")
        if (spec.num_experts, tuple(spec.moe_layers)) != (info["num_experts"], tuple(info["moe_layers"])):
            raise InputError(f"made for '{info['model']}' ({info['num_experts']} experts, {len(info['moe_layers'])} "
                             f"MoE layers); vLLM serves {spec.hf_model_type} with {spec.num_experts} experts and "
                             f"{spec.num_moe_layers} MoE layers")
        check_groups(rel.new2old, spec.n_group, spec.topk_group, path)
    except InputError as exc:
        msg = str(exc)
        if facts.effective and facts.effective != facts.strategy and "layout is" in msg:
            msg += (f" (vLLM was asked for {facts.strategy} but places experts {facts.effective}: "
                    "determine_expert_placement_strategy)")
        raise PluginRefused(f"moeplace: {where}: {msg}") from None
    if not facts.expert_parallel or facts.ep_size != info["num_gpus"]:
        got = f"EP size {facts.ep_size}" if facts.expert_parallel else "expert parallelism off"
        raise PluginRefused(f"moeplace: {where}: the placement is for {info['num_gpus']} EP ranks but vLLM runs "
                            f"with {got}: pass --enable-expert-parallel with TP x DP = {info['num_gpus']}")
    check_quantization(rel, facts, where)
    return rel


def check_quantization(rel: Relabel, facts: EngineFacts, where: str) -> None:
    """Refuse ``quantization_config`` entries that name experts the renaming moves (vLLM has built its
    quantized layers from them before any weight is read: too late to rename them)."""
    q = quantization_config(facts.hf_config)
    if q is None:
        return
    try:
        _, n = relabel_quantization(q, rel, lambda: expert_module_names(facts.model_dir, rel) if facts.model_dir
                                    else {}, "the served model's config")
    except InputError as exc:
        raise PluginRefused(f"moeplace: {where}: {exc}; serve a relabelled checkpoint instead") from None
    if n:
        raise PluginRefused(f"moeplace: {where}: the model's quantization_config names {n} expert module(s) the "
                            "relabelling moves (ignore / config_groups targets), and vLLM built its layers from them "
                            "before loading: serve a relabelled checkpoint (place export --format checkpoint renames "
                            "them)")


def rank_experts(rel: Relabel, ep_size: int, rank: int) -> set[int]:
    """The engine ids EP rank ``rank`` holds in ``rel``'s layout (vLLM's determine_expert_map)."""
    E = rel.num_experts
    per = E // ep_size
    return {int(x) for x in rel.layout.slot_ids(E, ep_size)[rank * per:(rank + 1) * per]}


def rank_of(local: set[int], E: int, ep_size: int, strategy: str) -> int:
    """The EP rank whose local ids (as vLLM computed them for ``strategy``) are ``local``."""
    return min(local) if strategy == "round_robin" else min(local) // (E // ep_size)


class LayerFilter(set):
    """vLLM's EP weight filter while the plugin reads the source checkpoint: as a set, the source ids some
    layer of this rank needs (what code asking by id alone sees); :meth:`ids_for` gives, by tensor name,
    the source ids that tensor's layer needs -- ``should_skip_weight`` wrapped by :func:`register` asks it,
    so each layer reads only its own source experts."""

    def __init__(self, rel: Relabel, local: set[int]) -> None:
        idx = np.fromiter(sorted(local), dtype=np.int64)
        self.per_layer = {d: {int(x) for x in rel.new2old[i, idx]} for i, d in enumerate(rel.moe_layers)}
        self.local = set(local)
        super().__init__(set(self.local).union(*self.per_layer.values()))

    def ids_for(self, name: str) -> set[int]:
        t = classify(name)
        if t is None or t.expert is None:
            return self
        return self.per_layer.get(t.layer, self.local)  # a layer outside the placement keeps its own ids


def source_ids(rel: Relabel, local: set[int]) -> set[int]:
    """Source expert ids whose tensors some layer's local ``local`` (engine ids) needs."""
    return set(LayerFilter(rel, local))


def skip_like_vllm(name: str, local: set[int]) -> bool:
    """vLLM 0.34.0's ``should_skip_weight`` (ep_weight_filter.py): a per-expert *heavy* tensor (``.weight``,
    ``.weight_packed``) of an expert not in ``local``; scales of every expert are kept (some backends need
    them all). The plugin passes vLLM's own function where vLLM is there."""
    m = re.search(r"\.experts\.(\d+)\.", name)
    return bool(m) and name.endswith((".weight", ".weight_packed")) and int(m[1]) not in local


def relabel_weights(weights: Iterable[tuple[str, Any]], rel: Relabel, local: set[int] | None = None,
                    skip: Callable[[str, set[int]], bool] = skip_like_vllm) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` of the source checkpoint -> those of the relabelled one, one at a time: per-expert
    tensors renamed (``experts.{old}`` -> ``experts.{old2new}``; with ``local``, those ``skip`` drops for the
    new name are dropped, as vLLM's filter drops them reading the relabelled checkpoint), router rows /
    stacked experts / per-expert biases gathered along dim 0 by ``new2old``. Tensors are torch tensors
    (vLLM's); a third tuple element (vLLM's per-weight extras) passes through."""
    import torch  # the tensors vLLM yields are torch's (vLLM brings it); moeplace's core install has none

    E = rel.num_experts
    for item in weights:
        name, tensor = item[0], item[1]
        t = classify(name)
        if t is not None and rel.moe_index(t.layer) is not None:
            if t.role == "expert":
                name = t.renamed(int(rel.old2new[rel.moe_index(t.layer), t.expert]))
                if local is not None and skip(name, local):
                    continue
            elif tensor.dim() > 0:
                if tensor.shape[0] != E:
                    raise PluginRefused(f"moeplace: tensor {name}: {tuple(tensor.shape)}, expected {E} expert rows "
                                        "along dim 0 to permute")
                tensor = tensor.index_select(0, torch.as_tensor(rel.rows(t), device=tensor.device))
        yield (name, tensor, *item[2:])


APPLIED = re.compile(rf"{LOG_TAG}: rank (\d+|\?)/(\d+) applied placement (\S+) \(new2old (\w+), layout (\w+)\)")


def applied_line(rel: Relabel, fingerprint: str, rank: int | None, ep_size: int, reading: int | None) -> str:
    """The line each rank logs (what ``place export --check-logs`` reads)."""
    digest = hashlib.sha256(np.ascontiguousarray(rel.new2old, dtype=np.int64).tobytes()).hexdigest()[:16]
    read = f"; reading {reading} of {rel.num_experts} source experts per layer" if reading is not None else ""
    return (f"{LOG_TAG}: rank {'?' if rank is None else rank}/{ep_size} applied placement {fingerprint} "
            f"(new2old {digest}, layout {rel.layout.name}){read}")


# ---------------------------------------------------------------------------- inside vLLM
def effective_strategy(par, num_expert_group: int, moe_backend: str | None) -> str:
    """The layout vLLM 0.34.0's FusedMoE will use: MegaMoE places experts contiguously (``experts_start_idx
    = ep_rank * local``), else vLLM's own ``determine_expert_placement_strategy`` on the parallel config."""
    if moe_backend == "deep_gemm_mega_moe":
        return "linear"
    import vllm.model_executor.layers.fused_moe.config as moe_config  # optional: inside vLLM only
    import vllm.model_executor.layers.fused_moe.expert_map_manager as maps  # optional, as above

    dp, tp = par.data_parallel_size, par.tensor_parallel_size
    pcp = getattr(par, "prefill_context_parallel_size", 1)
    # the sizes FusedMoEParallelConfig.make gives an EP layer (ranks do not enter the decision)
    mpc = moe_config.FusedMoEParallelConfig(tp_size=1, pcp_size=pcp, dp_size=dp, ep_size=dp * pcp * tp, tp_rank=0, pcp_rank=0,
                                 dp_rank=0, ep_rank=0, sp_size=1, use_ep=True, all2all_backend=par.all2all_backend,
                                 enable_eplb=par.enable_eplb)
    return maps.determine_expert_placement_strategy(par.expert_placement_strategy, mpc, num_expert_group,
                                               par.eplb_config.num_redundant_experts, par.enable_eplb)


def _facts(loader, model_config) -> EngineFacts:
    import vllm  # optional: only inside vLLM's processes
    from vllm.config import get_current_vllm_config  # optional, as above

    cfg = get_current_vllm_config()
    par = cfg.parallel_config
    ep = par.data_parallel_size * par.tensor_parallel_size * getattr(par, "prefill_context_parallel_size", 1)
    hf = model_config.hf_config.to_dict()
    model_dir = str(model_config.model)
    if not os.path.isdir(model_dir):  # a hub id: the local snapshot vLLM reads (downloaded as vLLM would)
        model_dir = loader._prepare_weights(model_config.model, None, model_config.revision, True, None)[0]
    spec = from_hf_config(hf, source="the served model's config")
    backend = getattr(getattr(cfg, "kernel_config", None), "moe_backend", None)
    return EngineFacts(vllm.__version__, hf, model_dir, bool(par.enable_expert_parallel), ep,
                       str(par.expert_placement_strategy), effective_strategy(par, spec.n_group, backend),
                       bool(par.enable_eplb), int(par.eplb_config.num_redundant_experts), type(loader).__name__)


def _log(line: str) -> None:
    from vllm.logger import init_logger  # optional: inside vLLM only (its log configuration)

    init_logger("vllm.moeplace").info(line)


def register() -> None:
    """vLLM's entry point: when ``MOEPLACE_PLACEMENT`` is set, wrap the default loader's weight iterator and
    vLLM's EP filter, refuse every other loader, and pass the variable to Ray DP actors."""
    path = os.environ.get(ENV)
    if not path:
        return
    import vllm  # optional: only inside vLLM's processes (this runs only when MOEPLACE_PLACEMENT is set)

    check_version(vllm.__version__)
    try:
        read_relabel(path)  # a missing or unreadable file fails here, in every process, before any loading
    except InputError as exc:
        raise PluginRefused(f"moeplace: {ENV}: {exc}") from None
    extra = [x for x in os.environ.get(RAY_ENV_COPY, "").split(",") if x.strip()]
    if ENV not in extra:  # Ray DP actors get only VLLM_* / HF_* ... and the names listed here (ray_env.py)
        os.environ[RAY_ENV_COPY] = ",".join([*extra, ENV])
    from vllm.model_executor.model_loader import base_loader, weight_utils  # optional, as above
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader  # optional, as above

    if getattr(DefaultModelLoader.get_all_weights, "_moeplace", False):
        return  # vLLM may load general plugins more than once per process
    _wrap_filter(weight_utils)
    _refuse_other_loaders(base_loader.BaseModelLoader, DefaultModelLoader)
    original = DefaultModelLoader.get_all_weights
    vllm_skip = weight_utils.should_skip_weight.__wrapped__

    def get_all_weights(self, model_config, model):
        facts = _facts(self, model_config)
        rel = resolve(path, facts)
        local = getattr(self, "local_expert_ids", None)
        rank = None
        if local is not None:  # vLLM computed them for the requested strategy: the effective layout's instead
            # (under EPLB vLLM's filter splits the slots linearly: compute_eplb_local_expert_ids)
            rank = rank_of(local, rel.num_experts, facts.ep_size, "linear" if facts.eplb else facts.strategy)
            self.local_expert_ids = LayerFilter(rel, rank_experts(rel, facts.ep_size, rank))
        else:
            rank = _ep_rank()
        mine = None if local is None else self.local_expert_ids.local
        _log(applied_line(rel, _fingerprint(path), rank, facts.ep_size,
                          None if local is None else len(mine)))
        try:
            yield from relabel_weights(original(self, model_config, model), rel, mine, vllm_skip)
        finally:
            if local is not None:
                self.local_expert_ids = local

    get_all_weights._moeplace = True
    DefaultModelLoader.get_all_weights = get_all_weights


def _ep_rank() -> int | None:
    """This worker's EP rank from vLLM's process groups (``None`` where they are not set up)."""
    try:
        from vllm.distributed import get_ep_group  # optional: inside vLLM only

        return int(get_ep_group().rank_in_group)
    except Exception:  # noqa: BLE001 -- no EP group (a single process, a test): the log line says '?'
        return None


def _fingerprint(path: str) -> str:
    """The placement's fingerprint (a manifest records it), else the file's sha256 prefix."""
    doc = read_json(path)
    fp = (doc.get("placement") or {}).get("fingerprint") if isinstance(doc, dict) else None
    if fp:
        return str(fp)
    return load_placement(path).fingerprint()


def _wrap_filter(weight_utils) -> None:
    """vLLM's ``should_skip_weight`` (as the safetensors iterators call it) asks a :class:`LayerFilter` by name."""
    original = weight_utils.should_skip_weight

    def should_skip_weight(name, local_expert_ids):
        if isinstance(local_expert_ids, LayerFilter):
            return original(name, local_expert_ids.ids_for(name))
        return original(name, local_expert_ids)

    should_skip_weight.__wrapped__ = original
    weight_utils.should_skip_weight = should_skip_weight


def _refuse_other_loaders(base, default) -> None:
    """Every loader but ``DefaultModelLoader`` (and its subclasses) refuses to start while the variable is set."""
    init = base.__init__

    def __init__(self, load_config, *args, **kwargs):
        if not isinstance(self, default):
            refuse_loader(type(self).__name__, str(getattr(load_config, "load_format", "?")))
        init(self, load_config, *args, **kwargs)

    base.__init__ = __init__


# ---------------------------------------------------------------------------- a deployment's logs
@dataclass(frozen=True)
class LogCheck:
    """What the plugin's lines in a deployment's logs say: per (rank, EP size) what it applied, and the
    problems (empty: every rank of the EP group applied the same placement)."""

    applied: dict[tuple[str, int], tuple[str, str, str]]
    lines: int
    problems: list[str]


def check_logs(texts: dict[str, str], fingerprint: str | None = None) -> LogCheck:
    """Read every ``moeplace-plugin: rank R/G applied placement ...`` line of the logs ``texts`` (name ->
    text) and say whether the deployment is whole: one EP size, every rank 0..G-1 present (by number, or by
    count where ranks are unknown), one placement (fingerprint, permutation, layout) on all, and with
    ``fingerprint`` that one."""
    applied: dict[tuple[str, int], tuple[str, str, str]] = {}
    unnumbered = 0
    lines = 0
    problems = []
    for name, text in texts.items():
        for m in APPLIED.finditer(text):
            lines += 1
            rank, G, what = m[1], int(m[2]), (m[3], m[4], m[5])
            if rank == "?":
                unnumbered += 1
                rank = f"?{unnumbered}"
            prev = applied.get((rank, G))
            if prev is not None and prev != what:
                problems.append(f"rank {rank} logged two placements ({prev[0]} and {what[0]}; {name})")
            applied[(rank, G)] = what
    if not applied:
        none = (f"no '{LOG_TAG}: ... applied placement' line: the plugin relabelled nothing on any rank "
                "(MOEPLACE_PLACEMENT unset, moeplace not installed in the image, VLLM_PLUGINS without moeplace, "
                "or not these logs)")
        return LogCheck({}, 0, [none])
    sizes = sorted({G for _, G in applied})
    if len(sizes) > 1:
        problems.append(f"ranks report EP sizes {sizes}: more than one deployment in these logs")
    G = sizes[-1]
    numbered = {int(r) for r, g in applied if g == G and not r.startswith("?")}
    if numbered and len(numbered) + unnumbered < G:
        missing = sorted(set(range(G)) - numbered)
        problems.append(f"{len(missing)} of {G} EP ranks logged no placement (ranks {_ranges(missing)}): they "
                        "loaded the original expert layout -- a mixed model")
    elif not numbered and unnumbered < G:
        problems.append(f"{unnumbered} of {G} EP ranks logged a placement: the others loaded the original expert "
                        "layout -- a mixed model")
    kinds = sorted(set(applied.values()))
    if len(kinds) > 1:
        problems.append("ranks applied different placements: " + "; ".join(
            f"{fp} (new2old {h}, {lay}) on {sum(1 for v in applied.values() if v == (fp, h, lay))} rank(s)"
            for fp, h, lay in kinds))
    if fingerprint is not None and any(fp != fingerprint for fp, _, _ in kinds):
        problems.append(f"the ranks applied {', '.join(sorted({k[0] for k in kinds}))}, not the placement given "
                        f"({fingerprint})")
    return LogCheck(applied, lines, problems)


def _ranges(ids: list[int]) -> str:
    out, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)
