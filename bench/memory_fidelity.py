"""Memory-plan fidelity: the KV pool the plan sizes against the pool a real engine printed at start-up.

Every case of bench/memory_cases.yaml is one published engine start-up (vLLM's "GPU KV cache size: N
tokens", SGLang's "KV Cache is allocated. #tokens: N"). The plan answers through the code path
``place simulate`` sizes its admission pools with (``sim.memory.plan_pools`` on the case's model, GPU
and engine settings): per-GPU KV token slots of one attention rank and the pool's bytes. The error of a
case is ``plan / published - 1`` (signed: negative = the plan's pool is smaller than the engine's).

Printed per case and overall: median and max |error| and the signed median, for the token count and,
where the log printed it, the pool's bytes. With ``--basis both`` (the default) every case is sized twice,
from each GPU's device-reported memory (what the engines size from, the shipped basis) and from its
marketing capacity (the plan's sizing before the device-reported figure was added), so the two columns
come from one run.

    .venv/bin/python bench/memory_fidelity.py [--cases bench/memory_cases.yaml] [--only ID[,ID]]
                                              [--basis both|device|marketing] [--out FILE]

Writes bench/results/memory_fidelity.json (``figures``: per basis the summary; ``cases``: per case the
published and planned figures, the error, and the plan's per-GPU lines). The runtime reserve is NOT fitted
on these cases: a systematic bias is reported (``figures.<basis>.kv_bytes.signed_median``), not removed.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _timing, beside this script
from _timing import BENCH, loadavg, rel, write_result  # before any project import: sets sys.path
from fidelity_harness import preset_model

from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.errors import InputError
from moeplace.sim.config import EngineConfig
from moeplace.sim.memory import plan_pools

CASES = BENCH / "memory_cases.yaml"
GiB = 2.0**30
BASES = ("device", "marketing")
REQUIRED = ("id", "source", "published_on", "published", "engine", "model", "gpu", "gpus", "attention_tp", "kv_dtype",
            "max_batched_tokens", "max_num_seqs", "assumptions")
ENGINES = ("vllm", "sglang")


# ---------------------------------------------------------------------------- cases
def load_cases(path: Path | str = CASES) -> list[dict]:
    """The cases of ``path``, each checked: every field the pool depends on present, one memory fraction
    (``gpu_memory_utilization`` for vLLM, ``mem_fraction_static`` for SGLang), a published token count."""
    import yaml

    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise InputError(f"{path}: not a readable case file ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("cases"), list) or not doc["cases"]:
        raise InputError(f"{path}: expected a mapping with a non-empty list 'cases'")
    seen: set[str] = set()
    for i, c in enumerate(doc["cases"]):
        where = f"{path}: case {c.get('id', i + 1) if isinstance(c, dict) else i + 1}"
        if not isinstance(c, dict):
            raise InputError(f"{where}: expected a mapping")
        missing = [k for k in REQUIRED if k not in c]
        if missing:
            raise InputError(f"{where}: field(s) {missing} missing")
        if c["id"] in seen:
            raise InputError(f"{where}: id repeated")
        seen.add(c["id"])
        if c["engine"] not in ENGINES:
            raise InputError(f"{where}: engine '{c['engine']}' (expected one of {ENGINES})")
        fracs = [k for k in ("gpu_memory_utilization", "mem_fraction_static") if k in c]
        if len(fracs) != 1:
            raise InputError(f"{where}: give exactly one of gpu_memory_utilization (vLLM) or mem_fraction_static "
                             f"(SGLang), got {fracs or 'none'}")
        if not (isinstance(c[fracs[0]], (int, float)) and 0 < c[fracs[0]] <= 1):
            raise InputError(f"{where}: {fracs[0]} must be a number in (0, 1], got {c[fracs[0]]!r}")
        pub = c["published"]
        if not isinstance(pub, dict) or not isinstance(pub.get("kv_tokens"), int) or pub["kv_tokens"] < 1:
            raise InputError(f"{where}: published.kv_tokens must be a whole number >= 1")
        if "kv_gib" in pub and not (isinstance(pub["kv_gib"], (int, float)) and pub["kv_gib"] > 0):
            raise InputError(f"{where}: published.kv_gib must be a number > 0")
        for k in ("gpus", "attention_tp", "max_batched_tokens", "max_num_seqs"):
            if not isinstance(c[k], int) or c[k] < 1:
                raise InputError(f"{where}: field '{k}' must be a whole number >= 1, got {c[k]!r}")
        if c.get("dcp", 1) != 1:
            raise InputError(f"{where}: dcp {c['dcp']}: `place simulate` has no decode context parallelism")
        if not isinstance(c["assumptions"], list):
            raise InputError(f"{where}: assumptions must be a list")
    return doc["cases"]


def case_model(case: dict):
    """The case's model preset with its checkpoint's quantization (``expert_dtype`` / ``weight_dtype``)."""
    return preset_model(case["model"], case)


def case_engine(case: dict) -> EngineConfig:
    """The engine settings the pool depends on, as ``place simulate`` takes them (SGLang's
    ``mem_fraction_static`` plays the role of vLLM's ``gpu_memory_utilization``: the static budget's share
    of the device memory)."""
    frac = case.get("gpu_memory_utilization", case.get("mem_fraction_static"))
    return EngineConfig(attention_tp=case["attention_tp"], moe_tp=case.get("moe_tp", 1), kv_dtype=case["kv_dtype"],
                        gpu_memory_utilization=float(frac), max_batched_tokens=case["max_batched_tokens"],
                        max_seqs=case["max_num_seqs"], cuda_graph_max_bs=case.get("cuda_graph_max_bs", 512),
                        mtp_draft=case.get("mtp", 0))


def case_cluster(case: dict, basis: str):
    """The case's cluster; ``basis`` "marketing" sizes from the GPU's marketing capacity (its
    device-reported figure dropped), "device" from what the device reports (the shipped sizing)."""
    cluster = make_cluster(case["gpus"], case["gpu"])
    if basis == "marketing" and cluster.gpu.device_memory_bytes is not None:
        cluster = dataclasses.replace(cluster, gpu=dataclasses.replace(cluster.gpu, device_memory_bytes=None))
    return cluster


# ---------------------------------------------------------------------------- the plan's answer
def kv_tokens(pools) -> int:
    """Per-GPU KV token slots of one attention rank's pool (a shared pool holding no state is all KV)."""
    if pools.kv_token_capacity is not None:
        return int(pools.kv_token_capacity)
    return int(pools.pool_bytes // pools.kv_bytes_per_token)


def plan_case(case: dict, basis: str = "device") -> dict:
    """The plan's pool for ``case`` through ``sim.memory.plan_pools`` (what ``place simulate`` admits against)."""
    model = case_model(case)
    pools, plan = plan_pools(model, case_cluster(case, basis), case_engine(case), int(case.get("redundant", 0)))
    kv_bytes = pools.kv_pool_bytes if not pools.shared else pools.pool_bytes
    return {"kv_tokens": kv_tokens(pools), "kv_gib": kv_bytes / GiB,
            "memory_bytes": plan.hbm_bytes, "budget_bytes": plan.budget_bytes,
            "weights_gb": plan.weight_bytes / 1e9, "reserve_gb": plan.reserve_bytes / 1e9,
            "kv_bytes_per_token": pools.kv_bytes_per_token,
            "lines": [{"section": x.section, "name": x.name, "gb": round(x.bytes / 1e9, 4)} for x in plan.lines]}


def error(planned: float, published: float) -> float:
    """Signed relative error of the plan: ``planned / published - 1``."""
    return planned / published - 1.0


def summarize(errors: list[float]) -> dict:
    """Median and max |error| and the signed median of ``errors`` (``None`` where there are none)."""
    if not errors:
        return {"n": 0, "median_abs": None, "max_abs": None, "signed_median": None}
    return {"n": len(errors), "median_abs": statistics.median(abs(e) for e in errors),
            "max_abs": max(abs(e) for e in errors), "signed_median": statistics.median(errors)}


def score(cases: list[dict], bases: tuple[str, ...]) -> tuple[list[dict], dict]:
    """Per case its published pool and, per basis, the plan's with its errors; per basis the summaries."""
    rows = [{"id": c["id"], "engine": c["engine"], "model": c["model"], "gpu": c["gpu"], "gpus": c["gpus"],
             "published_on": str(c["published_on"]),
             "source": c["source"].get("url") if isinstance(c["source"], dict) else c["source"],
             "published": c["published"], "planned": {}} for c in cases]
    figures = {}
    for basis in bases:
        tok_err, byte_err = [], []
        for c, row in zip(cases, rows):
            p = plan_case(c, basis)
            pub = c["published"]
            e_tok = error(p["kv_tokens"], pub["kv_tokens"])
            e_byte = error(p["kv_gib"], pub["kv_gib"]) if "kv_gib" in pub else None
            row["planned"][basis] = {**p, "kv_tokens_error": e_tok, "kv_gib_error": e_byte}
            tok_err.append(e_tok)
            if e_byte is not None:
                byte_err.append(e_byte)
        figures[basis] = {"kv_tokens": summarize(tok_err), "kv_bytes": summarize(byte_err)}
    return rows, figures


def _pct(x: float | None, signed: bool = True) -> str:
    if x is None or math.isnan(x):
        return "-"
    return f"{100 * x:+.1f} %" if signed else f"{100 * x:.1f} %"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=str(CASES))
    ap.add_argument("--only", default=None, help="comma-separated case ids (a subset)")
    ap.add_argument("--basis", choices=("both", *BASES), default="both")
    ap.add_argument("--out", default=None, help="results file (default bench/results/memory_fidelity.json)")
    a = ap.parse_args(argv)
    try:
        cases = load_cases(a.cases)
        if a.only:
            want = a.only.split(",")
            unknown = sorted(set(want) - {c["id"] for c in cases})
            if unknown:
                raise InputError(f"--only: unknown case id(s) {unknown}")
            cases = [c for c in cases if c["id"] in want]
        bases = BASES if a.basis == "both" else (a.basis,)
        rows, figures = score(cases, bases)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{len(cases)} published KV pool(s) from {rel(a.cases)}; load average {loadavg()}")
    head = f"{'case':<44}{'published':>12}" + "".join(f"{b + ' plan':>16}{'error':>10}" for b in bases)
    print(head)
    for r in rows:
        line = f"{r['id']:<44}{r['published']['kv_tokens']:>12,}"
        for b in bases:
            p = r["planned"][b]
            line += f"{p['kv_tokens']:>16,}{_pct(p['kv_tokens_error']):>10}"
        print(line)
        if "kv_gib" in r["published"]:
            line = f"{'  pool GiB':<44}{r['published']['kv_gib']:>12.2f}"
            for b in bases:
                p = r["planned"][b]
                line += f"{p['kv_gib']:>16.2f}{_pct(p['kv_gib_error']):>10}"
            print(line)
    for b in bases:
        for what in ("kv_tokens", "kv_bytes"):
            s = figures[b][what]
            print(f"{b:>10} {what:<9}: n {s['n']}, median |error| {_pct(s['median_abs'], False)}, max |error| "
                  f"{_pct(s['max_abs'], False)}, signed median {_pct(s['signed_median'])}")
    out = Path(a.out) if a.out else None
    write_result("memory_fidelity", {"cases_file": rel(a.cases), "bases": list(bases), "figures": figures,
                                     "cases": rows}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
