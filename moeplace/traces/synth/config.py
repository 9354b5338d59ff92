"""The knobs of the synthetic router (:class:`SynthConfig`) and the constants of its u-space."""
from __future__ import annotations

from dataclasses import dataclass

from moeplace.foundation import limits
from moeplace.foundation.errors import InputError

DOMAIN_NAMES = ("chat", "code", "math", "writing", "multilingual", "agentic", "science", "legal")
U_BITS = 16
U_SIZE = 1 << U_BITS
SYNTH_VERSION = 3  # 3: every chunk and MoE layer draws from its own stream (any number of workers, one trace)
DEFAULT_DRIFT_PHASES = 4  # phases of the domain mix when none are given (at most one per token)


@dataclass(frozen=True)
class SynthConfig:
    """What the synthetic router should look like. Defaults follow the published statistics
    (docs/design.md Sources §4)."""

    num_tokens: int = 100_000
    seed: int = 0
    # popularity: median over layers of max/mean of the whole trace's per-layer load
    skew: float = 6.0
    skew_depth_ratio: float = 2.5  # skew target of the last MoE layer / first (geometric in depth)
    cv: float | None = 1.0  # median over layers of the trace load's std/mean; None: plain lognormal
    # workload domains
    num_domains: int = 5
    domain_correlation: float = 0.5  # mean Pearson correlation of two domains' per-layer loads
    drift: float = 0.6  # 0: constant even mix; 1: each phase is a single domain
    drift_phases: int | None = None  # None: DEFAULT_DRIFT_PHASES, fewer for a trace of fewer tokens
    # structure on top of the popularity
    affinity: float = 0.45  # probability a slot follows the inter-layer coupling from its layer l-1 expert
    token_effect: float = 0.15  # probability a slot comes from the token id's preferred experts
    token_experts: int = 2  # preferred experts per (token id, layer) that token-sourced slots choose from
    theme: float = 0.35  # probability a slot comes from the token's theme (within-layer co-activation)
    themes: int | None = None  # equal-load expert groups per layer; None: auto (num_themes)
    locality: float | None = 0.15  # target top-k overlap of consecutive tokens of a request; None: no copy
    zipf_exponent: float = 1.05
    # requests and engine loop
    arrival_rate: float = 8.0  # requests per second (Poisson)
    prompt_median: int = 1024
    prompt_sigma: float = 1.1
    long_fraction: float = 0.03  # share of prompts from the Pareto long-context tail
    long_min: int = 32_768
    long_alpha: float = 1.1
    output_median: int = 256
    output_sigma: float = 1.0
    output_max: int = 32_768
    max_prefill_tokens: int = 4096  # represented prompt tokens per request (evenly spaced sample)
    max_decode_tokens: int = 1024  # represented decode tokens per request (the first ones)
    max_batch_tokens: int = 8192  # tokens per engine iteration
    max_running: int = 64  # concurrent requests
    iter_base_s: float = 0.012
    iter_token_s: float = 30e-6
    # output
    gate_weights: bool = False
    chunk_tokens: int = 8192

    def __post_init__(self) -> None:  # no I/O: the memory and disk estimates are check_resources'
        def bad(field: str, msg: str) -> None:
            raise InputError(f"synth config: field '{field}': {msg}")

        if self.drift_phases is None and isinstance(self.num_tokens, int) and not isinstance(self.num_tokens, bool):
            # the default adapts: a 3-token trace has 3 phases (a phase holds at least one token); given
            # phases are checked against the tokens below
            object.__setattr__(self, "drift_phases", max(1, min(DEFAULT_DRIFT_PHASES, self.num_tokens)))
        for name in ("num_tokens", "drift_phases"):  # the two sizes bounded below (a spec may give '1e12')
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                bad(name, f"expected a whole number, got {v!r}")
        if self.num_tokens < 1:
            bad("num_tokens", f"must be >= 1, got {self.num_tokens}")
        if not 0 <= self.seed <= 2**31 - 1:
            bad("seed", f"must be in [0, 2147483647], got {self.seed}")
        if not self.skew >= 1.0:
            bad("skew", f"max/mean must be >= 1, got {self.skew}")
        if not self.skew_depth_ratio > 0:
            bad("skew_depth_ratio", f"must be > 0, got {self.skew_depth_ratio}")
        if self.cv is not None and not self.cv > 0:
            bad("cv", f"must be > 0 or None, got {self.cv}")
        if not 1 <= self.num_domains <= 64:
            bad("num_domains", f"must be in [1, 64], got {self.num_domains}")
        if not 0 <= self.domain_correlation <= 1:
            bad("domain_correlation", f"must be in [0, 1], got {self.domain_correlation}")
        if not 0 <= self.drift <= 1:
            bad("drift", f"must be in [0, 1], got {self.drift}")
        if self.drift_phases < 1:
            bad("drift_phases", f"must be >= 1, got {self.drift_phases}")
        # ceilings (docs/design.md, Resource bounds): checked here, so flags and sweep specs meet the same ones
        limits.check_synth_tokens(self.num_tokens, "synth config: field 'num_tokens' (--tokens)")
        limits.require_at_most("synth config: field 'drift_phases' (--drift-phases)", self.drift_phases,
                               self.num_tokens, "phases", "a drift phase holds at least one token: at most "
                               "num_tokens phases")
        for name in ("affinity", "token_effect", "theme"):
            if not 0 <= getattr(self, name) < 1:
                bad(name, f"must be in [0, 1), got {getattr(self, name)}")
        if self.affinity + self.token_effect + self.theme > 0.95 + 1e-9:
            bad("affinity", "affinity + token_effect + theme must not exceed 0.95 (the base draw keeps the rest)")
        if self.themes is not None and not 1 <= self.themes <= 256:
            bad("themes", f"must be in [1, 256] or None (auto), got {self.themes}")
        if not 1 <= self.token_experts <= 64:
            bad("token_experts", f"must be in [1, 64], got {self.token_experts}")
        if self.locality is not None and not 0 <= self.locality < 0.9:
            bad("locality", f"must be in [0, 0.9) or None, got {self.locality}")
        for name in ("prompt_median", "output_median", "max_prefill_tokens", "max_decode_tokens",
                     "max_batch_tokens", "max_running", "chunk_tokens", "long_min", "output_max"):
            if getattr(self, name) < 1:
                bad(name, f"must be >= 1, got {getattr(self, name)}")
        if not self.arrival_rate > 0:
            bad("arrival_rate", f"must be > 0, got {self.arrival_rate}")
        if not 0 <= self.long_fraction <= 1:
            bad("long_fraction", f"must be in [0, 1], got {self.long_fraction}")


def check_resources(cfg: SynthConfig, num_layers: int, top_k: int, out=None) -> None:
    """Refuse, before any work, a trace whose generation needs more memory than this machine has
    available or (``out`` given) more disk than its file system has free (:mod:`moeplace.foundation.limits`:
    :func:`~moeplace.foundation.limits.synth_estimate`, :func:`~moeplace.foundation.limits.synth_disk_bytes`)."""
    est = limits.synth_estimate(num_tokens=cfg.num_tokens, drift_phases=cfg.drift_phases,
                                num_domains=cfg.num_domains, num_layers=num_layers, top_k=top_k,
                                what=f"--drift-phases {cfg.drift_phases}")
    limits.require_memory(est)
    if out is not None:
        sel = float(cfg.num_tokens) * num_layers * top_k
        limits.require_disk(f"--tokens {cfg.num_tokens}", out, limits.synth_disk_bytes(cfg.num_tokens, num_layers, top_k),
                            f"{sel:,.0f} selections x {limits.SYNTH_MIN_DISK_BYTES_PER_SELECTION} B", est.seconds)
