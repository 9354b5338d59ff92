"""Resource bounds, checked before any work: what a command will allocate, estimated from the input
numbers that scale it, and the documented ceilings (docs/design.md, "Resource bounds").

Each estimate is a model of the arrays the code allocates (the formula is in the function's docstring; the
per-item byte counts were measured with ``tracemalloc``). A check refuses with one line naming the flag
(or spec field) and the estimate when the estimate exceeds :data:`MEMORY_SHARE` of the memory the process
may really use (:func:`memory_headroom`: the least of the machine's ``MemAvailable``, what ``ulimit -v`` /
``ulimit -d`` leave and what the memory cgroup leaves; no figure at all: only the ceilings apply) or a
ceiling. Flags and sweep specs reach the same functions:
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
MAX_GPUS = 1 << 20  # GPUs in one cluster (10x the largest built); layouts and searches grow with the count
MAX_SWEEP_POINTS = 1_000  # sweep points run without --max-points (each is a full optimize/simulate run)
# a sweep point's cost, per worker: examples/sweep-k3.yaml ran 20 points in 76 s on 2 workers (docs/sweep.md)
SWEEP_POINT_SECONDS = 7.6
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


# ---------------------------------------------------------------------------- what the process may use
_UNLIMITED = 2**62  # cgroup files and rlimits say "no limit" with numbers near 2^63


def _meminfo_available() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` (Linux >= 3.14); else free physical pages x page size
    (``sysconf``); ``None`` when neither is known."""
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


def _proc_status_kib(field: bytes) -> int | None:
    try:
        with open("/proc/self/status", "rb") as fh:
            for line in fh:
                if line.startswith(field + b":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _rlimit_headroom(which: str, used_field: bytes) -> int | None:
    """What the soft resource limit ``which`` (``RLIMIT_AS``: ``ulimit -v``; ``RLIMIT_DATA``:
    ``ulimit -d``) leaves above what this process holds of it now (``VmSize`` / ``VmData``)."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    try:
        soft, _hard = resource.getrlimit(getattr(resource, which))
    except (AttributeError, ValueError, OSError):
        return None
    if soft == resource.RLIM_INFINITY or soft < 0 or soft >= _UNLIMITED:
        return None
    used = _proc_status_kib(used_field) or 0
    return max(0, soft - used)


def _read_int(path: str) -> int | None:
    try:
        with open(path, "rb") as fh:
            text = fh.read().strip()
    except OSError:
        return None
    if text == b"max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat_field(path: str, name: bytes) -> int:
    try:
        with open(path, "rb") as fh:
            for line in fh:
                k, _, v = line.partition(b" ")
                if k == name:
                    return int(v)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_headroom(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """What this process's memory cgroup leaves: its limit less its usage, the reclaimable page cache
    (``inactive_file``) not counted as used. cgroup v2 (``memory.max`` / ``memory.current``) first, then
    v1 (``memory.limit_in_bytes`` / ``memory.usage_in_bytes``); ``None`` without a limit."""
    try:
        with open(proc, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    v2 = next((ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")), None)
    v1 = next((ln.split(":", 2)[2] for ln in lines if ":memory:" in ln or ln.split(":")[1:2] == ["memory"]), None)
    candidates = []
    if v2 is not None:
        for d in (f"{root}{v2.rstrip('/')}", root):
            candidates.append((f"{d}/memory.max", f"{d}/memory.current", f"{d}/memory.stat", b"inactive_file"))
    if v1 is not None:
        for d in (f"{root}/memory{v1.rstrip('/')}", f"{root}/memory"):
            candidates.append((f"{d}/memory.limit_in_bytes", f"{d}/memory.usage_in_bytes", f"{d}/memory.stat",
                               b"total_inactive_file"))
    for limit_f, usage_f, stat_f, inactive in candidates:
        if not os.path.exists(limit_f):
            continue
        limit = _read_int(limit_f)
        if limit is None or limit >= _UNLIMITED:
            return None
        usage = _read_int(usage_f) or 0
        usage = max(0, usage - _stat_field(stat_f, inactive))
        return max(0, limit - usage)
    return None


def memory_headroom() -> tuple[int, str] | None:
    """The memory this process may really allocate, and what bounds it: the least of what the machine
    has available (:func:`_meminfo_available`), what the address-space and data limits leave
    (``ulimit -v`` / ``ulimit -d``, less what the process already holds) and what its memory cgroup leaves
    (a container's limit). ``None`` when nothing is known (then only the ceilings apply)."""
    found = [(v, why) for v, why in (
        (_meminfo_available(), "this machine has available"),
        (_rlimit_headroom("RLIMIT_AS", b"VmSize"), "the address-space limit (ulimit -v) leaves this process"),
        (_rlimit_headroom("RLIMIT_DATA", b"VmData"), "the data-segment limit (ulimit -d) leaves this process"),
        (_cgroup_headroom(), "the memory cgroup's limit (the container's) leaves"),
    ) if v is not None]
    return min(found, key=lambda f: f[0]) if found else None


def available_memory() -> int | None:
    """Bytes this process may allocate without swapping or being refused (:func:`memory_headroom`)."""
    h = memory_headroom()
    return None if h is None else h[0]


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
def require_memory(est: Estimate, available: int | None = None, advice: str = "choose a smaller value") -> None:
    """Refuse ``est`` (one line naming ``est.what``) when it needs more than :data:`MEMORY_SHARE` of the
    available memory (``available``: bytes; default :func:`available_memory`)."""
    avail = available_memory() if available is None else available
    if avail is None or est.bytes <= MEMORY_SHARE * avail:
        return
    took = f"; it would also run for about {fmt_seconds(est.seconds)}" if est.seconds else ""
    raise InputError(f"{est.what}: needs about {fmt_bytes(est.bytes)} of memory ({est.detail}), more than the "
                     f"{fmt_bytes(avail)} {_bound_words(avail)}{took}; {advice}")


def _bound_words(avail: int) -> str:
    """What bounds ``avail`` bytes, in words (the limit :func:`memory_headroom` found at that figure)."""
    h = memory_headroom()
    return h[1] if h is not None and h[0] == avail else "this machine has available"


def out_of_memory_line(exc: BaseException) -> str:
    """The one line for an allocation that failed although no estimate refused it (``exc``: the
    MemoryError, or the ``ENOMEM`` text a library reported), with what bounds this process's memory."""
    h = memory_headroom()
    bound = f"; now {fmt_bytes(h[0])} {h[1]}" if h is not None else ""
    said = " ".join(str(exc).split())[:200]
    return (f"out of memory ({said or type(exc).__name__}){bound}; use a smaller input or setting, or raise the "
            "limit (ulimit -v, the container's memory)")


def require_at_most(what: str, value: float, ceiling: float, unit: str, why: str) -> None:
    """Refuse ``value`` above the documented ``ceiling`` (one line naming ``what``; ``why`` says what the
    ceiling protects). NaN is refused too."""
    if not value <= ceiling:
        raise InputError(f"{what} {fmt_count(value)}: more than the ceiling of {fmt_count(ceiling)} {unit} "
                         f"({why}; docs/design.md, Resource bounds)")


def check_gpus(num_gpus: float, what: str = "--gpus") -> None:
    """At most :data:`MAX_GPUS` GPUs: every layout, placement and suggestion search grows with the count
    (``place plan --gpus 10^9`` spent 37 s before its first error)."""
    require_at_most(what, num_gpus, MAX_GPUS, "GPUs",
                    "more than any cluster built; layouts and searches grow with the GPU count")


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
                       num_placements: int = 1, rule: RuleMemory | None = None, num_windows: int = 0,
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
                + 8 W L G (n + 1) + 8 W L E

    Scoring ``W`` windows (``num_windows``) keeps each placement's expected GPU loads (float64
    ``[W, L, G]``; one more copy while they are stacked) and the windows as float64 ``[W, L, E]``.

    Measured (tracemalloc, K3, one EPLB placement): 45 MB at G = 512 (R = 128), 385 MB at G = 2048
    (R = 1152); the model gives 43 and 382 MB."""
    L, E, G, R = num_layers, num_experts, num_gpus, num_redundant
    P = E + R
    n = max(1, num_placements)
    per = 4.0 * L * E * (R + 1) + 8.0 * L * P
    b = n * per + 48.0 * L * P
    rule = rule or RuleMemory()
    b += n * rule.per_placement + rule.once
    W = max(0, int(num_windows))
    b += 8.0 * W * L * G * (n + 1) + 8.0 * W * L * E
    extra = rule.what + (f", and scoring {W:,} window{'s' if W != 1 else ''} ({W:,} x {L} x {G:,} GPU loads x 8 B "
                         "per placement)" if W else "")
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


STATS_BASE_BYTES = 250e6  # the pass's decode buffers and token sample (peak RSS 380-520 MB measured, ~150 of it imports)


def stats_estimate(*, num_windows: int, num_layers: int, num_experts: int, workers: int, mapped_bytes: float,
                   what: str, group_windows: int | None = None) -> Estimate:
    """Peak memory of the streaming pass over a trace (``traces.stats``): the expert counts, int64
    ``[W, L, E]`` for ``W`` windows, plus the partial counts of the row groups in flight (up to three per
    worker thread: one being reduced, two queued), each ``[G, L, E]`` for the ``G`` windows one row group
    touches (``group_windows``; ``W`` when not given), a window label (~100 B) per window, the decode
    buffers (:data:`STATS_BASE_BYTES`) and the largest file, which is memory-mapped (``mapped_bytes``:
    address space, not resident memory)::

        bytes = 8 L E (W + 3 workers min(G, W)) + 100 W + 250 MB + mapped
    """
    W, L, E = float(num_windows), num_layers, num_experts
    partial = min(W, float(group_windows if group_windows is not None else W))
    windows = W + 3 * max(1, workers) * partial
    counts = 8.0 * L * E * windows + 100.0 * W
    return Estimate(what, counts + STATS_BASE_BYTES + mapped_bytes,
                    f"{fmt_count(W)} window{'s' if W != 1 else ''} x {L} layers x {E} experts x 8 B, with the "
                    f"row groups' partial counts in flight {fmt_count(windows)} windows' worth, the decode "
                    f"buffers and a {fmt_bytes(mapped_bytes)} file mapped")


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
