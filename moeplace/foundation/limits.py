"""Resource bounds, checked before any work: what a command will allocate, estimated from the input
numbers that scale it, and the documented ceilings (docs/design.md, "Resource bounds").

Each estimate is a model of the arrays the code allocates (the formula is in the function's docstring; the
per-item byte counts were measured with ``tracemalloc``). A check refuses with one line naming the flag
(or spec field) and the estimate when the estimate exceeds :data:`MEMORY_SHARE` of the memory the machine
has available (``MemAvailable`` of ``/proc/meminfo``, else the free physical pages ``sysconf`` reports;
no figure at all: only the ceilings apply) or a ceiling. Flags and sweep specs reach the same functions:
the ceilings from the configs' ``__post_init__`` (pure), the memory checks from the library entry
points (:func:`moeplace.placement.compare.compare_policies`, :func:`moeplace.sim.runner.simulate`,
:func:`moeplace.traces.synth.synthesize`) and from the mapping both ``place simulate`` and ``place sweep``
use to build a simulation config.

Estimates deliberately take plain numbers, not configs: this module sits below every package that has
a config.
"""
from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from moeplace.foundation.errors import InputError

# ---------------------------------------------------------------------------- ceilings (docs/design.md)
MAX_SYNTH_TOKENS = 10**10  # a synthetic trace: ~1.5e13 selections for K3, weeks of generation, terabytes
MAX_SIM_SECONDS = 86_400.0  # one simulated day; a serving benchmark runs minutes
MAX_SIM_REQUESTS = 10**8  # requests one simulation may create (closed: concurrency; open: rate x duration)
MEMORY_SHARE = 0.9  # share of the available memory a command may plan to use

# ---------------------------------------------------------------------------- measured per-item sizes
# a simulated request: its Request object, its arrival Event and heap entry, its place in the recorder
# (tracemalloc: 200,000 and 400,000 concurrent requests peak at 101.5 and 203.2 MB)
SIM_REQUEST_BYTES = 510
# the synthetic trace generator's working set (design tables, one chunk of tokens) for a K3-sized model
# (92 MoE layers, top-16): 276 MB measured at the defaults; scaled by layers x top-k for other models
SYNTH_BASE_BYTES = 300e6
SYNTH_BASE_SELECTIONS = 92 * 16
# on disk: 1.26 B per selection measured at the defaults (locality and skew compress it); the floor used
# to say what a trace needs at least
SYNTH_MIN_DISK_BYTES_PER_SELECTION = 0.5
SYNTH_SELECTIONS_PER_S = 1.0e6  # generation rate, 2 shared cores (1.3-2.1 M/s measured under load)


@dataclass(frozen=True)
class Estimate:
    """What a piece of work needs: ``bytes`` of memory at its peak (``detail`` says of what), and where
    cheap ``seconds`` of run time. ``what`` names the input that scales it, as the user gave it (a flag
    and its value, or a spec field)."""

    what: str
    bytes: float
    detail: str
    seconds: float | None = None


def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n / 2**10:,.0f} KiB"


def fmt_seconds(s: float) -> str:
    for unit, size in (("days", 86_400), ("hours", 3_600), ("minutes", 60)):
        if s >= size:
            return f"{s / size:,.1f} {unit}"
    return f"{s:.1f} s"


def fmt_count(x: float) -> str:
    """``100000`` -> ``100000``, ``1e12`` -> ``1e+12`` (as a user would type it back)."""
    return f"{int(x)}" if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


# ---------------------------------------------------------------------------- what the machine has
def available_memory() -> int | None:
    """Bytes of memory available to a new allocation without swapping: ``MemAvailable`` from
    ``/proc/meminfo`` (Linux >= 3.14); else free physical pages x page size (``sysconf``); ``None``
    when neither is known (then only the ceilings apply)."""
    try:
        with open("/proc/meminfo", "rb") as fh:
            for line in fh:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return pages * size if pages > 0 and size > 0 else None


def free_disk(path: str | os.PathLike) -> int | None:
    """Free bytes on the file system that would hold ``path`` (its nearest existing ancestor)."""
    p = Path(os.path.abspath(os.fspath(path)))
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


# ---------------------------------------------------------------------------- the checks
def require_memory(est: Estimate, available: int | None = None) -> None:
    """Refuse ``est`` (one line naming ``est.what``) when it needs more than :data:`MEMORY_SHARE` of the
    available memory (``available``: bytes; default :func:`available_memory`)."""
    avail = available_memory() if available is None else available
    if avail is None or est.bytes <= MEMORY_SHARE * avail:
        return
    took = f"; it would also run for about {fmt_seconds(est.seconds)}" if est.seconds else ""
    raise InputError(f"{est.what}: needs about {fmt_bytes(est.bytes)} of memory ({est.detail}), more than the "
                     f"{fmt_bytes(avail)} this machine has available{took}; choose a smaller value")


def require_at_most(what: str, value: float, ceiling: float, unit: str, why: str) -> None:
    """Refuse ``value`` above the documented ``ceiling`` (one line naming ``what``; ``why`` says what the
    ceiling protects). NaN is refused too."""
    if not value <= ceiling:
        raise InputError(f"{what} {fmt_count(value)}: more than the ceiling of {fmt_count(ceiling)} {unit} "
                         f"({why}; docs/design.md, Resource bounds)")


def check_sim_duration(duration: float, what: str = "--duration") -> None:
    """Simulated seconds: at most :data:`MAX_SIM_SECONDS` (the simulator keeps every request and
    iteration it ran, so memory and run time grow with the simulated time)."""
    require_at_most(what, duration, MAX_SIM_SECONDS, "simulated seconds",
                    "one simulated day; memory and run time grow with the simulated time")


def check_synth_tokens(num_tokens: float, what: str = "--tokens") -> None:
    require_at_most(what, num_tokens, MAX_SYNTH_TOKENS, "tokens",
                    "10^10 tokens of a K3 trace are 1.5e13 selections: terabytes and months of generation")


# ---------------------------------------------------------------------------- estimates
@dataclass(frozen=True)
class RuleMemory:
    """What a replica rule adds to planning and scoring placements (``placement.rules``' own figure):
    ``per_placement`` bytes for each placement kept, ``once`` bytes for the whole comparison, and the
    words that say of what (appended to the estimate's detail)."""

    per_placement: float = 0.0
    once: float = 0.0
    what: str = ""


def placement_estimate(num_layers: int, num_experts: int, num_gpus: int, num_redundant: int, *,
                       num_placements: int = 1, rule: RuleMemory | None = None,
                       what: str | None = None) -> Estimate:
    """Peak memory of planning and scoring ``num_placements`` placements of ``L`` MoE layers, ``E``
    experts, ``G`` GPUs and ``R`` redundant slots (``P = E + R`` slots per layer); ``rule``: what the replica
    rule adds (its ``planning_memory``).

    Every placement kept for the comparison holds its replica map ``log2phy`` (int32 ``[L, E, R + 1]``,
    padded to the most replicas an expert can have, as vLLM pads it) and its ``phy2log`` (int64
    ``[L, P]``); a policy works on about six int64 ``[L, P]`` arrays (EPLB's packing). Under SGLang's
    rule each placement also caches the per-rank dispatch map (int32 ``[G, L, E]``); under the ideal
    rule the split LP holds a bool ``[L, E, G]``::

        bytes = n x (4 L E (R + 1) + 8 L P) + 48 L P  [+ n x 4 G L E  sglang]  [+ L E G  ideal]

    Measured (tracemalloc, K3, one EPLB placement): 45 MB at G = 512 (R = 128), 385 MB at G = 2048
    (R = 1152); the model gives 43 and 382 MB."""
    L, E, G, R = num_layers, num_experts, num_gpus, num_redundant
    P = E + R
    n = max(1, num_placements)
    per = 4.0 * L * E * (R + 1) + 8.0 * L * P
    b = n * per + 48.0 * L * P
    rule = rule or RuleMemory()
    b += n * rule.per_placement + rule.once
    extra = rule.what
    each = "one placement" if n == 1 else f"{n} placements (one per policy), each"
    detail = (f"{each} with a replica map of {L} layers x {E} experts x {R + 1:,} replica columns x 4 B"
              f"{extra}")
    return Estimate(what or f"--gpus {G} (with {R:,} redundant slots)", b, detail)


def simulation_estimate(*, arrival: str, concurrency: int, rate: float, rate_end: float | None, duration: float,
                        max_requests: int | None, what: str | None = None) -> Estimate:
    """Peak memory of one simulation's requests.

    Closed loop: ``concurrency`` requests exist from the start, each a Request, an arrival event and its
    heap entry, kept by the recorder (:data:`SIM_REQUEST_BYTES`). Open: the arrival process draws about
    ``m = 1.2 n + 20 sqrt(n + 1) + 10`` gaps for ``n = rate x duration`` expected requests (ramp: the
    mean of ``rate`` and ``rate_end``) and holds gaps, their cumulative sum, the mask and the kept times
    (``25 m`` bytes), then every request it creates::

        closed: bytes = 510 x concurrency
        open:   bytes = 25 m + 510 n          (n capped by max_requests)

    Run time: about 60 us of wall time per request created (measured, 2 shared cores). Memory and run
    time of the iterations themselves grow with ``duration``, which :data:`MAX_SIM_SECONDS` bounds."""
    if arrival == "closed":
        n = float(concurrency)
        if max_requests is not None:
            n = min(n, float(max_requests))
        b = SIM_REQUEST_BYTES * n
        return Estimate(what or f"--concurrency {fmt_count(concurrency)}", b,
                        f"{fmt_count(n)} requests in flight x {SIM_REQUEST_BYTES} B", seconds=60e-6 * n)
    mean_rate = rate if arrival != "ramp" or rate_end is None else (rate + rate_end) / 2
    n_all = mean_rate * duration
    m = 1.2 * n_all + 20 * math.sqrt(n_all + 1) + 10
    n = n_all if max_requests is None else min(n_all, float(max_requests))
    b = 25.0 * m + SIM_REQUEST_BYTES * n
    return Estimate(what or f"--rate {fmt_count(rate)} x --duration {fmt_count(duration)}", b,
                    f"{fmt_count(round(n_all))} arrivals drawn at 25 B, {fmt_count(round(n))} requests kept at "
                    f"{SIM_REQUEST_BYTES} B", seconds=60e-6 * n)


def expected_requests(*, arrival: str, concurrency: int, rate: float, rate_end: float | None, duration: float,
                      max_requests: int | None) -> float:
    """Requests one simulation creates at the least (closed: the ``concurrency`` in flight at the start;
    open: ``rate x duration``), capped by ``max_requests``."""
    if arrival == "closed":
        n = float(concurrency)
    else:
        n = (rate if arrival != "ramp" or rate_end is None else (rate + rate_end) / 2) * duration
    return n if max_requests is None else min(n, float(max_requests))


def check_sim_requests(n: float, what: str) -> None:
    """At most :data:`MAX_SIM_REQUESTS` requests in one simulation (``n``: :func:`expected_requests`)."""
    if not n <= MAX_SIM_REQUESTS:
        raise InputError(f"{what}: {fmt_count(round(n))} simulated requests, more than the ceiling of "
                         f"{fmt_count(MAX_SIM_REQUESTS)} (every request is kept for the latency statistics, "
                         f"{SIM_REQUEST_BYTES} B each; docs/design.md, Resource bounds)")


def synth_estimate(*, num_tokens: int, drift_phases: int, num_domains: int, num_layers: int, top_k: int,
                   what: str | None = None) -> Estimate:
    """Peak memory and run time of generating a synthetic trace.

    The drift schedule draws a permutation of ``K + 1`` anchors (int64) and holds two float64
    ``[K + 1, D]`` mixes (``K`` phases, ``D`` domains); the rest is the generator's working set, which
    does not grow with the token count (it streams chunks)::

        bytes = (K + 1) (8 + 16 D) + 300 MB x (L k) / (92 x 16)

    (measured: 276 MB for K3 at K = 4, +275 MB at K = 3,000,000 with D = 5; the model says 92 B per phase).
    Run time: ``num_tokens x L x k`` selections at :data:`SYNTH_SELECTIONS_PER_S`."""
    K, D = drift_phases, num_domains
    sel = float(num_tokens) * num_layers * top_k
    b = (K + 1.0) * (8 + 16 * D) + SYNTH_BASE_BYTES * (num_layers * top_k) / SYNTH_BASE_SELECTIONS
    return Estimate(what or f"--drift-phases {K}", b,
                    f"{fmt_count(K + 1)} drift anchors x {D} domains, plus the generator's working set",
                    seconds=sel / SYNTH_SELECTIONS_PER_S)


def require_disk(what: str, path: str | os.PathLike, need: float, detail: str, seconds: float | None = None) -> None:
    """Refuse writing at least ``need`` bytes under ``path`` when its file system has less free."""
    free = free_disk(path)
    if free is None or need <= free:
        return
    took = f" and about {fmt_seconds(seconds)} to generate" if seconds else ""
    raise InputError(f"{what}: needs at least {fmt_bytes(need)} of disk ({detail}){took}, more than the "
                     f"{fmt_bytes(free)} free at {path}; choose a smaller value")


def synth_disk_bytes(num_tokens: int, num_layers: int, top_k: int) -> float:
    """The least a synthetic trace takes on disk: selections x
    :data:`SYNTH_MIN_DISK_BYTES_PER_SELECTION`."""
    return float(num_tokens) * num_layers * top_k * SYNTH_MIN_DISK_BYTES_PER_SELECTION
