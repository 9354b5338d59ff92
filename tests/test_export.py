"""Export to engine files and import back: round trips, engine constraints, launch flags, CLI errors."""
from __future__ import annotations

import json
import shlex

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeplace.cli.main import main
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import load_model
from moeplace.placement.export import export_placement, format_names, import_loads, import_placement
from moeplace.placement.export.flags import FlagOptions, launch_command
from moeplace.placement.export.sglang import full_phy2log
from moeplace.placement.export.vllm import load_records, read_load_stats, split_over_replicas
from moeplace.placement.record import Placement, load_placement
from moeplace.traces.loads import Loads, load_loads

PLACEMENT_FORMATS = {"sglang": ".json", "sglang-pt": ".pt", "vllm-expert-map": ".json", "vllm-jsonl": ".jsonl",
                     "vllm-ascend": ".json", "trtllm": ".yaml", "trtllm-lb": ".yaml"}


@pytest.fixture(scope="module")
def dsv3():
    return load_model("deepseek-v3")  # 61 layers, 0-2 dense: exercises dense-layer rows


def random_phy2log(rng, L, E, G, R, distinct_per_gpu=False):
    """Valid ``[L, E+R]``: every expert once plus R random replicas, shuffled. With ``distinct_per_gpu`` no
    GPU holds one expert twice (resampled per layer; with 4 GPUs and 12 replicas about 3% of draws qualify,
    so a few hundred tries were not always enough)."""
    P = E + R
    rows = []
    for _ in range(L):
        for _ in range(5000):
            row = np.concatenate([np.arange(E), rng.integers(0, E, R)])
            rng.shuffle(row)
            per = np.sort(row.reshape(G, P // G), axis=1)
            if not distinct_per_gpu or not (np.diff(per, axis=1) == 0).any():
                break
        rows.append(row)
    return np.array(rows)


def make(model, phy2log, G, gpn=8):
    return Placement.from_phy2log(phy2log, model, G, gpn, {"cluster": {"gpu": "h200"}})


def vllm_default(model, G, R):
    """vLLM's EPLB start layout ``[0..E-1] + [i % E for i in range(R)]`` on every MoE layer."""
    E = model.num_experts
    row = np.concatenate([np.arange(E), np.arange(R) % E])
    return make(model, np.tile(row, (model.num_moe_layers, 1)), G)


def roundtrip(pl, model, fmt, tmp_path, **kw):
    out = tmp_path / f"x{PLACEMENT_FORMATS[fmt]}"
    export_placement(pl, model, fmt, out, **kw)
    return import_placement(out, fmt, model, num_gpus=pl.num_gpus, gpus_per_node=pl.gpus_per_node)


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("fmt", list(PLACEMENT_FORMATS))
def test_default_k3_placement_round_trips_every_format(k3, fmt, tmp_path):
    pl = vllm_default(k3, 32, 32)
    back = roundtrip(pl, k3, fmt, tmp_path)
    assert np.array_equal(back.phy2log, pl.phy2log)
    assert (back.num_gpus, back.gpus_per_node, back.model_name) == (32, 8, "kimi-k3")


@pytest.mark.parametrize("fmt", list(PLACEMENT_FORMATS))
def test_random_k3_placement_with_replicas_round_trips(k3, fmt, tmp_path):
    rng = np.random.default_rng(7)
    pl = make(k3, random_phy2log(rng, k3.num_moe_layers, k3.num_experts, 32, 32, fmt == "vllm-ascend"), 32)
    assert (pl.logcnt > 1).any()
    back = roundtrip(pl, k3, fmt, tmp_path)
    assert np.array_equal(back.phy2log, pl.phy2log)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(list(PLACEMENT_FORMATS)), G=st.sampled_from([4, 8, 16, 32]),
       extra=st.integers(0, 3), seed=st.integers(0, 2**31))
def test_round_trip_is_identity_hypothesis(dsv3, tmp_path, fmt, G, extra, seed):
    E = dsv3.num_experts
    R = G * extra  # 256 is divisible by every G here, so E + R is too
    rng = np.random.default_rng(seed)
    pl = make(dsv3, random_phy2log(rng, dsv3.num_moe_layers, E, G, R, fmt == "vllm-ascend"), G,
              gpn=min(G, 8))
    back = roundtrip(pl, dsv3, fmt, tmp_path)
    assert np.array_equal(back.phy2log, pl.phy2log)
    assert back.num_gpus == G and back.num_redundant == R


# ------------------------------------------------------------------ SGLang
def test_sglang_json_has_all_decoder_layers_and_complete_dense_rows(dsv3, tmp_path):
    rng = np.random.default_rng(1)
    pl = make(dsv3, random_phy2log(rng, dsv3.num_moe_layers, 256, 8, 32), 8)
    out = tmp_path / "loc.json"
    export_placement(pl, dsv3, "sglang", out)
    d = json.loads(out.read_text())
    assert list(d) == ["physical_to_logical_map"]  # init_by_mapping(**d): any extra key is a TypeError
    m = np.array(d["physical_to_logical_map"])
    assert m.shape == (61, 288)
    assert np.array_equal(m[3:], pl.phy2log)  # decoder layer i reads row i; MoE layers are 3..60
    for dense in (0, 1, 2):  # SGLang's trivial row arange(P) % E: every expert present
        assert np.array_equal(m[dense], np.arange(288) % 256)


def test_sglang_pt_loads_with_weights_only(dsv3, tmp_path):
    import torch

    pl = vllm_default(dsv3, 16, 16)
    out = tmp_path / "loc.pt"
    export_placement(pl, dsv3, "sglang-pt", out)
    d = torch.load(out, weights_only=True, map_location="cpu")
    assert list(d) == ["physical_to_logical_map"]
    t = d["physical_to_logical_map"]
    assert t.dtype == torch.int64 and tuple(t.shape) == (61, 272)
    assert np.array_equal(t.numpy(), full_phy2log(pl, dsv3))


def _write_map(path, rows, **extra):
    path.write_text(json.dumps({"physical_to_logical_map": rows, **extra}))


def test_sglang_import_rejects_what_sglang_would_fail_on(dsv3, tmp_path):
    pl = vllm_default(dsv3, 8, 0)
    good = full_phy2log(pl, dsv3).tolist()
    f = tmp_path / "bad.json"
    _write_map(f, good, provenance={"x": 1})
    with pytest.raises(InputError, match="unexpected keys"):
        import_placement(f, "sglang", dsv3, num_gpus=8)
    dense_hole = [r[:] for r in good]
    dense_hole[1] = [0] * 256  # a dense row missing experts: SGLang's static dispatch divides by zero
    _write_map(f, dense_hole)
    with pytest.raises(InputError, match=r"layer 1 \(dense\).*logical expert 1 has no physical slot"):
        import_placement(f, "sglang", dsv3, num_gpus=8)
    _write_map(f, good[3:])  # MoE rows only: SGLang counts num_hidden_layers
    with pytest.raises(InputError, match="must hold 61 rows, got 58"):
        import_placement(f, "sglang", dsv3, num_gpus=8)
    neg = [r[:] for r in good]
    neg[5][7] = -1
    _write_map(f, neg)
    with pytest.raises(InputError, match=r"layer 5 \(MoE\): slot 7.*out of range"):
        import_placement(f, "sglang", dsv3, num_gpus=8)
    _write_map(f, good)
    with pytest.raises(InputError, match="do not divide over --gpus 3"):
        import_placement(f, "sglang", dsv3, num_gpus=3)
    with pytest.raises(InputError, match="pass --gpus"):
        import_placement(f, "sglang", dsv3)


def test_sglang_export_refuses_wrong_suffix_and_warns_for_k3(k3, dsv3, tmp_path):
    pl = vllm_default(dsv3, 8, 0)
    with pytest.raises(InputError, match=r"must end in \.json"):
        export_placement(pl, dsv3, "sglang", tmp_path / "loc.txt")
    assert not (tmp_path / "loc.txt").exists()
    assert export_placement(pl, dsv3, "sglang", tmp_path / "a.json") == []
    warn = export_placement(vllm_default(k3, 32, 0), k3, "sglang", tmp_path / "k3.json")
    assert len(warn) == 1 and "--init-expert-location is ignored" in warn[0]
    assert "kimi_k3.py lacks get_model_config_for_expert_location" in warn[0] and "--format checkpoint" in warn[0]


def test_logical_count_round_trip_json_and_pt(dsv3, tmp_path):
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 1000, (3, dsv3.num_moe_layers, 256))
    loads = Loads(counts, dsv3, 4096)
    pl = vllm_default(dsv3, 8, 8)
    with pytest.raises(InputError, match="needs expert loads"):
        export_placement(pl, dsv3, "sglang-logical-count", tmp_path / "c.json")
    for suffix in (".json", ".pt"):
        out = tmp_path / f"c{suffix}"
        export_placement(pl, dsv3, "sglang-logical-count", out, loads=loads)
        back = import_loads(out, "sglang-logical-count", dsv3)
        assert np.array_equal(back.counts, counts)
    d = json.loads((tmp_path / "c.json").read_text())
    arr = np.array(d["logical_count"])
    assert arr.shape == (3, 61, 256) and not arr[:, :3].any()  # dense layers hold no tokens
    arr[0, 1, 5] = 9
    (tmp_path / "d.json").write_text(json.dumps({"logical_count": arr.tolist()}))
    with pytest.raises(InputError, match="tokens in dense layers"):
        import_loads(tmp_path / "d.json", "sglang-logical-count", dsv3)
    with pytest.raises(InputError, match="holds expert loads"):
        import_placement(tmp_path / "c.json", "sglang-logical-count", dsv3)


# ------------------------------------------------------------------ vLLM
def test_vllm_expert_map_shared_list_and_errors(dsv3, tmp_path):
    E = 256
    row = list(range(E)) + [0, 1, 2, 3, 4, 5, 6, 7]
    f = tmp_path / "map.json"
    f.write_text(json.dumps(row))  # one list shared by all MoE layers (#49572 accepts it)
    pl = import_placement(f, "vllm-expert-map", dsv3, num_gpus=8)
    assert pl.phy2log.shape == (58, 264) and (pl.phy2log == np.array(row)).all()
    f.write_text(json.dumps([row] * 57))
    with pytest.raises(InputError, match="must hold 58 rows, got 57"):
        import_placement(f, "vllm-expert-map", dsv3, num_gpus=8)
    missing = [list(range(1, E)) + [1] * 9] * 58
    f.write_text(json.dumps(missing))
    with pytest.raises(InputError, match="MoE layer 0 .decoder layer 3.*logical expert 0 has no physical slot"):
        import_placement(f, "vllm-expert-map", dsv3, num_gpus=8)


def test_vllm_jsonl_last_mapping_wins_and_checks_fields(dsv3, tmp_path):
    a, b = vllm_default(dsv3, 8, 8), make(dsv3, random_phy2log(np.random.default_rng(2), 58, 256, 8, 8), 8)
    from moeplace.placement.export.vllm import mapping_record

    f = tmp_path / "m.jsonl"
    f.write_text(json.dumps(mapping_record(a)) + "\n\n" + json.dumps(mapping_record(b)) + "\n")
    assert np.array_equal(import_placement(f, "vllm-jsonl", dsv3, num_gpus=8).phy2log, b.phy2log)
    for field, value, msg in [("version", 2, "'version' is 2"), ("num_slots", 265, "num_slots"),
                              ("num_redundant_experts", 9, "num_redundant_experts")]:
        rec = mapping_record(b) | {field: value}
        f.write_text(json.dumps(rec) + "\n")
        with pytest.raises(InputError, match=msg):
            import_placement(f, "vllm-jsonl", dsv3, num_gpus=8)
    rec = mapping_record(b)
    del rec["initial_global_assignments"]["17"]
    f.write_text(json.dumps(rec) + "\n")
    with pytest.raises(InputError, match=r"lacks MoE layers \['17'\]"):
        import_placement(f, "vllm-jsonl", dsv3, num_gpus=8)
    f.write_text("{not json\n")
    with pytest.raises(InputError, match="line 1: not valid JSON"):
        import_placement(f, "vllm-jsonl", dsv3, num_gpus=8)


def test_split_over_replicas_hand_computed():
    # layer 0: expert 0 has 3 replicas (slots 0, 2, 3), expert 1 one (slot 1); 10 tokens -> 4, 3, 3
    p2l = np.array([[0, 1, 0, 0]])
    assert split_over_replicas(np.array([[10, 5]]), p2l).tolist() == [[4, 5, 3, 3]]


def test_vllm_jsonl_load_records_reproduce_loads(dsv3, tmp_path):
    rng = np.random.default_rng(4)
    pl = make(dsv3, random_phy2log(rng, 58, 256, 8, 16), 8)
    counts = rng.integers(0, 500, (2, 58, 256))
    loads = Loads(counts, dsv3, 1024)
    recs = load_records(pl, loads, dsv3.name)
    assert [r["step"] for r in recs] == [0, 1] and recs[0]["num_ranks"] == 8
    assert np.array(recs[0]["tokens"]).sum() == counts[0].sum()
    out = tmp_path / "m.jsonl"
    export_placement(pl, dsv3, "vllm-jsonl", out, loads=loads)
    lines = out.read_text().splitlines()
    assert json.loads(lines[-1])["record_type"] == "eplb_initial_mapping"  # vLLM reads the last one
    assert np.array_equal(read_load_stats(out, dsv3).counts, counts)
    assert import_placement(out, "vllm-jsonl", dsv3).num_gpus == 8  # EP size from the load records


def test_vllm_refuses_more_redundancy_than_vllm_supports(tmp_path):
    qwen = load_model("qwen3-30b-a3b")  # 128 experts
    pl = vllm_default(qwen, 8, 1024)
    with pytest.raises(InputError, match="exceed vLLM's limit of 1023"):
        export_placement(pl, qwen, "vllm-jsonl", tmp_path / "m.jsonl")
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------ vllm-ascend
def test_ascend_layout_and_duplicate_refusal(dsv3, tmp_path):
    pl = vllm_default(dsv3, 8, 8)
    out = tmp_path / "ascend.json"
    export_placement(pl, dsv3, "vllm-ascend", out)
    d = json.loads(out.read_text())
    assert d["moe_layer_count"] == 58 and len(d["layer_list"]) == 58
    lay = d["layer_list"][4]
    assert lay["layer_id"] == 4 and lay["device_count"] == 8
    assert lay["device_list"][7]["device_expert"] == list(range(231, 256)) + list(range(8))  # 33 slots/device
    dup = pl.phy2log.copy()
    dup[2, 1] = 0  # device 0 now holds expert 0 twice (and expert 1 keeps its replica in slot 257)
    with pytest.raises(InputError, match=r"MoE layer 2 \(decoder layer 5\): device 0 holds expert 0 twice"):
        export_placement(make(dsv3, dup, 8), dsv3, "vllm-ascend", tmp_path / "dup.json")
    assert not (tmp_path / "dup.json").exists()


def test_ascend_import_checks_positions_and_shapes(dsv3, tmp_path):
    pl = vllm_default(dsv3, 8, 8)
    out = tmp_path / "a.json"
    export_placement(pl, dsv3, "vllm-ascend", out)
    d = json.loads(out.read_text())
    d["layer_list"][3]["layer_id"] = 9
    (tmp_path / "b.json").write_text(json.dumps(d))
    with pytest.raises(InputError, match=r"layer_list\[3\]: field 'layer_id' is 9"):
        import_placement(tmp_path / "b.json", "vllm-ascend", dsv3)
    d = json.loads(out.read_text())
    d["layer_list"][0]["device_list"][2]["device_expert"].pop()
    (tmp_path / "c.json").write_text(json.dumps(d))
    with pytest.raises(InputError, match=r"device_list\[2\]: field 'device_expert' has 32 experts, expected 33"):
        import_placement(tmp_path / "c.json", "vllm-ascend", dsv3)
    with pytest.raises(InputError, match="--gpus is 16"):
        import_placement(out, "vllm-ascend", dsv3, num_gpus=16)


# ------------------------------------------------------------------ launch flags
def _command_args(text):
    body = "\n".join(l for l in text.splitlines() if not l.startswith("#")).replace("\\\n", " ")
    return shlex.split(body)


def _flag(args, name):
    assert args.count(name) == 1, name
    return args[args.index(name) + 1]


def test_sglang_flags_match_the_placement(dsv3, tmp_path):
    pl = vllm_default(dsv3, 16, 16)
    out = tmp_path / "loc.json"
    text = launch_command(pl, dsv3, "sglang", out, FlagOptions(tp=16, dp=1))
    args = _command_args(text)
    assert args[:3] == ["python", "-m", "sglang.launch_server"]
    assert _flag(args, "--ep-num-redundant-experts") == "16"
    assert _flag(args, "--tp-size") == "16" and _flag(args, "--ep-size") == "16"
    assert _flag(args, "--nnodes") == "2"
    assert _flag(args, "--init-expert-location") == str(out.resolve())
    assert _flag(args, "--moe-a2a-backend") == "deepep"
    assert _flag(args, "--kv-cache-dtype") == "fp8_e4m3"
    assert _flag(args, "--context-length") == str(dsv3.max_context)
    assert "--enable-eplb" not in args
    online = _command_args(launch_command(pl, dsv3, "sglang", out, FlagOptions(online_eplb=True, eplb_interval=500, tp=16)))
    assert _flag(online, "--eplb-rebalance-num-iterations") == "500"


def test_vllm_flags_pick_backend_by_topology(k3, tmp_path):
    one_node = Placement.from_phy2log(vllm_default(k3, 8, 0).phy2log, k3, 8, 8, {})
    args = _command_args(launch_command(one_node, k3, "vllm-expert-map", tmp_path / "m.json",
                                        FlagOptions(kv_cache_dtype="bf16", max_model_len=32768, dp=8,
                                                    placement_path=str(tmp_path / "p.json"))))
    # released vLLM loads no file; a replica-free placement goes through the moeplace plugin
    # (8 DP ranks: the variable is passed on to Ray DP actors too)
    assert args[:4] == [f"MOEPLACE_PLACEMENT={(tmp_path / 'p.json').resolve()}",
                        "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY=MOEPLACE_PLACEMENT", "vllm", "serve"]
    assert _flag(args, "--all2all-backend") == "flashinfer_nvlink_one_sided"
    assert "--data-parallel-address" not in args and "--enable-eplb" not in args
    assert _flag(args, "--kv-cache-dtype") == "auto" and _flag(args, "--max-model-len") == "32768"
    # with replicas on a model vLLM's EPLB serves: its own online EPLB with the recommended settings, no PR key
    dsv3 = load_model("deepseek-v3")
    args = _command_args(launch_command(vllm_default(dsv3, 8, 8), dsv3, "vllm-expert-map", tmp_path / "m.json",
                                        FlagOptions(dp=8)))
    cfg = json.loads(_flag(args, "--eplb-config"))
    assert cfg == {"window_size": 1000, "step_interval": 3000, "num_redundant_experts": 8, "use_async": True}
    mapped = _command_args(launch_command(one_node, k3, "vllm-expert-map", tmp_path / "m.json",
                                          FlagOptions(dp=8, vllm_pr=49572)))
    assert json.loads(_flag(mapped, "--eplb-config"))["initial_expert_map_path"].endswith("m.json")
    four = vllm_default(k3, 32, 32)
    text = launch_command(four, k3, "vllm-jsonl", tmp_path / "m.jsonl", FlagOptions(tp=1, dp=32, vllm_pr=41141))
    args = _command_args(text)
    assert _flag(args, "--all2all-backend") == "deepep_v2" and _flag(args, "--data-parallel-size") == "32"
    cfg = json.loads(_flag(args, "--eplb-config"))
    assert cfg == {"num_redundant_experts": 32, "window_size": 1000, "step_interval": 3000,
                   "initial_mapping_path": str((tmp_path / "m.jsonl").resolve()), "disable_online_rebalancing": True}
    assert "Hopper" in text and "#50647" in text and "PR #41141" in text  # K3 caveats on H200; the PR named


def test_ascend_flags_pass_redundancy(dsv3, tmp_path):
    args = _command_args(launch_command(vllm_default(dsv3, 8, 8), dsv3, "vllm-ascend", tmp_path / "a.json",
                                        FlagOptions(dp=8)))
    extra = json.loads(_flag(args, "--additional-config"))
    assert extra == {"eplb_config": {"expert_map_path": str((tmp_path / "a.json").resolve()),
                                     "num_redundant_experts": 8}}


# ------------------------------------------------------------------ CLI
def test_cli_export_import_and_errors(dsv3, tmp_path, capsys):
    pl = vllm_default(dsv3, 8, 8)
    pj = tmp_path / "pl.json"
    pl.save(pj)
    assert main(["export", str(pj), "--format", "sglang", "--out", str(tmp_path / "s.json"), "--flags",
                 "--tp", "8"]) == 0
    out = capsys.readouterr().out
    assert "--init-expert-location" in out and "wrote" in out
    assert main(["import-placement", str(tmp_path / "s.json"), "--format", "sglang", "--model", "deepseek-v3",
                 "--gpus", "8", "--out", str(tmp_path / "back.json")]) == 0
    assert np.array_equal(load_placement(tmp_path / "back.json").phy2log, pl.phy2log)
    capsys.readouterr()
    assert main(["import-placement", str(tmp_path / "s.json"), "--format", "sglang", "--model", "deepseek-v3",
                 "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("place: error: ") and "pass --gpus" in err and "Traceback" not in err
    assert not (tmp_path / "x.json").exists()
    assert main(["export", str(pj), "--format", "sglang-logical-count", "--out", str(tmp_path / "c.json")]) == 2
    assert "needs expert loads" in capsys.readouterr().err
    loads = Loads(np.ones((1, 58, 256), dtype=np.int64), dsv3)
    loads.save(tmp_path / "l.npz")
    assert main(["export", str(pj), "--format", "sglang-logical-count", "--out", str(tmp_path / "c.json"),
                 "--loads", str(tmp_path / "l.npz")]) == 0
    assert main(["import-placement", str(tmp_path / "c.json"), "--format", "sglang-logical-count",
                 "--model", "deepseek-v3", "--out", str(tmp_path / "l2.npz")]) == 0
    assert np.array_equal(load_loads(tmp_path / "l2.npz").counts, loads.counts)


def test_every_registered_format_is_covered():
    assert set(format_names()) == set(PLACEMENT_FORMATS) | {"sglang-logical-count"}


def test_cli_reads_vllm_load_stats_into_loads(dsv3, tmp_path):
    pl = vllm_default(dsv3, 8, 8)
    counts = np.random.default_rng(9).integers(0, 50, (2, 58, 256))
    export_placement(pl, dsv3, "vllm-jsonl", tmp_path / "m.jsonl", loads=Loads(counts, dsv3))
    assert main(["import-placement", str(tmp_path / "m.jsonl"), "--format", "vllm-jsonl", "--model", "deepseek-v3",
                 "--out", str(tmp_path / "l.npz")]) == 0
    assert np.array_equal(load_loads(tmp_path / "l.npz").counts, counts)
