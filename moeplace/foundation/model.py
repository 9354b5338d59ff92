"""Model architecture specs: what a routing trace is a trace *of*.

A :class:`ModelSpec` is plain data (presets live as JSON files in ``foundation/presets/models/``; a Hugging
Face ``config.json`` maps onto the same fields). Every number the planner, the optimizer and the simulator use
(parameters, bytes per expert, KV bytes per token, state bytes per sequence) derives from these fields
by the functions below; there is no per-model code path.
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from moeplace.foundation import formats, reading
from moeplace.foundation.checkpoint_files import DEEPSEEK_TYPES, MAX_LAYERS, check_hf_config
from moeplace.foundation.errors import InputError
from moeplace.foundation.reading import is_int, quote

# Bytes per parameter of each weight format, scales included.
#   mxfp4: 4-bit E2M1 values, one E8M0 (1-byte) scale per group of 32   -> 4.25 bits
#   nvfp4: 4-bit values, one FP8 scale per group of 16                  -> 4.5 bits
#   fp8_block128: FP8 values, one fp32 scale per 128x128 block (DeepSeek-V3 checkpoints)
#   int4_g32: 4-bit integers, one bf16 scale per group of 32 (Kimi K2-Thinking style)
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "fp8_block128": 1.0 + 4.0 / (128 * 128),
    "mxfp4": 4.25 / 8,
    "nvfp4": 4.5 / 8,
    "int4_g32": (4 + 16 / 32) / 8,
}

# Bytes per cached KV element for --kv-dtype.
KV_DTYPE_BYTES: dict[str, float] = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp32": 4.0}

ATTENTION_KINDS = ("mla", "kda", "gqa")

# Sizes that must be >= 1 (every other whole-number field must be >= 0: 0 shared experts, no vision tower).
_POSITIVE = {"num_layers", "num_experts", "top_k", "hidden_size", "moe_intermediate_size", "expert_hidden_size",
             "vocab_size", "num_heads", "num_kv_heads", "head_dim", "kv_lora_rank", "qk_rope_head_dim",
             "v_head_dim", "conv_kernel", "n_group", "topk_group"}


def check_field_types(obj: Any, where: str, ranges: bool = True) -> None:
    """Each field of the dataclass ``obj`` has its declared type: whole numbers are integers (not bool,
    not a string such as ``"big"``) and, with ``ranges``, in range; numbers are finite reals; flags are
    ``bool``; names are ``str``. A record read from JSON is checked here once, so arithmetic later never
    meets a string."""
    for f in dataclasses.fields(obj):
        v, ann = getattr(obj, f.name), str(f.type)
        if v is None and "None" in ann:
            continue
        base = ann.split("|")[0].strip()
        if base == "int":
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise InputError(f"{where}: field '{f.name}' must be a whole number, got {quote(v)}")
            if not -2**62 < v < 2**62:  # beyond any count this tool meets; keeps numpy int64 arithmetic exact
                raise InputError(f"{where}: field '{f.name}' is out of range, got {quote(v)}")
            if ranges and v < (1 if f.name in _POSITIVE else 0):
                raise InputError(f"{where}: field '{f.name}' must be >= {1 if f.name in _POSITIVE else 0}, "
                                 f"got {v}")
        elif base == "float" and (isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v)):
            raise InputError(f"{where}: field '{f.name}' must be a finite number, got {quote(v)}")
        elif base == "bool" and not isinstance(v, bool):
            raise InputError(f"{where}: field '{f.name}' must be true or false, got {quote(v)}")
        elif base == "str" and not isinstance(v, str):
            raise InputError(f"{where}: field '{f.name}' must be a string, got {quote(v)}")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3 family). Cache per token per layer:
    ``kv_lora_rank + qk_rope_head_dim`` values."""

    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    output_gate: bool = False  # K3's gated MLA: sigmoid(W_g x) before o_proj (full rank)

    def __post_init__(self) -> None:
        check_field_types(self, "model spec: mla")


@dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention (linear attention with a per-head recurrent state ``head_dim x head_dim``,
    fp32, and a short causal convolution over q, k, v)."""

    num_heads: int
    head_dim: int
    conv_kernel: int = 4
    full_rank_gate: bool = True  # K3: single full-rank output gate; Kimi-Linear: low-rank g_a/g_b
    state_dtype: str = "fp32"
    conv_state_dtype: str = "bf16"

    def __post_init__(self) -> None:
        check_field_types(self, "model spec: kda")
        for name in ("state_dtype", "conv_state_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise InputError(f"model spec: kda: field '{name}' is {quote(getattr(self, name))}, expected one of "
                                 f"{sorted(DTYPE_BYTES)}")


@dataclass(frozen=True)
class GQAConfig:
    """Grouped-query attention with a per-token K and V cache."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        check_field_types(self, "model spec: gqa")


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of an MoE language model, as far as placement, memory and cost need it.

    Layer indices are 0-based decoder-layer indices, as in Hugging Face module names
    (``model.layers.{i}``). ``moe_layers`` lists the layers with a routed-expert block; the rest have a
    dense MLP of width ``dense_intermediate_size``.

    A spec may describe the part of a model a trace holds (a routing log of some MoE layers only):
    ``moe_layers`` are then the held layers and ``declared_moe_layers`` all MoE layers the model declares
    (``()`` when ``moe_layers`` are all of them). Routing readers work on ``moe_layers``; weights, memory
    and the dense layers count the model's own (:attr:`model_moe_layers`). :meth:`restrict` makes such a
    spec, :meth:`whole` gives the model back, :attr:`layers_label` says "5 of 24 layers".
    """

    name: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden_size: int
    moe_intermediate_size: int
    expert_hidden_size: int  # width the routed experts run at (LatentMoE: < hidden_size)
    num_shared_experts: int
    shared_intermediate_size: int  # width of ONE shared expert
    dense_intermediate_size: int
    vocab_size: int
    max_context: int
    attention: tuple[str, ...]  # per layer: "mla" | "kda" | "gqa"
    mla: MLAConfig | None = None
    kda: KDAConfig | None = None
    gqa: GQAConfig | None = None
    expert_dtype: str = "bf16"  # routed experts
    weight_dtype: str = "bf16"  # everything else
    scoring: str = "softmax"  # router score function: softmax | sigmoid
    n_group: int = 1
    topk_group: int = 1
    tie_word_embeddings: bool = False
    vision_params: int = 0
    hf_model_type: str = ""
    source: str = ""  # where this spec came from (preset name or config path)
    declared_moe_layers: tuple[int, ...] = ()  # the model's MoE layers when moe_layers holds a subset
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise InputError(f"model spec '{self.name}': {msg}")

        check_field_types(self, f"model spec '{self.name}'")
        if not 0 < self.num_layers <= MAX_LAYERS:  # a trace's layer column is uint16
            bad(f"num_layers must be 1..{MAX_LAYERS:,}, got {self.num_layers}")
        if not self.moe_layers:
            bad("no MoE layers")
        if list(self.moe_layers) != sorted(set(self.moe_layers)):
            bad("moe_layers must be strictly increasing")
        if self.moe_layers[0] < 0 or self.moe_layers[-1] >= self.num_layers:
            bad(f"moe_layers must lie in [0, {self.num_layers})")
        if self.declared_moe_layers:
            d = self.declared_moe_layers
            if list(d) != sorted(set(d)) or d[0] < 0 or d[-1] >= self.num_layers:
                bad(f"declared_moe_layers must be strictly increasing in [0, {self.num_layers})")
            if not set(self.moe_layers) < set(d):
                bad(f"moe_layers {format_ranges(self.moe_layers)} must be a proper subset of declared_moe_layers "
                    f"{format_ranges(d)}")
        if not (1 <= self.top_k <= self.num_experts):
            bad(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.num_experts > 65535:
            bad("num_experts must fit uint16 expert ids")
        if len(self.attention) != self.num_layers:
            bad(f"attention lists {len(self.attention)} layers, expected num_layers={self.num_layers}")
        for kind in set(self.attention):
            if kind not in ATTENTION_KINDS:
                bad(f"unknown attention kind '{kind}' (expected one of {ATTENTION_KINDS})")
            if getattr(self, kind) is None:
                bad(f"layers use '{kind}' attention but no '{kind}' config is given")
        for name in ("expert_dtype", "weight_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                bad(f"{name} '{getattr(self, name)}' unknown (expected one of {sorted(DTYPE_BYTES)})")
        if self.scoring not in ("softmax", "sigmoid"):
            bad(f"scoring must be softmax or sigmoid, got '{self.scoring}'")

    # ---------------------------------------------------------------- layout
    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def model_moe_layers(self) -> tuple[int, ...]:
        """Every MoE layer of the model, held or not (``moe_layers`` when the spec is not partial)."""
        return self.declared_moe_layers or self.moe_layers

    @property
    def is_partial(self) -> bool:
        """True when the spec holds some of the model's MoE layers only (a partial routing log)."""
        return bool(self.declared_moe_layers)

    @property
    def layers_label(self) -> str:
        """``"5 of 24 layers"`` for a partial spec (every result computed on one says so), else ``""``."""
        if not self.is_partial:
            return ""
        return f"{self.num_moe_layers} of {len(self.declared_moe_layers)} layers"

    def restrict(self, layers) -> ModelSpec:
        """This model restricted to the MoE (decoder) ``layers`` a trace holds; all of them gives the whole
        model. A layer that is not an MoE layer of the model is an :class:`InputError`."""
        held = tuple(sorted({int(x) for x in layers}))
        full = self.model_moe_layers
        outside = [x for x in held if x not in full]
        if outside or not held:
            raise InputError(f"layers {format_ranges(outside) if outside else '(none)'}: not MoE layers of model "
                             f"'{self.name}' (its MoE layers: {format_ranges(full)})")
        if held == full:
            return self.whole()
        return dataclasses.replace(self, moe_layers=held, declared_moe_layers=full)

    def whole(self) -> ModelSpec:
        """The whole model (every MoE layer it declares)."""
        if not self.is_partial:
            return self
        return dataclasses.replace(self, moe_layers=self.declared_moe_layers, declared_moe_layers=())

    @property
    def dense_layers(self) -> tuple[int, ...]:
        moe = set(self.model_moe_layers)
        return tuple(i for i in range(self.num_layers) if i not in moe)

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """Indices of the layers with attention ``kind`` (e.g. ``"mla"``)."""
        return tuple(i for i, k in enumerate(self.attention) if k == kind)

    def moe_index(self, layer: int) -> int:
        """Position of decoder layer ``layer`` among the MoE layers (0 .. num_moe_layers-1)."""
        try:
            return self.moe_layers.index(layer)
        except ValueError:
            raise InputError(f"layer {layer} is not an MoE layer of model '{self.name}'") from None

    # ---------------------------------------------------------------- parameters
    @property
    def params_per_routed_expert(self) -> int:
        """Gated MLP at the expert width: gate, up (h x i) and down (i x h)."""
        return 3 * self.expert_hidden_size * self.moe_intermediate_size

    @property
    def bytes_per_routed_expert(self) -> float:
        return self.params_per_routed_expert * DTYPE_BYTES[self.expert_dtype]

    def attention_params(self, kind: str) -> int:
        """Parameters of one attention block of ``kind`` (projections, gates, norms ignored)."""
        h = self.hidden_size
        if kind == "mla":
            c = self.mla
            qk = c.qk_nope_head_dim + c.qk_rope_head_dim
            q = (h * c.q_lora_rank + c.q_lora_rank * c.num_heads * qk) if c.q_lora_rank else h * c.num_heads * qk
            kv = h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * c.num_heads * (
                c.qk_nope_head_dim + c.v_head_dim)
            o = c.num_heads * c.v_head_dim * h
            gate = h * c.num_heads * c.v_head_dim if c.output_gate else 0
            return q + kv + o + gate
        if kind == "kda":
            c = self.kda
            hd = c.num_heads * c.head_dim
            qkv_o = 4 * h * hd
            decay = h * c.head_dim + c.head_dim * hd + hd + c.num_heads  # f_a, f_b, dt_bias, A_log
            beta = h * c.num_heads
            gate = h * hd if c.full_rank_gate else h * c.head_dim + c.head_dim * hd
            conv = 3 * hd * c.conv_kernel
            return qkv_o + decay + beta + gate + conv
        if kind == "gqa":
            c = self.gqa
            return h * c.num_heads * c.head_dim * 2 + 2 * h * c.num_kv_heads * c.head_dim
        raise InputError(f"unknown attention kind '{kind}'")

    def param_breakdown(self) -> dict[str, int]:
        """Parameter counts by component (whole model, held MoE layers or not)."""
        h = self.hidden_size
        n_moe = len(self.model_moe_layers)
        latent = 2 * h * self.expert_hidden_size if self.expert_hidden_size != h else 0
        return {
            "routed_experts": n_moe * self.num_experts * self.params_per_routed_expert,
            "shared_experts": n_moe * self.num_shared_experts * 3 * h * self.shared_intermediate_size,
            "latent_projections": n_moe * latent,
            "routers": n_moe * h * self.num_experts,
            "dense_mlp": len(self.dense_layers) * 3 * h * self.dense_intermediate_size,
            "attention": sum(self.attention_params(k) for k in self.attention),
            "embeddings": self.vocab_size * h * (1 if self.tie_word_embeddings else 2),
            "vision": self.vision_params,
        }

    @property
    def total_params(self) -> int:
        return sum(self.param_breakdown().values())

    @property
    def active_params(self) -> int:
        """Parameters one text token touches: top-k routed experts plus everything dense."""
        b = self.param_breakdown()
        routed_active = len(self.model_moe_layers) * self.top_k * self.params_per_routed_expert
        return total_minus(b, ("routed_experts", "vision")) + routed_active

    @property
    def non_expert_params(self) -> int:
        """Everything but the routed experts (the BF16 "trunk", embeddings and vision tower)."""
        b = self.param_breakdown()
        return total_minus(b, ("routed_experts",))

    @property
    def checkpoint_bytes(self) -> float:
        return (self.param_breakdown()["routed_experts"] * DTYPE_BYTES[self.expert_dtype]
                + self.non_expert_params * DTYPE_BYTES[self.weight_dtype])

    # ---------------------------------------------------------------- memory per token / sequence
    def kv_bytes_per_token(self, kv_dtype: str = "bf16", attention_tp: int = 1) -> float:
        """KV-cache bytes one token adds, on one GPU of an attention-TP group.

        MLA caches one latent (``kv_lora_rank + qk_rope_head_dim``) per token and layer, replicated on
        every attention-TP rank; GQA caches K and V per KV head, split across TP ranks (never below one
        head); KDA layers cache nothing per token.
        """
        if kv_dtype not in KV_DTYPE_BYTES:
            raise InputError(f"kv dtype '{kv_dtype}' unknown (expected one of {sorted(KV_DTYPE_BYTES)})")
        b = KV_DTYPE_BYTES[kv_dtype]
        total = 0.0
        if self.mla is not None:
            total += len(self.layers_of("mla")) * (self.mla.kv_lora_rank + self.mla.qk_rope_head_dim) * b
        if self.gqa is not None:
            heads = max(1.0, self.gqa.num_kv_heads / attention_tp)
            total += len(self.layers_of("gqa")) * 2 * heads * self.gqa.head_dim * b
        return total

    def state_bytes_per_sequence(self, attention_tp: int = 1) -> float:
        """Fixed per-sequence state (KDA recurrent state + short-conv state), on one GPU of an
        attention-TP group. Independent of sequence length; heads split across TP ranks."""
        if self.kda is None:
            return 0.0
        c = self.kda
        n = len(self.layers_of("kda"))
        recurrent = c.num_heads * c.head_dim * c.head_dim * DTYPE_BYTES[c.state_dtype]
        conv = 3 * c.num_heads * c.head_dim * (c.conv_kernel - 1) * DTYPE_BYTES[c.conv_state_dtype]
        return n * (recurrent + conv) / attention_tp

    # ---------------------------------------------------------------- (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["moe_layers"] = list(self.moe_layers)
        d["declared_moe_layers"] = list(self.declared_moe_layers)
        if not self.declared_moe_layers:  # files of whole models stay as they were
            del d["declared_moe_layers"]
        d["attention"] = list(self.attention)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "") -> ModelSpec:
        d = dict(d)
        where = f"model spec {source or d.get('name', '?')}"
        missing = [k for k in ("name", "num_layers", "moe_layers", "attention") if k not in d]
        if missing:
            raise InputError(f"{where}: field '{missing[0]}' missing (a model spec as place model show --json writes "
                             "it, or a Hugging Face config.json with its model_type)")
        if not is_int(d["num_layers"]) or not 1 <= d["num_layers"] <= MAX_LAYERS:  # before any per-layer list
            raise InputError(f"{where}: field 'num_layers' must be a whole number 1..{MAX_LAYERS:,}, got "
                             f"{quote(d['num_layers'])}")
        try:
            d["moe_layers"] = tuple(int(x) for x in d["moe_layers"])
            d["declared_moe_layers"] = tuple(int(x) for x in d.get("declared_moe_layers") or ())
            att = d["attention"]
            if isinstance(att, dict):  # compact form: {"default": kind, "mla": [layers], ...}
                kinds = [att.get("default", "")] * int(d["num_layers"])
                for kind, layers in att.items():
                    if kind != "default":
                        for i in layers:
                            kinds[i] = kind
                att = kinds
            d["attention"] = tuple(att)
            for key, typ in (("mla", MLAConfig), ("kda", KDAConfig), ("gqa", GQAConfig)):
                if d.get(key) is not None:
                    d[key] = typ(**d[key])
            if source and not d.get("source"):
                d["source"] = source
            names = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(d) - names)
            if unknown:
                raise InputError(f"model spec {source or d.get('name')}: unknown fields {unknown}")
            return cls(**d)
        except InputError as exc:
            raise InputError(f"{source}: {exc}" if source and source not in str(exc) else str(exc)) from None
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise InputError(f"model spec {source or d.get('name', '?')}: invalid ({exc})") from None


def format_ranges(xs) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"`` (layer lists in messages and tables)."""
    xs = list(xs)
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def total_minus(breakdown: dict[str, int], keys: tuple[str, ...]) -> int:
    return sum(v for k, v in breakdown.items() if k not in keys)


# ---------------------------------------------------------------------------- presets
def _model_presets():
    return resources.files("moeplace.foundation.presets").joinpath("models")


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in _model_presets().iterdir() if p.name.endswith(".json"))


DEFAULT_MODEL = "kimi-k3"


def load_model(name_or_path: str | Path | None = None) -> ModelSpec:
    """A preset by name (``kimi-k3``), our own spec JSON, or a Hugging Face ``config.json``."""
    if name_or_path is not None and not str(name_or_path):
        raise InputError(f"model '': empty; give a preset ({', '.join(preset_names())}) or a config.json")
    name = str(name_or_path or DEFAULT_MODEL)
    if name in preset_names():
        text = _model_presets().joinpath(f"{name}.json").read_text()
        return ModelSpec.from_dict(json.loads(text), source=f"preset:{name}")
    path = Path(name)
    if not path.exists():
        raise InputError(f"model '{name}': not a preset ({', '.join(preset_names())}) and no such file")
    if path.is_dir() and (path / "config.json").is_file():  # a checkpoint directory: its config.json
        path = path / "config.json"
    d = reading.read_json(path, unreadable="not a readable JSON model config")
    if not isinstance(d, dict):
        raise InputError(f"{path}: expected a JSON object")
    kind = formats.kind_of(d)
    if kind is not None:  # a moeplace artifact (a placement JSON, a plan report) given where a model goes
        raise InputError(f"{path}: is a {formats.PREFIX}{kind} file ({formats.FORMATS[kind].written_by}), not a "
                         f"model: give a preset ({', '.join(preset_names())}), a Hugging Face config.json or a "
                         "model spec JSON (a preset's fields)")
    # Each format says what it is: every config.json transformers writes carries its 'model_type'; our
    # spec (a preset's format) has no such field. No guessing from which other keys a file holds.
    if "model_type" not in d:
        return ModelSpec.from_dict(d, source=str(path))
    try:
        return from_hf_config(d, source=str(path))
    except InputError as exc:  # every message names the file it is about
        raise InputError(str(exc) if str(path) in str(exc) else f"{path}: {exc}") from None
    except (TypeError, ValueError, KeyError, IndexError) as exc:  # a field of the wrong type or shape
        raise InputError(f"{path}: not a usable Hugging Face config ({type(exc).__name__}: {exc})") from None


def spec_from_json(text: str) -> ModelSpec:
    """Inverse of :meth:`ModelSpec.to_json` (used for trace/Loads metadata)."""
    return ModelSpec.from_dict(reading.parse_json(text, "model spec"))


# ---------------------------------------------------------------------------- Hugging Face configs
def _get(cfg: dict, *names, default=None, required=True, path=""):
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    if required and default is None:
        raise InputError(f"{path}: field '{names[0]}' missing from the Hugging Face config")
    return default


def from_hf_config(cfg: dict[str, Any], *, source: str = "config.json", name: str | None = None) -> ModelSpec:
    """Map a Hugging Face ``config.json`` (DeepSeek-V3/Kimi K2, Kimi-Linear/K3, Qwen2/3-MoE, Mixtral,
    OLMoE) onto a :class:`ModelSpec`. Weights are assumed BF16 unless ``quantization_config`` says
    otherwise. Any problem is an :class:`InputError` naming ``source``."""
    try:
        return _from_hf_config(cfg, source=source, name=name)
    except InputError as exc:
        if str(exc).startswith(source):
            raise
        raise InputError(f"{source}: {exc}") from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, ZeroDivisionError) as exc:
        # a field of the wrong type (``"hidden_size": "big"``) fails inside the mapping
        raise InputError(f"{source}: not a usable Hugging Face MoE config ({type(exc).__name__}: {exc})") from None


def _from_hf_config(cfg: dict[str, Any], *, source: str, name: str | None) -> ModelSpec:
    if isinstance(cfg.get("text_config"), dict):
        outer = cfg
        cfg = {**cfg["text_config"]}
        cfg.setdefault("quantization_config", outer.get("quantization_config"))
    mt = str(cfg.get("model_type", ""))
    if mt in DEEPSEEK_TYPES or mt in ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe"):
        check_hf_config(cfg, source)  # types and ranges, before anything is built per layer
    g = lambda *n, **kw: _get(cfg, *n, path=source, **kw)
    L = int(g("num_hidden_layers"))
    hidden = int(g("hidden_size"))
    expert_dtype = weight_dtype = "bf16"
    q = cfg.get("quantization_config") or {}
    qm = str(q.get("quant_method", "")).lower()
    if qm == "fp8":
        expert_dtype = weight_dtype = "fp8_block128"
    elif "mxfp4" in json.dumps(q).lower():
        expert_dtype = "mxfp4"
    elif qm in ("compressed-tensors",) and "int" in json.dumps(q).lower():
        expert_dtype = "int4_g32"

    mla = kda = gqa = None
    if mt in DEEPSEEK_TYPES:
        E = int(g("n_routed_experts", "num_experts"))
        k = int(g("num_experts_per_tok", "num_experts_per_token"))
        first_dense = int(g("first_k_dense_replace", default=0, required=False))
        freq = int(g("moe_layer_freq", default=1, required=False))
        moe = tuple(i for i in range(L) if i >= first_dense and (i - first_dense) % freq == 0)
        if isinstance(cfg.get("mlp_layer_types"), list):  # transformers' KimiLinearConfig names them
            moe = tuple(i for i, t in enumerate(cfg["mlp_layer_types"]) if t == "sparse")
        mla = MLAConfig(
            num_heads=int(g("num_attention_heads")),
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=int(g("kv_lora_rank")),
            qk_nope_head_dim=int(g("qk_nope_head_dim")),
            qk_rope_head_dim=int(g("qk_rope_head_dim")),
            v_head_dim=int(g("v_head_dim")),
            output_gate=bool(cfg.get("mla_use_output_gate", mt == "kimi_k3" or "routed_expert_hidden_size" in cfg)),
        )
        attention = ["mla"] * L
        lin = cfg.get("linear_attn_config")
        if isinstance(lin, dict) and lin.get("kda_layers"):
            kda = KDAConfig(
                num_heads=int(lin.get("num_heads", mla.num_heads)),
                head_dim=int(lin.get("head_dim", 128)),
                conv_kernel=int(lin.get("short_conv_kernel_size", 4)),
                full_rank_gate="routed_expert_hidden_size" in cfg,
            )
            for i1 in lin["kda_layers"]:  # Kimi configs number layers from 1
                attention[int(i1) - 1] = "kda"
        elif mt == "kimi_linear" and isinstance(cfg.get("layer_types"), list):
            # the same facts as transformers' KimiLinearConfig serialises them (0-based layer_types)
            kda = KDAConfig(num_heads=int(g("linear_num_heads", default=mla.num_heads, required=False)),
                            head_dim=int(g("linear_head_dim", default=128, required=False)),
                            conv_kernel=int(g("linear_conv_kernel_dim", default=4, required=False)),
                            full_rank_gate="routed_expert_hidden_size" in cfg)
            attention = ["kda" if t == "linear_attention" else "mla" for t in cfg["layer_types"]]
        shared = int(g("n_shared_experts", "num_shared_experts", default=0, required=False))
        spec = {
            "num_experts": E, "top_k": k, "moe_layers": moe,
            "moe_intermediate_size": int(g("moe_intermediate_size")),
            "expert_hidden_size": int(g("routed_expert_hidden_size", default=hidden, required=False)),
            "num_shared_experts": shared,
            "shared_intermediate_size": int(g("moe_intermediate_size")),
            "dense_intermediate_size": int(g("intermediate_size")),
            # transformers' DeepSeek-V3 / Kimi routers only score with sigmoid and drop scoring_func
            "scoring": str(g("scoring_func", default="softmax" if mt == "deepseek_v2" else "sigmoid",
                          required=False)),
            "n_group": int(g("n_group", "num_expert_group", default=1, required=False)),
            "topk_group": int(g("topk_group", default=1, required=False)),
        }
    elif mt in ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe"):
        E = int(g("num_experts", "num_local_experts"))
        k = int(g("num_experts_per_tok"))
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        step = int(cfg.get("decoder_sparse_step") or 1)
        moe = tuple(i for i in range(L) if i not in mlp_only and (i + 1) % step == 0)
        heads = int(g("num_attention_heads"))
        gqa = GQAConfig(num_heads=heads, num_kv_heads=int(g("num_key_value_heads", default=heads, required=False)),
                        head_dim=int(cfg.get("head_dim") or hidden // heads))
        attention = ["gqa"] * L
        expert_i = int(g("moe_intermediate_size", "intermediate_size"))
        shared_i = int(cfg.get("shared_expert_intermediate_size") or 0)
        spec = {
            "num_experts": E, "top_k": k, "moe_layers": moe, "moe_intermediate_size": expert_i,
            "expert_hidden_size": hidden, "num_shared_experts": 1 if shared_i else 0,
            "shared_intermediate_size": shared_i,
            "dense_intermediate_size": int(g("intermediate_size")),
            "scoring": "softmax",
        }
    else:
        raise InputError(f"{source}: model_type '{mt}' is not supported (expected deepseek_v3, kimi_k2, "
                         "kimi_linear, qwen3_moe, qwen2_moe, mixtral or olmoe)")
    return ModelSpec(
        name=name or str(cfg.get("name_or_path") or cfg.get("_name_or_path") or mt),
        num_layers=L, hidden_size=hidden,
        vocab_size=int(g("vocab_size")),
        max_context=int(g("max_position_embeddings", "model_max_length", default=0, required=False) or 0),
        attention=tuple(attention), mla=mla, kda=kda, gqa=gqa,
        expert_dtype=expert_dtype, weight_dtype=weight_dtype,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hf_model_type=mt, source=source, **spec,
    )
