"""The KV and state cache pools of one attention-DP rank (:class:`CachePools`): the admission-control
model the simulator shares with the planner, and how free memory is split between the pools
(:func:`make_pools`)."""
from __future__ import annotations

from dataclasses import dataclass

from moeplace.foundation.memory.config import Layout, MemoryConfig
from moeplace.foundation.model import ModelSpec


@dataclass(frozen=True)
class CachePools:
    """The KV and state pools of one attention-DP rank, as seen on each of its GPUs.

    This is the admission-control model the simulator shares with the planner. Units: bytes per GPU;
    token counts are per-GPU page-rounded token slots (``kv_tokens(n)``).

    ``kv_bytes_per_token``: bytes one cached token takes on a GPU (MLA latent, replicated across TP);
    ``state_bytes_per_seq``: per-GPU state of one sequence (KDA state / TP x state slots per request);
    ``shared``: one pool of ``pool_bytes`` for both (vLLM) or two fixed pools (``kv_pool_bytes``,
    ``state_slots``; SGLang).
    """

    pool_bytes: float
    kv_pool_bytes: float
    state_pool_bytes: float
    kv_bytes_per_token: float
    state_bytes_per_seq: float
    shared: bool
    dcp: int
    page_size: int
    max_num_seqs: int
    max_model_len: int

    # -- the functions the simulator calls
    def kv_tokens(self, num_tokens: int) -> int:
        """Per-GPU token slots a sequence of ``num_tokens`` occupies: its tokens spread over ``dcp``
        ranks, rounded up to whole pages."""
        per_rank = -(-num_tokens // self.dcp)
        return -(-per_rank // self.page_size) * self.page_size

    @property
    def kv_pool_bytes_per_gpu(self) -> float:
        return self.kv_pool_bytes

    @property
    def state_slots(self) -> int | None:
        """Sequences the state pool holds per DP rank; ``None`` when the pool is shared."""
        if self.shared:
            return None
        if self.state_bytes_per_seq == 0:
            return self.max_num_seqs
        return int(self.state_pool_bytes // self.state_bytes_per_seq)

    @property
    def kv_token_capacity(self) -> int | None:
        """Per-GPU token slots the KV pool holds (``None`` when the pool is shared)."""
        if self.shared:
            return None
        if self.kv_bytes_per_token == 0:
            return 2**62
        return int(self.kv_pool_bytes // self.kv_bytes_per_token)

    def seq_bytes(self, num_tokens: int) -> float:
        """Per-GPU bytes one sequence of ``num_tokens`` takes (state + its KV pages)."""
        return self.state_bytes_per_seq + self.kv_tokens(num_tokens) * self.kv_bytes_per_token

    def fits(self, used_kv_tokens: int, used_seqs: int) -> bool:
        """Do ``used_seqs`` sequences holding ``used_kv_tokens`` per-GPU token slots (the sum of their
        ``kv_tokens``) fit the pools of one DP rank? (A simulator calls this as sequences grow, to decide
        on preemption.)"""
        if used_seqs > self.max_num_seqs:
            return False
        if self.shared:
            return used_seqs * self.state_bytes_per_seq + used_kv_tokens * self.kv_bytes_per_token <= self.pool_bytes
        return used_seqs <= self.state_slots and used_kv_tokens <= self.kv_token_capacity

    def can_admit(self, num_tokens: int, used_kv_tokens: int = 0, used_seqs: int = 0) -> bool:
        """Can one more sequence growing to ``num_tokens`` be admitted on a DP rank that already holds
        ``used_seqs`` sequences occupying ``used_kv_tokens`` per-GPU token slots (sum of ``kv_tokens``)?"""
        if num_tokens > self.max_model_len:
            return False
        return self.fits(used_kv_tokens + self.kv_tokens(num_tokens), used_seqs + 1)

    # -- concurrency
    def concurrency(self, mix: tuple[tuple[int, float], ...]) -> tuple[int, str]:
        """Sequences per DP rank at a length mix (shares of sequences; one length = ``((n, 1.0),)``), in
        steady state with every length present at its share. Returns ``(count, ceiling)`` with the
        ceiling ``"kv"``, ``"state"`` or ``"max_num_seqs"``."""
        longest = max(n for n, _ in mix)
        if longest > self.max_model_len:
            return 0, "max_model_len"
        if not self.fits(self.kv_tokens(longest), 1):  # the longest sequence must fit on its own
            alone_state = self.state_bytes_per_seq > (self.pool_bytes if self.shared else self.state_pool_bytes)
            return 0, "state" if alone_state else "kv"
        kv_tok = sum(w * self.kv_tokens(n) for n, w in mix)
        kv = kv_tok * self.kv_bytes_per_token
        if self.shared:
            per_seq = self.state_bytes_per_seq + kv
            count = int(self.pool_bytes // per_seq) if per_seq else self.max_num_seqs
            ceiling = "kv" if kv >= self.state_bytes_per_seq else "state"
        else:
            by_kv = int(self.kv_token_capacity // kv_tok) if kv_tok else 2**62
            by_state = self.state_slots
            count, ceiling = (by_kv, "kv") if by_kv <= by_state else (by_state, "state")
        if count > self.max_num_seqs:
            return self.max_num_seqs, "max_num_seqs"
        return count, ceiling

    def max_context(self) -> int:
        """The longest sequence one DP rank can hold alone (tokens; ignores the model's limit)."""
        room = (self.pool_bytes - self.state_bytes_per_seq) if self.shared else self.kv_pool_bytes
        if self.state_bytes_per_seq > (self.pool_bytes if self.shared else self.state_pool_bytes):
            return 0
        if self.kv_bytes_per_token == 0:
            return 2**62
        pages = int(max(room, 0) // (self.kv_bytes_per_token * self.page_size))
        return pages * self.page_size * self.dcp


def make_pools(model: ModelSpec, lay: Layout, config: MemoryConfig, free_bytes: float) -> CachePools:
    """Split ``free_bytes`` per GPU between the KV pool and the state pool by ``config.pool_split``."""
    kvb = model.kv_bytes_per_token(config.kv_dtype, attention_tp=lay.tp)
    state = model.state_bytes_per_sequence(attention_tp=lay.tp) * config.state_slots_per_seq
    free = max(free_bytes, 0.0)
    if config.pool_split == "shared" or state == 0 or kvb == 0:
        # A model without state (or without KV) has one pool whatever the rule says.
        kv_part, state_part, shared = free, 0.0, True
    elif config.pool_split == "ratio":
        r = 0.9 if config.pool_param is None else config.pool_param
        state_part = free * r / (1 + r)
        kv_part, shared = free - state_part, False
    else:
        state_part = min(free, int(config.pool_param) * state)
        kv_part, shared = free - state_part, False
    return CachePools(pool_bytes=free, kv_pool_bytes=kv_part, state_pool_bytes=state_part, kv_bytes_per_token=kvb,
                      state_bytes_per_seq=state, shared=shared, dcp=lay.dcp, page_size=config.page_size,
                      max_num_seqs=config.max_num_seqs, max_model_len=model.max_context or 2**62)
