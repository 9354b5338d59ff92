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


def scenario_loads(loads_we: np.ndarray, cfg: OptimizerConfig, num_gpus: int,
                   groups: np.ndarray | None = None) -> np.ndarray:
    """The scenarios a layer is planned for: their sum, or (``robust``) every window plus, with
    ``envelope``, one more: each expert at its highest share in any window (renormalized). The worst
    case over the windows' mixtures is always one of the windows (a GPU's load is linear in the mix), so
    mixtures add nothing; the envelope lies outside them — experts hot in different windows all hot at
    once, as an unseen workload may have them — so it keeps such experts replicated and apart.

    ``dilate`` > 1 with ``groups`` (int ``[W]``, each window's scenario group: input file, domain, ...)
    widens the set instead of adding to it: window ``w`` of group ``d`` becomes
    ``share_w + (dilate - 1) * (share_d - centroid)`` (shares of each group's sum, centroid = their mean;
    clipped at 0, renormalized), so the groups' spread is scaled by ``dilate`` about its centre and each
    window keeps its own noise. A workload unlike every group sits farther from the centroid than the
    groups do (by ``D / (D - 1)`` on average over the group left out, the jackknife scale), so a
    plan for the groups as they are is too optimistic about it. With fewer than 2 groups it does nothing.

    ``spread`` > 0 adds the rows of :func:`spread_rows` (after ``dilate``, before the envelope)."""
    loads = np.asarray(loads_we, dtype=np.float64)
    if not cfg.robust:
        return normalize_scenarios(loads.sum(axis=0, keepdims=True), num_gpus)
    if cfg.dilate > 1.0 and groups is not None:
        loads = dilate_windows(loads, np.asarray(groups), cfg.dilate)
    wn = normalize_scenarios(loads, num_gpus)
    if cfg.spread > 0 and wn.shape[0] >= 2:
        wn = np.vstack([wn, spread_rows(wn, cfg.spread)])
    if cfg.envelope and wn.shape[0] >= 2:
        env = wn.max(axis=0)
        wn = np.vstack([wn, env * (num_gpus / env.sum())])
    return wn


SPREAD_AXES = 8  # principal directions of the windows' variation that --spread plans along (at most)


def spread_rows(wn: np.ndarray, k: float, axes: int = SPREAD_AXES) -> np.ndarray:
    """Scenarios for a variance-aware plan: the windows' mean ``m`` moved ``k`` standard deviations along
    each of the top ``axes`` principal directions ``v_i`` of the windows' variation, both ways:
    ``m +- k * sqrt(lambda_i) * v_i`` (``lambda_i``: the windows' variance along ``v_i``; rows clipped at 0
    and renormalized to the windows' total, ``[2 * axes', E]``, ``axes'`` = the directions with variance).

    Why: for a placement with per-GPU expert fractions ``x_g`` (``1 / count`` for the experts it holds),
    the worst of these rows on GPU ``g`` is ``x_g . m + k * max_i sqrt(lambda_i) |x_g . v_i|`` — its mean
    load plus ``k`` times the largest of its load's standard deviations along those directions, a
    lower approximation of ``k * sqrt(x_g^T Sigma x_g)`` (``Sigma``: the windows' covariance). So a plan
    for them is a ``mean + k * sd`` plan on the directions the planning data varies most in: experts whose
    loads rise together are kept apart, and replica counts follow an expert's upside (``m + k * sd``), not
    its mean. Windows and their mixtures alone cannot ask for that: a GPU's load is linear in the mix, so
    the worst mixture is a window. ``wn``: normalized windows ``[W, E]`` (rows sum to G)."""
    wn = np.asarray(wn, dtype=np.float64)
    W = wn.shape[0]
    m = wn.mean(axis=0)
    total = float(m.sum())
    _, s, vt = np.linalg.svd(wn - m, full_matrices=False)
    sd = s / np.sqrt(W)                              # the windows' standard deviation along each direction
    keep = sd > 1e-9 * max(total, 1e-300)
    rows = []
    for sd_i, v in zip(sd[keep][:axes], vt[keep][:axes]):
        for sign in (1.0, -1.0):
            r = np.clip(m + sign * k * sd_i * v, 0.0, None)
            rows.append(r * (total / r.sum()))
    return np.array(rows).reshape(-1, wn.shape[1])


def dilate_windows(loads_we: np.ndarray, groups: np.ndarray, factor: float) -> np.ndarray:
    """Windows ``[W, E]`` (token counts) with their group's offset from the groups' centroid scaled by
    ``factor`` (see :func:`scenario_loads`); returns shares ``[W, E]`` (rows sum to 1, empty rows stay 0).
    ``groups``: int ``[W]``. Groups without tokens are ignored; fewer than 2 groups with tokens: shares
    unchanged."""
    loads = np.asarray(loads_we, dtype=np.float64)
    tot = loads.sum(axis=1, keepdims=True)
    shares = np.divide(loads, tot, out=np.zeros_like(loads), where=tot > 0)
    names = [g for g in np.unique(groups) if loads[groups == g].sum() > 0]
    if len(names) < 2:
        return shares
    gsh = {g: loads[groups == g].sum(axis=0) / loads[groups == g].sum() for g in names}
    centroid = np.mean(list(gsh.values()), axis=0)
    out = shares.copy()
    for w in np.flatnonzero(tot[:, 0] > 0):
        if groups[w] in gsh:
            row = np.clip(shares[w] + (factor - 1.0) * (gsh[groups[w]] - centroid), 0.0, None)
            out[w] = row / row.sum() if row.sum() > 0 else shares[w]
    return out


def solve_layer(layer: int, loads_we: np.ndarray, num_slots: int, num_gpus: int, gpus_per_node: int,
                cfg: OptimizerConfig, deadline: float, samples_nk: np.ndarray | None = None,
                origin: np.ndarray | None = None, groups: np.ndarray | None = None) -> LayerResult:
    """Optimize MoE layer ``layer``. ``loads_we``: token counts ``[W, E]`` of the planning windows;
    ``groups``: int ``[W]`` scenario group of each window (``dilate``);
    ``samples_nk``: expert ids ``[N, k]`` of sampled tokens (traffic objective); ``origin``: the current
    ``phy2log`` row ``[P]`` for a migration budget. ``deadline``: ``time.time()`` by which to return."""
    t0 = time.time()
    mono_deadline = time.monotonic() + max(0.0, deadline - t0)
    wn = scenario_loads(loads_we, cfg, num_gpus, groups)
    rule = get_rule(cfg.engine)
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
