"""The peer: NVIDIA aiconfigurator's own estimate of every end-to-end fidelity case it supports.

    pip install 'aiconfigurator>=0.12,<0.13'      # the full package (its CLI/API); moeplace itself is not needed
    python bench/peer_aiconfigurator.py [--cases bench/fidelity_cases.yaml] [--out bench/results/peer_aiconfigurator.json]
    python bench/peer_aiconfigurator.py --only GROUP_OR_ID,... --merge   # new cases only, the others' records kept

aiconfigurator (Apache-2.0, PyPI ``aiconfigurator``; its silicon tables in ``aiconfigurator-core``) estimates a
deployment from per-operation latencies measured on H100/H200/B200/B300/GB200/GB300 for TensorRT-LLM,
SGLang and vLLM releases. This script gives it each case of bench/fidelity_cases.yaml exactly as the case
states the deployment (GPU, engine, model, parallelism, batch, lengths, dtypes, MTP, KV memory fraction)
through its public API (``aiconfigurator.cli.api.cli_estimate``), reads the figure the case publishes from
its result, and writes one record per case: the estimate and the call that produced it, or why the case is
not supported. It imports nothing from moeplace, so it runs in any environment where aiconfigurator is
installed; bench/fidelity.py joins the records into bench/results/fidelity.json as each case's
``"peer": {"aiconfigurator": {"simulated": ..., "error": ...}}``.

Mapping (one rule for every case, nothing chosen per case):

- GPU: h100 -> h100_sxm, h200 -> h200_sxm, b200 -> b200_sxm, b300 -> b300_sxm, gb200-nvl72 -> gb200,
  gb300-nvl72 -> gb300; aiconfigurator has no H800 tables (H800 cases: not supported).
- Engine: the case's ``engine`` field, else its source organisation: NVIDIA -> trtllm; LMSYS/SGLang and Mooncake/SGLang -> sglang;
  DeepSeek's and Alibaba RTP-LLM's own engines have no tables (not supported). The engine's current release
  in aiconfigurator's tables (its ``current`` slot).
- Model: DeepSeek-V3 cases on TensorRT-LLM run DeepSeek-R1 (the posts' model; same architecture), the rest
  DeepSeek-V3; Qwen3-30B-A3B -> Qwen/Qwen3-30B-A3B; Kimi K2 -> Kimi-K2-Instruct (from the HuggingFace config aiconfigurator ships, through a
  local model directory: nothing is downloaded). ``expert_dtype: nvfp4`` -> MoE quant nvfp4; the KV cache
  dtype as the case states it (FP8 unless it says bf16); attention and dense GEMM dtypes as aiconfigurator
  infers them for the model on that GPU (it has no context-MLA FP8 table for every system).
- Parallelism: TP = the case's attention TP, attention DP = GPUs / TP, MoE TP = the case's moe_tp,
  MoE EP = GPUs / moe_tp.
- Kind: ``serve`` -> ``agg`` (in-flight batching with the case's batch per rank, or its concurrency's share
  of each rank when that is smaller, and max batched tokens as the context-token budget, its KV memory
  fraction), figure ``tokens/s/gpu`` (x GPUs for a whole deployment's ``output_tok_s``, or ``tokens/s/user``
  x concurrency when fewer requests run than the ranks hold; ``total_tok_s`` adds the prompt tokens); ``decode`` -> ``static_gen``
  at the case's batch per rank (figure ``tokens/s/user`` or ``tokens/s/gpu``, x 8 per node); ``prefill``
  -> ``static_ctx`` with ``tokens_per_rank / isl`` prompts per rank (figure: prompt tokens per second per
  GPU from ``ttft``, x 8 per node). MTP: ``nextn`` drafts with the expected accepted drafts per step
  (sum over positions of the product of the conditional acceptances).
- A batch that does not fit: where aiconfigurator reports OOM at the case's batch per rank (it sizes
  memory more conservatively than the engine did; trtllm-bench's ``max_batch_size`` is a cap, not what
  runs), the largest batch that fits, found by bisection between 1 and the case's batch (one rule for every
  case), is run instead and recorded (``batch_reduced_from``). A model that does not fit at batch 1 stays
  not supported.
- Not modelled by aiconfigurator and recorded as a note: two-batch overlap (TBO/DBO), routing skew and
  redundant experts (its MoE tables assume a fixed token distribution).
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = ROOT / "bench" / "fidelity_cases.yaml"
OUT = ROOT / "bench" / "results" / "peer_aiconfigurator.json"
E2E = ("prefill", "decode", "serve")
SYSTEMS = {"h100": "h100_sxm", "h200": "h200_sxm", "b200": "b200_sxm", "b300": "b300_sxm",
           "gb200-nvl72": "gb200", "gb300-nvl72": "gb300"}
BACKENDS = {"NVIDIA": "trtllm", "LMSYS/SGLang": "sglang", "Mooncake/SGLang (Moonshot)": "sglang"}
PER_NODE = 8  # the sources' "node" is an 8-GPU server


def model_path(case: dict, backend: str) -> str:
    if case["model"] == "deepseek-v3":
        return "deepseek-ai/DeepSeek-R1" if backend == "trtllm" else "deepseek-ai/DeepSeek-V3"
    return {"kimi-k2": "moonshotai/Kimi-K2-Instruct", "kimi-k3": "moonshotai/Kimi-K3",
            "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B"}[case["model"]]


def local_model(hf_id: str, root: Path, utils: str = "aiconfigurator_core.sdk.utils") -> str:
    """``hf_id`` itself when the peer resolves it offline, else a local model directory holding the
    ``config.json`` the peer ships for it (its model_configs), so that no download is attempted. ``utils``:
    the peer's module holding ``DefaultHFModels`` and ``_get_model_config_path`` (aisimulate keeps them in
    ``aisimulate_core.sdk.utils``)."""
    mod = importlib.import_module(utils)
    if hf_id in mod.DefaultHFModels:
        return hf_id
    shipped = Path(mod._get_model_config_path()) / f"{hf_id.replace('/', '--')}_config.json"
    if not shipped.exists():
        return hf_id
    d = root / hf_id.replace("/", "--")
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(shipped.read_text())
    return str(d)


def accepted_drafts(mtp) -> tuple[int, float]:
    """(draft tokens, expected accepted drafts per step) of the case's ``mtp: [d, acceptance]``."""
    if not mtp:
        return 0, 0.0
    d, acc = int(mtp[0]), mtp[1]
    per = [float(a) for a in acc] if isinstance(acc, (list, tuple)) else [float(acc)] * d
    total, p = 0.0, 1.0
    for a in per[:d]:
        p *= a
        total += p
    return d, total


def call_of(case: dict, peer: str = "aiconfigurator") -> tuple[dict | None, str | None]:
    """The ``cli_estimate`` keyword arguments of a case, or (None, why ``peer`` does not support it)."""
    if case["kind"] not in E2E:
        return None, f"kernel-table case ({peer} estimates deployments)"
    system = SYSTEMS.get(case["gpu"])
    if system is None:
        return None, f"no {case['gpu'].upper()} tables in {peer}"
    backend = case.get("engine") or BACKENDS.get(case["source"]["org"])  # the case's engine field first
    if backend is None:
        return None, f"no tables for {case['source']['org']}'s own engine"
    c = case["config"]
    tp = int(c.get("attention_tp", 1))
    moe_tp = int(c.get("moe_tp", 1))
    gpus = int(c["gpus"])
    kw = {"model_path": model_path(case, backend), "system_name": system, "backend_name": backend,
          "tp_size": tp, "attention_dp_size": gpus // tp, "moe_tp_size": moe_tp, "moe_ep_size": gpus // moe_tp,
          "kvcache_quant_mode": "bfloat16" if c.get("kv_dtype", "fp8") == "bf16" else "fp8",
          "isl": int(c["isl"])}
    if c.get("expert_dtype") == "nvfp4":
        kw["moe_quant_mode"] = "nvfp4"
    d, accepted = accepted_drafts(c.get("mtp"))
    if d:
        kw.update(nextn=d, nextn_accepted=accepted)
    if case["kind"] == "serve":
        # a closed loop of fewer requests than the ranks' slots: each rank holds its share (rounded up)
        per_rank = min(int(c["batch_per_rank"]), -(-int(c.get("concurrency", 1 << 62)) // (gpus // tp)))
        kw.update(mode="agg", osl=int(c["osl"]), batch_size=per_rank, ctx_tokens=int(c["max_batched_tokens"]))
        if "kv_cache_free_gpu_mem_fraction" in c:
            kw["free_gpu_memory_fraction"] = float(c["kv_cache_free_gpu_mem_fraction"])
    elif case["kind"] == "decode":
        kw.update(mode="static_gen", osl=int(c["osl"]), batch_size=int(c["batch_per_rank"]))
    else:
        kw.update(mode="static_ctx", osl=2, batch_size=max(1, int(c["tokens_per_rank"]) // int(c["isl"])))
    return kw, None


def figure(case: dict, kw: dict, raw: dict) -> float:
    """The case's published metric from aiconfigurator's result dict."""
    metric = case["metric"]
    if metric == "per_user_tok_s":
        return float(raw["tokens/s/user"])
    if metric in ("input_tok_s_per_node", "input_tok_s_per_gpu"):
        prompts = float(raw["global_bs"])
        per_gpu = prompts * kw["isl"] / (float(raw["ttft"]) / 1e3) / float(raw["num_total_gpus"])
        return per_gpu * PER_NODE if metric == "input_tok_s_per_node" else per_gpu
    per_gpu = float(raw["tokens/s/gpu"])
    c = case["config"]
    if metric in ("output_tok_s", "total_tok_s"):  # the whole deployment's tokens
        users = int(c.get("concurrency", 1 << 62))
        out = per_gpu * int(c["gpus"])
        if users < kw["batch_size"] * kw["attention_dp_size"]:  # fewer requests than the ranks hold
            out = float(raw["tokens/s/user"]) * users
        # total: prompt and output tokens, every request brings isl prompt tokens per osl output tokens
        return out if metric == "output_tok_s" else out * (kw["isl"] + kw["osl"]) / kw["osl"]
    return per_gpu * PER_NODE if metric == "output_tok_s_per_node" else per_gpu


def _oom(exc: Exception) -> bool:
    return "OOM" in str(exc)


def estimate_fitting(estimate, kw: dict):
    """``(kw, result, None)`` of ``estimate(**kw)``; where that is OOM at ``batch_size`` > 1, the largest
    batch that fits (bisection; what an engine's memory cap would leave running) as ``(kw with that batch,
    its result, the case's batch)``. Other errors, and OOM at batch 1, propagate."""
    try:
        return kw, estimate(**kw), None
    except Exception as exc:
        if not _oom(exc) or kw.get("batch_size", 1) <= 1:
            raise
        first = exc
    lo, hi, best = 1, int(kw["batch_size"]) - 1, None  # the largest fitting batch in [lo, hi]
    while lo <= hi:
        mid = (lo + hi) // 2
        try:
            best = ({**kw, "batch_size": mid}, estimate(**{**kw, "batch_size": mid}))
            lo = mid + 1
        except Exception as exc:
            if not _oom(exc):
                raise
            hi = mid - 1
    if best is None:
        raise first
    return best[0], best[1], int(kw["batch_size"])


def notes_of(case: dict) -> list[str]:
    c = case["config"]
    out = []
    if c.get("dbo"):
        out.append("two-batch overlap not modelled")
    if int(c.get("redundant", 0)):
        out.append("redundant experts / EPLB not modelled (fixed token distribution)")
    return out


def run_cases(cases: list[dict], estimate, peer: str, utils: str = "aiconfigurator_core.sdk.utils") -> list[dict]:
    """One record per case: ``estimate`` (the peer's ``cli_estimate``) called as :func:`call_of` maps the case
    (through :func:`estimate_fitting`), the figure the case publishes (:func:`figure`) and its error, or why
    the case is not supported. ``peer`` names the peer in the records and the printed lines; ``utils`` is
    passed to :func:`local_model`."""
    models = Path(tempfile.mkdtemp(prefix=f"peer-{peer}-"))
    records = []
    try:
        for case in cases:
            records.append(_record(case, estimate, peer, utils, models))
    finally:
        shutil.rmtree(models, ignore_errors=True)
    return records


def _record(case: dict, estimate, peer: str, utils: str, models: Path) -> dict:
    kw, why = call_of(case, peer)
    rec = {"id": case["id"], "split": case["split"], "metric": case["metric"], "published": case["published"]}
    if kw is None:
        rec.update(supported=False, reason=why)
        if case["kind"] in E2E:
            print(f"  {case['id']:36s} not supported: {why}", flush=True)
        return rec
    t0 = time.perf_counter()
    hf_id, local = kw["model_path"], local_model(kw["model_path"], models, utils)
    try:
        kw, res, reduced = estimate_fitting(estimate, {**kw, "model_path": local})
        kw = {**kw, "model_path": hf_id}  # recorded by name: the local folder is this run's temporary copy
        value = figure(case, kw, res.raw)
    except Exception as exc:  # noqa: BLE001 - the peer's own refusal (OOM, missing table, parallelism)
        msg = " ".join(str(exc).replace(local, hf_id).split())[:300]
        rec.update(supported=False, reason=f"{peer} raised {type(exc).__name__}: {msg}", call=kw)
        print(f"  {case['id']:36s} not supported: {rec['reason'][:120]}", flush=True)
        return rec
    err = value / case["published"] - 1
    if reduced:
        rec["batch_reduced_from"] = reduced
    rec.update(supported=True, simulated=value, error=err, call=kw,
               notes=notes_of(case) + ([f"batch {kw['batch_size']} per rank (OOM at {reduced})"] if reduced else []),
               backend_version=res.backend_version, kv_cache_warning=res.kv_cache_warning,
               result={k: res.raw.get(k) for k in ("ttft", "tpot", "tokens/s/gpu", "tokens/s/user", "bs",
                                                   "global_bs", "num_total_gpus", "parallel", "gemm",
                                                   "kvcache", "fmha", "moe", "memory")},
               seconds=time.perf_counter() - t0)
    print(f"  {case['id']:36s} {case['metric']:22s} published {case['published']:>9,.1f}  "
          f"{peer} {value:>9,.1f}  {err:+7.1%}", flush=True)
    return rec


def write_atomic(path: str | Path, doc: dict) -> None:
    """``doc`` as JSON at ``path``, through a temporary file in the same folder (never half-written)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)
    print(f"wrote {path}")


def peer_main(doc: str, out: Path, peer: str, load, hint: str, utils: str = "aiconfigurator_core.sdk.utils",
              after=None) -> int:
    """A peer script's command line (``--cases``, ``--out``, default ``out``): ``load()`` imports the peer and
    returns its ``cli_estimate`` and the fields its file records (version, API), or raises ImportError (then
    ``hint`` says how to install it); every case through :func:`run_cases`, then ``after(cases, records)``
    where given (a further run of the same peer that adds to the records and returns fields for the file),
    written by :func:`write_atomic`."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--cases", default=str(CASES))
    ap.add_argument("--out", default=str(out))
    ap.add_argument("--only", default=None, metavar="IDS",
                    help="run only these cases (comma-separated case ids or groups); needs --merge")
    ap.add_argument("--merge", action="store_true",
                    help="keep the records of --out for the cases not run now (the same peer release only)")
    args = ap.parse_args()
    import yaml  # the script's only dependency besides the peer (every peer environment has it)

    cases = yaml.safe_load(Path(args.cases).read_text())
    try:
        run, kept = select_cases(cases, args.only, Path(args.out) if args.merge else None, peer)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        estimate, fields = load()
    except ImportError as exc:
        print(f"error: {peer} is not installed ({exc}); {hint}", file=sys.stderr)
        return 2
    if kept and kept.get("version") != fields.get("version"):
        print(f"error: {args.out} holds {peer} {kept.get('version')}, this environment has {fields.get('version')}: "
              "a merge would mix two releases; rerun every case instead", file=sys.stderr)
        return 2
    logging.disable(logging.WARNING)
    records = run_cases(run, estimate, peer, utils)
    more = after(run, records) if after else {}
    if kept:
        new = {r["id"]: r for r in records}
        old = {r["id"]: r for r in kept["cases"]}
        records = [new.get(c["id"]) or old[c["id"]] for c in cases if c["id"] in new or c["id"] in old]
    write_atomic(args.out, {"peer": peer, **fields, "database_mode": "SILICON", **more, "cases": records})
    return 0


def select_cases(cases: list[dict], only: str | None, merge: Path | None, peer: str) -> tuple[list[dict], dict]:
    """The cases to run (``only``: comma-separated ids or groups, every case when None) and, with ``merge``,
    the existing results file whose other records are kept. A selection must name known cases and, as it
    leaves records out, come with a merge into an existing file of the same peer."""
    run = cases
    if only is not None:
        want = {w.strip() for w in only.split(",") if w.strip()}
        known = {c["id"] for c in cases} | {c.get("group") for c in cases}
        if not want or want - known:
            raise ValueError(f"--only: unknown case or group {sorted(want - known) or '(none given)'}")
        run = [c for c in cases if c["id"] in want or c.get("group") in want]
        if merge is None:
            raise ValueError("--only leaves cases out of the results file: add --merge")
    if merge is None:
        return run, {}
    try:
        kept = json.loads(merge.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--merge: cannot read {merge} ({exc})") from None
    if kept.get("peer") != peer or not isinstance(kept.get("cases"), list):
        raise ValueError(f"--merge: {merge} is not a {peer} results file")
    return run, kept


def _load():
    import aiconfigurator  # the peer: optional, installed in the environment that runs this script
    from aiconfigurator.cli.api import cli_estimate  # its public API

    version = getattr(aiconfigurator, "__version__", None)
    if version is None:
        from importlib.metadata import version as _v  # only where the package does not say its version
        version = _v("aiconfigurator")
    return cli_estimate, {"version": version, "api": "aiconfigurator.cli.api.cli_estimate"}


def main() -> int:
    return peer_main(__doc__, OUT, "aiconfigurator", _load, "pip install 'aiconfigurator>=0.12,<0.13'")


if __name__ == "__main__":
    sys.exit(main())
