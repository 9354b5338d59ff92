"""``place kernels bench``: time the real EP MoE (dispatch, expert GEMMs, combine) over a grid, write the
simulator's calibration profile, and check the calibrated simulator on configurations it was not
calibrated on.

Protocol (all in one set of ``world_size`` processes):

1. micro-benchmarks, one rank at a time: the grouped expert forward over the rank's local experts vs
   tokens per expert (-> ``expert_gemm``, per expert) and the counting sort vs selections (-> ``permute``);
2. end-to-end EP layers: for each (tokens per rank, routing skew) of the grid, ``warmup + reps`` forward
   passes of :func:`kernels.moe.ep_moe_forward`; every rank records its phase times and what it served
   (rows, distinct local experts, rows received from other ranks);
3. calibration uses only the *train* grid (balanced routing, some batch sizes): ``dispatch`` and
   ``combine`` curves are least-squares lines ``t = latency + bytes / bandwidth`` through the slowest
   rank's measured times;
4. validation predicts the MoE layer time of every *test* configuration (other batch sizes and skewed,
   imbalanced routing) with the simulator's own :meth:`sim.cost.CostModel.moe_layer_times` under the
   profile, and compares with the measured layer time (slowest rank, median over reps).
"""
from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist

from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.model import GQAConfig, ModelSpec
from moeplace.kernels.launch import run_distributed
from moeplace.kernels.moe import (
    StepTimes,
    ep_moe_forward,
    grouped_expert_forward,
    local_weights,
    sort_by_destination,
)
from moeplace.placement.dispatch import choose_slots
from moeplace.placement.record import Placement
from moeplace.sim.calibration import PROFILE_FORMAT, Profile, profile_from_dict
from moeplace.sim.config import CostConfig
from moeplace.sim.cost import CostModel, MoeWork


@dataclass(frozen=True)
class BenchConfig:
    world_size: int = 4
    hidden: int = 512
    intermediate: int = 256
    num_experts: int = 32
    top_k: int = 4
    num_redundant: int = 0
    engine: str = "vllm"  # the replica rule (the key recorded in the result's provenance)
    train_tokens: tuple[int, ...] = (64, 256, 1024)
    test_tokens: tuple[int, ...] = (128, 512)
    train_skews: tuple[float, ...] = (0.0,)
    test_skews: tuple[float, ...] = (0.0, 1.0, 1.6)
    gemm_tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    reps: int = 7
    warmup: int = 2
    seed: int = 0
    dtype: str = "float32"

    def grid(self) -> list[tuple[str, int, float]]:
        train = [("train", n, s) for n in self.train_tokens for s in self.train_skews]
        test = [("test", n, s) for n in self.test_tokens for s in self.test_skews]
        return train + test


def _median_time(fn, reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def bench_placement(cfg: BenchConfig) -> Placement:
    """Contiguous blocks (vLLM ``linear``) plus redundant replicas of experts 0..R-1 — routing skew, not
    the placement, drives the imbalance of the test grid."""
    E, R = cfg.num_experts, cfg.num_redundant
    phy2log = np.concatenate([np.arange(E), np.arange(R) % E])[None, :]
    return Placement(phy2log, cfg.world_size, cfg.world_size, "kernels-bench", E, (0,))


def _routing(cfg: BenchConfig, n: int, skew: float, rank: int, salt: int):
    """Top-k ids for ``n`` tokens from a Zipf-like popularity ``(i+1)^-skew`` (0 = uniform)."""
    rng = np.random.default_rng([cfg.seed, n, int(skew * 1000), rank, salt])
    E, k = cfg.num_experts, cfg.top_k
    logits = -skew * np.log(np.arange(1, E + 1)) + rng.gumbel(size=(n, E))
    ids = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    w = rng.random((n, k))
    return torch.as_tensor(ids, dtype=torch.int64), torch.as_tensor(w / w.sum(1, keepdims=True))


def bench_rank(rank: int, world_size: int, cfg: BenchConfig) -> dict:
    """Everything one rank measures (runs inside :func:`kernels.launch.run_distributed`)."""

    dtype = getattr(torch, cfg.dtype)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    g = torch.Generator().manual_seed(cfg.seed)
    h, inter, E = cfg.hidden, cfg.intermediate, cfg.num_experts
    w_gate_up = (torch.randn(E, 2 * inter, h, generator=g) / h ** 0.5).to(device, dtype)
    w_down = (torch.randn(E, h, inter, generator=g) / inter ** 0.5).to(device, dtype)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # 1. micro-benchmarks, one rank at a time (on a CPU test bed the ranks share the host's cores; the
    #    curve is what ONE rank's kernels cost with a core to themselves — the sharing is modelled in the
    #    validation). ``expert_gemm`` times the grouped forward over ALL of this rank's local experts with
    #    n tokens each, divided by their number: cycling through the experts' weights like the real layer
    #    does, rather than re-using one expert's weights from cache.
    gemm, permute = [], []
    placement = bench_placement(cfg)
    S = placement.slots_per_gpu
    lw_gu, lw_d = local_weights(placement, 0, rank, w_gate_up, w_down)
    for turn in range(world_size):
        dist.barrier()
        if turn != rank:
            continue
        for n in cfg.gemm_tokens:
            x = torch.randn(n * S, h, generator=g).to(device, dtype)
            counts = torch.full((S,), n, dtype=torch.int64)
            t = _median_time(lambda x=x, c=counts: (grouped_expert_forward(x, c, lw_gu, lw_d), sync()), cfg.reps)
            gemm.append([n, t / S])
        for n in (64, 256, 1024, 4096):
            slots = torch.randint(0, placement.num_slots, (n, cfg.top_k), generator=g).to(device)
            permute.append([n * cfg.top_k, _median_time(
                lambda s=slots: (sort_by_destination(s, placement.num_slots, world_size), sync()), cfg.reps)])
    dist.barrier()

    # 2. end-to-end EP layers
    records = []
    for split, n, skew in cfg.grid():
        reps = []
        served = None
        for it in range(cfg.warmup + cfg.reps):
            ids, w = _routing(cfg, n, skew, rank, it)
            x = torch.randn(n, h, generator=g).to(device, dtype)
            ids, w = ids.to(device), w.to(device, dtype)
            dist.barrier()
            t = StepTimes()
            t0 = time.perf_counter()
            ep_moe_forward(x, ids, w, placement, 0, lw_gu, lw_d, rule=cfg.engine, times=t)
            total = time.perf_counter() - t0
            if it >= cfg.warmup:
                reps.append([t.dispatch, t.experts, t.combine, total, t.rows_received])
            if it == cfg.warmup:
                served = _served(cfg, placement, n, skew, it, world_size, rank, S)
        records.append({"split": split, "tokens": n, "skew": skew, "reps": reps, **served})
    return {"rank": rank, "gemm": gemm, "permute": permute, "records": records,
            "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                       else f"cpu ({platform.machine()}, {len(os.sched_getaffinity(0))} cores)"),
            "threads": torch.get_num_threads(), "cores": len(os.sched_getaffinity(0))}


def _served(cfg, placement, n, skew, it, world_size, rank, S) -> dict:
    """What this rank serves in iteration ``it``: rows per local slot and rows received from other ranks
    (recomputed from every rank's routing, which is deterministic)."""
    per_slot = np.zeros(S, dtype=np.int64)
    remote = 0
    for src in range(world_size):
        ids, _ = _routing(cfg, n, skew, src, it)
        slots = np.asarray(choose_slots(placement, 0, ids.numpy(), cfg.engine, src_gpu=src)).ravel()
        mine = slots[slots // S == rank] % S
        np.add.at(per_slot, mine, 1)
        if src != rank:
            remote += mine.size
    return {"rows": int(per_slot.sum()), "touched": int((per_slot > 0).sum()), "remote_rows": int(remote)}


# ----------------------------------------------------------------------------- profile + validation
def _bench_model(cfg: BenchConfig):
    """A one-MoE-layer ModelSpec with the bench's expert shape, so the simulator's cost model prices the
    measured configurations with the same formulas it uses for K3."""
    return ModelSpec(name="kernels-bench", num_layers=1, moe_layers=(0,), num_experts=cfg.num_experts,
                     top_k=cfg.top_k, hidden_size=cfg.hidden, moe_intermediate_size=cfg.intermediate,
                     expert_hidden_size=cfg.hidden, num_shared_experts=0, shared_intermediate_size=0,
                     dense_intermediate_size=cfg.intermediate, vocab_size=16, max_context=4096,
                     attention=("gqa",), gqa=GQAConfig(num_heads=1, num_kv_heads=1, head_dim=cfg.hidden))


def _config_table(results: list[dict], cfg: BenchConfig) -> list[dict]:
    """Per grid point: measured layer time (slowest rank per rep, median over reps); the dispatch time
    of the slowest rank; the expert phase as the layer sees it (until the last rank has finished its
    experts); the combine time of the rank that entered the combine last (the others' combine time
    includes waiting for it); and the per-rank work the simulator needs."""
    rows = []
    for i, (split, n, skew) in enumerate(cfg.grid()):
        recs = [r["records"][i] for r in results]
        reps = np.array([rec["reps"] for rec in recs])  # [G, reps, 5]: dispatch, experts, combine, total
        layer = float(np.median(reps[:, :, 3].max(axis=0)))
        d, e, c = reps[:, :, 0], reps[:, :, 1], reps[:, :, 2]
        last = np.argmax(d + e, axis=0)  # per rep: the rank that reaches the combine last
        cols = np.arange(reps.shape[1])
        rows.append({
            "split": split, "tokens": n, "skew": skew, "measured": layer,
            "dispatch_max": float(np.median(d.max(axis=0))),
            "experts_max": float(np.median((d + e).max(axis=0) - d.max(axis=0))),
            "combine_max": float(np.median(c[last, cols])),
            "rows": np.array([rec["rows"] for rec in recs], dtype=np.float64),
            "touched": np.array([rec["touched"] for rec in recs], dtype=np.float64),
            "remote": np.array([rec["remote_rows"] for rec in recs], dtype=np.float64),
        })
    return rows


def _line_points(x: np.ndarray, t: np.ndarray, x_max: float) -> list[list[float]]:
    """Least-squares ``t = a + b x`` (a, b >= 0) as profile points over ``[1, x_max]``."""
    A = np.stack([np.ones_like(x), x], axis=1)
    (a, b), *_ = np.linalg.lstsq(A, t, rcond=None)
    a, b = max(float(a), 0.0), max(float(b), 0.0)
    xs = np.unique(np.geomspace(1.0, max(x_max, 2.0), 8).round())
    return [[float(v), a + b * float(v)] for v in xs]


def build_profile(results: list[dict], cfg: BenchConfig):
    """The calibration profile from the TRAIN grid only (see the module docstring)."""
    value_bytes = torch.finfo(getattr(torch, cfg.dtype)).bits // 8
    row_bytes = cfg.hidden * value_bytes
    gemm = np.median(np.array([r["gemm"] for r in results]), axis=0)  # [n, 2] median over ranks
    permute = np.median(np.array([r["permute"] for r in results]), axis=0)
    train = [r for r in _config_table(results, cfg) if r["split"] == "train"]
    x = np.array([r["remote"].max() * row_bytes for r in train])
    x_max = max(float(x.max()) * 4, 2.0)
    d = {"format": PROFILE_FORMAT, "device": results[0]["device"], "dtype": cfg.dtype,
         "world_size": cfg.world_size,
         "ops": {
             "expert_gemm": {"x": "tokens_per_expert", "hidden": cfg.hidden, "intermediate": cfg.intermediate,
                             "points": gemm.tolist()},
             "permute": {"x": "selections", "points": permute.tolist()},
             "dispatch": {"x": "bytes", "link": "any",
                          "points": _line_points(x, np.array([r["dispatch_max"] for r in train]), x_max)},
             "combine": {"x": "bytes", "link": "any",
                         "points": _line_points(x, np.array([r["combine_max"] for r in train]), x_max)},
         },
         "provenance": {"tool": "place kernels bench", "config": asdict(cfg), "torch": torch.__version__,
                        "host": platform.node(), "threads_per_rank": results[0]["threads"],
                        "cpu_count": os.cpu_count()}}
    profile: Profile = profile_from_dict(d, "kernels bench")
    return profile


def predict(profile, cfg: BenchConfig, rows: list[dict], shared_cores: int | None = None,
            contention: float = 1.0) -> np.ndarray:
    """The simulator's MoE layer time for each grid point, under ``profile``
    (:meth:`sim.cost.CostModel.moe_layer_times`: slowest rank's experts + slowest dispatch + slowest
    combine).

    ``shared_cores``: on a CPU test bed whose ``world_size`` ranks share fewer cores, the expert phase
    cannot finish before the ranks' total expert work has been spread over those cores, so it takes
    ``max(slowest rank, contention * total / shared_cores)`` (processor sharing; the loopback
    all-to-all is CPU work too, priced at the mean rank's bytes or the heaviest rank's alone; ``contention`` >= 1 is
    the slowdown of oversubscribed ranks — context switches, a shared cache — fitted on the calibration
    grid by :func:`fit_contention`). GPUs do not share, so the simulator itself never applies this; it
    describes the test bed, not the model being checked.
    """
    cost = _cost(profile, cfg)
    out = []
    for r in rows:
        z = np.zeros((1, cfg.world_size))
        work = MoeWork(tokens=r["rows"][None], touched=r["touched"][None], nvlink=r["remote"][None], nic=z)
        experts, comm, _ = cost.moe_layer_times(work)
        e, c = float(experts[0]), float(comm[0])
        if shared_cores and shared_cores < cfg.world_size:
            e = max(e, contention * float(cost.expert_time(work.tokens, work.touched).sum()) / shared_cores)
            # Loopback all-to-all is CPU work on the same cores: the calibration (balanced ranks) measured
            # every rank moving the mean bytes at once; one heavy rank alone moves its bytes cores/G as
            # long as that (it has a core to itself).
            mean = MoeWork(tokens=work.tokens, touched=work.touched, nvlink=np.full_like(work.nvlink,
                           work.nvlink.mean()), nic=z)
            c = max(float(cost.moe_layer_times(mean)[1][0]), c * shared_cores / cfg.world_size)
        out.append(e + c)
    return np.array(out)


def fit_contention(profile, cfg: BenchConfig, rows: list[dict], shared_cores: int) -> float:
    """Slowdown of ``world_size`` ranks sharing ``shared_cores`` cores, from the TRAIN grid: the median
    ratio of the measured expert phase to ``total single-rank expert work / shared_cores`` (>= 1)."""
    train = [r for r in rows if r["split"] == "train"]
    ratios = []
    for r in train:
        total = float(expert_work(profile, cfg, r).sum()) / shared_cores
        if total > 0:
            ratios.append(r["experts_max"] / total)
    return max(1.0, float(np.median(ratios))) if ratios else 1.0


def _cost(profile, cfg: BenchConfig):
    value_bytes = torch.finfo(getattr(torch, cfg.dtype)).bits // 8
    return CostModel(_bench_model(cfg), make_cluster(cfg.world_size, "h200", cfg.world_size),
                     CostConfig(dispatch_bytes_per_value=value_bytes, combine_bytes_per_value=value_bytes,
                                activation_bytes=value_bytes), profile=profile)


def expert_work(profile, cfg: BenchConfig, row: dict) -> np.ndarray:
    """Each rank's expert time with a core to itself, ``[G]`` (the simulator's ``expert_time``)."""
    return _cost(profile, cfg).expert_time(row["rows"], row["touched"])


def validate(profile, results: list[dict], cfg: BenchConfig) -> dict:
    """Predicted vs measured MoE layer time on the held-out TEST grid: median and p90 relative error."""
    rows = _config_table(results, cfg)
    cores = results[0]["cores"] if results[0]["device"].startswith("cpu") else None
    shared = cores if cores and cores < cfg.world_size else None
    contention = fit_contention(profile, cfg, rows, shared) if shared else 1.0
    pred = predict(profile, cfg, rows, shared_cores=shared, contention=contention)
    table = []
    for r, p in zip(rows, pred):
        imb = float(r["rows"].max() / max(r["rows"].mean(), 1e-9))
        table.append({"split": r["split"], "tokens_per_rank": r["tokens"], "skew": r["skew"],
                      "max_over_mean": round(imb, 3), "measured_s": r["measured"], "predicted_s": float(p),
                      "rel_error": float(abs(p - r["measured"]) / r["measured"])})
    test = np.array([t["rel_error"] for t in table if t["split"] == "test"])
    train = np.array([t["rel_error"] for t in table if t["split"] == "train"])
    return {"table": table, "shared_cores": shared, "contention": contention,
            "test_median_rel_error": float(np.median(test)), "test_p90_rel_error": float(np.percentile(test, 90)),
            "train_median_rel_error": float(np.median(train))}


def run_bench(cfg: BenchConfig, backend: str | None = None) -> tuple[object, dict, list[dict]]:
    """Measure, calibrate on the train grid, validate on the test grid: ``(profile, validation, raw)``."""
    results = run_distributed(bench_rank, cfg.world_size, cfg, backend=backend, timeout=1800)
    profile = build_profile(results, cfg)
    return profile, validate(profile, results, cfg), results
