"""bench/memory_fidelity.py: the published KV pools it scores, the plan it asks (the pools `place simulate`
admits against) and the error it reports."""
from __future__ import annotations

import json

import pytest
import yaml
from benchkit import REPO, load_bench

from moeplace.foundation.errors import InputError
from moeplace.sim.memory import plan_pools

mf = load_bench("memory_fidelity")


def _case(**over) -> dict:
    c = {"id": "tiny", "source": {"url": "https://example.org/log"}, "published_on": "2025-01-01", "engine": "vllm",
         "model": "qwen3-30b-a3b", "gpu": "h100", "gpus": 1, "attention_tp": 1, "moe_tp": 1,
         "gpu_memory_utilization": 0.9, "kv_dtype": "bf16", "max_batched_tokens": 2048, "max_num_seqs": 64,
         "published": {"kv_tokens": 1000}, "assumptions": []}
    c.update(over)
    return c


def test_every_shipped_case_is_scored_through_the_simulators_pools():
    cases = mf.load_cases()
    assert cases and len({c["id"] for c in cases}) == len(cases)
    for c in cases:
        got = mf.plan_case(c, "device")
        pools, _ = plan_pools(mf.case_model(c), mf.case_cluster(c, "device"), mf.case_engine(c), c.get("redundant", 0))
        assert got["kv_tokens"] == mf.kv_tokens(pools) > 0
        assert got["kv_gib"] == pytest.approx(pools.pool_bytes / 2**30)


def test_the_reported_error_is_plan_over_published_minus_one(tmp_path):
    planned = mf.plan_case(_case())["kv_tokens"]
    cases = [_case(id="half", published={"kv_tokens": 2 * planned}),          # the plan holds half: -50 %
             _case(id="quarter-more", published={"kv_tokens": round(planned / 1.25)})]  # +25 %
    f = tmp_path / "cases.yaml"
    f.write_text(yaml.safe_dump({"cases": cases}))
    out = tmp_path / "mf.json"
    assert mf.main(["--cases", str(f), "--basis", "device", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    errs = {r["id"]: r["planned"]["device"]["kv_tokens_error"] for r in doc["cases"]}
    assert errs["half"] == pytest.approx(-0.5, abs=1e-12)
    assert errs["quarter-more"] == pytest.approx(planned / round(planned / 1.25) - 1, abs=1e-12)
    s = doc["figures"]["device"]["kv_tokens"]
    assert s["n"] == 2 and s["max_abs"] == pytest.approx(0.5)
    assert s["median_abs"] == pytest.approx((0.5 + abs(errs["quarter-more"])) / 2)
    assert s["signed_median"] == pytest.approx((errs["half"] + errs["quarter-more"]) / 2)
    assert doc["figures"]["device"]["kv_bytes"]["n"] == 0  # no case printed its pool's bytes


def test_only_runs_the_named_subset(tmp_path):
    out = tmp_path / "one.json"
    first = mf.load_cases()[0]["id"]
    assert mf.main(["--only", first, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["id"] for r in doc["cases"]] == [first] and set(doc["bases"]) == {"device", "marketing"}


@pytest.mark.parametrize("change, message", [
    ({"gpu_memory_utilization": None}, "give exactly one of gpu_memory_utilization"),
    ({"mem_fraction_static": 0.8}, "give exactly one of"),
    ({"published": {"kv_tokens": "many"}}, "published.kv_tokens"),
    ({"engine": "tgi"}, "engine 'tgi'"),
    ({"dcp": 8}, "no decode context parallelism"),
])
def test_a_bad_case_is_named(tmp_path, change, message):
    c = _case(**{k: v for k, v in change.items() if v is not None})
    for k, v in change.items():
        if v is None:
            del c[k]
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump({"cases": [c]}))
    with pytest.raises(InputError, match=message):
        mf.load_cases(f)
    assert mf.main(["--cases", str(f), "--out", str(tmp_path / "x.json")]) == 2
    assert not (tmp_path / "x.json").exists()


def test_the_shipped_cases_file_is_the_default():
    assert mf.CASES == REPO / "bench" / "memory_cases.yaml"
