"""Leave-one-out isolation for the robust plan: the workload left out of a leave-one-domain-out never
reaches the planner (the final plan and the shift estimate's folds alike), and the bench statistic that
says why no static hedge helps. (The hedges themselves, --envelope / --dilate / --spread, were removed:
docs/placement.md.)"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from benchkit import load_bench

import moeplace.placement.policies.moeplace as planner_module
from moeplace.foundation.cluster import make_cluster
from moeplace.placement.compare import compare_policies
from moeplace.placement.shift import scenarios
from moeplace.traces.loads import Loads

E, L, K = 16, 2, 2


def _spy_on_planner(monkeypatch) -> list[np.ndarray]:
    """Record every loads array the moeplace policy hands its layer optimizer (the planner's whole input)."""
    received: list[np.ndarray] = []
    real = planner_module.optimize_layers

    def spy(loads_wle, *args, **kw):
        received.append(np.asarray(loads_wle).copy())
        return real(loads_wle, *args, **kw)

    monkeypatch.setattr(planner_module, "optimize_layers", spy)
    return received


@pytest.fixture(scope="module")
def small(k3):
    return replace(k3, name="small", num_layers=L + 1, moe_layers=tuple(range(1, L + 1)), num_experts=E,
                   top_k=K, attention=("kda",) * (L + 1), mla=None)


def _domains(model, per_domain=3, seed=0):
    """Four domains (tags a-d), ``per_domain`` windows each; every window distinct; domain d favours
    experts 4d..4d+3."""
    rng = np.random.default_rng(seed)
    counts, tags = [], []
    for d, tag in enumerate("abcd"):
        for _ in range(per_domain):
            w = np.ones(E)
            w[4 * d:4 * d + 4] = 6.0
            counts.append(rng.multinomial(400, w / w.sum(), size=L))
            tags.append(tag)
    return Loads(np.array(counts, np.int64), model, 200, (), {"window_domains": tags})


def test_left_out_domain_never_reaches_the_planner(small, monkeypatch):
    loads = _domains(small)
    ids, names, _ = scenarios(loads)
    held = names.index("c")
    train = np.flatnonzero(ids != held)
    held_rows = {loads.counts[w].tobytes() for w in np.flatnonzero(ids == held)}
    train_rows = {loads.counts[w].tobytes() for w in train}
    received = _spy_on_planner(monkeypatch)
    cmp = compare_policies(loads.select(train), make_cluster(8, "h200", 4), num_redundant=0,
                           policies=["moeplace"], plan_fraction=1.0, shift=True,
                           options={"robust": True, "workers": 1, "lns_rounds": 0})
    # the final plan and the shift estimate's folds: all from the 3 other domains
    assert len(received) == 1 + 3
    for arr in received:
        for row in arr.astype(np.int64):
            assert row.tobytes() not in held_rows
            assert row.tobytes() in train_rows
    assert cmp.results[0].shift is not None


def test_hot_hits_counts_the_unseen_domains_hot_experts_each_statistic_finds():
    bench = load_bench("shift_lodo")
    # 3 domains x 2 windows (equal), 1 layer, experts A..F; the unseen domain 2 is hot on A and B. A and B
    # are steady in domains 0 and 1 (top of their mean, zero spread); C and D are hot in one domain each (top
    # of their maximum and of their spread) and cold in domain 2.
    dom = {0: [30, 25, 40, 0, 5, 0], 1: [30, 25, 0, 35, 10, 0], 2: [50, 40, 2, 2, 3, 3]}
    counts = np.array([dom[d] for d in (0, 0, 1, 1, 2, 2)], dtype=np.float64)[:, None, :]  # [W, L, E]
    hits = bench._hot_hits(counts, np.array([0, 0, 1, 1, 2, 2]), 2, r=2)
    assert hits == {"mean": 1.0, "max": 0.0, "sd": 0.0, "random": 2 / 6, "own_half": 1.0}
    # left out in turn, domain 0's hot pair {C, A} is half found by the others' mean (A) and by their max (A)
    hits0 = bench._hot_hits(counts, np.array([0, 0, 1, 1, 2, 2]), 0, r=2)
    assert hits0["mean"] == 0.5 and hits0["max"] == 0.5
