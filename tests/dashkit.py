"""A small run directory for the dashboard tests (tests/test_dashboard*.py), made with the same library
calls and CLI commands ``place demo`` chains: a synthetic trace of a mini K3-shaped model, placements
and the ``place optimize --json`` comparison, a ``place plan --json`` file, a ``place simulate --out``
directory and a ``place sweep --out`` directory (``runs/sweep-small``, tests/data/sweep-small.yaml: 7 points,
3 simulated, about 7 s). Not a test file."""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from moeplace.cli.main import main as place
from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.formats import tagged
from moeplace.foundation.memory import MemoryConfig, plan_memory
from moeplace.foundation.model import ModelSpec
from moeplace.placement.compare import compare_policies
from moeplace.placement.windows import routing_windows
from moeplace.traces.synth import SynthConfig, synthesize

NUM_GPUS = 16  # two nodes of 8 H200
NUM_REDUNDANT = 16
WINDOW_TOKENS = 1024
SWEEP_SPEC = Path(__file__).resolve().parent / "data" / "sweep-small.yaml"
SWEEP_DIR = "runs/sweep-small"


def mini_k3() -> ModelSpec:
    """8 decoder layers (layer 0 dense, 1-7 MoE), 32 experts top-4, KDA + MLA attention like K3."""
    hidden = 512
    return ModelSpec.from_dict({
        "name": "mini-k3", "num_layers": 8, "moe_layers": list(range(1, 8)), "num_experts": 32, "top_k": 4,
        "hidden_size": hidden, "moe_intermediate_size": hidden, "expert_hidden_size": hidden,
        "num_shared_experts": 1, "shared_intermediate_size": hidden, "dense_intermediate_size": 2 * hidden,
        "vocab_size": 4096, "max_context": 1 << 20,
        "attention": ["kda", "kda", "kda", "mla", "kda", "kda", "kda", "mla"],
        "mla": {"num_heads": 8, "q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
                "qk_rope_head_dim": 16, "v_head_dim": 32, "output_gate": True},
        "kda": {"num_heads": 8, "head_dim": 32, "conv_kernel": 4},
        "expert_dtype": "bf16", "weight_dtype": "bf16", "scoring": "sigmoid",
    }, source="tests/dashkit")


def _place(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = place(list(argv))
    assert rc == 0, f"place {' '.join(argv)} exited {rc}"
    return out.getvalue()


def make_run_dir(root: Path, *, tokens: int = 6000) -> Path:
    """Write the run directory ``root`` (see the module docstring) and return it."""
    root = Path(root)
    model = mini_k3()
    synthesize(model, SynthConfig(num_tokens=tokens, seed=1, num_domains=3, max_running=16, prompt_median=256,
                                  output_median=64, long_fraction=0.0), root / "traces")
    # read as `place optimize` reads its inputs, so each placement records what it was planned on
    loads = routing_windows([root / "traces"], window_tokens=WINDOW_TOKENS)
    cluster = make_cluster(NUM_GPUS, "h200")
    cmp = compare_policies(loads, cluster, num_redundant=NUM_REDUNDANT, policies=["moeplace", "eplb", "linear"],
                           time_limit=20.0, options={"pareto": True, "objective": "balance+traffic"})
    for r in cmp.results:
        r.placement.save(root / "placements" / f"{r.policy}.json")
    (root / "comparison.json").write_text(json.dumps(tagged("comparison", cmp.to_dict()), indent=1))
    plan = plan_memory(model, cluster, MemoryConfig(context=1 << 17))
    (root / "plan.json").write_text(json.dumps(tagged("memory-plan", plan.to_dict()), indent=1))
    # the plan made for the placements (their GPUs and redundant slots), attention TP4 x DP4 where the default
    # layout is TP8 x DP2: the dashboard's launch commands follow it (plan.json, without the slots, is passed over)
    serve = plan_memory(model, cluster, MemoryConfig(context=1 << 17, tp=4, dp=4, num_redundant=NUM_REDUNDANT))
    (root / "serve-plan.json").write_text(json.dumps(tagged("memory-plan", serve.to_dict()), indent=1))
    _place("simulate", str(root / "traces"), "--placement", str(root / "placements" / "moeplace.json"),
           "--placement", str(root / "placements" / "linear.json"), "--gpus", str(NUM_GPUS), "--attention-tp", "8",
           "--concurrency", "16", "--duration", "0.25", "--max-seqs", "32", "--out", str(root / "sim"), "--no-progress")
    _place("sweep", str(SWEEP_SPEC), "--local", "--workers", "2", "--quiet", "--out", str(root / SWEEP_DIR))
    return root
