"""bench/shift_coverage.py, the benchmark of the shift ranges' coverage: its planted languages sit as far
apart as it says, and its tallies count what they claim (coverage over the points that had a range, the
median width, a ranking call right or wrong)."""
from __future__ import annotations

import numpy as np
import pytest
from benchkit import load_bench

from moeplace.placement.shift import load_distance


def test_planted_languages_sit_the_stated_distance_apart():
    b = load_bench("shift_coverage")
    rng = np.random.default_rng(0)
    p_data = rng.dirichlet(np.ones(32) * 0.5, size=(4, 3))  # 4 datasets, 3 layers, 32 experts
    p = b.with_languages(p_data, 3, seed=1)
    assert p.shape == (4, 3, 3, 32) and np.allclose(p.sum(-1), 1)
    apart = np.mean([load_distance(p[d, a], p[d, c]) for d in range(4) for a in range(3) for c in range(a + 1, 3)])
    assert apart == pytest.approx(b.TWIN_DISTANCE, abs=1e-3)
    # the language effect is shared: language a moves every dataset the same way
    shift = np.log(p[:, 0]) - np.log(p[:, 1])
    assert np.corrcoef(shift[0].ravel(), shift[1].ravel())[0, 1] > 0.5


def _row(policy, inside, width, data="d", split="s", realized=0.5, estimate=0.5, difference=False):
    rng = None if width is None else [estimate - width / 2, estimate + width / 2]
    return {"data": data, "split": split, "mode": "tagged", "policy": policy, "target": "dataset", "case": "c",
            "realized": realized, "estimate": estimate, "range": rng, "inside": inside,
            "width": width, "difference": difference}


def test_coverage_counts_only_points_with_a_range_and_quotes_the_median_width():
    b = load_bench("shift_coverage")
    rows = [_row("eplb", True, 0.1), _row("eplb", False, 0.3), _row("eplb", True, 0.2), _row("eplb", None, None)]
    c = b.summarize(rows)["tagged | eplb | dataset"]
    assert (c["points"], c["with_range"], c["inside"]) == (4, 3, 2)
    assert c["coverage"] == pytest.approx(2 / 3) and c["median_width"] == pytest.approx(0.2)


def test_a_ranking_call_is_right_when_its_sign_is_the_realized_mean_differences():
    b = load_bench("shift_coverage")
    rows = [  # split s1: estimate +0.02 [0.01, 0.03] (decisive), realized mean +0.01: right
        _row("m - e", True, 0.02, split="s1", realized=0.03, estimate=0.02, difference=True),
        _row("m - e", False, 0.02, split="s1", realized=-0.01, estimate=0.02, difference=True),
        # split s2: estimate -0.01, range spans 0 (no call), realized mean +0.02: sign wrong
        _row("m - e", True, 0.1, split="s2", realized=0.02, estimate=-0.01, difference=True)]
    r = b.ranking(rows)["tagged | m - e"]
    assert r == {"splits": 2, "sign_right": 1, "decisive": 1, "decisive_right": 1}


def test_calibration_bootstraps_whole_splits_and_reads_how_far_inside_each_point_lies():
    b = load_bench("shift_coverage")
    # range [0, 1]: centre 0.5, half-width 0.5; realized 0.25 / 0.75 lie at z = -0.5 / +0.5
    rows = [_row("eplb", True, 1.0, split="s1", realized=0.25), _row("eplb", True, 1.0, split="s1", realized=0.75),
            _row("eplb", True, 1.0, split="s2", realized=0.75)]
    rows.append({**_row("eplb", True, 1.0, split="s2", realized=0.25), "data_seed": 7})  # another draw: its own split
    c = b.calibration(rows)["tagged | eplb | dataset"]
    assert c["splits"] == 3 and c["points"] == 4 and c["level"] == b.CHECK_LEVEL
    assert c["coverage"]["value"] == 1.0 and c["rms_z"]["value"] == pytest.approx(0.5)
    # a normal error of rms 0.5 half-widths lies inside 95.4 % of the time
    assert c["implied_coverage"]["value"] == pytest.approx(0.9545, abs=1e-4)
    assert c["rms_z"]["interval"] == pytest.approx([0.5, 0.5])  # every resample is the same here
    miss = [_row("eplb", False, 0.2, split=f"s{i}", realized=0.9, estimate=0.5) for i in range(3)]
    m = b.calibration(rows + miss)["tagged | eplb | dataset"]
    assert m["coverage"]["value"] == pytest.approx(4 / 7)
    assert m["coverage"]["interval"][0] < 4 / 7 < m["coverage"]["interval"][1]


def test_the_range_as_sampled_puts_the_layer_samples_noise_back():
    b = load_bench("shift_coverage")
    from moeplace.placement.shift import t80

    t = {"mean": 0.5, "per_group": [0.4, 0.5, 0.6], "range": [0.45, 0.55], "spread_sampled_layers": 0.1,
         "layer_sample_se": 0.02}
    h = t80(2) * np.sqrt(0.01 * (1 + 1 / 3) + 0.0004)
    assert b.as_sampled(t, 0.0, 1.0) == pytest.approx([0.5 - h, 0.5 + h])
    assert b.as_sampled({**t, "per_group": [0.0, 0.05, 0.1]}, 0.0, 1.0)[0] == 0.0  # clipped like the printed range
    assert b.as_sampled({k: v for k, v in t.items() if k != "spread_sampled_layers"}, 0.0, 1.0) == [0.45, 0.55]
