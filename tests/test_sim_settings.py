"""One mapping from user settings to SimConfig: `place simulate`'s flags and a `place sweep` point with
the same settings give equal SimConfigs (engine, workload, lengths, rebalance, run)."""
from __future__ import annotations

from pathlib import Path

import pytest

from moeplace.cli.commands.simulate import simulation_config
from moeplace.cli.main import build_parser
from moeplace.cli.sweep.run import sim_config
from moeplace.cli.sweep.spec import expand_points, load_spec
from moeplace.foundation.errors import InputError
from moeplace.sim.config import LengthMix


def _spec(tmp_path: Path, workload: str, engine: str, axes: str, simulate: str):
    p = tmp_path / "spec.yaml"
    p.write_text("name: t\nmodel: qwen3-30b-a3b\nseed: 7\n"
                 f"workloads:\n  - {{name: w, synth: {{num_tokens: 2000}}, {workload}}}\n"
                 f"axes: {{gpus: [8], {axes}}}\nengine: {{{engine}}}\nsimulate: {{{simulate}}}\n")
    spec = load_spec(p)
    return spec, expand_points(spec)[0]


def _flags(*argv: str):
    return build_parser().parse_args(["simulate", "trace", "--placement", "eplb", *argv])


def test_open_loop_point_and_flags_give_the_same_config(tmp_path):
    spec, point = _spec(
        tmp_path,
        workload="arrival: gamma, rate: 3.5, burstiness: 1.5, context_mix: '8k:0.7,32k:0.3', output_len: 256, "
                 "max_requests: 100",
        engine="max_batched_tokens: 4096, max_seqs: 128, gpu_memory_utilization: 0.85, pool_split: 'ratio:0.5', "
               "chunked_prefill: false, dual_batch_overlap: true, preemption: swap, mtp_draft: 1, "
               "mtp_acceptance: 0.8, prefix_hit: 0.3, moe_tp: 2, dp_balance: tokens, deepep_mode: low_latency, "
               "attention_dtype: fp8, cuda_graph_max_bs: 128, kernels_per_layer: 13, warmup: 5",
        axes="kv_dtype: bf16, engine: sglang, rebalance: 'every=25,window=25,moves=32,policy=eplb,decision=0.5'",
        simulate="duration: 30, mode: replay")
    args = _flags("--attention-tp", "4", "--engine", "sglang", "--kv-dtype", "bf16", "--max-batched-tokens", "4096",
                  "--max-seqs", "128", "--gpu-memory-utilization", "0.85", "--pool-split", "ratio:0.5",
                  "--no-chunked-prefill", "--dbo", "--preemption", "swap", "--mtp", "1:0.8", "--prefix-hit", "0.3",
                  "--moe-tp", "2", "--dp-balance", "tokens", "--deepep-mode", "low_latency",
                  "--attention-dtype", "fp8", "--cuda-graph-max-bs", "128", "--kernels-per-layer", "13", "--warmup", "5",
                  "--rate", "3.5", "--arrival", "gamma", "--burstiness", "1.5", "--context-mix", "8k:0.7,32k:0.3",
                  "--output-len", "256", "--max-requests", "100", "--duration", "30", "--mode", "replay",
                  "--seed", "7", "--rebalance", "every=25,window=25,moves=32,policy=eplb,decision=0.5")
    from_sweep = sim_config(spec, point, 4)
    from_flags = simulation_config(args, spec.model.max_context)
    assert from_sweep == from_flags
    # the settings arrived (not two sets of defaults)
    e, w = from_flags.engine, from_flags.workload
    assert (e.attention_tp, e.replica_rule, e.pool_split, e.pool_param, e.mtp_draft, e.a2a_mode) == \
        (4, "sglang", "ratio", 0.5, 1, "low_latency")
    assert e.kernels_per_layer == 13
    assert (w.arrival, w.rate, w.burstiness, w.max_requests) == ("gamma", 3.5, 1.5, 100)
    assert w.lengths == LengthMix.context_mix(((8192, 0.7), (32768, 0.3)), 256, spec.model.max_context)
    assert from_flags.rebalance.decision_s == 0.5 and from_flags.mode == "replay" and from_flags.seed == 7


def test_closed_loop_static_point_and_flags_give_the_same_config(tmp_path):
    spec, point = _spec(tmp_path, workload="concurrency: 32", engine="max_seqs: 64", axes="kv_dtype: fp8",
                        simulate="duration: 12")
    args = _flags("--attention-tp", "8", "--concurrency", "32", "--max-seqs", "64", "--duration", "12",
                  "--seed", "7")
    from_sweep = sim_config(spec, point, 8)
    assert from_sweep == simulation_config(args, spec.model.max_context)
    assert from_sweep.workload.concurrency == 32 and from_sweep.rebalance is None
    assert from_sweep.workload.lengths is None  # the trace's own lengths


def test_sweep_alone_fixes_an_unfixed_decision_time_and_names_the_point(tmp_path):
    """The sweep's one difference: a rebalance without decision=S charges no decision time (a sweep must
    repeat), where `place simulate` charges the policy's measured time."""
    spec, point = _spec(tmp_path, workload="concurrency: 8", engine="max_seqs: 64",
                        axes="rebalance: 'every=8,window=8,moves=0'", simulate="duration: 1")
    assert sim_config(spec, point, 8).rebalance.decision_s == 0.0
    args = _flags("--rebalance", "every=8,window=8,moves=0", "--seed", "7")
    assert simulation_config(args, spec.model.max_context).rebalance.decision_s is None
    bad, bad_point = _spec(tmp_path, workload="concurrency: 8", engine="max_seqs: 64",
                           axes="rebalance: 'every=8,window=8,colour=red'", simulate="duration: 1")
    with pytest.raises(InputError, match=r"spec\.yaml: point #0 .*unknown keys \['colour'\]"):
        sim_config(bad, bad_point, 8)
