"""Timelines: expert distributions laid out over simulated time (Loads inputs, --phases, the long horizons of
online-vs-static comparisons), drawn from by the statistical router by the clock."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from simkit import linear_placement, mini_model

from moeplace.foundation.errors import InputError
from moeplace.sim.inputs import drawn_tokens, parse_phases
from moeplace.sim.routing import StatRouter
from moeplace.sim.timeline import MIN_PER_EXPERT, merge_windows, phase_timeline
from moeplace.traces.loads import Loads


def _counts(m, hot: list[int], windows: int, per_window: int) -> np.ndarray:
    """``[W, L, E]``: every selection of every window on the experts ``hot`` (evenly)."""
    c = np.zeros((windows, m.num_moe_layers, m.num_experts))
    c[:, :, hot] = per_window / len(hot)
    return c


def test_windows_merge_until_the_noise_floor_and_phases_keep_their_seconds():
    m = mini_model(num_experts=16)
    # 16 experts: 128 selections per expert need 2,048 selections per layer; windows of 512 -> 4 per range
    c = _counts(m, list(range(16)), 10, 512)
    ranges = merge_windows(c)
    assert ranges[0] == (0, 4) and ranges[-1][1] == 10 and len(ranges) == 2  # the short tail joins
    assert all(c[a:b].sum(axis=(0, 2)).min() / 16 >= MIN_PER_EXPERT for a, b in ranges)
    a, b = _counts(m, [0, 1], 4, 1024), _counts(m, [8, 9], 4, 1024)
    tl = phase_timeline([("morning", a, np.ones(4), 600.0), ("evening", b, np.ones(4), 900.0)], drawn=True)
    assert tl.duration_s == 1500.0 and tl.ends_s[np.searchsorted(tl.ends_s, 600.0)] == 600.0
    assert tl.labels[0].startswith("morning") and tl.labels[-1].startswith("evening")
    assert tl.window_at(10.0) == 0 and tl.labels[tl.window_at(700.0)].startswith("evening")
    assert tl.window_at(10**6) == tl.num_windows - 1  # past the end the last window goes on
    assert tl.stretched(3000.0).duration_s == 3000.0
    blocks = tl.blocks(2, "x")
    assert blocks[0][0] == 0 and blocks[-1][1] == tl.num_windows
    with pytest.raises(InputError, match="cannot be cut"):
        tl.blocks(tl.num_windows + 1, "x")


def test_the_router_draws_the_window_of_the_simulated_second():
    """Morning sends every token to experts 0-1 (GPU 0), evening to 8-9 (GPU 2 of 4 linear GPUs): an
    iteration at 100 s loads GPU 0 only, one at 700 s GPU 2 only; the rebalancer sees that window's loads."""
    m = mini_model(num_experts=16)
    a, b = _counts(m, [0, 1], 2, 4096), _counts(m, [8, 9], 2, 4096)
    tl = phase_timeline([("morning", a, np.ones(2), 600.0), ("evening", b, np.ones(2), 900.0)], drawn=True)
    loads = Loads(np.concatenate([a, b]).astype(np.int64), m)
    trace = dataclasses.replace(drawn_tokens(loads, "x.npz", seed=0), timeline=tl)
    pl = linear_placement(m, 4, 2)
    r = StatRouter(trace, pl, "vllm")
    rng = np.random.default_rng(0)
    work, counts = r.route_count(100, rng, want_counts=True, now=100.0)
    assert work.tokens[:, 0].sum() == 100 * m.top_k * m.num_moe_layers and work.tokens[:, 1:].sum() == 0
    assert counts[:, [0, 1]].sum() == pytest.approx(counts.sum())
    work, counts = r.route_count(100, rng, want_counts=True, now=700.0)
    assert work.tokens[:, 2].sum() == work.tokens.sum() and counts[:, [8, 9]].sum() == pytest.approx(counts.sum())
    assert r.repeated_tokens == 0  # drawn by the clock: nothing is a repeat of a walked trace token


def test_tokens_drawn_from_loads_follow_their_distribution_and_phases_parse():
    m = mini_model(num_experts=16, top_k=2)
    c = np.zeros((1, m.num_moe_layers, 16), dtype=np.int64)
    c[0, :, :4] = [4000, 2000, 1000, 1000]
    t = drawn_tokens(Loads(c, m), "x.npz", seed=1)
    ids = t.expert_ids
    assert ids.max() < 4 and (ids[:, :, 0] != ids[:, :, 1]).all()  # top-k distinct, only experts with load
    share = np.bincount(ids.ravel(), minlength=16)[:4] / ids.size
    assert share[0] > share[1] > share[3] and t.prompt_len[0] == 2048 and t.output_len[0] == 512
    assert [(p.source, p.seconds) for p in parse_phases("a.npz:600, b:900.5")] == [("a.npz", 600.0), ("b", 900.5)]
    # no seconds at all: each phase lasts in proportion to its traffic; some of each is refused
    assert [(p.source, p.seconds) for p in parse_phases("a.npz,b")] == [("a.npz", None), ("b", None)]
    for bad in ("a.npz:0", "a.npz:x", ":5", "a.npz,b:60", "a.npz,,b"):
        with pytest.raises(InputError, match="--phases"):
            parse_phases(bad)
