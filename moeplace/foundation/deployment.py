"""A disaggregated deployment: a prefill pool and a decode pool, each with its own GPUs, attention layout,
expert parallelism and batching limits — the one description ``place plan``, ``place optimize --phase``,
``place simulate`` and ``place export --flags`` read (``--pools``).

Written on the command line, one word per pool::

    --pools prefill:gpus=8,tp=8,ep=8 decode:gpus=16,dp=16,ep=16,batch=64

or as a YAML/JSON file (``--pools deployment.yaml``)::

    gpu: gb300-nvl72          # optional: the command's --gpu otherwise
    kv_link: rdma             # how the KV cache moves from prefill to decode: rdma (NIXL over the NICs) | nvlink
    pools:
      prefill: {gpus: 8, tp: 8, ep: 8}
      decode: {gpus: 16, dp: 16, ep: 16, batch: 64}

Per pool (:class:`PoolSpec`): ``gpus`` (required), attention ``tp`` x ``dp`` (= ``gpus``; one may be left
out), ``ep`` (expert-parallel size, default ``gpus``; the rest of the pool's GPUs tensor-shard each expert:
MoE TP = ``gpus / ep``, which ``moe_tp`` may state), ``dense_tp``, ``redundant`` (redundant expert slots per
MoE layer), ``batch`` (running sequences per attention-DP rank: vLLM ``--max-num-seqs``, SGLang
``--max-running-requests``) and ``tokens`` (tokens per forward per DP rank: ``--max-num-batched-tokens`` /
``--chunked-prefill-size``). Both forms go through the typed-settings parser
(:mod:`foundation.settings`): an unknown key names the nearest valid one, a wrong value names its type.
Nothing here does I/O except :func:`parse_pools`, which reads the file a user named.

TEP8 prefill is ``prefill:gpus=8,tp=8,ep=8`` (attention TP8 with expert parallelism over the same 8 GPUs,
vLLM ``--tensor-parallel-size 8 --enable-expert-parallel``); DEP16 decode is ``decode:gpus=16,dp=16,ep=16``
(16 attention-DP ranks of one GPU, EP16).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from moeplace.foundation import reading
from moeplace.foundation.errors import InputError
from moeplace.foundation.settings import Range, build, parse_keys

Count = Annotated[int, Range(1)]
POOL_ROLES = ("prefill", "decode")
KV_LINKS = ("rdma", "nvlink")
DEFAULT_BATCH = 256  # running sequences per DP rank when a pool does not say (vLLM's --max-num-seqs default)
DEFAULT_TOKENS = 8192  # tokens per forward per DP rank (--max-num-batched-tokens)


@dataclass(frozen=True)
class PoolSpec:
    """One pool of a disaggregated deployment (see the module docstring for the keys)."""

    role: Literal["prefill", "decode"]
    gpus: Count
    tp: Count | None = None
    dp: Count | None = None
    ep: Count | None = None
    moe_tp: Count | None = None
    dense_tp: Count | None = None
    redundant: Annotated[int, Range(0)] = 0
    batch: Count | None = None
    tokens: Count | None = None

    def __post_init__(self) -> None:
        w = f"--pools {self.role}"
        if self.tp is not None and self.dp is not None and self.tp * self.dp != self.gpus:
            raise InputError(f"{w}: tp {self.tp} x dp {self.dp} = {self.tp * self.dp}, but attention TP x DP must "
                             f"equal the pool's {self.gpus} GPUs")
        for name in ("tp", "dp", "ep", "dense_tp"):
            v = getattr(self, name)
            if v is not None and (v > self.gpus or self.gpus % v):
                raise InputError(f"{w}: {name} {v} must divide the pool's {self.gpus} GPUs")
        if self.moe_tp is not None and self.moe_tp * self.ep_size != self.gpus:
            raise InputError(f"{w}: moe_tp {self.moe_tp} x ep {self.ep_size} = {self.moe_tp * self.ep_size}, but EP x "
                             f"MoE TP must equal the pool's {self.gpus} GPUs")

    @property
    def ep_size(self) -> int:
        return self.ep or self.gpus

    @property
    def moe_tp_size(self) -> int:
        return self.gpus // self.ep_size

    @property
    def max_seqs(self) -> int:
        return self.batch or DEFAULT_BATCH

    @property
    def max_batched_tokens(self) -> int:
        return self.tokens or DEFAULT_TOKENS

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Deployment:
    """A prefill pool and a decode pool (in that order), the GPU kind they run on (``None``: the command's
    ``--gpu``), GPUs per NVLink domain (``None``: the GPU preset's) and the link the KV cache crosses from
    prefill to decode (``rdma``: NIXL over the GPUs' NICs, as vLLM's NixlConnector and SGLang's
    disaggregation transfer it between nodes; ``nvlink``: both pools in one NVLink domain)."""

    pools: tuple[PoolSpec, ...]
    gpu: str | None = None
    gpus_per_node: Count | None = None
    kv_link: Literal["rdma", "nvlink"] = "rdma"

    def __post_init__(self) -> None:
        roles = [p.role for p in self.pools]
        if sorted(roles) != sorted(POOL_ROLES) or len(roles) != 2:
            raise InputError(f"--pools: a deployment has one prefill and one decode pool, got "
                             f"{', '.join(roles) or 'none'}")
        if roles != list(POOL_ROLES):
            object.__setattr__(self, "pools", tuple(sorted(self.pools, key=lambda p: POOL_ROLES.index(p.role))))

    @property
    def prefill(self) -> PoolSpec:
        return self.pools[0]

    @property
    def decode(self) -> PoolSpec:
        return self.pools[1]

    def pool(self, role: str) -> PoolSpec:
        if role not in POOL_ROLES:
            raise InputError(f"pool '{role}' unknown (expected one of {', '.join(POOL_ROLES)})")
        return self.pools[POOL_ROLES.index(role)]

    @property
    def num_gpus(self) -> int:
        return sum(p.gpus for p in self.pools)

    def gpu_kind(self, default: str) -> str:
        return self.gpu or default

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"pools": {p.role: {k: v for k, v in p.to_dict().items() if k != "role"}
                                       for p in self.pools}, "kv_link": self.kv_link}
        if self.gpu is not None:
            d["gpu"] = self.gpu
        if self.gpus_per_node is not None:
            d["gpus_per_node"] = self.gpus_per_node
        return d

    def with_gpu(self, gpu: str | None, gpus_per_node: int | None) -> Deployment:
        """The deployment on ``gpu`` (``None``: keep its own) unless it names one itself."""
        return dataclasses.replace(self, gpu=self.gpu or gpu, gpus_per_node=self.gpus_per_node or gpus_per_node)


_POOL_KEYS = tuple(f.name for f in dataclasses.fields(PoolSpec) if f.name != "role")
_WORD = re.compile(r"^\s*([A-Za-z_]+)\s*:(.*)$")


def _number(text: str) -> Any:
    """``"8"`` -> 8 (a whole number), anything else stays text (the typed parser names what was expected)."""
    t = text.strip()
    return int(t) if re.fullmatch(r"[+-]?\d+", t) else t


def pool_from_word(word: str) -> PoolSpec:
    """``"decode:gpus=16,dp=16,ep=16"`` -> a :class:`PoolSpec` (keys checked by the typed-settings parser)."""
    m = _WORD.match(word)
    if not m:
        raise InputError(f"--pools '{reading.quote(word)[1:-1]}': expected ROLE:key=value,... (e.g. "
                         "prefill:gpus=8,tp=8,ep=8 decode:gpus=16,dp=16,ep=16)")
    role, rest = m.group(1), m.group(2)
    raw: dict[str, Any] = {}
    for part in (x for x in rest.split(",") if x.strip()):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise InputError(f"--pools {role}: '{part.strip()}' is not key=value (keys: {', '.join(_POOL_KEYS)})")
        if key.strip() in raw:
            raise InputError(f"--pools {role}: key '{key.strip()}' given twice")
        raw[key.strip()] = _number(value)
    return pool_from_mapping(role, raw)


def pool_from_mapping(role: Any, raw: Any) -> PoolSpec:
    if role not in POOL_ROLES:
        raise InputError(f"--pools: pool '{role}' unknown (expected {' and '.join(POOL_ROLES)})")
    if isinstance(raw, dict) and "gpus" not in raw:
        raise InputError(f"--pools {role}: 'gpus' is required (the pool's GPU count)")
    return build(PoolSpec, f"--pools {role}", raw, role=role)


_DEPLOYMENT_KEYS = {"pools": Any, "gpu": str | None, "gpus_per_node": Count | None,
                    "kv_link": Literal["rdma", "nvlink"]}


def deployment_from_mapping(raw: Any, where: str) -> Deployment:
    """A :class:`Deployment` from the mapping a YAML/JSON file holds (``where`` names the file)."""
    top = parse_keys(where, raw, _DEPLOYMENT_KEYS)
    pools = top.pop("pools", None)
    if not isinstance(pools, dict):
        raise InputError(f"{where}: field 'pools' must map prefill and decode to their settings")
    try:
        return Deployment(pools=tuple(pool_from_mapping(r, v) for r, v in pools.items()), **top)
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None


def parse_pools(words: list[str] | tuple[str, ...] | str) -> Deployment:
    """``--pools`` as given: the pool words, or one YAML/JSON file that describes the deployment."""
    if isinstance(words, str):
        words = [words]
    words = list(words)
    if len(words) == 1 and ":" not in words[0]:
        p = Path(words[0])
        missing = "no such --pools file (or give the pools as ROLE:key=value words)"
        raw = reading.read_json(p, missing) if p.suffix == ".json" else reading.read_yaml(p, missing)
        return deployment_from_mapping(raw, str(p))
    return Deployment(pools=tuple(pool_from_word(w) for w in words))


def pools_help(what: str) -> str:
    """The ``--pools`` help text of a command (``what``: what the command does with each pool)."""
    return (f"a disaggregated deployment: ROLE:key=value,... per pool, e.g. prefill:gpus=8,tp=8,ep=8 "
            f"decode:gpus=16,dp=16,ep=16,batch=64 (keys: {', '.join(_POOL_KEYS)}), or a YAML/JSON file with "
            f"pools/gpu/kv_link; {what}")
