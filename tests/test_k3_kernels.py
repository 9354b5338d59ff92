"""Kimi K3's decode step through its engines' own kernels (sim/k3_kernels.py): the counts read from the
engines' code, the critical path over two CUDA streams, and the hardware terms that now bind at batch 1."""
import numpy as np
import pytest

from moeplace.foundation.cluster import make_cluster
from moeplace.sim.config import CostConfig, EngineConfig
from moeplace.sim.cost import CostModel, MoeWork, RankWork
from moeplace.sim.k3_kernels import BUILDS, K3Kernels, build_of, is_k3, weights


def _decode(model, cluster, tp, batch=1):
    D, G, L = cluster.num_gpus // tp, cluster.num_gpus, model.num_moe_layers
    w = RankWork.zeros(D)
    w.dec_seqs[:] = batch
    w.tokens[:] = w.sampled[:] = batch
    w.dec_ctx[:] = batch * 1024
    sel = batch * D * model.top_k / G
    moe = MoeWork(np.full((L, G), sel), np.full((L, G), min(sel, model.num_experts / G)), np.full((L, G), sel),
                  np.zeros((L, G)))
    return w, moe


def test_counts_per_build_as_read_from_the_engines(k3):
    """Critical-path kernels per part of a layer (module docstring's table): a fork counts its longer
    branch; a TP all-reduce only with attention TP > 1."""
    want = {("vllm-dep", 1): (4, 9, 9, 3, 0), ("vllm-tp", 8): (4, 9, 9, 4, 1), ("sglang", 16): (4, 9, 6, 4, 1),
            ("sglang", 1): (4, 9, 6, 3, 0)}
    for (build, tp), (kda, mla, moe, mlp, ar) in want.items():
        k = K3Kernels(k3, build, tp)
        got = tuple(k._count(k.lists[p]) for p in ("kda", "mla", "moe", "mlp", "attn_ar"))
        assert got == (kda, mla, moe, mlp, ar), (build, tp)
        assert k._count(k.lists["res"]) == 2
    assert build_of("sglang", 8) == "sglang" and build_of("vllm", 1) == "vllm-dep" and build_of("trtllm", 8) == "vllm-tp"
    assert is_k3(k3)


def test_every_kernel_cited_and_every_gemm_weight_known(k3):
    w = weights(k3)
    for build, parts in BUILDS.items():
        for steps in parts.values():
            for s in steps:
                for k in ([*s[0], *s[1]] if isinstance(s, tuple) else [s]):
                    assert k.source and (k.op != "gemm" or k.weight in w), (build, k.name)
    # the KDA q/k/v/g projection: 4 x hidden x (heads x head_dim); vLLM's TP8 comment: 6,288 rows of 7,168
    # per rank = (4 x 12,288 + 128 f_a x 8 + 96 beta + pad) / 8 -- its q/k/v/g share is 6,144
    assert w["kda_qkvg"][0] / 8 / 7168 == 6144


def test_a_fork_counts_its_longer_branch(k3):
    """With every kernel at a 1 ms floor (far above any kernel's own time at batch 1), each layer takes its
    critical-path count x 1 ms: the aux branches (KDA's f_a/beta then f_b: 2) count once, not added."""
    cl = make_cluster(16, "h200")
    cfg = CostConfig().replace(kernel_floor_s=1e-3)
    cost = CostModel.for_engine(k3, cl, cfg, EngineConfig(attention_tp=1, replica_rule="vllm"))
    w, moe = _decode(k3, cl, 1)
    exp, comm, _ = cost.moe_layer_times(moe, "low_latency")
    floor = cost._k3.layer_floor(cost, w, exp, comm)
    assert floor == pytest.approx(cost.layer_kernels() * 1e-3)
    assert cost.layer_kernels()[1] == 2 + 4 + 9  # a KDA MoE layer


def test_batch_one_binds_the_hardware(k3):
    """DEP (attention DP): every GPU reads all of a KDA layer's projection weights each step, so the
    kernel-priced layer is at least those bytes over the HBM bandwidth the cost model grants -- a hardware
    term the uniform floor did not have."""
    cl = make_cluster(16, "gb300-nvl72")
    cost = CostModel.for_engine(k3, cl, CostConfig(), EngineConfig(attention_tp=1, replica_rule="vllm"))
    w, moe = _decode(k3, cl, 1)
    exp, comm, _ = cost.moe_layer_times(moe, "low_latency")
    floor = cost._k3.layer_floor(cost, w, exp, comm)
    wt = weights(k3)
    crit = (wt["kda_qkvg"][0] + wt["kda_o"][0]) * 2  # BF16 bytes on the critical path
    kda_moe = [i for i, kind in enumerate(k3.attention) if kind == "kda" and i in set(k3.moe_layers)]
    assert np.all(floor[kda_moe] >= crit / cost.hbm_bw)
    assert floor[kda_moe[0]] > cost.layer_kernels()[kda_moe[0]] * cost.cfg.kernel_floor_s  # not the floor alone


def test_fewer_fused_kernels_shorten_the_tp_batch_one_step(k3):
    """Under attention TP (weights split 8 ways) batch 1 is latency-bound: K3's ~1,600 kernels make a
    shorter step than the generic list's 2,825 at the same floor and gap."""
    from moeplace.sim.cost import KERNEL_BUILDS

    cl = make_cluster(16, "b200")
    e = EngineConfig(attention_tp=8, replica_rule="vllm")
    w, moe = _decode(k3, cl, 8)
    new = CostModel.for_engine(k3, cl, CostConfig(), e)
    old = CostModel.for_engine(k3, cl, CostConfig(), e)
    b = KERNEL_BUILDS["unfused"]
    old._k3 = None
    old._layer_kernels = np.array([b[k] + b["moe" if m else "mlp"] + b["norm"]
                                   for k, m in zip(k3.attention, old._is_moe)], dtype=np.float64)
    t_new, t_old = new.step_time(w, moe).total, old.step_time(w, moe).total
    assert old.layer_kernels().sum() == 2825 and new.layer_kernels().sum() < 1700
    assert t_new < t_old
    # each of K3's layers still takes at least its kernels x (floor + gap)
    gap = new.kernel_gap_s()
    assert t_new >= float(new.layer_kernels().sum()) * (new.cfg.kernel_floor_s + gap)
