"""Synthetic routing traces shaped like a real MoE router (docs/design.md Sources §4), for models whose
traces we cannot capture (Kimi K3).

Every expert selection is drawn in "u-space": an expert popularity distribution is laid out as
consecutive intervals of the circle ``[0, 2^16)`` in a per-layer random expert order, and a selection is
the expert whose interval holds a point ``u`` (one table lookup). Each (MoE layer, domain) has its own
*base* layout ``pi[l, d]``; besides, each layer has a *shared grid* (every expert an equal interval, the
grid rotated by a random fraction of an interval per layer). The point comes from one of five sources:

- **base**: ``u`` uniform in the domain's layout.
- **inter-layer affinity** (``affinity``): ``u`` uniform inside the shared-grid interval of the expert
  the same slot chose at layer ``l-1``, read in the shared grid of layer ``l``: expert ``e`` at ``l-1``
  leads to the two experts at ``l`` whose intervals overlap its own, the same pairs in every domain
  (affinity is stable across workloads, ExFlow). This near-permutation carries each domain's load
  pattern from layer to layer without mixing domains; the popularity fields are correlated along it
  (``LAYER_COHERENCE``), so hot experts make their successors hot (hot paths) and cold ones stay cold.
- **token identity** (``token_effect``, ``token_experts``): the Zipf vocabulary tiles the circle, token
  ``t`` owning an interval as wide as its frequency; ``token_experts`` rotations of the circle per layer
  give the token its preferred points, and ``u`` is uniform inside the token's interval at one of them
  (domain layout). A rare token keeps landing on the same few experts (OLMoE: a token's most common
  expert is in its top-k in 90-99% of occurrences), a frequent one spreads, and over the vocabulary ``u``
  stays uniform, so this source preserves the domain's marginal.
- **theme** (``theme``, ``themes``): the experts of each layer form ``themes`` groups of consecutive
  circle positions, and the popularity is designed so that each group carries exactly 1/``themes`` of
  every domain's load (:func:`design_popularity`); a theme draw is ``u`` uniform inside the token's group.
  The token's theme comes from its id (the group under a point of the token's interval on the Zipf
  circle, so each theme gets 1/``themes`` of the tokens and the source preserves the marginal) and is the
  same at every layer. The experts one token uses therefore cluster within a layer, the way experts
  specialized on kinds of tokens are used together in real routers, which is what co-placement exploits
  (co-locating co-activated experts cuts inter-node all-to-all bytes by up to 20 % on DeepSeek-V3 /
  Qwen3 / Llama-4 traces, arXiv 2604.23150); since each group has equal load and equal size, a placement
  can co-locate groups without giving up balance. The affinity source keeps most of a token's theme from
  layer to layer (position ``i`` of the circle follows position ``i``).
- **temporal locality** (``locality``): copy the expert the same slot had at the previous token of the
  same request (marginal-neutral). The copy probability is solved (regula falsi on a pilot batch with
  fixed random numbers) so that consecutive tokens of a request share the requested fraction of top-k.

Duplicates within a token's top-k are re-drawn from the base source until none remain (this flattens
the hottest experts; the popularity design below compensates).

Popularity (:func:`design_popularity`): ``pi[l, d] ~ exp(sigma_l * x')`` with
``x = sqrt(rho) g[l] + sqrt(1 - rho) h[l, d]`` (standard normal vectors shared by all domains / per domain)
and ``x'`` its lower part stretched by ``1 + beta`` (cold experts). The realized per-slot distribution
``q[l, d]`` follows from the sources analytically (forward through the affinity coupling); ``sigma_l`` is
solved per layer so that the **whole trace's** load (domains weighted by the drift schedule's average
mix) has the layer's max/mean target (geometric in depth, median ``skew``); ``beta`` and ``rho`` so that
``q`` has the requested median CV and mean correlation between domains. A token's top-k holds distinct
experts (duplicates are re-drawn), which takes load off the hottest experts, the more so the more a
token's draws concentrate (themes): a pilot batch measures the realized median skew and CV, and the design
is solved again aiming higher (secant on the skew, up to ``SKEW_ROUNDS`` designs).

Requests: Poisson arrivals; prompt lengths lognormal with a Pareto tail (``long_fraction``) up to the
model's context (1 M tokens for K3); output lengths lognormal; a continuous-batching engine loop (decode
one token per running request per iteration, then chunked prefill FIFO under ``max_batch_tokens``) gives
the ``step`` column. **Long requests are represented, not replayed**: a prompt longer than
``max_prefill_tokens`` is represented by that many evenly spaced positions of the prompt (true position
values kept, so context lengths stay visible to sim/ and to the stats), and decode by its first
``max_decode_tokens`` tokens; the trace's token budget counts represented tokens, so a 1 M-token prompt
weighs ``max_prefill_tokens`` tokens in the loads. Each request gets a domain drawn from the mix at its
arrival; the mix moves linearly through ``drift_phases`` phases, each dominated by one domain to the
extent ``drift``.

Modules, in the order data flows: ``config`` (:class:`SynthConfig`), ``popularity`` (the design above),
``sampler`` (:class:`SynthDesign`, the sampling tables, and :class:`ExpertSampler`), ``calibration``
(:func:`build_design`: design + pilot corrections; the locality copy probability), ``requests`` (arrivals,
lengths, the engine loop; :func:`synth_chunks`) and ``writer`` (:func:`synthesize`, optionally through a
forked writer process).
"""
from __future__ import annotations

from moeplace.traces.synth.calibration import build_design, calibrate_copy
from moeplace.traces.synth.config import DOMAIN_NAMES, SYNTH_VERSION, SynthConfig
from moeplace.traces.synth.popularity import (
    design_popularity,
    domain_names,
    drift_anchor_mixes,
    mean_domain_correlation,
    num_themes,
    quantize,
)
from moeplace.traces.synth.requests import engine_batches, synth_chunks
from moeplace.traces.synth.sampler import ExpertSampler, SynthDesign, zipf_ranks
from moeplace.traces.synth.writer import synthesize

__all__ = [
    "DOMAIN_NAMES", "SYNTH_VERSION", "ExpertSampler", "SynthConfig", "SynthDesign", "build_design", "calibrate_copy",
    "design_popularity", "domain_names", "drift_anchor_mixes", "engine_batches", "mean_domain_correlation",
    "num_themes", "quantize", "synth_chunks", "synthesize", "zipf_ranks",
]
