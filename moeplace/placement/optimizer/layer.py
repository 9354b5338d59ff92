"""One layer, end to end: greedy start (or the current placement under a migration budget), local
search, CP-SAT large-neighbourhood search, then the optional traffic refinement. Pure function of its
inputs and the seed; the only non-determinism is a wall-clock deadline cutting the search short, and
every stage the deadline skipped or cut short is recorded (:attr:`LayerResult.skipped` / ``cut``), so a
result that lists none is the one the same seed gives on any machine."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from moeplace.placement.optimizer.config import OptimizerConfig
from moeplace.placement.optimizer.greedy import count_bound, greedy_layer, normalize_scenarios
from moeplace.placement.optimizer.lns_cpsat import exact_model_size, solve_exact, solve_neighbourhood
from moeplace.placement.optimizer.local_search import LayerState, local_search
from moeplace.placement.optimizer.partition import partition_start
from moeplace.placement.optimizer.traffic import TrafficModel, same_node, traffic_search
from moeplace.placement.rules import get_rule
from moeplace.placement.rules.ideal import ideal_split

PARETO_SLACKS = (0.0, 0.0025, 0.005, 0.01, 0.02, 0.05)

# Stage names as the output prints them ("traffic refinement skipped: time limit").
STAGES = ("local search + CP-SAT", "exact model", "hedging", "traffic refinement")
MARGIN = 0.05  # a stage that ends this close to the deadline may have been stopped by it: counted as cut


@dataclass
class LayerResult:
    """What one layer's solve returns. ``value``: scenario-aggregated max/mean of the plan (even split);
    ``bound``: a proven lower bound on it; ``greedy_value``: the start's value."""

    layer: int
    p2l: np.ndarray
    value: float
    bound: float
    greedy_value: float
    seconds: float
    moves: int = 0
    lns_improved: int = 0
    span0: float | None = None
    span: float | None = None
    ideal_value: float | None = None
    pareto: list = field(default_factory=list)
    hedge: dict | None = None
    traffic_start: str | None = None
    skipped: list = field(default_factory=list)  # stages the deadline left no time to start
    cut: list = field(default_factory=list)      # stages the deadline stopped before they finished

    def stats(self) -> dict:
        d = {"layer": self.layer, "value": self.value, "balancedness": 1.0 / self.value, "bound": self.bound,
             "gap": self.value / self.bound - 1.0, "greedy_value": self.greedy_value,
             "seconds": round(self.seconds, 3), "moves": self.moves, "lns_improved": self.lns_improved}
        for k in ("span0", "span", "ideal_value", "traffic_start"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        if self.pareto:
            d["pareto"] = self.pareto
        if self.hedge:
            d.update(self.hedge)
        if self.skipped:
            d["skipped"] = list(self.skipped)
        if self.cut:
            d["cut"] = list(self.cut)
        return d


def scenario_loads(loads_we: np.ndarray, cfg: OptimizerConfig, num_gpus: int) -> np.ndarray:
    """The scenarios a layer is planned for: their sum, or (``robust``) every window. The worst case over
    the windows' mixtures is always one of the windows (a GPU's load is linear in the mix), so mixtures add
    nothing. (Hedges that added scenarios beyond the windows — their envelope, the scenario set widened
    about its centroid, the mean moved along the windows' principal directions — were removed: none beat
    plain ``robust`` on unseen workloads by more than repeat-run noise; docs/placement.md.)"""
    loads = np.asarray(loads_we, dtype=np.float64)
    if not cfg.robust:
        return normalize_scenarios(loads.sum(axis=0, keepdims=True), num_gpus)
    return normalize_scenarios(loads, num_gpus)


def solve_layer(layer: int, loads_we: np.ndarray, num_slots: int, num_gpus: int, gpus_per_node: int,
                cfg: OptimizerConfig, deadline: float, samples_nk: np.ndarray | None = None,
                origin: np.ndarray | None = None) -> LayerResult:
    """Optimize MoE layer ``layer``. ``loads_we``: token counts ``[W, E]`` of the planning windows;
    ``samples_nk``: expert ids ``[N, k]`` of sampled tokens (traffic objective); ``origin``: the current
    ``phy2log`` row ``[P]`` for a migration budget. ``deadline``: ``time.time()`` by which to return."""
    t0 = time.time()
    mono_deadline = time.monotonic() + max(0.0, deadline - t0)
    wn = scenario_loads(loads_we, cfg, num_gpus)
    rule = get_rule(cfg.rule)
    # The even-split bound holds for the even-split rules only (vLLM, TensorRT-LLM); SGLang and the ideal
    # split can split unevenly (total / G).
    bound = count_bound(wn, num_slots, num_gpus) if rule.even_split else 1.0
    # SGLang's static map sends a node's ranks to that node's replica: one replica per node keeps
    # the expected split even (load / count), which is what the search below models.
    nd = gpus_per_node if rule.node_distinct and num_gpus > gpus_per_node else None
    if origin is not None:
        start = np.asarray(origin, dtype=np.int64)
    else:
        start = greedy_layer(wn, num_slots, num_gpus, node_distinct=nd)
    st = LayerState(wn, start, num_gpus, cfg.cvar, origin=origin,
                    max_moves=cfg.max_moves if origin is not None else None, node_distinct=nd)
    greedy_value = st.value()
    skipped: list[str] = []
    cut: list[str] = []

    def left() -> float:
        return mono_deadline - time.monotonic()

    def stage(name: str, run, need: float = 0.01) -> None:
        """Run one stage unless the deadline leaves less than ``need`` seconds; note when the deadline
        skipped it or may have stopped it (ending within MARGIN of the deadline counts: conservative, so a
        result that lists nothing is reproducible)."""
        if left() <= need:
            skipped.append(name)
            return
        run()
        if left() <= MARGIN:
            cut.append(name)

    # Local search, then CP-SAT on neighbourhoods of the most loaded GPU while it pays.
    def lns() -> None:
        nonlocal improved
        local_search(st, mono_deadline)
        misses = 0
        for r in range(cfg.lns_rounds):
            if misses >= cfg.lns_patience or st.value() <= bound * (1 + cfg.gap_tol):
                return
            wall = left()  # the deterministic limit binds first unless time runs out
            if wall <= 0.01:
                return
            gpus = _neighbourhood(st, cfg.lns_gpus, rng)
            if solve_neighbourhood(st, gpus, cfg.seed + 7919 * r, cfg.lns_dtime, wall):
                improved += 1
                misses = 0
                local_search(st, mono_deadline)
            else:
                misses += 1

    rng = np.random.default_rng([cfg.seed, layer])
    improved = 0
    stage("local search + CP-SAT", lns)
    # Small layers under an even-split rule (no SGLang node rule, no migration budget): the exact model of
    # counts + placement, hinted with the heuristic's answer; its proven bound tightens ours.
    if (rule.even_split and origin is None and not cfg.cvar
            and exact_model_size(wn.shape[1], num_slots, num_gpus) <= cfg.exact_max_vars
            and st.value() > bound * (1 + cfg.gap_tol)):
        def exact() -> None:
            nonlocal bound
            ex = solve_exact(wn, num_slots, num_gpus, cfg.seed, left(), st.p2l, 20 * cfg.lns_dtime)
            if ex is not None:
                p2l, v, b, _ = ex
                bound = max(bound, min(b, v))
                if v < st.value() - 1e-12:
                    st.set(p2l)
        stage("exact model", exact, need=0.05)
    hedge = None
    wins = normalize_scenarios(np.asarray(loads_we, dtype=np.float64), num_gpus)
    if cfg.hedge and not cfg.robust and wins.shape[0] >= 2:
        def hedging() -> None:
            nonlocal hedge
            before = LayerState(wins, st.p2l, num_gpus).value()
            cap = max(st.value(), bound) * (1 + cfg.hedge_tol)
            hs = LayerState(np.vstack([wn, wins]), st.p2l, num_gpus, 0.0, origin=origin, max_moves=st.max_moves,
                            node_distinct=nd, cap_rows=1, cap=cap)
            local_search(hs, mono_deadline, max_iters=cfg.hedge_iters)
            st.set(hs.p2l)
            hedge = {"worst_window_before": 1.0 / before, "worst_window_after": 1.0 / hs.value()}
        stage("hedging", hedging)
    res = LayerResult(layer, st.p2l.copy(), st.value(), bound, greedy_value, 0.0, st.moves, improved)
    res.hedge = hedge

    if samples_nk is not None:  # a Loads sample marks missing layers of a token with -1
        samples_nk = np.asarray(samples_nk, dtype=np.int64)
        samples_nk = samples_nk[(samples_nk >= 0).all(axis=1)]
    if cfg.objective != "balance" and samples_nk is not None and len(samples_nk) and num_gpus > gpus_per_node:
        # the partition-first start ignores SGLang's node rule and the migration budget: not offered there
        def traffic() -> None:
            _traffic(st, res, samples_nk, num_gpus, gpus_per_node, cfg, mono_deadline,
                     partition=nd is None and origin is None)
        stage("traffic refinement", traffic)
    res.skipped, res.cut = skipped, cut
    if not rule.per_token:  # a fractional split: also report its LP optimum on the planning loads
        union = np.asarray(loads_we, dtype=np.float64).sum(axis=0)
        z = ideal_split(res.p2l[None], union[None], num_gpus)[1][0]
        res.ideal_value = float(z / max(union.sum() / num_gpus, 1e-12)) if union.sum() > 0 else 1.0
    res.seconds = time.time() - t0
    return res


def _neighbourhood(st: LayerState, size: int, rng: np.random.Generator) -> np.ndarray:
    """The most loaded GPU, the least loaded ones and random others (half and half)."""
    worst = st.load.max(axis=0)
    order = np.argsort(worst, kind="stable")
    top = int(order[-1])
    size = min(size, st.G)
    light = [int(g) for g in order[: (size - 1 + 1) // 2] if g != top]
    rest = [g for g in range(st.G) if g != top and g not in light]
    extra = rng.choice(rest, size=min(len(rest), size - 1 - len(light)), replace=False) if rest else []
    return np.array(sorted({top, *light, *map(int, extra)}), dtype=np.int64)


def _traffic(st: LayerState, res: LayerResult, samples: np.ndarray, G: int, gpn: int, cfg: OptimizerConfig,
             deadline: float, partition: bool = True) -> None:
    """Traffic refinement from two starts, the balance plan and (``partition``) a co-activation-grouped
    placement with the same replica counts (:mod:`.partition`); for each balance floor the better result
    that meets it wins (lower span for ``traffic``; lower ``value + weight * span / span0`` otherwise)."""
    base_p2l, base_val = st.p2l.copy(), st.value()
    weight = None if cfg.objective == "traffic" else cfg.traffic_weight
    starts = [("balance", base_p2l)]
    if partition:
        part = partition_start(samples, st.wn, st.cnt, G, gpn)
        if part is not None:  # first: when the deadline cuts the search short, it is the one that pays
            starts.insert(0, ("partition", part))
    res.span0 = TrafficModel(samples, base_p2l, G, gpn).span()
    span0 = max(res.span0, 1e-9)
    inside = same_node(st, gpn)

    def run(cap: float) -> tuple[np.ndarray, float, float, str]:
        best, best_key = None, None
        for name, p2l in starts:
            st.set(p2l)
            tm = TrafficModel(samples, p2l, G, gpn)
            if name != "balance":
                local_search(st, deadline, allowed=inside, on_swap=tm.swap)
                if st.value() > cap:  # node loads off: repair across nodes
                    local_search(st, deadline, on_swap=tm.swap)  # swaps anywhere, no re-counts
            traffic_search(st, tm, cap, weight, deadline)
            local_search(st, deadline, allowed=inside, on_swap=tm.swap)
            v, s = st.value(), tm.span()
            key = (v > cap + 1e-12, s if weight is None else v + weight * s / span0)
            if best_key is None or key < best_key:
                best, best_key = (st.p2l.copy(), v, s, name), key
        return best

    if cfg.pareto:
        for slack in PARETO_SLACKS:
            _, v, s, _ = run(1.0 / max(1.0 / base_val - slack, 1e-6))
            res.pareto.append({"floor": 1.0 / base_val - slack, "balancedness": 1.0 / v, "span": s})
    floor = cfg.balance_floor if cfg.balance_floor is not None else 1.0 / base_val - 0.01
    cap = max(1.0 / floor, base_val)
    res.p2l, res.value, res.span, res.traffic_start = run(cap)
