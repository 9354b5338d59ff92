"""Small inputs for the simulator tests (tests/test_sim_*.py): traces written with TraceWriter, simple
placements, a simulation builder. Not a test file."""
from __future__ import annotations

import numpy as np

from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.model import ModelSpec
from moeplace.placement.record import Placement
from moeplace.sim.config import EngineConfig, SimConfig
from moeplace.sim.engine import Simulation
from moeplace.sim.memory import override_pools, plan_pools
from moeplace.sim.workload import load_trace_tokens
from moeplace.traces.format import TraceWriter


def write_trace(path, model: ModelSpec, num_requests: int = 8, prompt: int = 24, output: int = 8,
                skew: float = 1.0, seed: int = 0, hot_shift: int = 0, tags: dict[str, str] | None = None) -> str:
    """A trace of ``num_requests`` requests of ``prompt`` prefill + ``output`` decode tokens. Expert ids
    per layer from a Zipf-like popularity (``skew`` 0 = uniform); ``hot_shift`` rotates the popular
    experts for the second half of the requests (drift)."""
    rng = np.random.default_rng(seed)
    L, E, k = model.num_moe_layers, model.num_experts, model.top_k
    base = 1.0 / np.arange(1, E + 1) ** skew
    perms = np.stack([rng.permutation(E) for _ in range(L)])
    T = prompt + output
    prov = {"kind": "synthetic", "generator": "tests/simkit", **({"tags": tags} if tags else {})}
    with TraceWriter(path, model, prov) as w:
        step = 0
        for r in range(num_requests):
            shift = hot_shift if r >= num_requests // 2 else 0
            ids = np.empty((T, L, k), dtype=np.uint16)
            for l in range(L):
                p = np.empty(E)
                p[(perms[l] + shift) % E] = base
                p /= p.sum()
                g = rng.gumbel(size=(T, E)) + np.log(p)[None, :]
                ids[:, l, :] = np.argsort(-g, axis=1)[:, :k]
            pos = np.repeat(np.arange(T), L)
            w.write(request_id=np.full(T * L, 1000 + r), position=pos, phase=(pos >= prompt).astype(np.uint8),
                    step=np.full(T * L, step) + pos, layer=np.tile(np.array(model.moe_layers), T),
                    expert_ids=ids.reshape(T * L, k))
            step += T
    return str(path)


def linear_placement(model: ModelSpec, num_gpus: int, gpus_per_node: int) -> Placement:
    L, E = model.num_moe_layers, model.num_experts
    return Placement.from_phy2log(np.tile(np.arange(E), (L, 1)), model, num_gpus, gpus_per_node, {"policy": "test"})


def build(trace_path, placement: Placement, config: SimConfig, gpus: int = 8, gpu: str = "h200",
          gpus_per_node: int | None = None, kv_tokens=None, state_slots=None, profile=None, trace=None,
          chrome: bool = False) -> Simulation:
    trace = trace or load_trace_tokens(trace_path)
    cluster = make_cluster(gpus, gpu, gpus_per_node)
    pools, _ = plan_pools(trace.model, cluster, config.engine, placement.num_redundant)
    pools = override_pools(pools, kv_tokens, state_slots)
    return Simulation(config, trace, placement, cluster, pools, profile=profile, label="t", chrome=chrome)


def engine(**kw) -> EngineConfig:
    return EngineConfig(**kw)


def mini_model(num_experts: int = 16, top_k: int = 4, hidden: int = 512, expert_dtype: str = "bf16",
               max_context: int = 1 << 20) -> ModelSpec:
    """A 4-layer K3-shaped model (KDA + MLA attention, LatentMoE experts) small enough for exact tests:
    layer 0 dense (KDA), layers 1-3 MoE (KDA, KDA, MLA)."""
    return ModelSpec.from_dict({
        "name": "mini-k3", "num_layers": 4, "moe_layers": [1, 2, 3], "num_experts": num_experts, "top_k": top_k,
        "hidden_size": hidden, "moe_intermediate_size": hidden, "expert_hidden_size": hidden,
        "num_shared_experts": 1, "shared_intermediate_size": hidden, "dense_intermediate_size": 2 * hidden,
        "vocab_size": 1024, "max_context": max_context,
        "attention": ["kda", "kda", "kda", "mla"],
        "mla": {"num_heads": 8, "q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
                "qk_rope_head_dim": 16, "v_head_dim": 32, "output_gate": True},
        "kda": {"num_heads": 8, "head_dim": 32, "conv_kernel": 4},
        "expert_dtype": expert_dtype, "weight_dtype": "bf16", "scoring": "sigmoid",
    }, source="tests")


def write_fixed_trace(path, model: ModelSpec, experts_per_token, num_requests: int, prompt: int, output: int) -> str:
    """Every token of every request routes to the same experts ``experts_per_token`` (k ids) at every
    MoE layer: per-GPU loads are then known exactly for any placement."""
    L = model.num_moe_layers
    T = prompt + output
    ids = np.tile(np.asarray(experts_per_token, dtype=np.uint16), (T * L, 1))
    with TraceWriter(path, model, {"kind": "synthetic", "generator": "tests/simkit fixed"}) as w:
        for r in range(num_requests):
            pos = np.repeat(np.arange(T), L)
            w.write(request_id=np.full(T * L, r), position=pos, phase=(pos >= prompt).astype(np.uint8),
                    step=r * T + pos, layer=np.tile(np.array(model.moe_layers), T), expert_ids=ids)
    return str(path)


def random_placement(model: ModelSpec, num_gpus: int, num_redundant: int, gpus_per_node: int = 8,
                     seed: int = 0) -> Placement:
    """Every expert once plus ``num_redundant`` random replicas per layer, shuffled over the slots."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(model.num_moe_layers):
        row = np.concatenate([np.arange(model.num_experts), rng.integers(0, model.num_experts, num_redundant)])
        rng.shuffle(row)
        rows.append(row)
    return Placement.from_phy2log(np.array(rows), model, num_gpus, gpus_per_node, {"cluster": {"gpu": "h200"}})
