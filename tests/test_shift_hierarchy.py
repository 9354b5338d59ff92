"""The default shift ranges hold on constructed dataset x language data where the two languages of a dataset
look as unrelated as other datasets (bench/shift_hierarchy.py, its OLMoE part with EPLB: real per-domain
expert counts of OLMoE-1B-7B as datasets): the old single threshold grouping misses realized figures, the
default span of groupings covers every one, and --group gives ranges that cover too."""
from __future__ import annotations

from benchkit import load_bench

from moeplace.foundation.cluster import make_cluster


def test_default_ranges_cover_realized_figures_on_unseen_datasets(tmp_path):
    b = load_bench("shift_hierarchy")
    p_data, names, model = b.olmoe_data()
    assert model.layers_label == "3 of 16 layers"
    p, _ = b.calibrated(p_data, seed=11)
    assert abs(b.twin_distance(p) - b.TWIN_DISTANCE) < 1e-3
    pairs = b.write_inputs(p, names, model, tmp_path, seed=3)
    inside = {"before": [], "after": [], "given": []}
    for plan, test in ((range(3), range(3, 6)), (range(3, 6), range(3))):
        row = b.run_direction(pairs, list(plan), list(test), make_cluster(8, "h200", 4), 8, ["eplb"], None)["eplb"]
        assert row["old_groups"] == 6 and row["after_groupings"] == [6, 5, 4, 3]
        for how in inside:
            inside[how] += [row[how]["mean_inside"], row[how]["worst_inside"]]
        # the old grouping (each input its own group) is the finest level spanned: its ranges lie inside
        for key in ("mean_range", "worst_range"):
            assert row["after"][key][0] <= row["before"][key][0] and row["after"][key][1] >= row["before"][key][1]
        assert row["after"]["mean"] < row["before"]["mean"]  # the figures: the coarsest grouping's
    assert all(inside["after"]) and all(inside["given"])
    assert not all(inside["before"])  # the failure: one threshold grouping, every input its own group
