"""The fidelity cases' harness: the case table (bench/fidelity_cases.yaml) read and checked, and each case
evaluated: kernel-table cases on the cost model's formulas, end-to-end cases by the discrete-event
simulator (stat mode, steady state after the warm-up) or by one steady engine iteration (:class:`Steady`,
the fit's fast evaluator); the least-squares fit of the free constants (:data:`FIT`) over any set of cases.

bench/fidelity.py runs it (the split, the grouped cross-validation, the report)."""
from __future__ import annotations

import dataclasses
import functools
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CASES = ROOT / "bench" / "fidelity_cases.yaml"
sys.path.insert(0, str(ROOT))

FROZEN = ROOT / "bench" / "fidelity_frozen.yaml"


def load_frozen(path: Path = FROZEN) -> dict:
    """The frozen structure (bench/fidelity_frozen.yaml): its date, the publication cut-off, the fitted
    constants with their bounds, the sourced constants, the ensemble's and the interval's settings. The
    CostConfig defaults must hold the frozen sourced constants (else the structure changed: a re-freeze)."""
    import datetime

    import yaml

    from moeplace.foundation.errors import InputError
    from moeplace.sim.config import CostConfig

    try:
        fz = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise InputError(f"{path}: not a readable frozen-structure file ({exc})") from None
    for key in ("frozen_on", "cutoff", "fit", "fixed", "ensemble", "interval"):
        if not isinstance(fz, dict) or key not in fz:
            raise InputError(f"{path}: field '{key}' missing")
    for key in ("frozen_on", "cutoff", "structure_cutoff"):  # the last one optional
        if key in fz and not isinstance(fz[key], datetime.date):
            raise InputError(f"{path}: field '{key}' must be a date (YYYY-MM-DD), got {fz[key]!r}")
    if "structure_cutoff" in fz and fz["structure_cutoff"] > fz["cutoff"]:
        raise InputError(f"{path}: structure_cutoff {fz['structure_cutoff']} is after cutoff {fz['cutoff']}: the "
                         "structure cannot have been chosen on cases the fit has not seen")
    d = CostConfig()
    for name, v in fz["fixed"].items():
        if not hasattr(d, name):
            raise InputError(f"{path}: fixed constant '{name}' is not a CostConfig field")
        if not math.isclose(getattr(d, name), float(v), rel_tol=1e-9):
            raise InputError(f"{path}: the code's {name} = {getattr(d, name)!r} differs from the frozen {v!r} "
                             f"(frozen on {fz['frozen_on']}): the structure changed; re-freeze it with a new date")
    for f in fz["fit"]:
        if not hasattr(d, f["name"]) or not f["lo"] < f["hi"]:
            raise InputError(f"{path}: fitted constant {f!r}: unknown field or empty bounds")
    from moeplace.sim import ensemble

    code = {"sample_iterations": ensemble.SAMPLE_ITERATIONS, "level": ensemble.LEVEL,
            "prior_groups": ensemble.PRIOR_GROUPS}
    frozen = {"sample_iterations": fz["ensemble"].get("sample_iterations"), "level": fz["interval"].get("level"),
              "prior_groups": fz["interval"].get("prior_groups")}
    for k, v in code.items():
        if frozen[k] is None or not math.isclose(float(frozen[k]), float(v)):
            raise InputError(f"{path}: {k} {frozen[k]!r} differs from the code's {v!r} (sim/ensemble.py): the "
                             "structure changed; re-freeze it with a new date")
    if fz["interval"].get("contains_median") is not True:
        raise InputError(f"{path}: interval.contains_median must be true (sim.ensemble.speed_interval widens the "
                         "interval to the median): the structure changed; re-freeze it with a new date")
    if set(fz["interval"].get("scales") or {}) != set(ensemble.FEATURES):
        raise InputError(f"{path}: interval.scales must give one scale per feature {ensemble.FEATURES}")
    return fz


# Fitted constants: (CostConfig field, lower bound, upper bound), as frozen in bench/fidelity_frozen.yaml
# (every bound's source is there). Everything else in CostConfig is a published constant
# (docs/simulate.md, "Cost model").
FIT = tuple((f["name"], float(f["lo"]), float(f["hi"])) for f in load_frozen()["fit"])
KINDS = ("gemm", "deepep_normal", "deepep_ll", "prefill", "decode", "serve")
E2E = ("prefill", "decode", "serve")
KERNEL = "kernel"  # the regime field of a kernel-table case
# the serving engine a case ran (``engine``; without it, its source organisation's, ENGINE_OF_SOURCE)
ENGINES = ("sglang", "trtllm", "vllm")
METRICS = ("tflops", "bottleneck_gb_s", "latency_us", "input_tok_s_per_node", "input_tok_s_per_gpu",
           "output_tok_s_per_node", "output_tok_s_per_gpu", "per_user_tok_s", "output_tok_s", "total_tok_s")


# ---------------------------------------------------------------------------- cases
def load_cases(path: Path) -> list[dict]:
    """The case table; one-line errors naming the case and field."""
    import yaml

    from moeplace.foundation.errors import InputError

    try:
        cases = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise InputError(f"{path}: not a readable YAML case table ({exc})") from None
    if not isinstance(cases, list) or not cases:
        raise InputError(f"{path}: expected a list of cases")
    seen = set()
    for i, c in enumerate(cases):
        where = f"{path}: case {i + 1} ({c.get('id', '?') if isinstance(c, dict) else '?'})"
        if not isinstance(c, dict):
            raise InputError(f"{where}: expected a mapping")
        for key in ("id", "source", "split", "group", "regime", "kind", "gpu", "config", "metric", "published",
                    "assumptions", "published_on"):
            if key not in c:
                raise InputError(f"{where}: missing field '{key}'")
        if c["id"] in seen:
            raise InputError(f"{where}: duplicate id")
        seen.add(c["id"])
        if c["split"] not in ("calibration", "validation"):
            raise InputError(f"{where}: field 'split' must be calibration or validation, got {c['split']!r}")
        if c["kind"] not in KINDS:
            raise InputError(f"{where}: field 'kind' must be one of {KINDS}, got {c['kind']!r}")
        if not all(k in c["source"] for k in ("org", "title", "url")):
            raise InputError(f"{where}: field 'source' needs org, title and url")
        if not (isinstance(c["published"], (int, float)) and c["published"] > 0):
            raise InputError(f"{where}: field 'published' must be a positive number")
        if c["kind"] in E2E and "model" not in c:
            raise InputError(f"{where}: end-to-end cases need a 'model'")
        if "engine" in c and c["engine"] not in ENGINES:
            raise InputError(f"{where}: field 'engine' must be one of {ENGINES}, got {c['engine']!r}")
        if c["metric"] not in METRICS:
            raise InputError(f"{where}: field 'metric' must be one of {METRICS}, got {c['metric']!r}")
        if publication_date(c) is None and str(c["published_on"]) != "unknown":
            raise InputError(f"{where}: field 'published_on' must be YYYY-MM-DD, YYYY-MM or unknown, got "
                             f"{c['published_on']!r}")
        lat = c.get("published_latency")
        if lat is not None and (not isinstance(lat, dict) or not lat or any(
                k not in (*LATENCY_KEYS, "ttft_comparable", "why") for k in lat)
                or any(not (isinstance(lat[k], (int, float)) and lat[k] > 0) for k in LATENCY_KEYS if k in lat)
                or any(f"{m}_p50_ms" in lat and f"{m}_mean_ms" in lat for m in ("ttft", "tpot"))):
            raise InputError(f"{where}: field 'published_latency' must map ttft_p50_ms / tpot_p50_ms (per-request "
                             "medians) or ttft_mean_ms / tpot_mean_ms (per-request means), one of the two for each, "
                             "to positive milliseconds")
        if not isinstance(c.get("group"), str) or not c["group"]:
            raise InputError(f"{where}: field 'group' must name the case's deployment group (one table, one build, "
                             "one blog's sweep)")
        check_case_fields(c, where)
        if c.get("regime") != regime_of(c):
            raise InputError(f"{where}: field 'regime' must be {regime_of(c)!r} (the rule of sim.fidelity.regime over "
                             f"its configuration), got {c.get('regime')!r}")
    return cases


# end-to-end configuration fields that are whole numbers, each with its least value (0 for ``redundant`` and
# ``cuda_graph_max_bs``: no redundant slots, no CUDA graphs)
_E2E_COUNTS = {**dict.fromkeys(("gpus", "attention_tp", "moe_tp", "batch_per_rank", "max_batched_tokens", "isl", "osl",
                                "concurrency", "tokens_per_rank", "kv_tokens"), 1),
               "redundant": 0, "cuda_graph_max_bs": 0}
_E2E_NEEDS = {"prefill": ("gpus", "isl", "tokens_per_rank"), "decode": ("gpus", "isl", "osl", "batch_per_rank"),
              "serve": ("gpus", "isl", "osl", "batch_per_rank", "max_batched_tokens", "concurrency")}


# the per-request latencies a case may publish (bench/fidelity_cases.yaml ``published_latency``): each source's
# own statistic over its requests, the median (bench_serving's / vllm bench serve's P50) or the mean (InferenceX's
# tables, "Mean latency"); the simulation gives the same statistic over its steady window's requests
LATENCY_KEYS = ("ttft_p50_ms", "tpot_p50_ms", "ttft_mean_ms", "tpot_mean_ms")


def published_latency(case: dict, metric: str) -> tuple[float, str] | None:
    """The case's published ``metric`` ("ttft" / "tpot") in ms and its statistic ("p50" / "mean"), or None."""
    lat = case.get("published_latency") or {}
    for stat in ("p50", "mean"):
        if f"{metric}_{stat}_ms" in lat:
            return float(lat[f"{metric}_{stat}_ms"]), stat
    return None


def latency_means(requests, warmup_s: float) -> dict:
    """Mean TTFT and TPOT (s) over the requests the run's medians are taken over (sim.results.latency_window)."""
    from moeplace.sim.results import latency_window

    lat, _ = latency_window(requests, warmup_s)
    cols = {m: lat[f"{m}_s"].drop_nulls() for m in ("ttft", "tpot")}
    return {f"{m}_mean_s": float(c.mean()) if c.len() else None for m, c in cols.items()}


def check_case_fields(c: dict, where: str) -> None:
    """The kinds of a case's fields, beyond their presence (:func:`load_cases`): the source's org, title and
    url are text (the url a web address), the assumptions a list of text (at least one line), the GPU a preset;
    an end-to-end case's model a preset (its dtypes known to it), its configuration the fields its kind runs
    on as whole numbers >= 1, the attention-TP size dividing the GPUs, ``duration`` a positive number;
    ``published_latency`` a mapping of positive milliseconds. One line naming the case and field."""
    from moeplace.foundation.cluster import gpu_preset_names
    from moeplace.foundation.errors import InputError
    from moeplace.foundation.model import DTYPE_BYTES, KV_DTYPE_BYTES, preset_names

    src = c["source"]
    if not all(isinstance(src[k], str) and src[k].strip() for k in ("org", "title", "url")) \
            or not src["url"].startswith(("https://", "http://")):
        raise InputError(f"{where}: field 'source' needs org, title and url as text (url a web address)")
    if not (isinstance(c["assumptions"], list) and c["assumptions"]
            and all(isinstance(a, str) and a.strip() for a in c["assumptions"])):
        raise InputError(f"{where}: field 'assumptions' must be a list of at least one line of text")
    if c["gpu"] not in gpu_preset_names():
        raise InputError(f"{where}: field 'gpu' must be a GPU preset {gpu_preset_names()}, got {c['gpu']!r}")
    cfg = c["config"]
    if not isinstance(cfg, dict) or not cfg:
        raise InputError(f"{where}: field 'config' must be a mapping")
    if c["kind"] not in E2E:
        return
    if c["model"] not in preset_names():
        raise InputError(f"{where}: field 'model' must be a model preset {preset_names()}, got {c['model']!r}")
    for k in _E2E_NEEDS[c["kind"]]:
        if k not in cfg:
            raise InputError(f"{where}: field 'config.{k}' missing (a {c['kind']} case runs on it)")
    for k, least in _E2E_COUNTS.items():
        if k in cfg and not (isinstance(cfg[k], int) and not isinstance(cfg[k], bool) and cfg[k] >= least):
            raise InputError(f"{where}: field 'config.{k}' must be a whole number >= {least}, got {cfg[k]!r}")
    if cfg["gpus"] % int(cfg.get("attention_tp", 1)):
        raise InputError(f"{where}: field 'config.attention_tp' ({cfg.get('attention_tp')}) must divide "
                         f"config.gpus ({cfg['gpus']})")
    if "duration" in cfg and not (isinstance(cfg["duration"], (int, float)) and cfg["duration"] > 0):
        raise InputError(f"{where}: field 'config.duration' must be a positive number of seconds")
    for k in ("expert_dtype", "weight_dtype"):
        if k in cfg and cfg[k] not in DTYPE_BYTES:
            raise InputError(f"{where}: field 'config.{k}' must be one of {sorted(DTYPE_BYTES)}, got {cfg[k]!r}")
    if "kv_dtype" in cfg and cfg["kv_dtype"] not in KV_DTYPE_BYTES:
        raise InputError(f"{where}: field 'config.kv_dtype' must be one of {sorted(KV_DTYPE_BYTES)}, got "
                         f"{cfg['kv_dtype']!r}")


def publication_date(case: dict):
    """The case's publication date (a month counts as its last day: the latest it can be); None when
    unknown or not a date."""
    import calendar
    import datetime

    v = case.get("published_on")
    if isinstance(v, datetime.date):
        return v
    try:
        parts = [int(p) for p in str(v).split("-")]
        if len(parts) == 3:
            return datetime.date(*parts)
        if len(parts) == 2:
            return datetime.date(parts[0], parts[1], calendar.monthrange(parts[0], parts[1])[1])
    except ValueError:
        return None
    return None


def after_cutoff(case: dict, frozen: dict) -> bool:
    """Published after the frozen cut-off (a case of unknown date counts as seen, i.e. before it)."""
    d = publication_date(case)
    return d is not None and d > frozen["cutoff"]


def after_structure(case: dict, frozen: dict) -> bool:
    """Published after the newest case the structure's choices were made on (``structure_cutoff``, when the
    frozen file has one: after a refit moved ``cutoff`` past it, such a case is fitted but its grouped-CV
    figure is still one the structure was never chosen on)."""
    d, s = publication_date(case), frozen.get("structure_cutoff")
    return s is not None and d is not None and d > s


def regime_of(case: dict) -> str:
    """The regime of a case under the label's rule (sim.fidelity.case_regime); ``kernel`` for kernel tables."""
    from moeplace.sim.fidelity import case_regime

    return case_regime({"kind": case["kind"], "config_full": case["config"]}) or KERNEL


# ---------------------------------------------------------------------------- kernel cases
@functools.cache
def _kernel_shape(gpu: str, ep: int):
    """The model and cluster of an isolated kernel benchmark (frozen data, read once per GPU and EP: a fit
    prices every kernel case hundreds of times, and reading the presets was a third of its time)."""
    from moeplace.foundation.cluster import make_cluster
    from moeplace.foundation.model import load_model

    return load_model("deepseek-v3"), make_cluster(ep, gpu)


def _kernel_cost(gpu: str, ep: int, cfg):
    """A cost model for an isolated kernel benchmark: compute at the full isolated rate."""
    from moeplace.sim.cost import CostModel

    return CostModel(*_kernel_shape(gpu, ep), cfg.replace(sustained_efficiency=1.0))


def kernel_metric(case: dict, cfg) -> float:
    """Simulated figure of a kernel-table case from the cost model's own formulas."""
    c = case["config"]
    if case["kind"] == "gemm":
        cm = _kernel_cost(case["gpu"], 8, cfg)
        g, m, n, k = c["groups"], c["m"], c["n"], c["k"]
        rows = g * m
        bytes_ = g * n * k * 1.0 + rows * k * 1.0 + rows * n * 2.0  # FP8 weights and inputs, BF16 out
        t = float(cm.gemm_time(2.0 * n * k, rows, g, bytes_, cm.gpu.flops("fp8") * cm.cfg.gemm_efficiency, 1))
        return 2.0 * g * m * n * k / t / 1e12
    ep, T, k = c["ep"], c["tokens"], c["top_k"]
    cm = _kernel_cost(case["gpu"], ep, cfg)
    n = cm.cluster.gpus_per_node
    hit = 1 - (1 - 1 / ep) ** k  # a given GPU receives a given token
    nv, nic = T * (n - 1) * hit, T * (ep - n) * hit
    b = cm.copy_bytes(c["op"]) * c["hidden"] / cm.model.expert_hidden_size
    if case["kind"] == "deepep_normal":
        t = float(cm.a2a_time(nv, nic, c["op"], "normal"))
        N = ep // n
        if N > 1:  # DeepEP's test counts RDMA bytes as one copy per destination node, its own included
            counted = T * N * (1 - (1 - 1 / N) ** k) * b
        else:  # NVLink bytes as one copy per destination rank, its own included
            counted = T * ep * hit * b
        return counted / t / 1e9
    return float(cm.a2a_time(nv, nic, c["op"], "low_latency")) * 1e6  # latency, microseconds


# ---------------------------------------------------------------------------- end-to-end cases
_TRACES: dict = {}


def preset_model(name: str, settings: dict):
    """Model preset ``name`` with the checkpoint's quantization where ``settings`` gives it (``expert_dtype``,
    ``weight_dtype``)."""
    from moeplace.foundation.model import load_model

    m = load_model(name)
    for field in ("expert_dtype", "weight_dtype"):
        if settings.get(field):
            m = dataclasses.replace(m, **{field: settings[field]})
    return m


def case_model(case: dict):
    return preset_model(case["model"], case["config"])


def case_trace(case: dict, quick: bool):
    """Routing for the case: ``routing: balanced`` (DeepSeek's profiles "simulate an absolutely balanced
    MoE routing strategy"): every expert of every layer is chosen by exactly ``T k / E`` of the ``T``
    tokens (each token takes ``k`` distinct experts from a random permutation, so destinations spread as
    uniform routing spreads them) and only the router's per-iteration sampling noise remains; else the
    project's synthetic router for the model without workload drift (synthesized in every run)."""
    from moeplace.sim.workload import TraceTokens, load_trace_tokens
    from moeplace.traces.synth import SynthConfig, synthesize

    model = case_model(case)
    routing = case["config"].get("routing", "synthetic")
    key = (case["model"], routing)
    if key not in _TRACES:
        base = dataclasses.replace(model, expert_dtype=case_model({"model": case["model"], "config": {}}).expert_dtype)
        if routing == "balanced":
            rng = np.random.default_rng(0)
            T, L, k, E = 4096, base.num_moe_layers, base.top_k, base.num_experts
            assert E % k == 0 and (T * k) % E == 0, "exact balance needs k | E and E | T k"
            ids = np.empty((T, L, k), dtype=np.uint16)
            for layer in range(L):  # T k / E permutations of the experts, cut into tokens of k distinct ones
                perms = np.argsort(rng.random((T * k // E, E)), axis=1)
                ids[:, layer] = perms.reshape(T, k)
            _TRACES[key] = TraceTokens(ids, np.array([0, T]), np.array([T - 1]), np.array([1]), np.array([T - 1]),
                                       np.array([0]), base, "uniform")
        else:
            # synthesized afresh every run (never a cached file a former generator wrote), stationary: a
            # benchmark's random prompts are one workload mix (drift 0), and the engines' EPLB is fitted to it
            tmp = tempfile.mkdtemp(prefix=f"fidelity-{case['model']}-")
            print(f"  synthesizing a stationary {case['model']} routing trace", flush=True)
            synthesize(base, SynthConfig(num_tokens=8000 if quick else 16000, drift=0.0), Path(tmp) / "trace")
            _TRACES[key] = load_trace_tokens(Path(tmp) / "trace")
            shutil.rmtree(tmp)
    tr = _TRACES[key]
    return dataclasses.replace(tr, model=model)


def case_setup(case: dict, quick: bool):
    """(trace, placement, cluster, engine config, workload config, duration) of an end-to-end case."""
    from moeplace.foundation.cluster import make_cluster
    from moeplace.sim.config import EngineConfig, LengthMix, WorkloadConfig, prefill_batches_of
    from moeplace.sim.runner import resolve_placement

    c = case["config"]
    trace = case_trace(case, quick)
    cluster = make_cluster(c["gpus"], case["gpu"])
    R = int(c.get("redundant", 0))
    policy = "linear" if c.get("routing") == "balanced" and R == 0 else "eplb"
    _, placement = resolve_placement(policy, trace, cluster, R, "sglang", 0)
    tp = int(c.get("attention_tp", 1))
    ranks = c["gpus"] // tp
    draft, acc = c.get("mtp", (0, 0.0))
    acc = tuple(float(a) for a in acc) if isinstance(acc, (list, tuple)) else float(acc)
    kind = case["kind"]
    if kind == "prefill":
        T = int(c["tokens_per_rank"])
        batch, mbt = max(1, T // c["isl"] + 1), T
        conc = ranks * (T // c["isl"] + 2) * 2
        lengths = LengthMix(components=((c["isl"], 1.0),), output_mean=1, range_ratio=0.0)
        duration = 90.0
    elif kind == "decode":
        batch = int(c["batch_per_rank"])
        mbt = batch * (1 + draft) + 64
        conc = ranks * batch
        lengths = LengthMix(components=((c["isl"], 1.0),), output_mean=c["osl"], range_ratio=0.0)
        duration = 12.0 if c["gpus"] <= 8 else 20.0
    else:
        batch, mbt, conc = int(c["batch_per_rank"]), int(c["max_batched_tokens"]), int(c["concurrency"])
        lengths = LengthMix(components=((c["isl"], 1.0),), output_mean=c["osl"], range_ratio=0.0)
        if c.get("length_sigma"):  # a dataset's own lengths (ShareGPT): log-normal, the published means kept
            si, so = (float(v) for v in c["length_sigma"])
            lengths = LengthMix(components=((max(1, round(c["isl"] * math.exp(-si * si / 2))), 1.0),), sigma=si,
                                output_mean=c["osl"], output_sigma=so, range_ratio=None)
        duration = float(c.get("duration", 400.0))
    if quick:
        duration = duration / 3
    engine = EngineConfig(attention_tp=tp, max_batched_tokens=mbt, max_seqs=batch,
                          chunked_prefill=bool(c.get("chunked_prefill", True)),
                          attention_dtype=c.get("attention_dtype", "bf16"),
                          cuda_graph_max_bs=int(c.get("cuda_graph_max_bs", 512)),
                          dual_batch_overlap=bool(c.get("dbo", False)), replica_rule="sglang",
                          kv_dtype=c.get("kv_dtype", "fp8"), mtp_draft=int(draft), mtp_acceptance=acc,
                          moe_tp=int(c.get("moe_tp", 1)), prefix_hit=float(c.get("prefix_hit", 0.0)),
                          dp_balance="tokens", phase={"serve": "both"}.get(kind, kind),
                          a2a_mode=c.get("moe_comm", "auto"), admission=c.get("admission", "on_demand"),
                          prefill_batches=prefill_batches_of(case_engine(case) or "", c.get("prefill_batches")),
                          kernel_build=c.get("kernel_build", "unfused"),
                          gpu_memory_utilization=0.9)
    wl = WorkloadConfig(arrival="closed", concurrency=conc, lengths=lengths)
    return trace, placement, cluster, engine, wl, duration


def case_kv_tokens(case: dict, trace, cluster, engine) -> int | None:
    """KV token slots per rank: the source's own figure when the case gives ``kv_tokens``; under
    TensorRT-LLM's rule when it gives ``kv_cache_free_gpu_mem_fraction``: that share of the memory left
    after weights and the runtime reserve (the plan model's pool at full memory utilization); else None
    (the plan's own pool)."""
    from moeplace.sim.memory import plan_pools

    if case["config"].get("kv_tokens"):
        return int(case["config"]["kv_tokens"])
    frac = case["config"].get("kv_cache_free_gpu_mem_fraction")
    if frac is None:
        return None
    pools, _ = plan_pools(trace.model, cluster, dataclasses.replace(engine, gpu_memory_utilization=1.0),
                          int(case["config"].get("redundant", 0)))
    return int(frac * pools.pool_bytes / pools.kv_bytes_per_token)


def _from_summary(case: dict, s: dict) -> float:
    per_node = 8  # the sources' "node" is an 8-GPU server
    # prefill: prompt tokens computed per second, counted per iteration (no prefix hits in these cases)
    # output_tok_s / total_tok_s: output (and prompt) tokens of the whole deployment (the case's GPUs)
    return {"input_tok_s_per_node": s["prefill_tok_s_per_gpu"] * per_node,
            "input_tok_s_per_gpu": s["prefill_tok_s_per_gpu"],
            "output_tok_s": s["output_tok_s_per_gpu"] * case["config"]["gpus"],
            "total_tok_s": (s["prefill_tok_s_per_gpu"] + s["output_tok_s_per_gpu"]) * case["config"]["gpus"],
            "output_tok_s_per_node": s["output_tok_s_per_gpu"] * per_node,
            "output_tok_s_per_gpu": s["output_tok_s_per_gpu"],
            "per_user_tok_s": s["per_user_tok_s"] or 0.0}[case["metric"]]


def sim_run(case: dict, cfg, quick: bool, keep_samples: bool = False):
    """The discrete-event simulator on the case (stat mode, steady state after the warm-up): ``(result,
    its summary with prefill_tok_s_per_gpu, the figures fidelity.json keeps, engine)``."""
    from moeplace.sim.config import SimConfig
    from moeplace.sim.runner import simulate

    trace, placement, cluster, engine, wl, duration = case_setup(case, quick)
    # co-located serving runs in waves of whole-request lifetimes; the published figures average whole
    # benchmark runs, so only the first 10 % is left out there (20 % elsewhere)
    warmup = 0.1 * duration if case["kind"] == "serve" else None
    config = SimConfig(duration=duration, mode="stat", seed=0, engine=engine, cost=cfg, workload=wl, warmup=warmup,
                       kv_tokens_per_rank=case_kv_tokens(case, trace, cluster, engine), ensemble=False)
    res = simulate(trace, [(case["id"], placement)], cluster, config, keep_samples=keep_samples)[0]
    s = dict(res.summary)
    s["prefill_tok_s_per_gpu"] = s["prefill_tok_s"] / s["num_gpus"]
    keep = {k: s[k] for k in ("output_tok_s_per_gpu", "input_tok_s_per_gpu", "per_user_tok_s", "itl_s",
                              "tpot_p50_s", "ttft_p50_s", "iterations", "requests_rejected", "preemptions",
                              "mean_decode_seqs", "mean_batch_tokens", "warmup_s", "duration_s", "wall_s",
                              "straggler_share", "mean_imbalance")}
    keep.update(latency_means(res.requests, s["warmup_s"]))
    return res, s, keep, engine


def sim_metric(case: dict, cfg, quick: bool) -> tuple[float, dict]:
    """The case's figure as the discrete-event simulator gives it (:func:`sim_run`)."""
    _, s, keep, _ = sim_run(case, cfg, quick)
    return _from_summary(case, s), keep


# the serving engine of each source whose aiconfigurator tables price a measured run (others: own engines)
ENGINE_OF_SOURCE = {"NVIDIA": "trtllm", "LMSYS/SGLang": "sglang", "Mooncake/SGLang (Moonshot)": "sglang"}


def case_engine(case: dict) -> str | None:
    """The serving engine of a case: its ``engine`` field, else its source organisation's; None for the
    sources' own engines (DeepSeek, RTP-LLM)."""
    return case.get("engine") or ENGINE_OF_SOURCE.get(case["source"]["org"])


def measured_metric(case: dict, cfg, quick: bool) -> dict:
    """The same simulation with ``--cost-model measured`` (aiconfigurator's tables, sim/measured.py) under the
    case's engine: ``{"simulated", "error", "roofline_terms"}``, or ``{"covered": False, "why"}``."""
    from moeplace.foundation.errors import InputError
    from moeplace.sim.config import SimConfig
    from moeplace.sim.runner import simulate

    if case["kind"] not in E2E:
        return {"covered": False, "why": "kernel-table case"}
    engine_name = case_engine(case)
    if engine_name is None:
        return {"covered": False, "why": f"no tables for {case['source']['org']}'s own engine"}
    trace, placement, cluster, engine, wl, duration = case_setup(case, quick)
    warmup = 0.1 * duration if case["kind"] == "serve" else None
    config = SimConfig(duration=duration, mode="stat", seed=0, engine=engine, cost=cfg, workload=wl, warmup=warmup,
                       kv_tokens_per_rank=case_kv_tokens(case, trace, cluster, engine), cost_model="measured",
                       cost_engine=engine_name, ensemble=False)
    try:
        res = simulate(trace, [(case["id"], placement)], cluster, config)[0]
    except InputError as exc:
        return {"covered": False, "why": str(exc).removeprefix("--cost-model measured: ")}
    s = dict(res.summary)
    s["prefill_tok_s_per_gpu"] = s["prefill_tok_s"] / s["num_gpus"]
    v = _from_summary(case, s)
    terms = s["cost_model"]["terms"]
    return {"simulated": v, "error": v / case["published"] - 1, "tables": s["cost_model"]["tables"],
            "experts": terms.get("experts"),
            "roofline_terms": sorted(t for t, src in terms.items() if src.startswith("roofline")),
            "tpot_p50_s": s["tpot_p50_s"]}


class Steady:
    """One steady-state engine iteration of an end-to-end case (the fit's fast evaluator): the
    published batch on every rank, routed by the statistical router, costed by the cost model."""

    def __init__(self, case: dict, quick: bool) -> None:
        from moeplace.sim.routing import StatRouter

        self.case = case
        trace, placement, cluster, engine, _, _ = case_setup(case, quick)
        self.trace, self.cluster, self.engine = trace, cluster, engine
        self.router = StatRouter(trace, placement, "sglang", 0, engine.attention_tp)
        self._work = None

    def _batch(self, RankWork):
        """(rank work, MoE work, tokens per decoding sequence per step) of the steady iteration; the router
        starts at the trace's start, so it is the same batch however often it is built."""
        c, e = self.case["config"], self.engine
        D = self.cluster.num_gpus // e.attention_tp
        w = RankWork.zeros(D)
        if self.case["kind"] == "prefill":
            T, isl = c["tokens_per_rank"], c["isl"]
            w.tokens[:] = w.pre_tokens[:] = T
            w.pre_seqs[:] = w.sampled[:] = T / isl
            w.pre_pairs[:] = T / isl * isl * (isl + 1) / 2
            w.pre_ctx[:] = T
            gain = 0.0
        else:
            b, d = c["batch_per_rank"], e.mtp_draft
            per = 1 + d
            ctx = c["isl"] + c["osl"] / 2
            w.dec_seqs[:] = b
            w.tokens[:] = w.sampled[:] = b * per
            w.dec_ctx[:] = b * (ctx + 1) * per + b * per * (per - 1) / 2
            gain = e.mtp_tokens_per_step()
        self.router.cursor = 0
        moe, _ = self.router.route_count(int(w.tokens.sum()), np.random.default_rng(0))
        return w, moe, gain

    def _iteration(self, cfg):
        """(cost model, rank work, MoE work, step time, iteration seconds with drafting, tokens per
        decoding sequence per step) of the steady iteration; the router restarts at the trace's start,
        so every evaluation routes the same tokens."""
        from moeplace.sim.cost import CostModel, RankWork

        e = self.engine
        cost = CostModel.for_engine(self.trace.model, self.cluster, cfg, e)
        if self._work is None:  # the batch and its routing do not depend on the constants: built once
            self._work = self._batch(RankWork)
        w, moe, gain = self._work
        st = cost.step_time(w, moe, e.dual_batch_overlap)
        dt = st.total + cost.draft_time(st, w, e.mtp_draft)
        return cost, w, moe, st, dt, gain

    def metric(self, cfg) -> float:
        _, w, _, _, dt, gain = self._iteration(cfg)
        G = self.cluster.num_gpus
        s = {"prefill_tok_s_per_gpu": float(w.pre_tokens.sum()) / dt / G,
             "output_tok_s_per_gpu": float(w.dec_seqs.sum()) * gain / dt / G,
             "per_user_tok_s": gain / dt}
        return _from_summary(self.case, s)

    def breakdown(self, cfg) -> dict:
        """Where the steady iteration's time goes, in microseconds per MoE layer (means over the MoE
        layers): attention + dense trunk of the slowest rank, expert GEMMs of the busiest and of the mean
        GPU, dispatch and combine of the slowest and mean GPU, the layer as composed (overlap included,
        kernel gaps excluded) and the gaps; the busiest GPU's selections over the mean; with dual-batch
        overlap, the compute and communication sides of the overlapped layer. Milliseconds per
        iteration: total, fixed overheads, drafting."""
        cost, w, moe, st, dt, _ = self._iteration(cfg)
        mode = cost.mode_of(w)
        is_moe = cost._is_moe
        attn = cost._attention_layers(w)[is_moe]
        t_exp = cost.expert_times(moe)
        out = {"mode": mode, "dbo": self.engine.dual_batch_overlap, "graph": st.graph,
               "busiest_over_mean_selections": float(np.mean(moe.tokens.max(axis=1) / moe.tokens.mean(axis=1))),
               "attention_trunk_us": float(attn.mean()) * 1e6,
               "experts_busiest_us": float(t_exp.max(axis=1).mean()) * 1e6,
               "experts_mean_us": float(t_exp.mean()) * 1e6}
        if mode != "allgather" and not cost.pure_tp:
            for op in ("dispatch", "combine"):
                t = cost.a2a_time(*cost.tep_copies(moe), op, mode)
                out[f"{op}_slowest_us"] = float(t.max(axis=1).mean()) * 1e6
                out[f"{op}_mean_us"] = float(t.mean()) * 1e6
        if self.engine.dual_batch_overlap:
            w2, moe2 = w.half(), moe.half()
            exp2, comm2, _ = cost.moe_layer_times(moe2, mode)
            share = cost.cfg.comm_sm_share if mode == "normal" else 0.0
            out["overlap_compute_us"] = float(np.mean(2 * (cost._attention_layers(w2)[is_moe] + exp2) / (1 - share))) * 1e6
            out["overlap_comm_us"] = float(np.mean(2 * comm2)) * 1e6
        gaps = float(np.mean(cost.kernel_gaps_s(self.engine.dual_batch_overlap)[is_moe]))
        out.update({"layer_us": float(st.layer[is_moe].mean()) * 1e6 - gaps * 1e6, "kernel_gaps_us": gaps * 1e6,
                    "iteration_ms": st.total * 1e3, "overhead_ms": st.overhead * 1e3,
                    "drafting_ms": (dt - st.total) * 1e3})
        return out


# ---------------------------------------------------------------------------- fit
def fit(cases: list[dict], quick: bool, start=None, steady: dict | None = None,
        correction: dict[str, float] | None = None, weights: dict[str, float] | None = None) -> tuple[object, dict]:
    """Least squares on log(simulated / published) over ``cases`` (the split fit: the calibration cases;
    a cross-validation fold: every case outside the held-out group). ``start``: the CostConfig the search
    starts from (default the CostConfig defaults); ``steady``: :class:`Steady` evaluators by case id, reused
    between fits; ``correction``: per end-to-end case, the factor event simulation / steady iteration at a
    reference fit (a co-located serving case's steady iteration leaves out its prefills; the factor carries
    the simulator's own answer into the fit, to first order), 1 where absent; ``weights``: per case id its
    weight in the sum of squares (a bootstrap member: how many times its group was drawn), 1 where absent."""
    from scipy.optimize import least_squares

    from moeplace.sim.config import CostConfig

    steady = {} if steady is None else steady
    for c in cases:
        if c["kind"] in E2E and c["id"] not in steady:
            steady[c["id"]] = Steady(c, quick)
    correction = correction or {}
    weights = weights or {}
    cases = [c for c in cases if weights.get(c["id"], 1.0) > 0]
    root_w = np.sqrt([weights.get(c["id"], 1.0) for c in cases])
    base = CostConfig() if start is None else start
    names = [f for f, _, _ in FIT]
    lo = np.array([b for _, b, _ in FIT])
    hi = np.array([b for _, _, b in FIT])
    scale = np.maximum(hi - lo, 1e-12)

    def cfg_of(x):
        return base.replace(**{n: float(lo[i] + x[i] * scale[i]) for i, n in enumerate(names)})

    def resid(x):
        cfg = cfg_of(x)
        out = []
        for c in cases:
            v = steady[c["id"]].metric(cfg) * correction.get(c["id"], 1.0) if c["kind"] in E2E \
                else kernel_metric(c, cfg)
            out.append(math.log(max(v, 1e-30) / c["published"]))
        return np.array(out) * root_w

    x0 = np.clip((np.array([getattr(base, n) for n in names]) - lo) / scale, 1e-6, 1 - 1e-6)
    t0 = time.perf_counter()
    sol = least_squares(resid, x0, bounds=(0.0, 1.0), diff_step=1e-3, max_nfev=400 if not quick else 60)
    cfg = cfg_of(sol.x)
    default = CostConfig()
    info = {"params": {n: getattr(cfg, n) for n in names}, "defaults": {n: getattr(default, n) for n in names},
            "bounds": {n: [lo_, hi_] for n, lo_, hi_ in FIT},
            "calibration_cases": [c["id"] for c in cases],
            "residual_rms_log": float(np.sqrt(np.sum(sol.fun ** 2) / np.sum(root_w ** 2))),
            "nfev": int(sol.nfev), "seconds": time.perf_counter() - t0, "status": sol.message}
    return cfg, info


def fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.1f}"
