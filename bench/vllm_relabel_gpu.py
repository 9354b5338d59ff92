"""GPU check of the relabelling inside vLLM (issue 33 item 4): one GPU, vLLM 0.34.0 installed with its own
dependencies (CUDA build). NOT RUN YET: no GPU was lent when it was written; `make check-engines` covers
what CPU allows.

For a tiny random DeepSeek-V3 (group-limited routing) and Qwen3-MoE checkpoint it serves, with vLLM's
offline ``LLM`` (expert parallelism on, EP size 1, eager mode), the same greedy prompts three ways:
  a. the original checkpoint,
  b. the relabelled copy (``place export --format checkpoint``),
  c. the original checkpoint with ``MOEPLACE_PLACEMENT`` (the load-time plugin),
and compares the sampled tokens and their log-probabilities (b and c must equal a up to kernel rounding).
Writes bench/results/vllm_relabel_gpu.json (or $OUT/vllm_relabel_gpu.json).

    python bench/vllm_relabel_gpu.py            # from the repository root, moeplace installed in the env
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

PROMPTS = [[1, 5, 9, 13, 2, 7], [3, 3, 8, 40, 11, 2, 6, 1]]


def run_vllm(model: str, env: dict) -> list:
    """One vLLM process per configuration (plugins are read at start): greedy tokens + logprobs."""
    code = f"""
import json
from vllm import LLM, SamplingParams
llm = LLM(model={model!r}, enforce_eager=True, enable_expert_parallel=True, gpu_memory_utilization=0.3,
          max_model_len=256, dtype="float32")
sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
outs = llm.generate([{{"prompt_token_ids": p}} for p in {PROMPTS!r}], sp)
print("RESULT" + json.dumps([[o.outputs[0].token_ids, [max(d.values(), key=lambda x: x.logprob).logprob
                                                      for d in o.outputs[0].logprobs]] for o in outs]))
"""
    r = subprocess.run([sys.executable, "-c", code], check=False, env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=600)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT")), None)
    if line is None:
        raise SystemExit(f"vLLM failed on {model}:\n{r.stderr[-3000:]}")
    return json.loads(line[len("RESULT"):])


def main() -> int:
    import relabelkit as kit

    from moeplace.cli.main import main as place

    out = Path(os.environ.get("OUT", REPO / "bench" / "results"))
    out.mkdir(parents=True, exist_ok=True)
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, groups in (("deepseek_v3", 4), ("qwen3_moe", 1)):
            d = Path(tmp) / kind
            kit.build(kind, d / "src")
            p = kit.placement(kind, seed=3, groups=groups)
            # EP size 1 on one GPU: the placement is for one rank (the permutation still renames every expert)
            p = type(p)(p.phy2log, 1, 1, p.model_name, p.num_experts, p.moe_layers)
            p.save(d / "p.json")
            assert place(["export", str(d / "p.json"), "--format", "checkpoint", "--model-path", str(d / "src"),
                          "--out", str(d / "dst")]) == 0
            a = run_vllm(str(d / "src"), {})
            b = run_vllm(str(d / "dst"), {})
            c = run_vllm(str(d / "src"), {"MOEPLACE_PLACEMENT": str(d / "p.json")})
            diff = lambda x, y: max(abs(u - v) for px, py in zip(x, y) for u, v in zip(px[1], py[1]))
            report[kind] = {"tokens_equal_relabelled": [x[0] for x in a] == [x[0] for x in b],
                            "tokens_equal_plugin": [x[0] for x in a] == [x[0] for x in c],
                            "logprob_max_abs_diff_relabelled": diff(a, b), "logprob_max_abs_diff_plugin": diff(a, c)}
            print(kind, report[kind])
    (out / "vllm_relabel_gpu.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(r["tokens_equal_relabelled"] and r["tokens_equal_plugin"] for r in report.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
