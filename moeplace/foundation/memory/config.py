"""The memory model's inputs as data: :class:`MemoryConfig` (a parallel layout and a serving
configuration, validated on construction) and :class:`Layout` (the layout with every derived size filled
in by :func:`resolve_layout`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from moeplace.foundation.errors import InputError
from moeplace.foundation.memory.inputs import MEMORY_FLAGS, POOL_SPLITS, GiB
from moeplace.foundation.model import KV_DTYPE_BYTES, ModelSpec, check_field_types


@dataclass(frozen=True)
class MemoryConfig:
    """A parallel layout and a serving configuration.

    ``tp``/``dp``/``ep``/``dense_tp`` left ``None`` are derived from the GPU count by
    :func:`resolve_layout` (``tp = W / dp``, or with neither given the largest divisor of ``W`` that
    divides the attention heads; ``dp = W / tp``; ``ep = W``; ``dense_tp = tp``).
    ``context``: the target length of one sequence (``None``: the model's maximum context).
    ``context_mix``: ``((length, share), ...)`` for the mixed-length concurrency figure.
    ``max_batched_tokens``: tokens per forward per DP rank (chunked-prefill size).
    ``max_num_seqs``: running-sequence cap per DP rank. ``state_slots_per_seq``: KDA state copies a
    request keeps (prefix caching keeps 3-5). ``pool_split``/``pool_param``: see :mod:`foundation.memory`
    (``ratio``: r; ``slots``: slots per DP rank). ``ll_max_dispatch_tokens``: DeepEP low-latency tokens per
    rank. ``moe_peak_factor``: max/mean tokens per GPU the MoE buffers are sized for.
    ``min_concurrency``: total concurrent sequences at ``context`` needed to call it a fit.
    """

    tp: int | None = None
    dp: int | None = None
    ep: int | None = None
    dense_tp: int | None = None
    num_redundant: int = 0
    dcp: int = 1
    context: int | None = None
    context_mix: tuple[tuple[int, float], ...] | None = None
    kv_dtype: str = "bf16"
    gpu_memory_utilization: float = 0.9
    max_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    state_slots_per_seq: int = 1
    pool_split: str = "shared"
    pool_param: float | None = None
    page_size: int = 64
    ll_max_dispatch_tokens: int = 128
    moe_peak_factor: float = 2.0
    other_reserve_bytes: float = 1.0 * GiB
    min_concurrency: int = 1

    def __post_init__(self) -> None:
        check_field_types(self, "plan config", ranges=False)  # a plan report read back: no "1.5" GPUs
        for name in ("tp", "dp", "ep", "dense_tp"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        for name in ("dcp", "max_batched_tokens", "max_num_seqs", "state_slots_per_seq", "page_size",
                     "ll_max_dispatch_tokens", "min_concurrency"):
            if getattr(self, name) < 1:
                raise InputError(f"{MEMORY_FLAGS.get(name, name)} must be >= 1, got {getattr(self, name)}")
        if self.num_redundant < 0:
            raise InputError(f"--redundant must be >= 0, got {self.num_redundant}")
        if self.context is not None and self.context < 1:
            raise InputError(f"--context must be >= 1 token, got {self.context}")
        if self.kv_dtype not in KV_DTYPE_BYTES:
            raise InputError(f"--kv-dtype '{self.kv_dtype}' unknown (expected one of {sorted(KV_DTYPE_BYTES)})")
        if not (0 < self.gpu_memory_utilization <= 1):
            raise InputError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.pool_split not in POOL_SPLITS:
            raise InputError(f"--pool-split '{self.pool_split}' unknown (expected one of {POOL_SPLITS})")
        if self.pool_split == "ratio" and self.pool_param is not None and not self.pool_param > 0:
            raise InputError(f"--pool-split ratio:{self.pool_param}: the ratio must be > 0")
        if self.pool_split == "slots" and (self.pool_param is None or self.pool_param < 1
                                           or self.pool_param != int(self.pool_param)):
            raise InputError(f"--pool-split slots:N needs a whole number of slots >= 1, got {self.pool_param}")
        if self.moe_peak_factor < 1:
            raise InputError(f"moe_peak_factor must be >= 1 (max/mean), got {self.moe_peak_factor}")
        if self.other_reserve_bytes < 0:
            raise InputError(f"--other-reserve must be >= 0 GiB, got {self.other_reserve_bytes / GiB:g} GiB")


@dataclass(frozen=True)
class Layout:
    """A resolved parallel layout on ``world`` GPUs: attention ``tp x dp``, MoE ``ep x moe_tp``."""

    world: int
    tp: int
    dp: int
    ep: int
    moe_tp: int
    dense_tp: int
    dcp: int
    num_redundant: int
    num_slots: int  # physical expert slots per MoE layer (E + R)

    def describe(self) -> str:
        moe = f"EP{self.ep}" + (f" x MoE-TP{self.moe_tp}" if self.moe_tp > 1 else "")
        dcp = f", DCP{self.dcp}" if self.dcp > 1 else ""
        return f"attention TP{self.tp} x DP{self.dp}{dcp}, MoE {moe}, dense TP{self.dense_tp}, R={self.num_redundant}"


def next_valid_redundant(num_experts: int, ep: int, at_least: int = 0) -> int:
    """Smallest ``R >= at_least`` with ``(num_experts + R) % ep == 0``."""
    return at_least + (-(num_experts + at_least)) % ep


def attention_heads(model: ModelSpec) -> set[int]:
    """Head counts attention TP must divide (query heads of every attention kind the model uses)."""
    return {getattr(model, kind).num_heads for kind in set(model.attention)}


def resolve_layout(model: ModelSpec, num_gpus: int, config: MemoryConfig) -> Layout:
    """Fill in the derived parallel sizes and validate the layout (clear errors, exit code 2)."""
    W = num_gpus
    tp, dp = config.tp, config.dp
    heads = attention_heads(model)
    if tp is None and dp is None:
        # Plain TP over as many GPUs as the heads allow; DP attention over the rest. The largest t that
        # divides W and every head count is their gcd (a scan of 1..W cost minutes at --gpus 10^9).
        tp = math.gcd(W, *heads)
        dp = W // tp
    elif tp is None:
        if W % dp:
            raise InputError(f"--dp {dp} does not divide {W} GPUs")
        tp = W // dp
    elif dp is None:
        if W % tp:
            raise InputError(f"--tp {tp} does not divide {W} GPUs")
        dp = W // tp
    if tp * dp != W:
        raise InputError(f"--tp {tp} x --dp {dp} = {tp * dp}, but attention TP x DP must equal the {W} GPUs")
    for h in heads:
        if h % tp:
            raise InputError(f"attention TP {tp} does not divide the {h} attention heads of '{model.name}' "
                             f"(choose --tp from {[t for t in range(1, h + 1) if h % t == 0 and W % t == 0]})")
    ep = config.ep or W
    if ep > W or W % ep:
        raise InputError(f"--ep {ep} must divide the {W} GPUs (EP x MoE-TP = GPUs)")
    E, R = model.num_experts, config.num_redundant
    if (E + R) % ep:
        raise InputError(f"{E} experts + {R} redundant = {E + R} slots per layer are not divisible by --ep {ep}; "
                         f"use --redundant {next_valid_redundant(E, ep, R)} (or another R with E+R a multiple "
                         f"of {ep})")
    dense_tp = config.dense_tp or tp
    if W % dense_tp:
        raise InputError(f"--dense-tp {dense_tp} must divide the {W} GPUs")
    if tp % config.dcp:
        raise InputError(f"--dcp {config.dcp} must divide the attention TP size {tp}")
    return Layout(world=W, tp=tp, dp=dp, ep=ep, moe_tp=W // ep, dense_tp=dense_tp, dcp=config.dcp,
                  num_redundant=R, num_slots=E + R)
