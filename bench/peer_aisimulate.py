"""The peer as users install it now: NVIDIA aisimulate (aiconfigurator's successor) on every end-to-end
fidelity case it supports, through the same call as bench/peer_aiconfigurator.py and through its own predict.

    python3.11 -m venv /tmp/aisimulate-venv          # its own environment: a 120 MB wheel pinning jax/flax
    /tmp/aisimulate-venv/bin/pip install aisimulate==0.13.0.dev202610270000000085
    /tmp/aisimulate-venv/bin/python bench/peer_aisimulate.py [--cases bench/fidelity_cases.yaml] \\
        [--out bench/results/peer_aisimulate.json] [--only GROUP_OR_ID,... --merge]
    python bench/fidelity.py --peer-only           # joins it (and aiconfigurator 0.12's) into fidelity.json

aiconfigurator's development moved into ai-dynamo/aisimulate (Apache-2.0, PyPI ``aisimulate``);
``aiconfigurator-core`` ends at 0.12. The ``aisimulate 0.13.0`` release on PyPI is only a placeholder
source distribution whose build fetches the real wheel from NVIDIA's own package index (pypi.nvidia.com);
without that index the newest build a user can install from PyPI is the binary development wheel
``0.13.0.dev202610270000000085`` (built 2026-10-27; ``pip install aisimulate --pre`` picks it), which is
what this script was run with. That wheel carries the whole engine: a compiled step engine
(``aisimulate/_runtime.abi3.so``, the only executor of ``cli_estimate``), the silicon tables
(``aisimulate_core/systems``: H100/H200/B200/B300/GB200/GB300 and others, TensorRT-LLM, SGLang and vLLM,
each engine's ``current`` slot the same release as aiconfigurator 0.12's: TensorRT-LLM 1.3.0rc20, SGLang
0.5.14, vLLM 0.24.0), and aiconfigurator's Python API kept as a compatibility layer
(``aisimulate.legacy_cli.api.cli_estimate``, same arguments; the wheel says it is removed in 0.14.0).

Two runs of it per case:

1. The estimate, as aiconfigurator 0.12 is run: bench/peer_aiconfigurator.py's mapping, imported from it,
   not copied (one rule for every case, its docstring says which): the same ``cli_estimate`` keyword
   arguments per case, the same OOM bisection, the same figure read from the result. The only difference
   is where the model configurations it ships live (``aisimulate_core.sdk.utils``).
2. ``aisimulate predict``, the command its README leads with (a replay of request traffic through its
   engine), on every serving case (decode and prefill cases are static batches, not traffic): the same
   deployment (GPU, engine and the table release the estimate used, parallelism, max batched tokens, KV
   memory fraction, MTP), the case's batch per rank as the engine's sequence cap (predict sizes the KV
   cache itself), the GEMM / MoE / attention / KV dtypes the estimate resolved for the case, and synthetic
   requests of the case's fixed lengths in a closed loop of its concurrency, stopping after 8 requests per
   slot (at least 32). Figures from its summary: output (or total) tokens/s of the deployment, per GPU
   (x 8 per node), or the median per-user output rate. Each record gains ``"predict"``.

The record says the exact version installed and the APIs called; it imports nothing from moeplace.
bench/fidelity.py joins it per case (``"peer": {"aisimulate": ...}``) and in ``peer_summary.aisimulate``:
its errors on the cases it supports beside moeplace's and aiconfigurator 0.12's, where the two peer
versions disagree (``versions``), and predict's errors on the serving cases (``predict``).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version as installed_version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the aiconfigurator peer's mapping, beside this script
from peer_aiconfigurator import ROOT, local_model, peer_main, run_cases  # noqa: F401  (run_cases: the tests)

OUT = ROOT / "bench" / "results" / "peer_aisimulate.json"
API = "aisimulate.legacy_cli.api.cli_estimate"
UTILS = "aisimulate_core.sdk.utils"
INDEX_NOTE = ("aisimulate 0.13.0 itself is only a placeholder source distribution on PyPI (its build fetches the "
              "wheel from NVIDIA's own package index, pypi.nvidia.com); {version} is the newest binary build users "
              "can install from PyPI without that index (pip install aisimulate --pre)")


def _load():
    from aisimulate.legacy_cli.api import cli_estimate  # the peer: installed in its own environment

    version = installed_version("aisimulate")
    return cli_estimate, {"version": version, "run": True, "api": API, "index": INDEX_NOTE.format(version=version),
                          "python": sys.version.split()[0]}


# ``aisimulate predict`` replays a closed loop of the case's concurrency; it stops after this many requests per
# slot (at least PREDICT_MIN_REQUESTS): the ramp-up and drain are then a small part of the run, as in the
# published benchmarks, which also send a fixed number of requests
PREDICT_WAVES = 8
PREDICT_MIN_REQUESTS = 32
PREDICT_TIMEOUT_S = 1800


def predict_config(case: dict, rec: dict, model: str) -> tuple[dict | None, str | None]:
    """The ``aisimulate predict`` configuration of a serving case (one rule for all), or (None, why not):
    the deployment of :func:`peer_aiconfigurator.call_of` (GPU, engine and its table release, parallelism,
    max batched tokens, the KV memory fraction, MTP) with the case's batch per rank as the engine's sequence
    cap (predict sizes the KV cache itself: no OOM bisection), the GEMM / MoE / attention / KV dtypes the
    estimate resolved for the same case (``rec``), and synthetic traffic of the case's fixed lengths at its
    concurrency, :data:`PREDICT_WAVES` requests per slot."""
    if case["kind"] != "serve":
        return None, "not a serving run (predict replays request traffic; decode and prefill cases are static batches)"
    if not rec.get("supported"):
        return None, "the estimate, on the same tables, does not support the case"
    kw, res, c = rec["call"], rec["result"], case["config"]
    worker = {"parallelism": {"tensor": kw["tp_size"], "attention_data": kw["attention_dp_size"],
                              "moe_tensor": kw["moe_tp_size"], "moe_expert": kw["moe_ep_size"]},
              "scheduler": {"max_batched_tokens": kw["ctx_tokens"], "max_sequences": int(c["batch_per_rank"])}}
    if "free_gpu_memory_fraction" in kw:
        worker["kv_cache"] = {"capacity": {"memory_fraction": kw["free_gpu_memory_fraction"]}}
    engine = {"mode": "aggregated", "model": model, "hardware": kw["system_name"], "backend": kw["backend_name"],
              "backend_version": rec["backend_version"], "gemm_quant_mode": res["gemm"], "moe_quant_mode": res["moe"],
              "fmha_quant_mode": res["fmha"], "kvcache_quant_mode": res["kvcache"], "workers": {"aggregated": worker}}
    if kw.get("nextn"):
        engine.update(nextn=kw["nextn"], nextn_accepted=kw["nextn_accepted"])
    users = int(c["concurrency"])
    traffic = {"source": {"type": "synthetic", "input_tokens": kw["isl"], "output_tokens": kw["osl"]},
               "load": {"type": "concurrency", "concurrency": users},
               "stop": {"requests": max(PREDICT_MIN_REQUESTS, PREDICT_WAVES * users)}}
    return {"traffic": traffic, "engine": engine}, None


def predict_figure(case: dict, summary: dict) -> float:
    """The case's published metric from ``aisimulate predict``'s summary (prediction.json)."""
    metric, gpus = case["metric"], int(case["config"]["gpus"])
    if metric == "per_user_tok_s":
        return float(summary["median_output_token_throughput_per_user"])
    if metric == "output_tok_s":
        return float(summary["output_throughput_tok_s"])
    if metric == "total_tok_s":
        return float(summary["total_throughput_tok_s"])
    per_gpu = float(summary["output_throughput_tok_s"]) / gpus
    return {"output_tok_s_per_gpu": per_gpu, "output_tok_s_per_node": per_gpu * 8}[metric]


def run_predict(cases: list[dict], records: list[dict], command: list[str] | None = None) -> dict:
    """``aisimulate predict`` (its command line, ``command``: by default this interpreter's) on every serving
    case: each record gains ``"predict"``: the figure and error, the configuration and the summary's
    throughput / latency, or why not."""
    command = command or [sys.executable, "-m", "aisimulate", "predict"]
    work = Path(tempfile.mkdtemp(prefix="peer-aisimulate-predict-"))
    by_id = {r["id"]: r for r in records}
    try:
        for case in cases:
            rec = by_id[case["id"]]
            if case["kind"] not in ("prefill", "decode", "serve"):
                continue
            hf_id = (rec.get("call") or {}).get("model_path", "")
            local = local_model(hf_id, work / "models", UTILS) if hf_id else ""
            cfg, why = predict_config(case, rec, local)
            if cfg is None:
                rec["predict"] = {"supported": False, "reason": why}
                continue
            rec["predict"] = _predict_one(case, cfg, command, work / case["id"], local, hf_id)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"predict": {"command": "aisimulate predict --config CASE.yaml --output-dir DIR",
                        "requests_per_slot": PREDICT_WAVES, "min_requests": PREDICT_MIN_REQUESTS}}


def _predict_one(case: dict, cfg: dict, command: list[str], d: Path, local: str, hf_id: str) -> dict:
    import yaml  # aisimulate depends on it

    d.mkdir(parents=True)
    (d / "case.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    recorded = {**cfg, "engine": {**cfg["engine"], "model": hf_id}}  # by name: the local folder is temporary
    t0 = time.perf_counter()
    try:
        run = subprocess.run([*command, "--config", str(d / "case.yaml"), "--output-dir", str(d / "out")],
                             capture_output=True, text=True, timeout=PREDICT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return {"supported": False, "reason": f"predict ran past {PREDICT_TIMEOUT_S} s", "config": recorded}
    report = d / "out" / "prediction.json"
    if run.returncode != 0 or not report.exists():
        lines = [ln for ln in (run.stderr + run.stdout).splitlines() if ln.strip()]
        msg = next((ln for ln in lines if "failed" in ln or "rror" in ln), lines[-1] if lines else "no output")
        msg = " ".join(msg.replace(local, hf_id).split()).removeprefix("aisimulate predict failed: ")[:300]
        print(f"  {case['id']:36s} predict not supported: {msg[:110]}", flush=True)
        return {"supported": False, "reason": f"aisimulate predict exited {run.returncode}: {msg}", "config": recorded}
    summary = json.loads(report.read_text())
    value = predict_figure(case, summary)
    err = value / case["published"] - 1
    print(f"  {case['id']:36s} {case['metric']:22s} published {case['published']:>9,.1f}  "
          f"aisimulate predict {value:>9,.1f}  {err:+7.1%}", flush=True)
    keep = ("output_throughput_tok_s", "input_throughput_tok_s", "total_throughput_tok_s", "median_tpot_ms",
            "median_ttft_ms", "median_output_token_throughput_per_user", "duration_ms", "completed_requests",
            "prediction_provenance", "kv_cache_precision")
    return {"supported": True, "simulated": value, "error": err, "config": recorded,
            "summary": {k: summary.get(k) for k in keep}, "seconds": time.perf_counter() - t0}


def main() -> int:
    return peer_main(__doc__, OUT, "aisimulate", _load, "see bench/peer_aisimulate.py's docstring", UTILS,
                     after=run_predict)


if __name__ == "__main__":
    sys.exit(main())
