"""One capability table: which released serving engine can apply a placement to which model, and how.

engine x version x model architecture x feature -> supported or not, with the precise reason and where
it was read. Every command that tells a user how to serve a placement reads this table (``place export
--flags``, ``place rebalance``, ``place plan``/``optimize`` advice, ``place sweep``'s recommendation, the
dashboard's launch tabs), so they never disagree; ``place engines`` prints it.

Features (:data:`FEATURES`):

- ``checkpoint``: a relabelled checkpoint (``place export --format checkpoint``): the experts of each layer
  permuted so that the engine's own fixed layout *is* the placement. An exact model equivalence, so it
  works wherever the engine serves the model with expert parallelism; replica-free placements only.
- ``plugin``: the same permutation applied while the engine loads the weights (vLLM general plugin
  ``moeplace``: ``pip install 'moeplace[vllm]'``, switched on by ``MOEPLACE_PLACEMENT=<placement JSON>``).
- ``placement_file``: the engine loads a placement with replicas from a file (SGLang
  ``--init-expert-location``, TensorRT-LLM ``initial_global_assignments``, vLLM only with open PRs).
- ``online_eplb``: the engine's own online rebalancer (vLLM ``--enable-eplb``, SGLang ``--enable-eplb``,
  TensorRT-LLM ``layer_updates_per_iter > 0``).
- ``stats_dump``: the engine writes expert loads or routed experts that ``place trace import`` reads.

The facts were read in the released wheels (vLLM 0.34.0, SGLang 0.5.23, unpacked from PyPI) and in
TensorRT-LLM's published source (stored copies of 2026; it has no checked release here). A model is
matched by its Hugging Face ``model_type`` (:attr:`ModelSpec.hf_model_type`); an architecture the table
does not name is "not checked" (``supported is None``), never assumed to work.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moeplace.foundation.errors import InputError
from moeplace.foundation.model import ModelSpec
from moeplace.placement.relabel import splits_groups

PLUGIN_ENV = "MOEPLACE_PLACEMENT"  # the vLLM plugin reads the placement JSON named here
# vLLM copies the variables named here into its Ray DP workers (the plugin's PLUGIN_ENV must travel)
RAY_ENV_COPY = "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"
PLUGIN_INSTALL = "pip install 'moeplace[vllm]'"  # the extra that declares the vllm.general_plugins entry point


@dataclass(frozen=True)
class Feature:
    name: str
    title: str
    summary: str
    applies_placement: bool  # serves a moeplace placement (as opposed to rebalancing or recording)
    replicas: bool  # can realize redundant slots


FEATURES: dict[str, Feature] = {f.name: f for f in (
    Feature("checkpoint", "relabelled checkpoint", "place export --format checkpoint: the engine's own layout is "
            "the placement", True, False),
    Feature("plugin", "load-time plugin", f"{PLUGIN_ENV}=PLACEMENT with {PLUGIN_INSTALL}: permuted while loading",
            True, False),
    Feature("placement_file", "placement file", "the engine loads a placement (replicas included) from a file",
            True, True),
    Feature("online_eplb", "online EPLB", "the engine's own online rebalancer", False, True),
    Feature("stats_dump", "statistics dump", "expert loads / routed experts place trace import reads", False, False),
)}

# --------------------------------------------------------------------------------------- model facts
# HF model_type -> config.json "architectures"[0] (the published checkpoints' configs; Kimi K2 ships the
# DeepSeek-V3 architecture class, Kimi K3 its own)
ARCHITECTURE_OF_MODEL_TYPE = {
    "deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM", "llama4": "Llama4ForConditionalGeneration",
    "kimi_k3": "KimiK3ForConditionalGeneration", "kimi_linear": "KimiLinearForCausalLM", "olmoe": "OlmoeForCausalLM",
}
# TensorRT-LLM moe_load_balancer.py: moe_model_arch_list (the architectures whose MoE layers join the balancer)
TRTLLM_LB_ARCHITECTURES = ("DeepseekV3ForCausalLM", "MixtralForCausalLM", "Llama4ForConditionalGeneration",
                           "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
_TRTLLM_LB_MODEL_TYPES = frozenset(t for t, a in ARCHITECTURE_OF_MODEL_TYPE.items() if a in TRTLLM_LB_ARCHITECTURES)

# SGLang 0.5.23 model classes with get_model_config_for_expert_location (models/*.py): deepseek_v2.py
# (DeepSeek-V2/V3, Kimi K2), kimi_k25.py, qwen2_moe.py, qwen3_moe.py, glm4_moe.py
_SGLANG_EXPERT_LOCATION = frozenset({"deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25", "qwen2_moe", "qwen3_moe",
                                     "glm4_moe"})
_SGLANG_K3 = "SGLang 0.5.23: kimi_k3.py lacks get_model_config_for_expert_location; "
# vLLM 0.34.0 model classes implementing MixtureOfExperts with EPLB wired into their FusedMoE
# (model_executor/models/{deepseek_v2,qwen3_moe,mixtral,glm4_moe,llama4}.py)
_VLLM_EPLB = frozenset({"deepseek_v2", "deepseek_v3", "kimi_k2", "qwen3_moe", "mixtral", "glm4_moe", "llama4"})
_VLLM_K3_EPLB = ("vLLM 0.34.0 does not wire K3 into EPLB (models/kimi_k3/nvidia/model.py builds its FusedMoE without "
                 "enable_eplb / num_redundant_experts and sets no num_moe_layers, so EPLB registers no layer; open "
                 "PR #50647): --enable-eplb changes nothing")
# vLLM's open PRs that load a precomputed expert map (none merged in 0.34.0)
VLLM_MAP_PRS = (49572, 41141, 34811, 53022)


@dataclass(frozen=True)
class Cell:
    """One cell of the table. ``supported``: True, False, or None (not checked for this architecture).
    ``how``: the flag, format or command that uses the feature; ``reason``: why, with the source read."""

    engine: str
    version: str
    model_type: str
    feature: str
    supported: bool | None
    reason: str
    how: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "version": self.version, "model_type": self.model_type,
                "feature": self.feature, "supported": self.supported, "reason": self.reason, "how": self.how}

    @property
    def mark(self) -> str:
        return {True: "yes", False: "no", None: "?"}[self.supported]


@dataclass(frozen=True)
class ByArchitecture:
    """A feature whose support depends on the architecture: ``yes`` (None: every architecture) get
    ``why_yes``; ``no`` maps an architecture to why not; any other is "not checked". Reasons may use
    ``{model}`` and ``{arch}``."""

    yes: frozenset[str] | None
    why_yes: str
    no: Mapping[str, str] = field(default_factory=dict)
    how: str = ""
    why_unchecked: str = "not checked for {arch}"
    otherwise: str | None = None  # set: every architecture outside ``yes`` is unsupported, for this reason

    def judge(self, model_type: str) -> tuple[bool | None, str]:
        if model_type in self.no:
            return False, self.no[model_type]
        if self.yes is None or model_type in self.yes:
            return True, self.why_yes
        if self.otherwise is not None:
            return False, self.otherwise
        return None, self.why_unchecked


@dataclass(frozen=True)
class EngineRelease:
    """One engine release and its rules per feature. ``name`` is the export target's name
    (``placement.export.flags.EXPORT_TARGETS``)."""

    name: str
    title: str
    version: str
    rules: Mapping[str, ByArchitecture]

    def cell(self, model: ModelSpec, feature: str) -> Cell:
        if feature not in FEATURES:
            raise InputError(f"feature '{feature}' unknown (expected one of {', '.join(FEATURES)})")
        mt = model.hf_model_type or model.name
        ok, why = self.rules[feature].judge(mt)
        arch = ARCHITECTURE_OF_MODEL_TYPE.get(mt, mt or "an unknown architecture")
        return Cell(self.name, self.version, mt, feature, ok, why.format(model=model.name, arch=arch),
                    self.rules[feature].how)


def _vllm(version: str = "0.34.0") -> EngineRelease:
    no_map = (f"vLLM {version} loads no expert map (its EPLBConfig has no file key: "
              f"{', '.join(f'#{n}' for n in VLLM_MAP_PRS)} are open PRs)")
    return EngineRelease("vllm", "vLLM", version, {
        "checkpoint": ByArchitecture(None, f"vLLM {version} places experts linearly (expert_map_manager.py "
                                     "determine_expert_map: EP rank r holds experts [r*E/G, (r+1)*E/G)), so a "
                                     "relabelled checkpoint is served as the placement",
                                     how="place export PLACEMENT --format checkpoint --model-path SRC --out DST"),
        "plugin": ByArchitecture(None, f"the moeplace vLLM plugin (entry point vllm.general_plugins: moeplace) "
                                 f"permutes each MoE layer's experts while vLLM {version} loads the weights",
                                 how=f"{PLUGIN_INSTALL}; {PLUGIN_ENV}=PLACEMENT vllm serve ..."),
        "placement_file": ByArchitecture(frozenset(), "", how="--vllm-pr 49572|41141 (open PRs)", otherwise=no_map),
        "online_eplb": ByArchitecture(_VLLM_EPLB, f"vLLM {version}: the model implements MixtureOfExperts and its "
                                      "FusedMoE takes enable_eplb / num_redundant_experts",
                                      {"kimi_k3": _VLLM_K3_EPLB, "kimi_linear": _VLLM_K3_EPLB,
                                       "qwen2_moe": f"vLLM {version}: qwen2_moe.py does not implement MixtureOfExperts",
                                       "kimi_k25": f"vLLM {version}: kimi_k25.py does not implement MixtureOfExperts"},
                                      how="--enable-expert-parallel --enable-eplb --eplb-config JSON"),
        "stats_dump": ByArchitecture(None, f"vLLM {version}: --enable-return-routed-experts returns each request's "
                                     "routed experts (bind_routed_experts_capturer, routed_experts_capturer.py: "
                                     "through FusedMoE's router, and under --moe-backend deep_gemm_mega_moe, the "
                                     "backend of vLLM's K3 recipe, through DeepGemmMegaMoEExperts, which has no "
                                     "FusedMoE router but is a RoutedExpertsCaptureSource that captures its logical "
                                     "top-k ids)",
                                     how="place trace import --format vllm-routed-experts"),
    })


def _sglang(version: str = "0.5.23") -> EngineRelease:
    k3_file = _SGLANG_K3 + "the loader returns None, so --init-expert-location is ignored and the default layout stays"
    k3_eplb = (_SGLANG_K3 + "--enable-eplb has no expert location to rebalance and the model allocates no redundant "
               "experts")
    return EngineRelease("sglang", "SGLang", version, {
        "checkpoint": ByArchitecture(None, f"SGLang {version} puts physical expert p on EP rank p // (P/G) and starts "
                                     "from the trivial layout, so a relabelled checkpoint is served as the placement",
                                     how="place export PLACEMENT --format checkpoint --model-path SRC --out DST"),
        "plugin": ByArchitecture(frozenset(), "", otherwise="moeplace has no SGLang load-time plugin (the relabelled "
                                 "checkpoint serves the placement)"),
        "placement_file": ByArchitecture(_SGLANG_EXPERT_LOCATION, f"SGLang {version} reads --init-expert-location "
                                         "(get_model_config_for_expert_location)",
                                         {"kimi_k3": k3_file, "kimi_linear": k3_file},
                                         how="--format sglang: --init-expert-location FILE"),
        "online_eplb": ByArchitecture(_SGLANG_EXPERT_LOCATION, f"SGLang {version}: --enable-eplb rebalances models "
                                      "with expert-location metadata",
                                      {"kimi_k3": k3_eplb, "kimi_linear": k3_eplb},
                                      how="--enable-eplb --ep-num-redundant-experts R"),
        "stats_dump": ByArchitecture(_SGLANG_EXPERT_LOCATION, f"SGLang {version}: --expert-distribution-recorder-mode "
                                     "stat|per_token dumps the expert distribution (.pt)",
                                     {"kimi_k3": _SGLANG_K3 + "--expert-distribution-recorder-mode asserts "
                                      "ExpertLocationMetadata is not None (eplb/expert_distribution.py): start-up "
                                      "fails"},
                                     how="place trace import --format sglang"),
    })


def _trtllm(version: str = "main (2026 source)") -> EngineRelease:
    lb_no = ("TensorRT-LLM's load balancer excludes {arch} (moe_load_balancer.py builds one only for "
             + ", ".join(TRTLLM_LB_ARCHITECTURES) + "; the section is silently ignored)")
    excluded = {t: lb_no for t in ARCHITECTURE_OF_MODEL_TYPE if t not in _TRTLLM_LB_MODEL_TYPES}
    serves = "whether TensorRT-LLM serves {arch} with expert parallelism was not checked"
    return EngineRelease("trtllm", "TensorRT-LLM", version, {
        "checkpoint": ByArchitecture(_TRTLLM_LB_MODEL_TYPES, "TensorRT-LLM's MoE without a load balancer gives EP "
                                     "rank r the slots [r*E/G, (r+1)*E/G) of the trivial assignment, so a relabelled "
                                     "checkpoint is served as the placement",
                                     how="place export PLACEMENT --format checkpoint --model-path SRC --out DST",
                                     why_unchecked=serves),
        "plugin": ByArchitecture(frozenset(), "", otherwise="moeplace has no TensorRT-LLM load-time plugin"),
        "placement_file": ByArchitecture(_TRTLLM_LB_MODEL_TYPES, "TensorRT-LLM reads moe_config.load_balancer."
                                         "initial_global_assignments (needs attention DP)", excluded,
                                         how="--format trtllm: moe_config.load_balancer", otherwise=lb_no),
        "online_eplb": ByArchitecture(_TRTLLM_LB_MODEL_TYPES, "TensorRT-LLM: moe_config.load_balancer."
                                      "layer_updates_per_iter > 0 (needs attention DP)", excluded,
                                      how="moe_config.load_balancer.layer_updates_per_iter", otherwise=lb_no),
        "stats_dump": ByArchitecture(_TRTLLM_LB_MODEL_TYPES, "TensorRT-LLM: EXPERT_STATISTIC_ITER_RANGE + "
                                     "EXPERT_STATISTIC_PATH dump per-iteration expert counts",
                                     how="place trace import --format trtllm-stats", why_unchecked=serves),
    })


def _vllm_ascend(version: str = "(its EPLB docs; no release checked)") -> EngineRelease:
    unchecked = "not checked for vllm-ascend"
    return EngineRelease("vllm-ascend", "vllm-ascend", version, {
        "checkpoint": ByArchitecture(frozenset(), "", why_unchecked=unchecked),
        "plugin": ByArchitecture(frozenset(), "", otherwise="the moeplace plugin is checked on vLLM for NVIDIA GPUs only"),
        "placement_file": ByArchitecture(None, "vllm-ascend reads additional_config.eplb_config.expert_map_path "
                                         "(Model Runner V1 only; scheduled for removal in v0.25.1)",
                                         how="--format vllm-ascend"),
        "online_eplb": ByArchitecture(frozenset(), "", why_unchecked=unchecked),
        "stats_dump": ByArchitecture(frozenset(), "", why_unchecked=unchecked),
    })


ENGINES: dict[str, EngineRelease] = {e.name: e for e in (_vllm(), _sglang(), _trtllm(), _vllm_ascend())}


def engine(name: str) -> EngineRelease:
    if name not in ENGINES:
        raise InputError(f"--engine '{name}' unknown (expected one of {', '.join(ENGINES)})")
    return ENGINES[name]


def cell(engine_name: str, feature: str, model: ModelSpec) -> Cell:
    """The table's cell for ``engine_name`` x ``model``'s architecture x ``feature``."""
    return engine(engine_name).cell(model, feature)


def table(models: list[ModelSpec], engines: list[str] | None = None) -> list[Cell]:
    """Every cell for ``models`` (engine-major, then model, then feature)."""
    return [ENGINES[e].cell(m, f) for e in (engines or list(ENGINES)) for m in models for f in FEATURES]


def serving_route(engine_name: str, model: ModelSpec, num_redundant: int) -> Cell | None:
    """How ``engine_name`` can serve a placement of ``model`` with ``num_redundant`` redundant slots per layer:
    the placement file when the engine applies it, else (replica-free placements only) the load-time plugin,
    else the relabelled checkpoint; ``None`` when the engine can serve it in none of these ways."""
    e = engine(engine_name)
    for f in ("placement_file", "plugin", "checkpoint"):
        c = e.cell(model, f)
        # an unchecked architecture keeps the placement file (the exporters' checks stand); the replica-free
        # routes are offered only where checked
        ok = c.supported is not False if f == "placement_file" else c.supported is True
        if ok and (FEATURES[f].replicas or num_redundant == 0):
            return c
    return None


def alternatives(engine_name: str, model: ModelSpec) -> list[Cell]:
    """The replica-free ways (plugin, checkpoint) ``engine_name`` serves ``model``, best first."""
    e = engine(engine_name)
    return [c for c in (e.cell(model, "plugin"), e.cell(model, "checkpoint")) if c.supported]


def offer(engine_name: str, model: ModelSpec, placement: str = "PLACEMENT") -> str:
    """One sentence offering the replica-free routes of ``engine_name`` for ``model`` ('' when none)."""
    alts = alternatives(engine_name, model)
    if not alts:
        return ""
    parts = []
    for c in alts:
        if c.feature == "plugin":
            parts.append(f"the load-time plugin ({PLUGIN_INSTALL}; {PLUGIN_ENV}={placement} "
                         f"{'vllm serve' if engine_name == 'vllm' else engine_name} ...)")
        else:
            parts.append(f"a relabelled checkpoint (place export {placement} --format checkpoint --model-path SRC "
                         "--out DST, then serve DST)")
    return ("serve a replica-free placement (place optimize ... --redundant 0) through " + " or ".join(parts))


def lacks(engine_name: str, model: ModelSpec, features: tuple[str, ...] = ("placement_file", "online_eplb")
          ) -> list[Cell]:
    """The cells of ``features`` that ``engine_name`` does not support for ``model``."""
    e = engine(engine_name)
    return [c for c in (e.cell(model, f) for f in features) if c.supported is False]


def advice(model: ModelSpec, num_redundant: int, engines: list[str] | None = None) -> list[str]:
    """One line per engine that cannot apply a ``model`` placement with ``num_redundant`` redundant slots per
    layer as it stands (no placement file it applies; for a replica-free one, no plugin or checkpoint
    route either), or whose online rebalancer does nothing for ``model``: what it lacks, with the table's
    reasons, and the replica-free route it offers instead. Empty when every engine applies it. What
    ``place plan``/``optimize``/``sweep``/``rebalance`` print."""
    lines = []
    for name in engines or ["vllm", "sglang", "trtllm"]:
        e = ENGINES[name]
        route = serving_route(name, model, num_redundant)
        missing = lacks(name, model)
        if route is not None and not missing:
            continue
        if route is not None and route.feature == "placement_file" and not any(
                c.feature == "online_eplb" for c in missing):
            continue
        by_reason: dict[str, list[str]] = {}
        for c in missing:
            by_reason.setdefault(c.reason, []).append(FEATURES[c.feature].title)
        what = "; ".join(f"{' and '.join(titles)}: {why}" for why, titles in by_reason.items())
        if route is None:
            alt = offer(name, model)
            lines.append(f"{e.title} {e.version} cannot apply a {model.name} placement with {num_redundant} redundant "
                         f"slots per layer ({what})" + (f"; instead {alt}" if alt else ""))
        else:
            title = FEATURES[route.feature].title
            lines.append(f"{e.title} {e.version} for {model.name} ({what}): it serves this placement through the "
                         f"{title} ({route.how})")
    return lines


def file_warnings(engine_name: str, model: ModelSpec, num_redundant: int, placement: str = "PLACEMENT") -> list[str]:
    """What ``place export`` says about a placement file of ``engine_name`` for ``model``: nothing when the
    engine applies it; else the table's reason and the route that does serve the placement."""
    c = cell(engine_name, "placement_file", model)
    if c.supported is not False:
        return []
    route = serving_route(engine_name, model, num_redundant)
    if route is not None:
        tail = f"this replica-free placement is served through the {FEATURES[route.feature].title} ({route.how})"
    else:
        tail = offer(engine_name, model, placement) or cell(engine_name, "checkpoint", model).reason
    return [f"{c.reason}: the file is what the loader reads, but it changes nothing for {model.name}; {tail}"]


def to_json(models: list[ModelSpec], engines: list[str] | None = None) -> dict[str, Any]:
    """The table as ``place engines --json`` prints it."""
    names = engines or list(ENGINES)
    return {"features": {f.name: {"title": f.title, "summary": f.summary, "applies_placement": f.applies_placement,
                                  "replicas": f.replicas} for f in FEATURES.values()},
            "engines": {n: {"title": ENGINES[n].title, "version": ENGINES[n].version} for n in names},
            "plugin": {"entry_point_group": "vllm.general_plugins", "name": "moeplace", "install": PLUGIN_INSTALL,
                       "env": PLUGIN_ENV},
            "models": {m.name: m.hf_model_type for m in models},
            "cells": [dict(c.to_dict(), model=m.name) for n in names for m in models
                      for c in [ENGINES[n].cell(m, f) for f in FEATURES]]}


# --------------------------------------------------------------------------------------- the deployable plan
SERVING_ENGINES = ("vllm", "sglang", "trtllm")  # the engines whose serving the plan commands report


def replica_free_only(model: ModelSpec, engines: tuple[str, ...] = SERVING_ENGINES) -> bool:
    """Whether the engines can serve ``model`` only with a replica-free placement (a relabelled checkpoint or
    the plugin) and none applies redundant slots (no placement file reaches the model): then a plan with
    replicas is one nobody can deploy, and ``place optimize`` plans without them by default (K3 today)."""
    with_replicas = any(serving_route(e, model, 1) is not None for e in engines)
    without = any(serving_route(e, model, 0) is not None for e in engines)
    return without and not with_replicas


def _groups_split(model: ModelSpec, placement: Any) -> bool:
    """A replica-free ``placement`` of a group-limited model (DeepSeek-V3's n_group / topk_group) that splits a
    routing group under the contiguous layout: no relabelling serves it exactly."""
    if placement is None or model.n_group <= 1 or model.topk_group >= model.n_group:
        return False
    return splits_groups(placement, model.n_group)


def _short(titles: list[str]) -> str:
    return " or ".join(titles)


def serving_lines(model: ModelSpec, num_redundant: int, placement: Any = None,
                  engines: tuple[str, ...] = SERVING_ENGINES) -> list[str]:
    """How each engine serves a ``model`` placement with ``num_redundant`` redundant slots per layer: a header
    line, then one line per engine (the route, or that it has none, and what the table says it lacks for the
    model); ``place engines --reasons`` has every reason. With ``placement``, a group-limited model's
    replica-free plan is checked first: one that splits a routing group is served by no relabelling."""
    split = _groups_split(model, placement)
    head = (f"serving a {model.name} placement with {num_redundant} redundant slots per layer (reasons: place "
            f"engines --model {model.name} --reasons):")
    lines = [head]
    for name in engines:
        e = ENGINES[name]
        missing = [FEATURES[c.feature].title for c in lacks(name, model)]
        lack = f"; no {' or '.join(missing)} for {model.name}" if missing else ""
        route = serving_route(name, model, num_redundant)
        if route is not None and route.feature != "placement_file" and split:
            lines.append(f"  {e.title} {e.version}: not served -- the plan splits DeepSeek-style routing groups "
                         f"(n_group {model.n_group}, top-{model.topk_group} groups), which no relabelling keeps "
                         f"exact: plan with --keep-groups{lack}")
            continue
        if route is None:
            alts = alternatives(name, model)
            if num_redundant and alts:
                how = f"not with replicas; a replica-free plan (--redundant 0) through the {_short([FEATURES[c.feature].title for c in alts])}"
            else:
                unchecked = [FEATURES[c.feature].title for c in (e.cell(model, "plugin"), e.cell(model, "checkpoint"))
                             if c.supported is None]
                how = "no route" + (f" ({_short(unchecked)} not checked)" if unchecked else "")
            lines.append(f"  {e.title} {e.version}: {how}{lack}")
            continue
        if route.feature == "placement_file":
            lines.append(f"  {e.title} {e.version}: the {FEATURES[route.feature].title} ({route.how}){lack}")
            continue
        titles = [FEATURES[c.feature].title for c in alternatives(name, model)]
        lines.append(f"  {e.title} {e.version}: the {_short(titles)}{lack}")
    return lines
