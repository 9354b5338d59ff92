"""Coverage and width of the shift estimate's ranges: do the printed 80 % ranges hold 80 % of what unseen
workloads realize, and how wide are they?

The question a range answers (docs/placement.md "Shift estimate"): what balancedness the written placement
keeps on *one new workload* of a kind the planning data does not hold — a new dataset, a new language. The
check: plan (``compare_policies`` with ``--plan-fraction 1``, as ``place optimize`` runs it) on some
datasets, score the placement on each dataset it did not see (both languages of it pooled: "a new
dataset") and, where the data has a third language, on the planning datasets in that language ("a new
language"); a realized figure inside its printed range counts as covered. Also the paired difference
(moeplace minus EPLB) against the realized difference on each new dataset, and whether the estimate ranks
the two the way the new datasets do.

Data with known structure (made here, deterministic; data files under bench/results/, which git ignores):

- ``olmoe``: the six real per-domain expert counts of OLMoE-1B-7B (arxiv, book, c4, github, tulu,
  wikipedia; MoE layers 0, 7 and 15 of 16, 64 experts, top-8; bench/data/olmoe-expert-counts.json, from the
  public allenai/OLMoE repository) are the datasets; each gets two languages by a log-linear language effect
  shared across datasets (scaled so a dataset's two languages sit 0.27 apart, total variation; as on the
  real 6 x 2 routing where related inputs were missed). 8 GPUs = 2 x 4, R = 8.
- ``synthetic``: six planted datasets x three planted languages of a 128-expert top-8 model (Qwen3-30B-A3B's
  shape, 8 of its 48 MoE layers): popularity = shared field + dataset field + language field (+ a small
  interaction), languages 0.27 apart within a dataset. Planning uses languages a and b; language c is the
  "new language". 16 GPUs = 4 x 4, R = 16.
- ``synthetic-4lang`` (issue 45's estimate only: the one before it has no per-language figure): the same
  construction in four languages (other seeds), planning on three, so "a new language" gets a range and
  the fourth language checks it.
- ``captured``: ``place trace capture`` of a tiny random-weight Qwen3-MoE (4 MoE layers x 64 experts, top-4)
  on six prompt domains in two "languages": the prompts as written and
  upper-cased (a token shift shared by every domain); 512-token windows. 8 GPUs = 2 x 4, R = 8.

Every input is a Loads file of windows whose metadata carries its tags (``dataset``, ``lang``). Splits:
three partitions of the six datasets into 3 + 3, both directions (6 splits per data set; ``--splits``).
Modes: ``tagged`` — the inputs' tags are used (before issue 45's estimate, which read no tags:
``--group`` by dataset); ``untagged`` — no tags, no groups (the tool finds the grouping itself). Runs:
``eplb`` + ``moeplace`` in one comparison, and the same with ``--robust``.

    .venv/bin/python bench/shift_coverage.py [--splits 6] [--data olmoe,synthetic,captured]
        [--label after] [--out PATH]

Prints the coverage table and writes ``bench/results/shift_coverage.json`` (committed: the current
estimate on the committed data sets; ``--label before`` with ``PYTHONPATH`` pointing at an older checkout
measured that checkout's estimate: the committed ``shift_coverage_before.json``). Also committed (what
docs/placement.md's table reads): ``shift_coverage_floored.json`` (the committed data sets) and
``shift_coverage_fresh.json`` (draws 2-5), the estimate before its layer-sample pivot (main 6857d12);
``shift_coverage_fresh67.json``, the pivot on fresh draws 6 and 7 (``--data-seed``, each to its own
``--out``, then ``--merge``).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _timing, beside this script (also when loaded by path)
from _timing import RESULTS, ROOT, loadavg, write_result

import moeplace.placement.shift as shift_module
from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.model import from_hf_config, load_model
from moeplace.placement.compare import compare_policies
from moeplace.placement.evaluate import evaluate
from moeplace.placement.shift import load_distance
from moeplace.placement.windows import routing_windows
from moeplace.traces.loads import Loads

NOMINAL = 0.80  # the coverage the ranges state
TARGET_COVERAGE = (0.70, 0.90)
TARGET_WIDTH = 0.20  # median width
OLMOE_COUNTS = ROOT / "bench" / "data" / "olmoe-expert-counts.json"
OLMOE_CONFIG = {"_name_or_path": "allenai/OLMoE-1B-7B-0924", "model_type": "olmoe", "num_hidden_layers": 16,
                "hidden_size": 2048, "intermediate_size": 1024, "num_experts": 64, "num_experts_per_tok": 8,
                "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 50304,
                "max_position_embeddings": 4096}
TWIN_DISTANCE = 0.27  # a dataset's languages apart (total variation), as on the real 6 x 2 routing
WINDOWS, WINDOW_TOKENS = 4, 2048
PARTITIONS = (((0, 1, 2), (3, 4, 5)), ((0, 2, 4), (1, 3, 5)), ((0, 1, 5), (2, 3, 4)))
RUNS = {"plain": {}, "robust": {"robust": True}}
PROMPTS = {  # the captured set's six prompt domains
    "code": ["def f(x):\n    return x * {i} + 1", "import numpy as np; y = np.zeros(({i}, 3))",
             "for (int j = 0; j < {i}; ++j) {{ a[j] = b[j]; }}", "SELECT id, name FROM t WHERE k = {i};"],
    "prose": ["The river ran quietly past the old mill on day {i}.",
              "Once upon a time there lived a king who had {i} daughters.",
              "She said that the meeting would start at noon, {i} minutes late.",
              "Weather today: cloudy with a chance of rain in the afternoon {i}."],
    "digits": ["{i} {i}7 3.14159 2.71828 1.41421 {i}0", "{i} + {i} = {i}{i}; 17 * 23 = 391",
               "2026-12-0{i} 12:34:56 +0000 {i}{i}", "0x{i}F 0b1011 0o755 1e-{i}"],
    "unicode": ["Größe über {i} Äpfel — ça coûte cher", "Привет, как дела? {i} рублей",
                "東京都 {i} 番地 の 天気 は 晴れ", "αβγ δεζ ηθι {i} κλμ"],
    "markup": ['{{"id": {i}, "name": "x", "tags": ["a", "b"]}}', '<div class="row"><span>{i}</span></div>',
               "key_{i}: value\nlist:\n  - a\n  - b", "| col {i} | col b |\n|---|---|"],
    "chatter": ["hey!! how r u doing today lol {i}", "ok cool see u at {i} then :)",
                "what do you think about the new phone? {i} stars", "thanks so much, that helped a lot {i}"],
}

# the estimate of issue 45 reads tags; the one before it does not (its --group is the tagged mode there)
NEW = hasattr(shift_module, "COVERAGE")


# ---------------------------------------------------------------------------- data
def with_languages(p_data: np.ndarray, n_lang: int, seed: int) -> np.ndarray:
    """``[D, n_lang, L, E]`` shares: each dataset in ``n_lang`` languages, a log-linear language effect
    shared by the datasets plus a smaller per-(dataset, language) one, scaled (bisection) so the languages
    of one dataset sit :data:`TWIN_DISTANCE` apart on average."""
    rng = np.random.default_rng(seed)
    D, L, E = p_data.shape
    z = rng.normal(size=(n_lang, L, E))
    eps = rng.normal(size=(D, n_lang, L, E))

    def make(beta: float) -> np.ndarray:
        logits = np.log(p_data + 1e-9)[:, None] + beta * z[None] + 0.3 * beta * eps
        p = np.exp(logits - logits.max(-1, keepdims=True))
        return p / p.sum(-1, keepdims=True)

    def apart(p: np.ndarray) -> float:
        return float(np.mean([load_distance(p[d, a], p[d, b]) for d in range(D)
                              for a in range(n_lang) for b in range(a + 1, n_lang)]))
    lo, hi = 0.0, 4.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if apart(make(mid)) < TWIN_DISTANCE else (lo, mid)
    return make(hi)


def write_multinomial(p: np.ndarray, datasets: list[str], langs: list[str], model, out: Path,
                      seed: int) -> dict[tuple[str, str], Path]:
    """One Loads file per (dataset, language): WINDOWS multinomial windows, tags in its metadata."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for d, ds in enumerate(datasets):
        for a, lang in enumerate(langs):
            counts = np.stack([np.stack([rng.multinomial(WINDOW_TOKENS * model.top_k, p[d, a, li])
                                         for li in range(p.shape[2])]) for _ in range(WINDOWS)])
            path = out / f"{ds}_{lang}.npz"
            Loads(counts.astype(np.int64), model, WINDOW_TOKENS, tuple(f"w{i}" for i in range(WINDOWS)),
                  {"constructed": "bench/shift_coverage.py", "tags": {"dataset": ds, "lang": lang}}).save(path)
            paths[(ds, lang)] = path
    return paths


DATA_SEED = 0  # --data-seed: 0 the committed data sets; others draw fresh ones of the same construction


def _seeded(seed: int) -> int:
    return seed + 1000 * DATA_SEED


def _dir(name: str) -> Path:
    return RESULTS / "shift_coverage" / (name if DATA_SEED == 0 else f"{name}-seed{DATA_SEED}")


def olmoe_data() -> dict:
    d = json.loads(OLMOE_COUNTS.read_text())
    names = sorted(d["domains"])
    counts = np.array([d["domains"][n] for n in names], dtype=np.float64)  # [D, 3, 64]
    model = from_hf_config(OLMOE_CONFIG, source="OLMoE-1B-7B-0924 config").restrict(d["layers"])
    p = with_languages(counts / counts.sum(-1, keepdims=True), 2, seed=_seeded(11))
    langs = ["en", "xx"]
    paths = write_multinomial(p, names, langs, model, _dir("olmoe"), seed=_seeded(3))
    return {"paths": paths, "datasets": names, "plan_langs": langs, "new_lang": None,
            "cluster": make_cluster(8, "h200", 4), "R": 8, "window_tokens": WINDOW_TOKENS}


def synthetic_data() -> dict:
    rng = np.random.default_rng(_seeded(7))
    base = load_model("qwen3-30b-a3b")
    model = base.restrict(base.moe_layers[::6])  # 8 of 48 MoE layers
    L, E = model.num_moe_layers, model.num_experts
    logits = 0.9 * rng.normal(size=(L, E))[None] + rng.normal(size=(6, L, E))
    p = np.exp(logits)
    p = with_languages(p / p.sum(-1, keepdims=True), 3, seed=_seeded(13))
    names, langs = [f"ds{i}" for i in range(6)], ["la", "lb", "lc"]
    paths = write_multinomial(p, names, langs, model, _dir("synthetic"), seed=_seeded(5))
    return {"paths": paths, "datasets": names, "plan_langs": langs[:2], "new_lang": langs[2],
            "cluster": make_cluster(16, "h200", 4), "R": 16, "window_tokens": WINDOW_TOKENS}


def synthetic_languages_data() -> dict:
    """The synthetic datasets in four planted languages; planning uses three, so "a new language" has
    three left-out values (a range) and the fourth language to check it on."""
    rng = np.random.default_rng(_seeded(17))
    base = load_model("qwen3-30b-a3b")
    model = base.restrict(base.moe_layers[::6])
    L, E = model.num_moe_layers, model.num_experts
    logits = 0.9 * rng.normal(size=(L, E))[None] + rng.normal(size=(6, L, E))
    p = np.exp(logits)
    p = with_languages(p / p.sum(-1, keepdims=True), 4, seed=_seeded(19))
    names, langs = [f"ds{i}" for i in range(6)], ["la", "lb", "lc", "ld"]
    paths = write_multinomial(p, names, langs, model, _dir("synthetic-4lang"), seed=_seeded(23))
    return {"paths": paths, "datasets": names, "plan_langs": langs[:3], "new_lang": langs[3],
            "cluster": make_cluster(16, "h200", 4), "R": 16, "window_tokens": WINDOW_TOKENS}


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def captured_data() -> dict:
    from moeplace.traces.capture import CaptureConfig, run_capture  # optional: torch (the capture extra)
    from moeplace.traces.stats import compute_stats  # a trace's Loads, then its tags added

    base = _dir("captured")
    base.mkdir(parents=True, exist_ok=True)
    cfg = base / "config.json"
    _bench_module("shift_lodo").write_tiny_moe_config(cfg)
    prompts_by_domain = PROMPTS
    langs = {"as-written": str, "upper": str.upper}
    paths = {}
    for ds, templates in prompts_by_domain.items():
        for lang, how in langs.items():
            npz = base / f"{ds}_{lang}.npz"
            if not npz.exists():
                trace = base / f"{ds}_{lang}"
                if not trace.exists():
                    txt = base / f"{ds}_{lang}.txt"
                    txt.write_text("\n".join(how(t.format(i=i)) for i in range(1, 17) for t in templates) + "\n")
                    run_capture(CaptureConfig(hf_config=cfg, prompts=txt, out=trace, max_new_tokens=16,
                                              batch_size=16, seed=_seeded(0), sample=True, ignore_eos=True))
                ld = compute_stats(trace, 512, loads_only=True)
                Loads(ld.counts, ld.model, ld.window_tokens, ld.labels,
                      {**ld.provenance, "tags": {"dataset": ds, "lang": lang}}).save(npz)
            paths[(ds, lang)] = npz
    return {"paths": paths, "datasets": list(prompts_by_domain), "plan_langs": list(langs), "new_lang": None,
            "cluster": make_cluster(8, "h200", 4), "R": 8, "window_tokens": 512}


DATA = {"olmoe": olmoe_data, "synthetic": synthetic_data, "captured": captured_data,
        "synthetic-4lang": synthetic_languages_data}


# ---------------------------------------------------------------------------- what the tool printed
def as_sampled(t: dict, lo: float, hi: float) -> list[float] | None:
    """The range the estimate printed before it took the layer sample's own noise out of the groups'
    spread: the tool's own :func:`~moeplace.placement.shift.prediction_interval` of the same left-out
    groups' figures with nothing taken out; the printed range where nothing was. Clipped to ``[lo, hi]``
    like the printed one."""
    if t.get("range") is None or t.get("spread_sampled_layers") is None:
        return t.get("range")
    r = shift_module.prediction_interval(t["per_group"], t.get("layer_sample_se", 0.0))
    return shift_module._clip(r, lo, hi)["range"]


def estimate_of(sh: dict, target: str, mode: str) -> tuple[float, list[float] | None, list[float] | None] | None:
    """(point, range, range as sampled) the tool printed for ``target`` ("dataset" / "lang")."""
    if NEW and mode == "tagged":
        t = (sh.get("by_tag") or {}).get(target)
        return None if t is None else (t["mean"], t.get("range"), as_sampled(t, 0.0, 1.0))
    if target != "dataset":  # one estimate only: the tool's own grouping
        return None
    first = next(iter((sh.get("by_tag") or {}).values()), None) if NEW else None
    return sh["mean"], sh.get("mean_range"), sh.get("mean_range") if first is None else as_sampled(first, 0.0, 1.0)


def difference_of(sh: dict, other: str, target: str, mode: str
                  ) -> tuple[float, list[float] | None, list[float] | None] | None:
    """(point, range, range as sampled) of this policy minus ``other`` the tool printed (before: the
    points' difference)."""
    if not NEW:
        return None
    key = target if mode == "tagged" else None
    for k, v in (sh.get("versus", {}).get(other) or {}).items():
        if key is None or k == key:
            return v["mean"], v.get("range"), as_sampled(v, -1.0, 1.0)
    return None


def pooled(paths: list[Path], window_tokens: int) -> np.ndarray:
    return routing_windows(paths, window_tokens=window_tokens).counts.astype(np.float64)


SHIFT_LAYERS: int | str = "auto"  # --shift-layers (the tool's default: auto)


def _sampled(rng: list[float] | None, x: float) -> dict:
    return {"range_as_sampled": rng, "inside_as_sampled": None if rng is None else bool(rng[0] <= x <= rng[1]),
            "width_as_sampled": None if rng is None else rng[1] - rng[0]}


def as_sampled_rows(rows: list[dict]) -> list[dict]:
    """The rows with the ranges as sampled in place of the printed ones (rows without them: as they are)."""
    return [{**x, "range": x["range_as_sampled"], "inside": x["inside_as_sampled"], "width": x["width_as_sampled"]}
            if "range_as_sampled" in x else x for x in rows]


def run_split(name: str, data: dict, plan: list[int], test: list[int], mode: str, run: str) -> list[dict]:
    ds = data["datasets"]
    plan_paths = [data["paths"][(ds[d], lang)] for d in plan for lang in data["plan_langs"]]
    loads = routing_windows(plan_paths, window_tokens=data["window_tokens"])
    if mode == "untagged":
        loads.provenance.pop("input_tags", None)
    elif not NEW:  # what --group NAME=PATH,... did: each dataset's inputs one group
        loads.provenance["input_groups"] = [Path(p).name.split("_")[0] for p in plan_paths]
    t0 = time.perf_counter()
    cmp = compare_policies(loads, data["cluster"], num_redundant=data["R"], policies=["eplb", "moeplace"],
                           plan_fraction=1.0, options={"workers": 1, **RUNS[run]}, shift=True, seed=0,
                           **({} if SHIFT_LAYERS == "auto" else {"shift_sample": SHIFT_LAYERS}))
    seconds = time.perf_counter() - t0
    tests = {"dataset": [(ds[d], pooled([data["paths"][(ds[d], lang)] for lang in data["plan_langs"]],
                                        data["window_tokens"])) for d in test]}
    if data["new_lang"]:
        tests["lang"] = [(data["new_lang"], pooled([data["paths"][(ds[d], data["new_lang"])] for d in plan],
                                                   data["window_tokens"]))]
    real = {r.policy: {t: [evaluate(r.placement, c, model=loads.model).balancedness for _, c in cases]
                       for t, cases in tests.items()} for r in cmp.results}
    rows = []
    split = f"{'+'.join(ds[d] for d in plan)} -> {'+'.join(ds[d] for d in test)}"
    for r in cmp.results:
        if r.shift is None or (r.policy == "eplb" and run != "plain"):
            continue
        policy = r.policy + (" --robust" if run == "robust" and r.policy == "moeplace" else "")
        for target, cases in tests.items():
            est = estimate_of(r.shift, target, mode)
            if est is None:
                continue
            point, rng, rng_s = est
            for (case, _), x in zip(cases, real[r.policy][target]):
                rows.append({"data": name, "split": split, "mode": mode, "policy": policy, "target": target,
                             "case": case, "realized": x, "estimate": point, "range": rng,
                             "inside": None if rng is None else bool(rng[0] <= x <= rng[1]),
                             "width": None if rng is None else rng[1] - rng[0], "seconds": seconds,
                             "data_seed": DATA_SEED, **_sampled(rng_s, x)})
            if r.policy == "moeplace":
                diff = difference_of(r.shift, "eplb", target, mode)
                dpoint = diff[0] if diff else r.shift["mean"] - next(
                    (x.shift["mean"] for x in cmp.results if x.policy == "eplb"), float("nan"))
                drng = diff[1] if diff else None
                drng_s = diff[2] if diff else None
                for (case, _), a, b in zip(cases, real["moeplace"][target], real["eplb"][target]):
                    rows.append({"data": name, "split": split, "mode": mode, "policy": f"{policy} - eplb",
                                 "target": target, "case": case, "realized": a - b, "estimate": dpoint,
                                 "range": drng, "inside": None if drng is None else bool(drng[0] <= a - b <= drng[1]),
                                 "width": None if drng is None else drng[1] - drng[0], "seconds": seconds,
                                 "data_seed": DATA_SEED, **_sampled(drng_s, a - b),
                                 "difference": True})
        if run == "plain" and r.policy == "eplb" or r.policy == "moeplace":
            worst = r.shift.get("worst_range")
            rows.append({"data": name, "split": split, "mode": mode, "policy": policy, "target": "summary",
                         "realized_mean": float(np.mean(real[r.policy]["dataset"])),
                         "realized_worst": float(np.min(real[r.policy]["dataset"])),
                         "mean_range": r.shift.get("mean_range"), "worst_range": worst,
                         "method": r.shift.get("method"), "layers": len(r.shift.get("layers") or [])})
    for x in rows:
        if x["target"] != "summary":
            rng = "no range" if x["range"] is None else f"[{x['range'][0]:.3f}, {x['range'][1]:.3f}]"
            print(f"  {name} {mode:8s} {split:32s} {x['policy']:25s} {x['target']:7s} {x['case']:10s} "
                  f"estimate {x['estimate']:+.3f} {rng} realized {x['realized']:+.3f} "
                  f"{'' if x['inside'] is None else ('in' if x['inside'] else 'MISS')}", flush=True)
    return rows


def summarize(rows: list[dict]) -> dict:
    """Coverage (share of realized figures inside their printed range) and median width, per (mode,
    policy, target) over every data set and per data set; points without a range are counted apart."""
    out: dict = {}

    def cell(sel: list[dict]) -> dict:
        ranged = [x for x in sel if x["range"] is not None]
        inside = sum(x["inside"] for x in ranged)
        widths = [x["width"] for x in ranged]
        return {"points": len(sel), "with_range": len(ranged), "inside": inside,
                "coverage": inside / len(ranged) if ranged else None,
                "median_width": statistics.median(widths) if widths else None}
    pts = [x for x in rows if x["target"] != "summary"]
    keys = sorted({(x["mode"], x["policy"], x["target"]) for x in pts})
    for mode, policy, target in keys:
        sel = [x for x in pts if (x["mode"], x["policy"], x["target"]) == (mode, policy, target)]
        c = cell(sel)
        c["by_data"] = {d: cell([x for x in sel if x["data"] == d]) for d in sorted({x["data"] for x in sel})}
        out[f"{mode} | {policy} | {target}"] = c
    return out


CHECK_LEVEL = 0.90  # the bootstrap interval of each coverage figure (how sure the check itself is)
CHECK_RESAMPLES = 2000


def calibration(rows: list[dict], seed: int = 0) -> dict:
    """How sure the coverage figures are, per (mode, policy, target) over the points with a range.

    The points of one split share their plan, their range and their planning data, so they are not
    independent draws: the unit of the bootstrap is the split (``data`` x ``split``), resampled with
    replacement ``CHECK_RESAMPLES`` times (seeded). Per cell: ``coverage`` and its ``CHECK_LEVEL``
    interval; ``rms_z``, the root mean square of ``z = (realized - the range's centre) / its half-width``
    (``|z| <= 1`` exactly when covered; a range of known spread that holds 80 % of normal errors has
    ``rms_z`` 0.78), and ``implied_coverage``, the coverage a normal error of that ``rms_z`` would have: both
    use how far inside or outside each point lies, not only whether. The 0.78 reference is for a known
    spread: a Student-t range from D = 3 groups (2 degrees of freedom) has a ``z`` of infinite variance even
    when calibrated (bench/shift_planning_groups.py: 78 % coverage at rms z 1.59 on every layer), so for
    such ranges read the coverage, not ``rms_z``.
    """
    cells: dict = {}
    for x in rows:
        if x["target"] == "summary" or x.get("range") is None:
            continue
        lo, hi = x["range"]
        half = (hi - lo) / 2
        z = (x["realized"] - (lo + hi) / 2) / half if half > 0 else (0.0 if x["inside"] else float("inf"))
        cell = cells.setdefault(f"{x['mode']} | {x['policy']} | {x['target']}", {})
        cell.setdefault((x["data"], x["split"], x.get("data_seed", 0)), []).append((z, bool(x["inside"])))
    rng = np.random.default_rng(seed)
    a = (1 - CHECK_LEVEL) / 2

    def figures(groups: list[list[tuple[float, bool]]]) -> tuple[float, float, float]:
        z = np.array([v for g in groups for v, _ in g])
        inside = np.array([i for g in groups for _, i in g])
        rms = float(np.sqrt(np.mean(z ** 2)))
        implied = float(math.erf(1 / (rms * math.sqrt(2)))) if rms > 0 else 1.0
        return float(inside.mean()), rms, implied

    out: dict = {}
    for key, by_split in sorted(cells.items()):
        groups = list(by_split.values())
        point = figures(groups)
        boot = np.array([figures([groups[i] for i in rng.integers(0, len(groups), len(groups))])
                         for _ in range(CHECK_RESAMPLES)])
        lo_q, hi_q = np.quantile(boot, [a, 1 - a], axis=0)
        out[key] = {"points": sum(len(g) for g in groups), "splits": len(groups), "level": CHECK_LEVEL,
                    **{name: {"value": point[i], "interval": [float(lo_q[i]), float(hi_q[i])]}
                       for i, name in enumerate(("coverage", "rms_z", "implied_coverage"))}}
    return out


def ranking(rows: list[dict]) -> dict:
    """Per (mode, run, split): does the estimated moeplace - EPLB difference have the sign of the realized
    mean difference over the new datasets; and where the range excludes 0, is that call right."""
    diffs = [x for x in rows if x.get("difference") and x["target"] == "dataset"]
    out: dict = {}
    for mode in sorted({x["mode"] for x in diffs}):
        for policy in sorted({x["policy"] for x in diffs}):
            sel = [x for x in diffs if x["mode"] == mode and x["policy"] == policy]
            by_split: dict = {}
            for x in sel:
                by_split.setdefault((x["data"], x["split"], x.get("data_seed", 0)), []).append(x)
            right = decisive = decisive_right = 0
            for xs in by_split.values():
                realized = float(np.mean([x["realized"] for x in xs]))
                est, rng = xs[0]["estimate"], xs[0]["range"]
                right += int(np.sign(est) == np.sign(realized))
                if rng is not None and (rng[0] > 0 or rng[1] < 0):
                    decisive += 1
                    decisive_right += int(np.sign(est) == np.sign(realized))
            out[f"{mode} | {policy}"] = {"splits": len(by_split), "sign_right": right, "decisive": decisive,
                                         "decisive_right": decisive_right}
    return out


def old_style(rows: list[dict]) -> dict:
    """The check the earlier benches made: the realized mean over the new datasets inside ``mean_range``
    and their worst inside ``worst_range`` (where the estimate prints one)."""
    out: dict = {}
    for x in (r for r in rows if r["target"] == "summary"):
        k = f"{x['mode']} | {x['policy']}"
        c = out.setdefault(k, {"mean_inside": 0, "worst_inside": 0, "n": 0, "worst_n": 0})
        c["n"] += 1
        if x["mean_range"]:
            c["mean_inside"] += int(x["mean_range"][0] <= x["realized_mean"] <= x["mean_range"][1])
        if x["worst_range"]:
            c["worst_n"] += 1
            c["worst_inside"] += int(x["worst_range"][0] <= x["realized_worst"] <= x["worst_range"][1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--splits", type=int, default=6, help="splits per data set (of 6: 3 partitions x 2 directions)")
    ap.add_argument("--data", default="olmoe,synthetic,captured")
    ap.add_argument("--modes", default="tagged,untagged")
    ap.add_argument("--runs", default="plain,robust")
    ap.add_argument("--shift-layers", default="auto", help="the estimate's layers, as place optimize's flag "
                    "(default auto: the tool's default)")
    ap.add_argument("--label", default="after", help="what the results describe (before: an older checkout)")
    ap.add_argument("--out", default=None, help="results file (default bench/results/shift_coverage.json)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="summarize the rows of these results files (runs of one data set each, side by side) "
                         "into one, instead of running")
    ap.add_argument("--data-seed", type=int, default=0,
                    help="0: the committed data sets; another: fresh ones of the same construction (new seeds: "
                         "the synthetic fields and windows, OLMoE's language effect and windows, the captured "
                         "model's sampling), for checking a change to the estimate on data it was not chosen on")
    args = ap.parse_args()
    global SHIFT_LAYERS, DATA_SEED
    DATA_SEED = args.data_seed
    SHIFT_LAYERS = args.shift_layers if args.shift_layers in ("auto", "all") else int(args.shift_layers)
    load0 = loadavg()
    t0 = time.perf_counter()
    rows: list[dict] = []
    info: dict = {}
    splits_run: dict = {}
    label = "issue 45" if NEW else "before issue 45"
    wall = 0.0
    measured_on = None
    seeds: list[int] = []
    if args.merge:
        for f in args.merge:
            part = json.loads(Path(f).read_text())
            wall += part["wall_s"]
            # a split's rows are one cluster per data draw: fresh draws (--data-seed) reuse the split names
            rows += [{"data_seed": part.get("data_seed", 0), **x} for x in part["rows"]]
            info.update(part["data"])
            for d, n in (part["splits"] if isinstance(part["splits"], dict)
                         else {d: part["splits"] for d in part["data"]}).items():
                splits_run[d] = splits_run.get(d, 0) + n
            seed = part.get("data_seed", 0)
            seeds += seed if isinstance(seed, list) else [seed]  # a merged file lists its draws
            load0 = part["loadavg_start"]
            label = part["estimate"]
            measured_on = part.get("machine")  # the runs' machine (a merge measures nothing itself)
    else:
        splits = [s for a, b in PARTITIONS for s in ((a, b), (b, a))][: args.splits]
        for name in args.data.split(","):
            data = DATA[name]()
            info[name] = {"datasets": data["datasets"], "plan_langs": data["plan_langs"],
                          "new_lang": data["new_lang"], "gpus": data["cluster"].num_gpus, "redundant": data["R"]}
            splits_run[name] = len(splits)
            for plan, test in splits:
                for mode in args.modes.split(","):
                    for run in args.runs.split(","):
                        rows += run_split(name, data, list(plan), list(test), mode, run)
    summary = summarize(rows)
    rank = ranking(rows)
    print(f"\n{args.label}: coverage of the printed ranges (nominal {NOMINAL:.0%}; target "
          f"{TARGET_COVERAGE[0]:.0%}-{TARGET_COVERAGE[1]:.0%}, median width <= {TARGET_WIDTH})")
    print("| mode | policy | new | coverage (inside / with a range) | median width | per data set |")
    print("|---|---|---|---|---|---|")
    for key, c in summary.items():
        mode, policy, target = key.split(" | ")
        cov = "-" if c["coverage"] is None else f"{c['coverage']:.0%} ({c['inside']}/{c['with_range']})"
        wid = "-" if c["median_width"] is None else f"{c['median_width']:.3f}"
        per = "; ".join(f"{d} {'-' if v['coverage'] is None else format(v['coverage'], '.0%')} / "
                        f"{'-' if v['median_width'] is None else format(v['median_width'], '.2f')}"
                        for d, v in c["by_data"].items())
        print(f"| {mode} | {policy} | {target} | {cov} | {wid} | {per} |")
    calib = calibration(rows)
    sampled = any("range_as_sampled" in x for x in rows)
    rows_s = as_sampled_rows(rows) if sampled else []
    calib_s = calibration(rows_s) if sampled else {}
    summary_s = summarize(rows_s) if sampled else {}
    print(f"\nhow sure each coverage figure is ({CHECK_LEVEL:.0%} intervals, the splits bootstrapped; rms z 0.78 and "
          f"implied coverage {NOMINAL:.0%} for a calibrated range of known spread)" + (
              "; beside it the same run's ranges as sampled (the layer sample's own noise left in the spread, "
              "as the estimate before did)" if sampled else "") + ":")
    print("| mode | policy | new | splits | coverage | rms z | implied coverage | median width |"
          + (" as sampled: coverage, rms z, median width |" if sampled else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|" if sampled else ""))
    for key, c in calib.items():
        f = {n: f"{c[n]['value']:.2f} [{c[n]['interval'][0]:.2f}, {c[n]['interval'][1]:.2f}]"
             for n in ("coverage", "rms_z", "implied_coverage")}
        line = (f"| {key} | {c['splits']} | {f['coverage']} | {f['rms_z']} | {f['implied_coverage']} | "
                f"{summary[key]['median_width']:.3f} |")
        if key in calib_s:
            cs = calib_s[key]
            line += (f" {cs['coverage']['value']:.2f}, {cs['rms_z']['value']:.2f}, "
                     f"{summary_s[key]['median_width']:.3f} |")
        print(line)
    print("\nranking moeplace against EPLB (sign of the estimated difference vs the realized mean difference):")
    for key, c in rank.items():
        print(f"  {key}: sign right in {c['sign_right']} of {c['splits']} splits; range excludes 0 in "
              f"{c['decisive']}, right in {c['decisive_right']}")
    write_result("shift_coverage", {"label": args.label, "estimate": label,
                                    "loadavg_start": load0, "wall_s": wall or time.perf_counter() - t0,
                                    "nominal": NOMINAL, "splits": splits_run, "data": info,
                                    "shift_layers": SHIFT_LAYERS,
                                    "data_seed": (seeds[0] if len(set(seeds)) == 1 else sorted(set(seeds)))
                                    if seeds else DATA_SEED,
                                    "summary": summary, "calibration": calib, "ranking": rank,
                                    **({"summary_as_sampled": summary_s, "calibration_as_sampled": calib_s}
                                       if sampled else {}), "old_style": old_style(rows),
                                    "rows": rows, **({"machine": measured_on} if measured_on else {})},
                 Path(args.out) if args.out else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
