"""bench/shift_planning_groups.py, the check of how the held-out figure's spread depends on the number of
planning groups: its tallies are what they say, on hand-computed cases."""
from __future__ import annotations

import math

import numpy as np
import pytest
from benchkit import load_bench

from moeplace.placement.shift import group_figures


def test_by_size_pools_the_spread_within_each_plan_apart_from_the_total():
    b = load_bench("shift_planning_groups")
    figures = {(0,): {1: 0.5, 2: 0.7}, (1,): {0: 0.4, 2: 0.6}, (0, 1): {2: 0.65}}
    s = b.by_size(figures)
    # n = 1: each plan's two new groups differ by 0.2 (variance 0.02); all four around 0.55: 0.05 / 3
    assert s[1]["level"] == pytest.approx(0.55)
    assert s[1]["within"] == pytest.approx(0.02)
    assert s[1]["total"] == pytest.approx(0.05 / 3)
    # n = 2: one plan, one new group: no spread to speak of
    assert s[2]["level"] == pytest.approx(0.65) and s[2]["within"] is None and s[2]["total"] is None


def _four_groups(y: float) -> dict:
    # leave-one-out figures of the planning set (0, 1, 2): 0.5, 0.6, 0.7; the written plan on group 3: y
    return {(1, 2): {0: 0.5, 3: 0.0}, (0, 2): {1: 0.6, 3: 0.0}, (0, 1): {2: 0.7, 3: 0.0}, (0, 1, 2): {3: y}}


def test_replay_is_the_student_t_range_of_the_leave_one_out_figures():
    b = load_bench("shift_planning_groups")
    h = 1.8856 * math.sqrt(0.01 * (1 + 1 / 3))  # t_{0.9, 2} * sqrt(s^2 (1 + 1/D)), s^2 = 0.01, about 0.2177
    inside = b.replay(_four_groups(0.75), 3)
    assert inside["points"] == 1 and inside["coverage"] == 1.0
    assert inside["rms_z"] == pytest.approx(0.15 / h, rel=1e-4)
    assert inside["mse_over_assumed"] == pytest.approx(0.15 ** 2 / (0.01 * 4 / 3))
    assert b.replay(_four_groups(0.85), 3)["coverage"] == 0.0  # 0.25 from the centre > 0.2177


def test_the_tools_range_on_every_layer_is_the_plain_student_t_range():
    b = load_bench("shift_planning_groups")
    figures = _four_groups(0.75)
    # two layers whose mean is each figure: every layer scored, nothing of a layer sample enters
    layer = {S: {t: np.array([v - 0.05, v + 0.05]) for t, v in d.items()} for S, d in figures.items()}
    tool = b.replay_tool(figures, layer, 3, np.arange(2))
    plain = b.replay(figures, 3)
    assert tool["coverage"] == plain["coverage"] == 1.0
    assert tool["rms_z"] == pytest.approx(plain["rms_z"])
    assert tool["median_width"] == pytest.approx(2 * 1.8856 * math.sqrt(0.01 * 4 / 3), rel=1e-4)


def test_tool_layers_are_the_default_estimates_sample():
    b = load_bench("shift_planning_groups")
    # 8 MoE layers, 5 folds: max(3, 8 // 5) = 3 layers, drawn as place optimize --seed 0 draws them
    k = b.tool_layers(8, 5)
    assert k.size == 3 and np.all(np.diff(k) > 0) and k.max() < 8
    assert b.tool_layers(4, 5).size == 3 and b.tool_layers(3, 5).size == 3


def test_the_previous_estimate_is_replayed_as_it_printed():
    # 3 groups x 2 sampled of 4 layers; per-group means 0.6, 0.5, 0.55 (variance 0.0025), layer means equal
    # (se 0); interaction mean square 0.04 / 2 = 0.02: noise 0.02 (1/2 - 1/4) = 0.005, floor 0.02 / 4 = 0.005
    b = load_bench("shift_planning_groups")
    per_layer = np.array([[0.5, 0.7], [0.6, 0.4], [0.55, 0.55]])
    lo, hi = b.previous_range(per_layer, 4)  # 0.0025 - 0.005 < 0: the floor
    assert hi - lo == pytest.approx(2 * 1.8856 * math.sqrt(0.005 * 4 / 3), rel=1e-4)
    assert b.previous_range(per_layer, 4, floor=False) == [pytest.approx(0.55), pytest.approx(0.55)]  # collapsed
    # the tool's pivot: neither the floor nor a collapse
    tool = group_figures(per_layer, 4)["range"]
    assert 0 < tool[1] - tool[0] < hi - lo and sum(tool) / 2 == pytest.approx(0.55)
    # every layer: all three are the same Student-t range
    full = np.array([[0.5, 0.7, 0.6, 0.6], [0.6, 0.4, 0.5, 0.5], [0.55, 0.55, 0.5, 0.6]])
    assert b.previous_range(full, 4) == pytest.approx(group_figures(full, 4)["range"])
