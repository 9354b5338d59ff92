"""Calibration on a team's own measured serving points (``place calibrate``): what it changes, how, and how
a calibrated run's figures and interval are labelled.

What calibration changes is declared and small (:data:`REFIT`): the efficiency and overhead terms of the
cost model -- the compute, HBM, GEMM, NVLink and RDMA efficiencies, the latency-bound kernel's floor, the
gap between kernels and the host time per iteration. The shape terms (GEMM tile fill, kernel and DeepEP
latencies), the published constants and the model's structure are left as they are. Two operations on an
ensemble of constant sets (:class:`Member`: constants and a weight), in this order:

1. **Reweight** (:func:`reweight`): each member's weight times the likelihood of the measured points under
   it, ``exp(-1/2 sum_j (r_ij / sigma)^2)`` with ``r_ij = log(simulated_ij / measured_j)`` (importance
   weights; Kish's effective sample size reports how many members carry the answer).
2. **Refit** (:func:`refit`): per member, the :data:`REFIT` subset moved to the maximum a posteriori
   values: ``sum_j (r_j / sigma)^2 + sum_k ((x_k - x0_k) / s_k)^2`` minimised within the constants'
   bounds, ``x`` each constant scaled to its bounds (0..1), ``x0`` the member's own value and ``s_k`` the
   prior width (an ensemble's own spread of each constant, at least 0.05; for a single constant set, how
   far the constants moved between grouped cross-validation folds, or :data:`DEFAULT_PRIOR_SD`). One point moves the constants it is most sensitive to, the least distance that
   explains it; more points pin more of them down.

The members are priced by a function of a constant set (``price(cfg) -> residuals``), so the same code
calibrates one constant set (a one-member ensemble: reweighting is then a no-op and the refit is the
calibration) and an ensemble of fitted members: ``place calibrate`` starts from the shipped cost-model
ensemble (sim/ensemble.py, sim/point.shipped_members), reweights all its members and refits every one that
keeps weight, with the members' own spread as the prior widths.

A calibrated run is priced like an uncalibrated one, by every member (:func:`calibrated_ensemble`,
bench/fidelity_frozen.yaml ``calibration``): one event simulation on the calibrated members' weighted median
member (:func:`median_member`), every calibrated member re-pricing its sampled steady iterations
(sim.ensemble.price_run), the printed figure their weighted median. Its interval comes from the
within-deployment error: bench/fidelity_anchored.py calibrates on all but one case of every published
deployment group and predicts the one left out the same way; those log errors (:data:`ANCHORED_PATH`,
package data, copied into CAL.json) combined with the members' spread (sim.ensemble.within_interval) make
the nominal 80 % interval, checked for its coverage there (each case's interval from its own members and
the other groups' errors).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np

from moeplace.foundation.errors import InputError
from moeplace.foundation.files import OutputKind, read_json, register_kind, tagged_artifact, write_text_atomic
from moeplace.foundation.formats import check, tagged
from moeplace.foundation.settings import Range, build
from moeplace.placement.dispatch import ENGINE_RULES
from moeplace.sim.config import CostConfig
from moeplace.sim.ensemble import LEVEL, Ensemble, effective_size

# The constants a calibration may change, with their bounds (the bounds of bench/fidelity_harness.py's FIT,
# which tests/test_calibrate.py checks): efficiency and overhead terms only.
REFIT: tuple[tuple[str, float, float], ...] = (
    ("sustained_efficiency", 0.3, 1.0),
    ("hbm_efficiency", 0.5, 1.0),
    ("gemm_efficiency", 0.3, 1.0),
    ("link_efficiency", 0.5, 1.0),
    ("nic_efficiency", 0.5, 1.0),
    ("kernel_floor_s", 2e-6, 9e-6),
    ("graph_gap_s", 1e-6, 2e-6),
    ("iteration_overhead_s", 0.2e-3, 1.5e-3),
)
# Measurement noise of one serving figure, log scale: the run-to-run spread of a serving benchmark repeated
# on the same deployment (a few per cent); chosen before any case was calibrated, not fitted
SIGMA = 0.05
# prior width (in bound-scaled units) where no spread of a constant is known
DEFAULT_PRIOR_SD = 0.25
# the metrics a calibration fits, by what a result file gives: output throughput and the median time per
# output token (TTFT is reported, not fitted: it is queueing as much as the model)
FIT_METRICS = ("output_tok_s", "tpot_s")
ANCHORED_PATH = Path(__file__).with_name("anchored_summary.json")
COVERAGE = 0.8


# ---------------------------------------------------------------------------- the deployment
Count = Annotated[int, Range(1)]
NonNeg = Annotated[int, Range(0)]


@dataclass(frozen=True)
class Deployment:
    """The deployment a result file came from (a small YAML beside the results, or ``place calibrate``'s
    flags): model, GPU, GPUs, attention TP / DP, EP, engine, precision, KV dtype, speculative decoding, and
    the engine settings the simulator needs to match it. ``ep``: GPUs the routed experts are spread over
    (default all; fewer means each expert is tensor-sharded over ``gpus / ep``); ``attention_dp``: when
    given, must be ``gpus / attention_tp``; ``mtp``: ``DRAFT:ACCEPT`` as ``place simulate --mtp``;
    ``placement``: the policy the engine placed experts by (``linear`` without EPLB)."""

    model: str
    gpu: str
    gpus: Count
    engine: Literal[ENGINE_RULES] = "vllm"
    attention_tp: Count = 8
    attention_dp: Count | None = None
    ep: Count | None = None
    gpus_per_node: Count | None = None
    expert_dtype: str | None = None
    weight_dtype: str | None = None
    kv_dtype: Literal["bf16", "fp8"] = "fp8"
    attention_dtype: Literal["bf16", "fp8"] = "bf16"
    mtp: str | None = None
    max_seqs: Count = 256
    max_batched_tokens: Count = 8192
    cuda_graph_max_bs: NonNeg = 512
    dbo: bool = False
    deepep_mode: Literal["auto", "normal", "low_latency", "allgather"] = "auto"
    kernel_build: Literal["unfused", "fused"] = "unfused"
    placement: str = "linear"
    redundant: NonNeg = 0

    def __post_init__(self) -> None:
        if self.gpus % self.attention_tp:
            raise InputError(f"deployment: attention_tp {self.attention_tp} does not divide gpus {self.gpus}")
        if self.attention_dp is not None and self.attention_dp * self.attention_tp != self.gpus:
            raise InputError(f"deployment: attention_dp {self.attention_dp} x attention_tp {self.attention_tp} is "
                             f"{self.attention_dp * self.attention_tp}, not gpus {self.gpus}")
        if self.ep is not None and self.gpus % self.ep:
            raise InputError(f"deployment: ep {self.ep} does not divide gpus {self.gpus}")

    @property
    def moe_tp(self) -> int:
        return self.gpus // (self.ep or self.gpus)

    @property
    def model_name(self) -> str:
        """The model's own name (a preset's, or the one its config file gives)."""
        from moeplace.foundation.model import load_model  # reads the preset or config file it names

        try:
            return load_model(self.model).name
        except InputError:
            return self.model

    def describe(self) -> str:
        par = f"TP{self.attention_tp}" + (f" DP{self.gpus // self.attention_tp}" if self.attention_tp < self.gpus else "")
        ep = f"EP{self.ep or self.gpus}" if self.moe_tp == 1 else f"TEP{self.moe_tp}"
        parts = [f"{self.model_name} on {self.gpus} x {self.gpu}", self.engine, par, ep, f"{self.kv_dtype} KV"]
        if self.expert_dtype:
            parts.append(f"{self.expert_dtype} experts")
        if self.mtp:
            parts.append(f"MTP {self.mtp}")
        return ", ".join(parts)


def deployment_of(raw: Any, where: str) -> Deployment:
    """A :class:`Deployment` from a user mapping (unknown keys named with the nearest valid one)."""
    if not isinstance(raw, dict):
        raise InputError(f"{where}: expected a mapping of deployment settings (model, gpu, gpus, ...)")
    for key in ("model", "gpu", "gpus"):
        if key not in raw:
            raise InputError(f"{where}: '{key}' missing (the deployment needs model, gpu and gpus)")
    return build(Deployment, where, raw)


# ---------------------------------------------------------------------------- the ensemble interface
@dataclass(frozen=True)
class Member:
    """One constant set of an ensemble and its weight (weights of an ensemble sum to 1)."""

    cost: CostConfig
    weight: float = 1.0
    name: str = "shipped"


def x_of(cfg: CostConfig) -> np.ndarray:
    """The :data:`REFIT` constants of ``cfg`` scaled to their bounds (0..1), clipped into them."""
    return np.array([min(max((getattr(cfg, n) - lo) / (hi - lo), 0.0), 1.0) for n, lo, hi in REFIT])


def cfg_of(base: CostConfig, x: np.ndarray) -> CostConfig:
    return base.replace(**{n: float(lo + x[i] * (hi - lo)) for i, (n, lo, hi) in enumerate(REFIT)})


Residuals = Callable[[CostConfig], np.ndarray]  # log(simulated / measured) of every measured figure


def reweight(members: Sequence[Member], residuals: Residuals, sigma: float = SIGMA) -> tuple[list[Member], dict]:
    """Members reweighted by the likelihood of the measured figures (importance weights); the info holds
    each member's rms log error and Kish's effective sample size ``(sum w)^2 / sum w^2``."""
    r = [np.asarray(residuals(m.cost), dtype=np.float64) for m in members]
    loglik = np.array([-0.5 * float(np.sum((ri / sigma) ** 2)) for ri in r])
    w0 = np.array([m.weight for m in members], dtype=np.float64)
    logw = np.log(np.maximum(w0, 1e-300)) + loglik
    w = np.exp(logw - logw.max())
    w /= w.sum()
    out = [dataclasses.replace(m, weight=float(wi)) for m, wi in zip(members, w)]
    return out, {"ess": effective_size(w), "members": len(members),
                 "rms_log_error": [float(np.sqrt(np.mean(ri ** 2))) if ri.size else 0.0 for ri in r]}


def refit(member: Member, residuals: Residuals, prior_sd: np.ndarray, sigma: float = SIGMA) -> tuple[Member, dict]:
    """``member`` with its :data:`REFIT` constants at the maximum a posteriori values (module docstring)."""
    from scipy.optimize import least_squares  # scipy: only a calibration imports it

    x0 = x_of(member.cost)
    sd = np.maximum(np.asarray(prior_sd, dtype=np.float64), 1e-3)

    def f(x):
        return np.concatenate([np.asarray(residuals(cfg_of(member.cost, x))) / sigma, (x - x0) / sd])

    start = np.clip(x0, 1e-6, 1 - 1e-6)
    sol = least_squares(f, start, bounds=(0.0, 1.0), diff_step=1e-3, max_nfev=200)
    # a constant the points do not move keeps its value exactly (the search starts a hair inside the bounds)
    x = np.where(np.abs(sol.x - x0) > 1e-4, sol.x, x0)
    cfg = member.cost.replace(**{n: float(lo + x[i] * (hi - lo)) for i, (n, lo, hi) in enumerate(REFIT)
                                 if x[i] != x0[i]})
    r = np.asarray(residuals(cfg))
    moved = {n: {"from": getattr(member.cost, n), "to": getattr(cfg, n),
                 "bound": bool(x[i] <= 1e-4 or x[i] >= 1 - 1e-4)}
             for i, (n, _, _) in enumerate(REFIT) if x[i] != x0[i]}
    return dataclasses.replace(member, cost=cfg), {"moved": moved, "residuals": r.tolist(), "nfev": int(sol.nfev)}


def calibrate_members(members: Sequence[Member], residuals: Residuals, prior_sd: np.ndarray | None = None,
                      sigma: float = SIGMA) -> tuple[list[Member], dict]:
    """Reweight, then refit every member that keeps weight (> 1e-3). ``prior_sd``: the refit's prior width
    per :data:`REFIT` constant; default the members' own spread where there are several (floored at 0.05),
    else :data:`DEFAULT_PRIOR_SD`."""
    if prior_sd is None:
        if len(members) > 1:
            xs = np.array([x_of(m.cost) for m in members])
            prior_sd = np.maximum(xs.std(axis=0), 0.05)
        else:
            prior_sd = np.full(len(REFIT), DEFAULT_PRIOR_SD)
    weighted, winfo = reweight(members, residuals, sigma)
    out, fits = [], []
    for m in weighted:
        if m.weight <= 1e-3 and len(weighted) > 1:
            continue
        fm, info = refit(m, residuals, prior_sd, sigma)
        out.append(fm)
        fits.append({"member": m.name, "weight": m.weight, **info})
    total = sum(m.weight for m in out)
    out = [dataclasses.replace(m, weight=m.weight / total) for m in out]
    return out, {"reweight": winfo, "refit": fits, "prior_sd": [float(v) for v in prior_sd], "sigma": sigma}


def median_member(members: Sequence[Member]) -> Member:
    """The member whose constants lie at the weighted median of every :data:`REFIT` constant (nearest in
    bound-scaled units): the one constant set a single run is priced by."""
    if len(members) == 1:
        return members[0]
    xs = np.array([x_of(m.cost) for m in members])
    w = np.array([m.weight for m in members])
    med = []
    for k in range(xs.shape[1]):
        order = np.argsort(xs[:, k])
        cum = np.cumsum(w[order])
        med.append(xs[order[np.searchsorted(cum, 0.5 * cum[-1])], k])
    return members[int(np.argmin(np.sum((xs - np.array(med)) ** 2, axis=1)))]


# ---------------------------------------------------------------------------- the within-deployment interval
def load_anchored(path: str | Path = ANCHORED_PATH) -> dict[str, Any]:
    """The committed summary of bench/fidelity_anchored.py: the within-deployment log errors' quantiles and
    the refit's prior widths."""
    return read_json(path, missing="missing (the package's anchored-calibration summary; "
                                   "python bench/fidelity_anchored.py writes it)")


def interval_factors(anchored: dict[str, Any]) -> tuple[float, float]:
    """``(lo, hi)``: the 10th and 90th percentiles of log(simulated / published) over the anchored
    predictions (a calibrated throughput S then lies in [S / e^hi, S / e^lo] with nominal 80 %)."""
    q = anchored["interval"]
    return float(q["log_lo"]), float(q["log_hi"])


def within_residuals(interval: dict[str, Any], where: str = "interval") -> tuple[float, ...]:
    """The within-deployment residuals of a calibration's ``interval`` (CAL.json's, copied from the anchored
    summary): log(published / anchored prediction) of each anchored end-to-end case (speed-like: + means the
    calibrated simulator was too slow)."""
    raw = interval.get("residuals_log")
    if not isinstance(raw, list) or not raw:
        raise InputError(f"{where}: field 'residuals_log' missing (the within-deployment errors a calibrated "
                         "run's interval is made of; written by place calibrate since its runs are priced by "
                         "every calibrated member): run place calibrate again")
    try:
        out = tuple(-float(v) for v in raw)  # stored as log(simulated / published), as log_lo / log_hi
    except (TypeError, ValueError):
        raise InputError(f"{where}: field 'residuals_log' must be a list of numbers") from None
    if not all(math.isfinite(v) for v in out):
        raise InputError(f"{where}: field 'residuals_log' must hold finite numbers")
    return out


def calibrated_ensemble(members: Sequence[Member], interval: dict[str, Any],
                        source: str = "place calibrate") -> Ensemble:
    """The calibrated members as the :class:`sim.ensemble.Ensemble` that prices a calibrated run
    (bench/fidelity_frozen.yaml, ``calibration``): every member with its calibrated weight, the event
    simulation on their weighted median member (:func:`median_member`, the ensemble's reference), the
    interval :func:`sim.ensemble.within_interval` of the members' spread and the within-deployment
    residuals of ``interval``."""

    names = tuple(f.name for f in dataclasses.fields(CostConfig))
    med = median_member(members).cost
    w = np.array([m.weight for m in members], dtype=np.float64)
    rows = np.array([[float(getattr(m.cost, n)) for n in names] for m in members], dtype=np.float64)
    return Ensemble(names, {n: float(getattr(med, n)) for n in names}, rows, w / w.sum(), (),
                    np.zeros((len(members), 0), dtype=np.int64), (), {}, float(interval.get("coverage", LEVEL)),
                    {"made": source}, within=within_residuals(interval))


def calibration_run(cal: Calibration, gpus: int, attention_tp: int, engine: str,
                    priced: str = "members") -> dict[str, Any]:
    """What a run's label needs of the calibration that priced it (``run["calibration"]``, JSON-ready).
    ``priced``: ``members`` (every calibrated member, :meth:`Calibration.ensemble`) or ``event`` (a
    comparison by ratios on the event constants alone, as ``place rebalance`` compares uncalibrated
    candidates on the reference constants)."""
    iv = {k: v for k, v in cal.interval.items() if k != "residuals_log"}
    out = {"label": cal.label(), "source": cal.source, "points": cal.points,
           "deployment": cal.deployment.describe(), "changes": cal.doc.get("changes", {}).get("what"),
           "members": len(cal.members), "ess": effective_size([m.weight for m in cal.members]),
           "event_constants": median_member(cal.members).name,
           "interval": {**iv, "residuals": len(cal.interval.get("residuals_log") or ())},
           "differs": differences(cal, gpus, attention_tp, engine), "priced": priced}
    return {**out, "note": calibration_note(out)}


def calibration_note(c: dict[str, Any]) -> str:
    """The label of a calibrated run: what it was calibrated on, where its interval comes from, and what
    the run extrapolates over."""
    iv = c["interval"]
    cov = iv.get("measured_coverage")
    members = c.get("members") or 1
    if c.get("priced") == "event":
        return (f"{c['label']} ({c['source']}): each candidate simulated once on the calibrated members' weighted "
                f"median member ({c.get('event_constants')}), no interval"
                + (f"; this run differs from the calibrated deployment in {', '.join(c['differs'])}: extrapolated"
                   if c.get("differs") else "") + "; compare the candidates by their ratios")
    priced = (f"figures are the weighted median of the {members} calibrated constant sets"
              + (f" (effective {c['ess']:.1f})" if c.get("ess") is not None else "")
              + f"; the ranges are the nominal {iv.get('coverage', COVERAGE):.0%} interval of their spread plus the "
              if members > 1 else
              "figures are priced by the one calibrated constant set the reweighting kept (it collapsed to one "
              f"member); the ranges are the nominal {iv.get('coverage', COVERAGE):.0%} interval of the ")
    note = (f"{c['label']} ({c['source']}): {priced}"
            f"within-deployment error ({iv.get('source', 'bench/fidelity_anchored.py')}"
            + (f"; measured coverage {cov:.0%}" if cov is not None and "coverage measured" not in
               iv.get("source", "") else "") + ")")
    if c.get("differs"):
        note += f"; this run differs from the calibrated deployment in {', '.join(c['differs'])}: extrapolated"
    return note + "; compare placements by their ratios within one run"


# ---------------------------------------------------------------------------- CAL.json
CAL_KIND = "serving-calibration"
SERVING_CALIBRATION = register_kind(OutputKind("serving calibration", False, tagged_artifact(CAL_KIND)))


@dataclass(frozen=True)
class Calibration:
    """A read CAL.json: the deployment, the calibrated members, how many measured points, the
    within-deployment interval, and the document itself."""

    deployment: Deployment
    members: list[Member]
    points: int
    interval: dict[str, Any]
    doc: dict[str, Any]
    source: str

    @property
    def cost(self) -> CostConfig:
        """The constants a calibrated run's event simulation runs on (:func:`median_member`; every member
        re-prices it: :meth:`ensemble`)."""
        return median_member(self.members).cost

    def ensemble(self):
        """The ensemble that prices a calibrated run (:func:`calibrated_ensemble`)."""
        return calibrated_ensemble(self.members, self.interval, f"place calibrate ({self.source})")

    def label(self) -> str:
        return f"calibrated on {self.points} measured point{'s' if self.points != 1 else ''} of " \
               f"{self.deployment.describe()}"


def calibration_doc(dep: Deployment, points: list[dict], members: list[Member], info: dict, base: list[Member],
                    interval: dict, prior_source: str) -> dict[str, Any]:
    names = [n for n, _, _ in REFIT]
    return tagged(CAL_KIND, {
        "deployment": dataclasses.asdict(dep),
        "deployment_text": dep.describe(),
        "points": points,
        "changes": {
            "what": "refit" if len(base) == 1 else "reweight+refit",
            "refit": names,
            "bounds": {n: [lo, hi] for n, lo, hi in REFIT},
            "sigma": info["sigma"], "prior_sd": dict(zip(names, info["prior_sd"])), "prior_source": prior_source,
            "fitted_metrics": list(FIT_METRICS),
            "reweight": info["reweight"], "refit_detail": info["refit"],
        },
        "base_members": [{"name": m.name, "weight": m.weight, "constants": dataclasses.asdict(m.cost)} for m in base],
        "members": [{"name": m.name, "weight": m.weight, "constants": dataclasses.asdict(m.cost)} for m in members],
        "interval": interval,
    })


def write_calibration(path: str | Path, doc: dict[str, Any]) -> None:
    import json  # only the writer formats JSON text

    write_text_atomic(path, json.dumps(doc, indent=1, default=float) + "\n")


def load_calibration(path: str | Path) -> Calibration:
    """A CAL.json written by ``place calibrate``; one-line errors naming the file and field."""
    doc = read_json(path)
    check(doc, CAL_KIND, str(path), "place calibrate --out writes one")
    where = str(path)
    try:
        dep = deployment_of(doc["deployment"], f"{where}: deployment")
        members = [Member(CostConfig(**m["constants"]), float(m["weight"]), str(m.get("name", "member")))
                   for m in doc["members"]]
        interval = doc["interval"]
        float(interval["log_lo"]), float(interval["log_hi"])
        within_residuals(interval, f"{where}: interval")
        points = len(doc["points"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{where}: field {exc} missing or malformed (expected a place calibrate output)") from None
    if not members:
        raise InputError(f"{where}: field 'members' is empty")
    return Calibration(dep, members, points, interval, doc, where)


def check_applies(cal: Calibration, model: str, gpu: str) -> None:
    """A calibration transfers within its model and GPU (other layouts, loads, placements and GPU counts of
    the same model on the same GPU): anything else is refused."""
    d = cal.deployment
    from moeplace.foundation.cluster import load_gpu  # the GPU's canonical name, as the run's cluster has it
    from moeplace.foundation.model import load_model  # the model's canonical name

    m_name, g_name = load_model(d.model).name, load_gpu(d.gpu).name
    if m_name != model or g_name != gpu:
        raise InputError(f"--calibration {cal.source}: calibrated on {m_name} on {g_name}; this run is {model} on "
                         f"{gpu}: a calibration applies to its own model and GPU only")


def differences(cal: Calibration, gpus: int, attention_tp: int, engine: str) -> list[str]:
    """How a run's deployment differs from the calibration's (what the calibration is extrapolated over)."""
    d = cal.deployment
    out = []
    if gpus != d.gpus:
        out.append(f"{gpus} GPUs (calibrated on {d.gpus})")
    if attention_tp != d.attention_tp:
        out.append(f"attention TP{attention_tp} (calibrated TP{d.attention_tp})")
    if engine != d.engine:
        out.append(f"{engine} (calibrated on {d.engine})")
    return out
