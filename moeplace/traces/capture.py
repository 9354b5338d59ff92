"""Capture routing from a running Hugging Face transformers MoE model (forward hooks on its routers).

In transformers >= 5 every MoE family we care about routes through a small router module at
``model.layers.{i}.mlp.gate`` whose forward returns ``(router_logits, topk_weights, topk_indices)``, and the
MoE block hands exactly that ``(topk_indices, topk_weights)`` pair to its experts:

- DeepSeek-V3 / Kimi K2 (``DeepseekV3TopkRouter``) and Kimi-Linear / K3 (``KimiLinearTopkRouter``): sigmoid
  scores, ``e_score_correction_bias`` added for the *choice* only, group-limited top-k (top-2 sum per group,
  ``topk_group`` groups kept), weights = unbiased scores of the chosen experts, renormalised when
  ``norm_topk_prob``, times ``routed_scaling_factor``;
- Qwen3-MoE, Qwen2-MoE, OLMoE (``*TopKRouter``): softmax, top-k, optional renormalisation;
- Mixtral (``MixtralTopKRouter``): softmax, top-k, always renormalised.

So the hook records what the experts consumed, in the router's own order, for every family alike; nothing
is recomputed. One forward of the decoder stack (the module that owns ``layers``) is one ``step``.

What a row means (see ``traces/format.py``): one (token, MoE layer) the model actually routed for a
request. Rows are excluded for

- left padding: tokens whose ``attention_mask`` is 0;
- finished requests: during decode, a row whose fed token is a stop token (``eos_token_id``) has ended
  its request; ``generate()`` keeps running it (feeding EOS, then padding with mask 1) only because the
  batch is rectangular, which a serving engine would not do.

Phases: a forward with no past (``past length 0``) starts a new batch of requests (new request ids) and is
prefill; later forwards that still feed more than one token per row continue the prefill (chunked
prefill); the first forward that feeds one token per row starts decode, and every later forward of the
batch is decode. Positions are the index of the token among its request's real tokens
(``cumsum(attention_mask) - 1``, what ``generate()`` itself feeds as ``position_ids``).

Usage::

    with RoutingRecorder(model, out="traces/run1") as rec:   # or capture_routing(model, out=...)
        model.generate(input_ids, attention_mask=mask, max_new_tokens=32)
    # traces/run1/part-00000.parquet now holds the trace (written atomically on exit)

Without ``out`` the rows stay in memory: ``rec.arrays()``.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import numpy as np

from moeplace.foundation import reading
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import ModelSpec, from_hf_config
from moeplace.foundation.progress import track
from moeplace.traces.format import PHASE_DECODE, PHASE_PREFILL, TraceWriter

_GATE_NAME = re.compile(r"^(?:(?P<prefix>.*)\.)?layers\.(?P<layer>\d+)\.mlp\.gate$")
_COLUMNS = ("request_id", "position", "phase", "step", "layer", "expert_ids", "gate_weights", "token_id")


# ---------------------------------------------------------------------------- model introspection
@dataclass(frozen=True)
class RouterSite:
    """Where one MoE layer's router lives: decoder-layer index and module name."""

    layer: int
    name: str


def find_routers(model) -> tuple[str, list[RouterSite]]:
    """The decoder stack (module name owning ``layers``) and the router of every MoE layer, by layer.

    Raises :class:`InputError` when the model has no ``layers.{i}.mlp.gate`` routers returning top-k
    (transformers < 5 computed the top-k inside the MoE block, where a hook cannot see it).
    """
    sites: list[RouterSite] = []
    prefixes = set()
    for name, module in model.named_modules():
        m = _GATE_NAME.match(name)
        if m is None:
            continue
        if not (hasattr(module, "top_k") and hasattr(module, "weight")):
            raise InputError(f"{type(model).__name__}: module '{name}' ({type(module).__name__}) is not a "
                             "top-k router; capture needs transformers >= 5 MoE routers returning "
                             "(logits, weights, indices)")
        sites.append(RouterSite(int(m["layer"]), name))
        prefixes.add(m["prefix"] or "")
    if not sites:
        raise InputError(f"{type(model).__name__}: no MoE routers found (expected modules named "
                         "'layers.<i>.mlp.gate'; supported: DeepSeek-V3/Kimi, Qwen2/3-MoE, Mixtral, OLMoE)")
    if len(prefixes) != 1:
        raise InputError(f"{type(model).__name__}: routers under several decoder stacks {sorted(prefixes)}")
    return prefixes.pop(), sorted(sites, key=lambda s: s.layer)


def model_spec_of(model, *, name: str | None = None, source: str = "") -> ModelSpec:
    """The :class:`ModelSpec` of a transformers model, from its config (``foundation.model.from_hf_config``),
    cross-checked against the routers actually present."""
    cfg = model.config.to_dict()
    spec = from_hf_config(cfg, source=source or f"{type(model).__name__}.config", name=name)
    _, sites = find_routers(model)
    layers = tuple(s.layer for s in sites)
    if layers != spec.moe_layers:
        raise InputError(f"{spec.source}: config says MoE layers {list(spec.moe_layers)} but the model has "
                         f"routers at layers {list(layers)}")
    gate = model.get_submodule(sites[0].name)
    if int(gate.top_k) != spec.top_k or int(gate.weight.shape[0]) != spec.num_experts:
        raise InputError(f"{spec.source}: config says {spec.num_experts} experts top-{spec.top_k}, router "
                         f"has {gate.weight.shape[0]} experts top-{gate.top_k}")
    return spec


def stop_token_ids(model) -> tuple[int, ...]:
    """EOS ids from the model's generation config (int or list), or none."""
    gen = getattr(model, "generation_config", None)
    # generate() stops on the generation config's ids (None: it never stops early); a bare base model
    # has no generation config, so its config's id is what a user's loop would stop on
    eos = gen.eos_token_id if gen is not None else getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


# ---------------------------------------------------------------------------- the recorder
@dataclass
class _Batch:
    """State of the requests of one rectangular batch across its forwards."""

    request_ids: np.ndarray  # int64 [B]
    in_prefill: bool
    finished: np.ndarray  # bool [B]: a stop token was fed during decode


@dataclass
class _Step:
    """What the pre-hook learned about the current forward; the router hooks fill ``routed``."""

    step: int
    batch_size: int
    seq_len: int
    keep: np.ndarray  # bool [B, S]: real, unfinished tokens
    keep_flat: Any  # torch bool [B*S]; moved to the routers' device on first use
    position: np.ndarray  # int32 [B, S]
    phase: int
    token_id: np.ndarray  # int32 [B, S]; -1 where unknown (inputs_embeds)
    request_ids: np.ndarray  # int64 [B]
    routed: dict  # layer -> (indices [n_keep, k] tensor, weights [n_keep, k] tensor)


class RoutingRecorder:
    """Context manager that records the routing of ``model`` (a transformers MoE model) while it runs.

    Parameters:
        model: a transformers ``*ForCausalLM`` (or its base model) of a supported family.
        out: trace directory to write (atomically, on exit); ``None`` keeps rows in memory only.
        spec: the model's :class:`ModelSpec`; default derived from ``model.config``.
        provenance: extra provenance fields stored in the trace metadata (``kind`` is ``"captured"``).
        domain: optional domain tag written on every row.
        stop_tokens: token ids that end a request during decode (default: the model's ``eos_token_id``).
        keep_in_memory: keep all rows for :meth:`arrays` (default: only when ``out`` is None).
        flush_rows: rows buffered before they are streamed to the writer.

    Counters after (or during) capture: ``num_rows``, ``num_steps``, ``num_requests``,
    ``num_padding_tokens`` and ``num_finished_tokens`` (tokens run but not recorded).
    """

    def __init__(self, model, out: str | Path | None = None, *, spec: ModelSpec | None = None,
                 provenance: dict[str, Any] | None = None, domain: str | None = None,
                 stop_tokens: tuple[int, ...] | None = None, keep_in_memory: bool | None = None,
                 flush_rows: int = 1 << 18) -> None:
        self.model = model
        self.out = Path(out) if out is not None else None
        prefix, self.sites = find_routers(model)
        self.spec = spec or model_spec_of(model)
        self.stack = model.get_submodule(prefix) if prefix else model
        self.domain = domain
        self.stop_tokens = np.asarray(stop_token_ids(model) if stop_tokens is None else stop_tokens, np.int64)
        self.keep_in_memory = (out is None) if keep_in_memory is None else keep_in_memory
        self.flush_rows = flush_rows
        import transformers  # optional: the [capture] extra

        self.provenance = {"kind": "captured", "source": "transformers-router-hooks",
                           "transformers_version": transformers.__version__,
                           "model_class": type(model).__name__, **(provenance or {})}
        self._handles: list = []
        self._writer: TraceWriter | None = None
        self._pending: list[dict[str, np.ndarray]] = []
        self._pending_rows = 0
        self._kept: list[dict[str, np.ndarray]] = []
        self._batch: _Batch | None = None
        self._cur: _Step | None = None
        self.num_rows = 0
        self.num_steps = 0
        self.num_requests = 0
        self.num_padding_tokens = 0
        self.num_finished_tokens = 0

    # ------------------------------------------------------------------ context
    def __enter__(self) -> Self:
        if self.out is not None:
            self._writer = TraceWriter(self.out, self.spec, self.provenance, gate_weights=True, token_id=True,
                                       domain=self.domain is not None).__enter__()
        try:
            self._handles.append(self.stack.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
            self._handles.append(self.stack.register_forward_hook(self._post_hook))
            for site in self.sites:
                gate = self.model.get_submodule(site.name)
                self._handles.append(gate.register_forward_hook(self._router_hook(site.layer)))
        except BaseException as exc:
            self._close(type(exc), exc, exc.__traceback__)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        return self._close(exc_type, exc, tb)

    def _close(self, exc_type, exc, tb) -> bool:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._cur = None
        if self._writer is None:
            return False
        if exc_type is None:
            try:
                self._flush()
            except BaseException as err:
                writer, self._writer = self._writer, None
                writer.__exit__(type(err), err, err.__traceback__)  # discards the partial trace
                raise
        writer, self._writer = self._writer, None
        return bool(writer.__exit__(exc_type, exc, tb))

    # ------------------------------------------------------------------ hooks
    def _pre_hook(self, module, args, kwargs):
        import torch  # ~3 s: loaded only when capturing (the CLI imports this module for every command)

        input_ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        mask = kwargs.get("attention_mask")
        ref = input_ids if input_ids is not None else embeds
        if ref is None:
            raise InputError("RoutingRecorder: the model was called without input_ids or inputs_embeds")
        B, S = int(ref.shape[0]), int(ref.shape[1])
        if mask is None:
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            past = int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else 0
            real = np.ones((B, S), bool)
            position = np.broadcast_to(past + np.arange(S, dtype=np.int64), (B, S)).copy()
        elif torch.is_tensor(mask) and mask.dim() == 2 and mask.shape[0] == B and mask.shape[1] >= S:
            m = mask.detach().to("cpu").numpy() != 0
            past = m.shape[1] - S
            real = m[:, past:]
            # why cumsum: left padding shifts every real token; its position is its rank among real ones
            position = (np.cumsum(m, axis=1) - 1)[:, past:]
        else:
            shape = tuple(mask.shape) if hasattr(mask, "shape") else type(mask).__name__
            raise InputError(f"RoutingRecorder: attention_mask of shape {shape} not understood; expected a "
                             f"2-D [batch={B}, past+seq>={S}] 0/1 mask or None")
        token_id = (input_ids.detach().to("cpu").numpy().astype(np.int64) if input_ids is not None
                    else np.full((B, S), -1, np.int64))

        b = self._batch
        if past == 0 or b is None or len(b.request_ids) != B:
            # a new rectangular batch: new requests (prefill when there is no past)
            ids = np.arange(self.num_requests, self.num_requests + B, dtype=np.int64)
            self.num_requests += B
            b = self._batch = _Batch(ids, in_prefill=(past == 0), finished=np.zeros(B, bool))
        elif b.in_prefill and S == 1:
            b.in_prefill = False
        phase = PHASE_PREFILL if b.in_prefill else PHASE_DECODE
        done_before = b.finished[:, None]
        self.num_finished_tokens += int((real & done_before).sum())
        keep = real & ~done_before
        if phase == PHASE_DECODE and len(self.stop_tokens):
            # the fed stop token and everything after it belong to a finished request
            ended = np.cumsum(np.isin(token_id, self.stop_tokens) & real, axis=1) > 0
            self.num_finished_tokens += int((keep & ended).sum())
            keep &= ~ended
            b.finished |= ended.any(axis=1)
        self.num_padding_tokens += int((~real).sum())
        self._cur = _Step(
            step=self.num_steps, batch_size=B, seq_len=S, keep=keep,
            keep_flat=torch.from_numpy(keep.reshape(-1).copy()),
            position=position.astype(np.int32), phase=phase, token_id=token_id.astype(np.int32),
            request_ids=b.request_ids, routed={})
        self.num_steps += 1

    def _router_hook(self, layer: int):
        def hook(module, args, output):
            import torch  # ~3 s: loaded only when capturing (the CLI imports this module for every command)

            cur = self._cur
            if cur is None:
                raise InputError(f"RoutingRecorder: router of layer {layer} ran outside a forward of the "
                                 "decoder stack; call the model (or its base model), not a layer")
            if not (isinstance(output, tuple) and len(output) == 3 and torch.is_tensor(output[2])
                    and not output[2].is_floating_point()):
                raise InputError(f"RoutingRecorder: router of layer {layer} ({type(module).__name__}) did "
                                 "not return (logits, weights, indices); transformers >= 5 is required")
            _, weights, indices = output
            n = cur.batch_size * cur.seq_len
            if indices.shape[0] != n:
                raise InputError(f"RoutingRecorder: router of layer {layer} saw {indices.shape[0]} tokens, "
                                 f"expected batch x seq = {n}")
            if layer in cur.routed:
                raise InputError(f"RoutingRecorder: router of layer {layer} ran twice in one forward")
            if cur.keep_flat.device != indices.device:
                cur.keep_flat = cur.keep_flat.to(indices.device)
            # keep selection on the device; one copy to host per step, in _post_hook
            cur.routed[layer] = (indices.detach()[cur.keep_flat], weights.detach()[cur.keep_flat])
        return hook

    def _post_hook(self, module, args, output):
        import torch  # ~3 s: loaded only when capturing (the CLI imports this module for every command)

        cur, self._cur = self._cur, None
        if cur is None:
            return
        layers = [s.layer for s in self.sites if s.layer in cur.routed]
        n_tok = int(cur.keep.sum())
        if not layers or n_tok == 0:
            return
        k = self.spec.top_k
        ids = torch.stack([cur.routed[layer][0] for layer in layers], dim=1).to("cpu").numpy()  # [n, L, k]
        w = torch.stack([cur.routed[layer][1].float() for layer in layers], dim=1).to("cpu").numpy()
        num_layers = len(layers)
        rows_b, rows_s = np.nonzero(cur.keep)  # row-major = token order (request, then position)
        rep = lambda a: np.repeat(a, num_layers)
        chunk = {
            "request_id": rep(cur.request_ids[rows_b]),
            "position": rep(cur.position[rows_b, rows_s]),
            "phase": np.full(n_tok * num_layers, cur.phase, np.uint8),
            "step": np.full(n_tok * num_layers, cur.step, np.int64),
            "layer": np.tile(np.asarray(layers, np.uint16), n_tok),
            "expert_ids": ids.reshape(-1, k).astype(np.uint16),
            "gate_weights": w.reshape(-1, k).astype(np.float32),
            "token_id": rep(cur.token_id[rows_b, rows_s]),
        }
        self.num_rows += n_tok * num_layers
        if self.keep_in_memory:
            self._kept.append(chunk)
        if self._writer is not None:
            self._pending.append(chunk)
            self._pending_rows += n_tok * num_layers
            if self._pending_rows >= self.flush_rows:
                self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        cols = {c: np.concatenate([p[c] for p in self._pending]) for c in _COLUMNS}
        if self.domain is not None:
            cols["domain"] = self.domain
        self._writer.write(**cols)
        self._pending.clear()
        self._pending_rows = 0

    # ------------------------------------------------------------------ results
    def arrays(self) -> dict[str, np.ndarray]:
        """All recorded rows as columns (``expert_ids``/``gate_weights`` ``[n, k]``), in record order."""
        if not self.keep_in_memory:
            raise InputError("RoutingRecorder: rows were streamed to the trace, not kept; pass "
                             "keep_in_memory=True to read them back here")
        if not self._kept:
            k = self.spec.top_k
            empty = {c: np.zeros(0, np.int64) for c in _COLUMNS}
            empty["expert_ids"] = np.zeros((0, k), np.uint16)
            empty["gate_weights"] = np.zeros((0, k), np.float32)
            return empty
        return {c: np.concatenate([p[c] for p in self._kept]) for c in _COLUMNS}


def capture_routing(model, out: str | Path | None = None, **kwargs) -> RoutingRecorder:
    """``with capture_routing(model, out="trace_dir"): model.generate(...)``; see :class:`RoutingRecorder`."""
    return RoutingRecorder(model, out, **kwargs)


# ---------------------------------------------------------------------------- capture from a config (CLI)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model")
# Model types whose transformers implementation carries another name (Kimi K2 ships DeepSeek-V3 code).
_MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


@dataclass(frozen=True)
class CaptureConfig:
    """``place trace capture``: build a model from ``hf_config`` (random weights unless ``weights`` names a
    local checkpoint directory), generate from every prompt, write the routing trace to ``out``."""

    hf_config: Path
    prompts: Path
    out: Path
    max_new_tokens: int
    batch_size: int = 8
    weights: Path | None = None
    tokenizer: Path | None = None
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    sample: bool = False
    ignore_eos: bool = False
    domain: str | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InputError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise InputError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise InputError(f"--dtype must be float32, bfloat16 or float16, got '{self.dtype}'")


def read_prompts(path: Path) -> list[str]:
    """One prompt per line (UTF-8); blank lines are skipped. Request ids number the prompts from 0."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read prompts ({exc.strerror or exc})") from None
    prompts = []
    for i, line in enumerate(raw.split(b"\n"), start=1):
        try:
            text = line.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError as exc:
            raise InputError(f"{path}: line {i}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        if text.strip():
            prompts.append(text)
    if not prompts:
        raise InputError(f"{path}: no prompts (expected one prompt per non-blank line)")
    return prompts


def load_hf_config(path: Path):
    """A transformers config object from a ``config.json`` (no download, no remote code)."""

    from transformers import AutoConfig  # optional: the [capture] extra

    d = reading.read_json(path, "cannot read config (no such file)", "not a JSON config")
    if not isinstance(d, dict) or "model_type" not in d:
        raise InputError(f"{path}: field 'model_type' missing: not a Hugging Face config.json")
    mt = _MODEL_TYPE_ALIASES.get(str(d["model_type"]), str(d["model_type"]))
    d = {k: v for k, v in d.items() if k not in ("model_type", "auto_map", "quantization_config")}
    try:
        return AutoConfig.for_model(mt, **d)
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{path}: field 'model_type': '{mt}' cannot be built by transformers ({exc})"
                         ) from None


class ByteTokenizer:
    """Stand-in when no tokenizer is available locally: the prompt's UTF-8 bytes, each id taken modulo the
    vocabulary size. Routing of random-weight models does not depend on real token semantics; nothing is
    downloaded."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]


def _tokenizer_for(cfg: CaptureConfig, vocab_size: int):
    tdir = cfg.tokenizer
    if tdir is None and cfg.weights is not None and any((cfg.weights / f).exists() for f in TOKENIZER_FILES):
        tdir = cfg.weights
    if tdir is None:
        return ByteTokenizer(vocab_size), "byte-level stand-in (utf-8 bytes modulo vocab_size)"
    from transformers import AutoTokenizer  # optional: the [capture] extra

    try:
        tok = AutoTokenizer.from_pretrained(str(tdir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise InputError(f"{tdir}: cannot load a tokenizer from this directory ({exc})") from None
    return _HFTokenizer(tok), str(tdir)


class _HFTokenizer:
    def __init__(self, tok) -> None:
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=True))


def left_pad(seqs: list[list[int]], pad_id: int):
    """``input_ids`` and ``attention_mask`` (int64 ``[B, max_len]``) with every sequence right-aligned."""
    import torch  # ~3 s: loaded only when capturing (the CLI imports this module for every command)

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask


@dataclass(frozen=True)
class CaptureResult:
    out: Path
    num_rows: int
    num_requests: int
    num_steps: int
    num_prompt_tokens: int
    num_generated_tokens: int
    num_padding_tokens: int
    num_finished_tokens: int
    seconds: float


def run_capture(cfg: CaptureConfig) -> CaptureResult:
    """Build the model, generate over every prompt in batches under a :class:`RoutingRecorder`, and write
    the trace atomically to ``cfg.out``."""

    import torch  # ~3 s: loaded only when capturing (the CLI imports this module for every command)
    from transformers import AutoModelForCausalLM  # optional: the [capture] extra

    prompts = read_prompts(cfg.prompts)
    config = load_hf_config(cfg.hf_config)
    # the spec first: an unsupported (e.g. dense) model fails before anything is built
    from_hf_config(config.to_dict(), source=str(cfg.hf_config))
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(cfg.seed)
    try:
        if cfg.weights is not None:
            if not cfg.weights.is_dir():
                raise InputError(f"{cfg.weights}: --weights must be a local checkpoint directory")
            model = AutoModelForCausalLM.from_pretrained(str(cfg.weights), config=config, dtype=dtype,
                                                         local_files_only=True)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model = model.to(cfg.device).eval()
    except (OSError, ValueError, RuntimeError, AssertionError) as exc:  # torch asserts on a missing device
        raise InputError(f"{cfg.weights or cfg.hf_config}: cannot build the model on '{cfg.device}' ({exc})"
                         ) from None
    # the trace's model is its config file (what load_model reads back): every later stage, export included,
    # resolves it -- not the weights directory transformers records as the config's name_or_path
    spec = model_spec_of(model, name=str(Path(cfg.hf_config).resolve()), source=str(cfg.hf_config))
    tokenizer, tok_desc = _tokenizer_for(cfg, int(config.vocab_size))
    encoded = [tokenizer.encode(p) for p in prompts]
    for i, e in enumerate(encoded):
        if not e:
            raise InputError(f"{cfg.prompts}: prompt {i}: encodes to no tokens")
    pad_id = getattr(config, "pad_token_id", None)
    pad_id = 0 if pad_id is None else int(pad_id)
    stop = () if cfg.ignore_eos else stop_token_ids(model)
    gen_kwargs = {"max_new_tokens": cfg.max_new_tokens, "do_sample": cfg.sample, "pad_token_id": pad_id,
                      "eos_token_id": list(stop) if stop else None}
    if not stop:
        model.generation_config.eos_token_id = None
    provenance = {
        "hf_config": str(cfg.hf_config), "model_type": config.model_type,
        "weights": str(cfg.weights) if cfg.weights else f"random (seed {cfg.seed})",
        "tokenizer": tok_desc, "prompts": str(cfg.prompts), "num_prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens, "batch_size": cfg.batch_size, "dtype": cfg.dtype,
        "device": cfg.device, "sampling": "sample" if cfg.sample else "greedy", "seed": cfg.seed,
        "stop_tokens": list(stop),
    }
    generated = 0
    t0 = time.perf_counter()
    with RoutingRecorder(model, cfg.out, spec=spec, provenance=provenance, domain=cfg.domain,
                         stop_tokens=stop) as rec, torch.inference_mode():
        for start in track(range(0, len(encoded), cfg.batch_size), "capture", "batch"):
            ids, mask = left_pad(encoded[start:start + cfg.batch_size], pad_id)
            out = model.generate(input_ids=ids.to(cfg.device), attention_mask=mask.to(cfg.device),
                                 **gen_kwargs)
            generated += int(out.shape[0] * (out.shape[1] - ids.shape[1]))
    return CaptureResult(out=cfg.out, num_rows=rec.num_rows, num_requests=rec.num_requests,
                         num_steps=rec.num_steps, num_prompt_tokens=sum(len(e) for e in encoded),
                         num_generated_tokens=generated, num_padding_tokens=rec.num_padding_tokens,
                         num_finished_tokens=rec.num_finished_tokens, seconds=time.perf_counter() - t0)
