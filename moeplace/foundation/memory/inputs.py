"""User inputs of the memory model: token counts with ``k``/``M`` suffixes, length mixes, pool-split
rules, and the flag names messages use. Every parser raises a one-line :class:`InputError` naming the
flag (or field) and what was expected; ``place plan``, ``place simulate``, ``place sweep`` and the
dashboard share these so a mix or a size means the same everywhere."""
from __future__ import annotations

import re

from moeplace.foundation.errors import InputError

GiB = 2**30
MiB = 2**20
KiB = 2**10

POOL_SPLITS = ("shared", "ratio", "slots")

# How `place plan` spells the fields whose flag is not the field name (messages name the flag a user typed;
# fields without a flag, such as ll_max_dispatch_tokens, are named as they are).
MEMORY_FLAGS = {"dcp": "--dcp", "max_batched_tokens": "--max-batched-tokens", "max_num_seqs": "--max-num-seqs",
              "state_slots_per_seq": "--state-slots", "page_size": "--page-size", "min_concurrency": "--min-seqs"}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


def parse_tokens(text: str | int, what: str = "size") -> int:
    """``"128k"`` -> 131072, ``"1M"`` -> 1048576, ``"4096"`` -> 4096 (binary suffixes: K3's maximum
    context 1,048,576 is "1M")."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.match(str(text))
        if not m:
            raise InputError(f"{what} '{text}': expected a token count such as 4096, 128k or 1M")
        mult = {"": 1, "k": KiB, "m": MiB}[m.group(2).lower()]
        value = round(float(m.group(1)) * mult)
    if value < 1:
        raise InputError(f"{what} '{text}': must be at least 1 token")
    return value


def parse_context_mix(text: str, max_context: int | None = None,
                      what: str = "--context-mix") -> tuple[tuple[int, float], ...]:
    """``"8k:0.7,128k:0.25,1M:0.05"`` -> ``((8192, 0.7), (131072, 0.25), (1048576, 0.05))``.
    Weights are shares of sequences and must sum to 1 (within 1e-6); with ``max_context`` (the model's)
    no length may exceed it. The one check of a length mix for ``plan``, ``simulate`` and ``sweep``."""
    items = []
    for i, part in enumerate(str(text).split(",")):
        if ":" not in part:
            raise InputError(f"{what} item {i + 1} '{part.strip()}': expected LENGTH:SHARE, e.g. 128k:0.25")
        length, share = part.split(":", 1)
        n = parse_tokens(length, what=f"{what} item {i + 1} length")
        try:
            w = float(share)
        except ValueError:
            raise InputError(f"{what} item {i + 1} share '{share.strip()}': expected a number") from None
        if not (0 < w <= 1):
            raise InputError(f"{what} item {i + 1} share {w}: expected a share in (0, 1]")
        if max_context and n > max_context:
            raise InputError(f"{what} item {i + 1} length {format_tokens(n)} exceeds the model's maximum "
                             f"context {format_tokens(max_context)} ({max_context:,} tokens)")
        items.append((n, w))
    total = sum(w for _, w in items)
    if abs(total - 1.0) > 1e-6:
        raise InputError(f"{what} shares sum to {total:g}, expected 1")
    return tuple(items)


def format_tokens(n: int) -> str:
    """Inverse of :func:`parse_tokens` where exact (1048576 -> "1M", 131072 -> "128k")."""
    if n % MiB == 0:
        return f"{n // MiB}M"
    if n % KiB == 0:
        return f"{n // KiB}k"
    return str(n)


def parse_pool_split(text: str) -> tuple[str, float | None]:
    """``"shared"`` | ``"ratio"`` | ``"ratio:0.9"`` | ``"slots:64"`` -> ``(rule, param)``."""
    rule, _, param = str(text).partition(":")
    if rule not in POOL_SPLITS:
        raise InputError(f"--pool-split '{text}': expected shared, ratio[:R] or slots:N")
    if not param:
        return rule, None
    try:
        return rule, float(param)
    except ValueError:
        raise InputError(f"--pool-split '{text}': '{param}' is not a number") from None
