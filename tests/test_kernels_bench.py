"""kernels/bench.py: the calibration profile it writes is what the simulator reads, and the validation
predicts with the simulator's own cost model."""
from __future__ import annotations

import numpy as np

from moeplace.kernels.bench import BenchConfig, build_profile, predict, run_bench, validate
from moeplace.sim.calibration import load_profile


def _fake_results(cfg: BenchConfig, a=2e-4, b=1e-9, gemm_per_token=1e-5, gemm_fixed=5e-5):
    """Timings that follow an exact latency + bytes/bandwidth law and a linear GEMM curve, so a correct
    calibration must predict every held-out point (imbalanced ones too) with ~0 error."""
    W, row_bytes = cfg.world_size, cfg.hidden * 4
    gemm = [[n, gemm_fixed + gemm_per_token * n] for n in cfg.gemm_tokens]
    results = [{"rank": r, "gemm": gemm, "permute": [[64, 1e-5], [256, 2e-5]], "records": [], "device": "test",
                "threads": 1, "cores": 64} for r in range(W)]
    rng = np.random.default_rng(0)
    for split, n, skew in cfg.grid():
        share = np.exp(-skew * np.arange(W))
        rows = np.maximum(1, (n * cfg.top_k * W * share / share.sum()).astype(int))
        touched = np.minimum(rows, cfg.num_experts // W)
        remote = (rows * (W - 1) / W).astype(int)
        expert = touched * (gemm_fixed + gemm_per_token * rows / touched)
        comm = a + b * remote.max() * row_bytes
        for r in range(W):
            total = comm + expert.max() + comm
            reps = [[comm, expert[r], comm + expert.max() - expert[r], total * (1 + 0.001 * rng.standard_normal()),
                     int(remote[r])] for _ in range(3)]
            results[r]["records"].append({"split": split, "tokens": n, "skew": skew, "reps": reps,
                                          "rows": int(rows[r]), "touched": int(touched[r]),
                                          "remote_rows": int(remote[r])})
    return results


def test_calibration_recovers_an_exact_law_on_held_out_points(tmp_path):
    cfg = BenchConfig(world_size=4)
    results = _fake_results(cfg)
    profile = build_profile(results, cfg)
    profile.save(tmp_path / "p.json")
    loaded = load_profile(tmp_path / "p.json")  # the simulator's own reader accepts it
    assert set(loaded.ops) == {"expert_gemm", "permute", "dispatch", "combine"}
    val = validate(loaded, results, cfg)
    assert val["test_median_rel_error"] < 0.02 and val["test_p90_rel_error"] < 0.05
    assert any(r["max_over_mean"] > 2 for r in val["table"] if r["split"] == "test")


def test_validation_detects_a_wrong_profile():
    cfg = BenchConfig(world_size=4)
    results = _fake_results(cfg)
    profile = build_profile(results, cfg)
    slow = _fake_results(cfg, gemm_per_token=3e-5)  # measured GEMMs 3x slower than calibrated
    assert validate(profile, slow, cfg)["test_median_rel_error"] > 0.3


def test_processor_sharing_only_binds_when_ranks_outnumber_cores():
    cfg = BenchConfig(world_size=4)
    results = _fake_results(cfg)
    profile = build_profile(results, cfg)
    from moeplace.kernels.bench import _config_table
    rows = _config_table(results, cfg)
    alone = predict(profile, cfg, rows)
    shared = predict(profile, cfg, rows, shared_cores=1)
    assert np.all(shared >= alone) and np.any(shared > alone * 1.5)


def test_real_bench_writes_a_loadable_profile(tmp_path):
    cfg = BenchConfig(world_size=2, hidden=32, intermediate=16, num_experts=8, top_k=2, train_tokens=(8, 32),
                      test_tokens=(16,), test_skews=(0.0, 1.5), gemm_tokens=(1, 4, 16, 64), reps=2, warmup=1)
    profile, val, raw = run_bench(cfg, backend="gloo")
    assert len(raw) == 2 and all(len(r["records"]) == len(cfg.grid()) for r in raw)
    profile.save(tmp_path / "profile.json")
    assert load_profile(tmp_path / "profile.json").world_size == 2
    assert {r["split"] for r in val["table"]} == {"train", "test"}
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 for r in val["table"])


def test_cli_writes_a_tagged_profile_and_report(tmp_path, capsys):
    import json

    from moeplace.cli.main import main
    prof, rep = tmp_path / "profile.json", tmp_path / "report.json"
    assert main(["kernels", "bench", "--world-size", "2", "--hidden", "32", "--intermediate", "16", "--experts", "8",
                 "--top-k", "2", "--train-tokens", "8,32", "--test-tokens", "16", "--test-skews", "0,1.5",
                 "--reps", "2", "--out", str(prof), "--report", str(rep)]) == 0
    assert "held-out: median error" in capsys.readouterr().out
    report = json.loads(rep.read_text())
    assert report["format"] == "moeplace.kernel-report/1" and report["validation"]["table"] and report["raw"]
    assert json.loads(prof.read_text())["format"] == "moeplace.calibration/1" and load_profile(prof).world_size == 2


def test_cli_rejects_bad_world_size(capsys):
    from moeplace.cli.main import main
    assert main(["kernels", "bench", "--world-size", "3", "--experts", "32"]) == 2
    assert "multiple of --world-size 3" in capsys.readouterr().err


def test_gpu_bench_cpu_path_writes_valid_profiles(tmp_path):
    """The GPU calibration script's code path, run on CPU with a small shape (bf16 only: no FP8 GEMM on
    CPU). On a GPU the same function also writes the FP8 profile."""
    import json

    from moeplace.kernels.gpu_bench import main as gpu_bench_main
    assert gpu_bench_main(["--out-dir", str(tmp_path), "--device", "cpu", "--hidden", "64", "--intermediate", "32",
                           "--max-tokens", "64", "--reps", "2"]) == 0
    summary = json.loads((tmp_path / "gpu_bench_summary.json").read_text())
    assert summary["profiles"]["fp8"] == "no kernel on this device / torch"
    prof = load_profile(tmp_path / summary["profiles"]["bf16"]["file"])
    assert prof.dtype == "bf16" and prof.ops["expert_gemm"].meta["hidden"] == 64
    assert prof.has("permute")
