"""How the held-out figure's spread depends on how many groups a plan was made on: the check of a candidate
cause of the shift estimate's conservative ranges (issue 45).

The shift estimate (docs/placement.md "Shift estimate") leaves out each of the ``D`` planning groups in
turn, plans on the other ``D - 1`` and scores the plan on the group it left out; the spread of those ``D``
figures sets the range for what the written placement, planned on all ``D``, keeps on one new group. If a
plan on more groups spreads less on a new group, the figures from ``D - 1``-group plans overstate the
spread (the ranges are too wide).

The check, on the data sets of ``bench/shift_coverage.py`` (six datasets each, a dataset's planning
languages one group): every subset ``S`` of ``n`` datasets (``n = 1..5``) is planned on (every MoE layer,
no layer sample) and scored on every dataset not in ``S``, ``b(S, t)``. Per ``n``:

- ``level``: the mean of ``b(S, t)``;
- ``within``: the spread of a new group's figure under one plan: the pooled variance over ``t`` of
  ``b(S, t)`` within each ``S`` (what the estimate's range is about: the written plan is one plan);
- ``total``: the variance of ``b(S, t)`` over every ``(S, t)`` (the plan's own variation included, as
  the leave-one-out figures carry it: each comes from a different plan).

And the shift estimate replayed, for every planning set of ``D = 3`` datasets (``D = 4`` too, every
layer only, where sizes 3 and 4 were planned), against the written plan's figure on each dataset it did not
see: coverage, the root mean square of ``z`` (the error over the range's half-width), the median width.
Four ways (``replay_tool``): on every layer; on the layers the tool's default estimate samples (the
tagged estimate's folds, ``--seed 0``), exactly as the tool prints it (the pivot of issue 45); and on that
sample, the estimate before the pivot (:func:`previous_range`, main 6857d12: on fresh draws 2-5 it
reproduced the printed ranges of ``bench/shift_coverage.py`` exactly) with the floor on its spread and
without it (where its excess coverage came from). Neither of the last two is what the tool prints. The paired
differences (``moeplace - eplb``) are replayed the same way.

    .venv/bin/python bench/shift_planning_groups.py [--data olmoe,synthetic,synthetic-4lang,captured]
        [--data-seeds 0] [--policies eplb,moeplace] [--sizes 1,2,3,4,5] [--out PATH] [--merge JSON ...]

Writes ``bench/results/shift_planning_groups.json`` (committed: EPLB, every size, draws 0, 2-5 and
101-140); ``shift_planning_groups_moeplace.json`` (EPLB, moeplace and their difference, sizes 2 and 3,
draws 0 and 2-5) and ``shift_planning_groups_robust.json`` (EPLB and ``moeplace --robust``, the two
synthetic sets, the same draws) are ``--out`` runs merged by ``--merge``. Development data: the committed
data sets (seed 0), draws already used to judge the estimate, and draws made for this check; not a fresh
check of any estimate (seeds 6 and 7 are left unseen for that).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # beside this script (also when loaded by path)
import shift_coverage as sc  # the data sets
from _timing import loadavg, write_result

from moeplace.placement.evaluate import evaluate
from moeplace.placement.policies import PlacementProblem, get_policy
from moeplace.placement.shift import _clip, group_figures, layer_sample_of, shift_layers, t80
from moeplace.placement.windows import routing_windows

RUNS = {"eplb": ("eplb", {}), "moeplace": ("moeplace", {}), "moeplace --robust": ("moeplace", {"robust": True})}


def figures(data: dict, run: str, sizes: tuple[int, ...] = (1, 2, 3, 4, 5)) -> tuple[dict[tuple[int, ...], dict[int, float]], dict]:
    """``b(S, t)`` for every subset ``S`` of 1..5 of the six datasets and every ``t`` not in ``S``, and the
    same per MoE layer (``[L]``)."""
    ds = data["datasets"]
    paths = [data["paths"][(d, lang)] for d in ds for lang in data["plan_langs"]]
    loads = routing_windows(paths, window_tokens=data["window_tokens"])
    counts = loads.counts.astype(np.float64)
    owner = np.asarray(loads.provenance["window_inputs"]) // len(data["plan_langs"])  # input -> dataset
    win = {i: np.flatnonzero(owner == i) for i in range(len(ds))}
    name, opts = RUNS[run]
    fn = get_policy(name)
    out: dict[tuple[int, ...], dict[int, float]] = {}
    layer: dict[tuple[int, ...], dict[int, np.ndarray]] = {}
    for n in sizes:
        for S in itertools.combinations(range(len(ds)), n):
            w = np.concatenate([win[i] for i in S])
            problem = PlacementProblem(loads=counts[w], model=loads.model, cluster=data["cluster"],
                                       num_redundant=data["R"], rule="vllm", seed=0, time_limit=None,
                                       samples=None, options={"workers": 1, **opts})
            placement = fn(problem)
            ms = {t: evaluate(placement, counts[win[t]], "vllm", model=loads.model, cluster=data["cluster"])
                  for t in range(len(ds)) if t not in S}
            out[S] = {t: m.balancedness for t, m in ms.items()}
            layer[S] = {t: m.layer_balancedness for t, m in ms.items()}
    return out, layer


def by_size(b: dict[tuple[int, ...], dict[int, float]]) -> dict[int, dict]:
    """Per number of planning groups: level, within-plan and total variance of the held-out figure."""
    out = {}
    for n in sorted({len(S) for S in b}):
        rows = [list(v.values()) for S, v in b.items() if len(S) == n]
        allv = np.array([x for r in rows for x in r])
        within = ([float(np.var(r, ddof=1)) for r in rows if len(r) > 1])
        out[n] = {"level": float(allv.mean()), "total": float(np.var(allv, ddof=1)) if allv.size > 1 else None,
                  "within": float(np.mean(within)) if within else None, "plans": len(rows), "points": int(allv.size)}
    return out


def replay(b: dict[tuple[int, ...], dict[int, float]], D: int) -> dict:
    """The estimate's Student-t range (every layer: no layer-sample terms) for every planning set of ``D``
    datasets, against the written plan's figure on each dataset it did not see."""
    z, err2, assumed, inside, loo_s2, new_s2 = [], [], [], [], [], []
    for S in (S for S in b if len(S) == D):
        x = np.array([b[tuple(j for j in S if j != i)][i] for i in S])
        m, s2 = float(x.mean()), float(np.var(x, ddof=1))
        h = t80(D - 1) * math.sqrt(s2 * (1 + 1 / D))
        ys = list(b[S].values())
        if len(ys) > 1:
            new_s2.append(float(np.var(ys, ddof=1)))
        loo_s2.append(s2)
        for y in ys:
            inside.append(abs(y - m) <= h)
            z.append((y - m) / h if h > 0 else math.inf)
            err2.append((y - m) ** 2)
            assumed.append(s2 * (1 + 1 / D))
    return {"D": D, "planning_sets": sum(len(S) == D for S in b), "points": len(z),
            "coverage": float(np.mean(inside)), "rms_z": float(np.sqrt(np.mean(np.square(z)))),
            "mse_over_assumed": float(np.mean(err2) / np.mean(assumed)),
            "loo_s2_mean": float(np.mean(loo_s2)), "new_s2_mean": float(np.mean(new_s2)) if new_s2 else None}


def _size(r: dict, n: int) -> dict:
    return r["by_size"][n] if n in r["by_size"] else r["by_size"][str(n)]


def pooled(results: list[dict]) -> dict:
    """Per policy (and per data set): the mean over draws of each ``n``'s level and variances, the ratio
    of the within-plan variance at ``n`` to that at ``n - 1`` against what a variance proportional to
    ``1 + 1/n`` gives, and the replayed ranges' coverage over every draw's points."""
    out: dict = {}
    keys = sorted({(r["policy"], r["data"]) for r in results}) + sorted({(r["policy"], "all") for r in results})
    for policy, data in keys:
        sel = [r for r in results if r["policy"] == policy and data in ("all", r["data"])]
        ns = sorted({int(n) for r in sel for n in r["by_size"]})
        cell: dict = {"draws": len(sel), "by_size": {}, "replay": {}}
        for n in ns:
            vals = [r["by_size"][n] if n in r["by_size"] else r["by_size"][str(n)] for r in sel]
            within = [v["within"] for v in vals if v["within"] is not None]
            total = [v["total"] for v in vals if v["total"] is not None]
            cell["by_size"][n] = {"level": float(np.mean([v["level"] for v in vals])),
                                  "within": float(np.mean(within)) if within else None,
                                  "total": float(np.mean(total)) if total else None}
        for n in ns[1:]:
            a, b = cell["by_size"][n - 1]["within"], cell["by_size"][n]["within"]
            if a and b:
                cell["by_size"][n]["within_ratio"] = b / a
                cell["by_size"][n]["model_ratio"] = (1 + 1 / n) / (1 + 1 / (n - 1))
                # how sure: the draws resampled (seeded), the ratio of the mean within-plan variances
                pairs = np.array([[_size(r, n - 1)["within"], _size(r, n)["within"]] for r in sel])
                rng = np.random.default_rng(0)
                boot = [pairs[i, 1].mean() / pairs[i, 0].mean()
                        for i in (rng.integers(0, len(pairs), len(pairs)) for _ in range(2000))]
                cell["by_size"][n]["within_ratio_90"] = [float(x) for x in np.quantile(boot, [0.05, 0.95])]
        for D in (3, 4):
            reps = [r["replay"].get(D) or r["replay"].get(str(D)) for r in sel]
            if any(x is None for x in reps):
                continue
            pts = sum(x["points"] for x in reps)
            cell["replay"][D] = {
                "points": pts,
                "coverage": sum(x["coverage"] * x["points"] for x in reps) / pts,
                "rms_z": math.sqrt(sum(x["rms_z"] ** 2 * x["points"] for x in reps) / pts),
                "loo_s2": float(np.mean([x["loo_s2_mean"] for x in reps])),
                "new_s2": float(np.mean([x["new_s2_mean"] for x in reps if x["new_s2_mean"] is not None]))}
        for kind in TOOL_KINDS:
            reps = [r["replay_tool"][kind] for r in sel]
            pts = sum(x["points"] for x in reps)
            cell["replay_tool"] = cell.get("replay_tool", {})
            cell["replay_tool"][kind] = {
                "points": pts, "coverage": sum(x["coverage"] * x["points"] for x in reps) / pts,
                "rms_z": math.sqrt(sum(x["rms_z"] ** 2 * x["points"] for x in reps) / pts),
                "median_width_mean": float(np.mean([x["median_width"] for x in reps]))}
        out[f"{policy} | {data}"] = cell
    return out


def tool_layers(L: int, folds: int) -> np.ndarray:
    """The layers ``place optimize``'s default estimate samples (``shift_layers``: auto, --seed 0)."""
    loads_like = type("L", (), {"counts": np.ones((1, L, 1))})()
    return shift_layers(loads_like, folds, "auto", 0)


def previous_range(per_layer: np.ndarray, active: int, floor: bool = True) -> list[float]:
    """The range the estimate printed before issue 45's pivot (main 6857d12), replayed for the record: the
    Student-t range over the groups' spread less the sample's noise, held at least at the floor
    ``sigma2_gl / active`` (``floor=False``: not held, as low as 0). Not what ``place optimize`` prints."""
    se, sample = layer_sample_of(per_layer, active)
    per = np.nanmean(per_layer, axis=1)
    s2 = float(np.var(per, ddof=1))
    if sample is not None:
        s2 = max(s2 - sample.noise, sample.interaction / active if floor else 0.0, 0.0)
    h = t80(per.size - 1) * math.sqrt(s2 * (1 + 1 / per.size) + se * se)
    return [float(per.mean()) - h, float(per.mean()) + h]


def replay_tool(b: dict, layer: dict, D: int, sample: np.ndarray, bounds: tuple[float, float] = (0.0, 1.0),
                estimate: Callable[[np.ndarray, int], list[float]] | None = None) -> dict:
    """The tool's own range (:func:`group_figures`: the layer sample's ``se`` and its noise taken out of
    the spread; clipped to ``bounds`` as the tool clips it) on the layers ``sample``, for every planning set
    of ``D`` datasets, against the written plan's figure over every layer on each dataset it did not see;
    ``estimate(per_layer, active) -> [lo, hi]`` replays another range instead (:func:`previous_range`)."""
    inside, z, widths = [], [], []
    L = next(iter(next(iter(layer.values())).values())).size
    for S in (S for S in b if len(S) == D):
        per_layer = np.array([layer[tuple(j for j in S if j != i)][i][sample] for i in S])
        rng = group_figures(per_layer, L)["range"] if estimate is None else estimate(per_layer, L)
        lo, hi = _clip({"range": rng}, *bounds)["range"]
        for y in b[S].values():
            inside.append(lo <= y <= hi)
            z.append((y - (lo + hi) / 2) / ((hi - lo) / 2) if hi > lo else (0.0 if lo == y else math.inf))
            widths.append(hi - lo)
    return {"D": D, "layers": [int(x) for x in sample], "points": len(z), "coverage": float(np.mean(inside)),
            "rms_z": float(np.sqrt(np.mean(np.square(z)))), "median_width": float(np.median(widths))}


TOOL_KINDS = ("every layer", "the tool's sample", "the tool's sample, before (floored spread)",
              "the tool's sample, before, spread not floored")


def tool_replays(run: str, b: dict, layer: dict, sample: np.ndarray) -> dict:
    """The tool's range replayed on every layer and on its own layer sample; and the previous estimate on
    that sample, with and without the floor on its spread (:func:`replay_tool`, :func:`previous_range`)."""
    L = next(iter(next(iter(layer.values())).values())).size
    bounds = (-1.0, 1.0) if " - " in run else (0.0, 1.0)  # a difference, or a figure
    return dict(zip(TOOL_KINDS, (
        replay_tool(b, layer, 3, np.arange(L), bounds=bounds),
        replay_tool(b, layer, 3, sample, bounds=bounds),
        replay_tool(b, layer, 3, sample, bounds=bounds, estimate=previous_range),
        replay_tool(b, layer, 3, sample, bounds=bounds, estimate=lambda p, a: previous_range(p, a, floor=False)))))


def _keyed(r: dict) -> tuple[dict, dict]:
    """A stored result's figures and per-layer figures, keyed as :func:`figures` keys them."""
    def key(S: str) -> tuple[int, ...]:
        return tuple(int(i) for i in S.split(","))
    return ({key(S): {int(t): y for t, y in v.items()} for S, v in r["figures"].items()},
            {key(S): {int(t): np.asarray(a) for t, a in v.items()} for S, v in r["layer_figures"].items()})


def measure(name: str, seed: int, run: str, data: dict, b: dict, layer: dict, seconds: float) -> dict:
    sizes = by_size(b)
    rep = {D: replay(b, D) for D in (3, 4) if any(len(S) == D for S in b) and any(len(S) == D - 1 for S in b)}
    L = next(iter(next(iter(layer.values())).values())).size
    folds = 3 + len(data["plan_langs"])  # the tagged estimate's folds: three datasets, the languages
    tool = tool_replays(run, b, layer, tool_layers(L, folds))
    print(f"{name} seed {seed} {run} ({seconds:.0f} s): "
          + "; ".join(f"n={n} level {v['level']:.3f} within {v['within'] or 0:.5f} total "
                      f"{v['total'] or 0:.5f}" for n, v in sizes.items()), flush=True)
    for k, r in tool.items():
        print(f"   the tool's range, {k} {r['layers']}: coverage {r['coverage']:.2f} rms z "
              f"{r['rms_z']:.2f} median width {r['median_width']:.3f}", flush=True)
    for D, r in rep.items():
        print(f"   replay D={D}: coverage {r['coverage']:.2f} rms z {r['rms_z']:.2f} mse/assumed "
              f"{r['mse_over_assumed']:.2f} loo s2 {r['loo_s2_mean']:.5f} new s2 "
              f"{r['new_s2_mean'] or 0:.5f}", flush=True)
    return {"data": name, "data_seed": seed, "policy": run, "by_size": sizes, "replay": rep,
            "replay_tool": tool, "seconds": seconds,
            "figures": {",".join(map(str, S)): v for S, v in b.items()},
            # per layer only what the replays read: the leave-one-out plans of D = 3 (2 datasets each)
            "layer_figures": {",".join(map(str, S)): {t: [float(x) for x in a] for t, a in v.items()}
                              for S, v in layer.items() if len(S) == 2}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="olmoe,synthetic,synthetic-4lang,captured")
    ap.add_argument("--data-seeds", default="0")
    ap.add_argument("--policies", default="eplb,moeplace")
    ap.add_argument("--sizes", default="1,2,3,4,5", help="the numbers of planning datasets (of 6) planned on")
    ap.add_argument("--out", default=None)
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="summarize the results of these files (runs of other draws) into one, instead of running")
    args = ap.parse_args()
    load0 = loadavg()
    t0 = time.perf_counter()
    results = []
    sizes = tuple(int(n) for n in args.sizes.split(","))
    wall = 0.0
    for f in args.merge or []:
        part = json.loads(Path(f).read_text())
        for r in part["results"]:  # the replays recomputed from the stored figures (this version's kinds)
            b, layer = _keyed(r)
            r["layer_figures"] = {S: v for S, v in r["layer_figures"].items() if len(S.split(",")) == 2}
            r["replay_tool"] = tool_replays(r["policy"], b, layer, np.asarray(r["replay_tool"]["the tool's sample"]["layers"]))
            results.append(r)
        wall += part["wall_s"]
        load0 = part["loadavg_start"]
    for seed in ([] if args.merge else (int(s) for s in args.data_seeds.split(","))):
        sc.DATA_SEED = seed
        for name in args.data.split(","):
            data = sc.DATA[name]()
            runs = {}
            for run in args.policies.split(","):
                t1 = time.perf_counter()
                runs[run] = (*figures(data, run, sizes), time.perf_counter() - t1)
            if "eplb" in runs:  # the paired differences the estimate prints, on the same plans' figures
                for run in [r for r in runs if r != "eplb"]:
                    (b, lb, dt), (be, le, dte) = runs[run], runs["eplb"]
                    runs[f"{run} - eplb"] = ({S: {t: v - be[S][t] for t, v in b[S].items()} for S in b},
                                             {S: {t: v - le[S][t] for t, v in lb[S].items()} for S in lb}, dt + dte)
            for run, (b, layer, dt) in runs.items():
                results.append(measure(name, seed, run, data, b, layer, dt))
    summary = pooled(results)
    print("\npooled over the draws (mean within-plan variance per number of planning groups n; ratio to n-1 "
          "against a variance proportional to 1 + 1/n):")
    for key, c in summary.items():
        print(f"  {key} ({c['draws']} draws): " + "; ".join(
            f"n={n} level {v['level']:.3f} within {v['within'] or 0:.5f}"
            + (f" ratio {v['within_ratio']:.2f} [{v['within_ratio_90'][0]:.2f}, {v['within_ratio_90'][1]:.2f}] "
               f"(model {v['model_ratio']:.2f})" if "within_ratio" in v else "")
            for n, v in c["by_size"].items()))
        for kind, r in c["replay_tool"].items():
            print(f"     the tool's range on {kind}: {r['points']} points, coverage {r['coverage']:.3f}, rms z "
                  f"{r['rms_z']:.2f}, median width {r['median_width_mean']:.3f}")
        for D, r in c["replay"].items():
            print(f"     replay D={D}: {r['points']} points, coverage {r['coverage']:.3f}, rms z {r['rms_z']:.2f}, "
                  f"leave-one-out s2 {r['loo_s2']:.5f}, the written plan's s2 on new groups {r['new_s2']:.5f}")
    write_result("shift_planning_groups", {"loadavg_start": load0, "wall_s": wall or time.perf_counter() - t0,
                                           "development_data": True, "summary": summary, "results": results},
                 Path(args.out) if args.out else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
