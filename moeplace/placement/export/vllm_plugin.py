"""A vLLM general plugin that relabels experts while vLLM loads the weights: a placement served without
writing a relabelled copy of the checkpoint (docs/export.md "Without copying: the vLLM plugin").

Declared in the wheel as entry point ``vllm.general_plugins`` / ``moeplace`` (``pip install 'moeplace[vllm]'``
next to vLLM); vLLM's ``load_general_plugins`` calls :func:`register` in every process. It does nothing
unless ``MOEPLACE_PLACEMENT`` names a placement JSON (relabelled under vLLM's own
``--expert-placement-strategy``) or a relabel manifest (its permutation and layout). Then it wraps
``DefaultModelLoader.get_all_weights`` (vLLM 0.34.0, ``model_executor/model_loader/default_loader.py``) so
every ``(name, tensor)`` the checkpoint yields is renamed / row-permuted exactly as ``place export --format
checkpoint`` would have written it (:func:`relabel_weights`, the same :mod:`moeplace.placement.relabel` maps).

vLLM's EP weight filter (``local_expert_ids``: per-expert tensors of other ranks are skipped before they are
read, by the id in the checkpoint name) is kept correct: while the wrapped iterator runs, the filter holds
the *source* ids any layer of this rank needs, and the renamed tensors are filtered by the rank's own ids.

Refusals are one line (a ``RuntimeError`` vLLM prints as the cause): a vLLM release not checked here, a model
whose expert count or MoE layers differ from the file's, an EP size other than the placement's GPU count,
a manifest whose layout is not vLLM's strategy, or a checkpoint that is already relabelled.

Nothing here imports vLLM or torch at moeplace import time: vLLM is imported inside :func:`register`.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.foundation.model import from_hf_config
from moeplace.placement.relabel import VLLM_STRATEGY, Relabel, check_groups, classify, read_relabel

ENV = "MOEPLACE_PLACEMENT"
# vLLM releases whose loader this plugin was read against (DefaultModelLoader.get_all_weights, the EP
# weight filter's local_expert_ids, FusedMoE's per-expert checkpoint names).
CHECKED_VLLM = ("0.34.0",)
MANIFEST = "moeplace-relabel.json"


class PluginRefused(RuntimeError):
    """The plugin will not relabel this deployment; the message is one line."""


@dataclass(frozen=True)
class EngineFacts:
    """What the plugin checks against the file, gathered from vLLM at load time (or by a test)."""

    version: str
    hf_config: dict[str, Any]
    model_dir: str | None
    expert_parallel: bool
    ep_size: int
    strategy: str  # ParallelConfig.expert_placement_strategy: "linear" | "round_robin"


def check_version(version: str) -> None:
    if version not in CHECKED_VLLM:
        raise PluginRefused(f"moeplace: {ENV} is set but vLLM {version} is not a release this plugin was checked "
                            f"against ({', '.join(CHECKED_VLLM)}); unset {ENV} or serve a relabelled checkpoint "
                            "(place export --format checkpoint)")


def resolve(path: str, facts: EngineFacts) -> Relabel:
    """The renaming to apply for this deployment, after every check (:class:`PluginRefused` otherwise)."""
    check_version(facts.version)
    where = f"{ENV}={path}"
    if facts.strategy not in VLLM_STRATEGY:
        raise PluginRefused(f"moeplace: {where}: vLLM expert placement strategy {facts.strategy!r} unknown to moeplace")
    layout = VLLM_STRATEGY[facts.strategy]
    try:
        rel, info = read_relabel(path, layout)
        spec = from_hf_config(facts.hf_config, source="the served model's config")
        if (spec.num_experts, tuple(spec.moe_layers)) != (info["num_experts"], tuple(info["moe_layers"])):
            raise InputError(f"made for '{info['model']}' ({info['num_experts']} experts, {len(info['moe_layers'])} "
                             f"MoE layers); vLLM serves {spec.hf_model_type} with {spec.num_experts} experts and "
                             f"{spec.num_moe_layers} MoE layers")
        check_groups(rel.new2old, spec.n_group, spec.topk_group, path)
    except InputError as exc:
        raise PluginRefused(f"moeplace: {where}: {exc}") from None
    if facts.model_dir and (Path(facts.model_dir) / MANIFEST).is_file():
        raise PluginRefused(f"moeplace: {where}: {facts.model_dir} is already a relabelled checkpoint "
                            f"({MANIFEST}); serve it without {ENV}")
    if not facts.expert_parallel or facts.ep_size != info["num_gpus"]:
        got = f"EP size {facts.ep_size}" if facts.expert_parallel else "expert parallelism off"
        raise PluginRefused(f"moeplace: {where}: the placement is for {info['num_gpus']} EP ranks but vLLM runs "
                            f"with {got}: pass --enable-expert-parallel with TP x DP = {info['num_gpus']}")
    return rel


def source_ids(rel: Relabel, local: set[int]) -> set[int]:
    """Source expert ids whose tensors some layer's local ``local`` (engine ids) needs: what vLLM's EP weight
    filter must let through while it still sees source names."""
    idx = np.fromiter(sorted(local), dtype=np.int64)
    return {int(x) for x in np.unique(rel.new2old[:, idx])}


def relabel_weights(weights: Iterable[tuple[str, Any]], rel: Relabel,
                    local: set[int] | None = None) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` of the source checkpoint -> those of the relabelled one, one at a time: per-expert
    tensors renamed (``experts.{old}`` -> ``experts.{old2new}``; with ``local``, only those whose new id is
    in it), router rows / stacked experts / per-expert biases gathered along dim 0 by ``new2old``. Tensors
    are torch tensors (vLLM's); a third tuple element (vLLM's per-weight extras) passes through."""
    import torch  # the tensors vLLM yields are torch's (vLLM brings it); moeplace's core install has none

    E = rel.num_experts
    for item in weights:
        name, tensor = item[0], item[1]
        t = classify(name)
        if t is not None and rel.moe_index(t.layer) is not None:
            if t.role == "expert":
                new = int(rel.old2new[rel.moe_index(t.layer), t.expert])
                if local is not None and new not in local:
                    continue
                name = t.renamed(new)
            elif tensor.dim() > 0:
                if tensor.shape[0] != E:
                    raise PluginRefused(f"moeplace: tensor {name}: {tuple(tensor.shape)}, expected {E} expert rows "
                                        "along dim 0 to permute")
                tensor = tensor.index_select(0, torch.as_tensor(rel.rows(t), device=tensor.device))
        yield (name, tensor, *item[2:])


def _facts(model_config) -> EngineFacts:
    import vllm  # optional: only inside vLLM's processes
    from vllm.config import get_current_vllm_config  # optional, as above

    par = get_current_vllm_config().parallel_config
    ep = par.data_parallel_size * par.tensor_parallel_size * getattr(par, "prefill_context_parallel_size", 1)
    hf = model_config.hf_config.to_dict()
    model = str(model_config.model)
    return EngineFacts(vllm.__version__, hf, model if os.path.isdir(model) else None,
                       bool(par.enable_expert_parallel), ep, str(par.expert_placement_strategy))


def register() -> None:
    """vLLM's entry point: wrap the default loader's weight iterator when ``MOEPLACE_PLACEMENT`` is set."""
    path = os.environ.get(ENV)
    if not path:
        return
    import vllm  # optional: only inside vLLM's processes (this runs only when MOEPLACE_PLACEMENT is set)

    check_version(vllm.__version__)
    try:
        read_relabel(path)  # a missing or unreadable file fails here, in every process, before any loading
    except InputError as exc:
        raise PluginRefused(f"moeplace: {ENV}: {exc}") from None
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader  # optional, as above

    if getattr(DefaultModelLoader.get_all_weights, "_moeplace", False):
        return  # vLLM may load general plugins more than once per process
    original = DefaultModelLoader.get_all_weights

    def get_all_weights(self, model_config, model):
        rel = resolve(path, _facts(model_config))
        local = getattr(self, "local_expert_ids", None)
        if local is not None:
            self.local_expert_ids = source_ids(rel, local)
        try:
            yield from relabel_weights(original(self, model_config, model), rel, local)
        finally:
            if local is not None:
                self.local_expert_ids = local

    get_all_weights._moeplace = True
    DefaultModelLoader.get_all_weights = get_all_weights
