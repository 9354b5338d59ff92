"""Leave-one-domain-out on the project's own data: how well placements planned on some workloads balance
an unseen one, how well ``place optimize``'s shift estimate predicts that, and what ``--robust`` keeps over
EPLB. (The hedges once measured here — ``--envelope``, ``--dilate``, ``--spread`` — were removed from the
optimizer: none beat plain ``--robust`` on unseen domains by more than repeat-run noise; their figures stay
in bench/results/shift_lodo.json and docs/placement.md.)

Data (made here, deterministic):

- ``synthetic``: a ``place trace synth`` trace of Qwen3-30B-A3B's shape (48 MoE layers x 128 experts,
  top-8), 4 domains, drift 1 (each phase one domain), split by each token's domain tag into one trace
  per domain (requests keep one domain each); scenarios = those traces. No planning window holds a token
  of the unseen domain. ``synthetic-window-tag`` (``--synthetic-split window-tag``, EPLB and ``--robust``
  only): the trace as it is, scenarios = the windows' dominant domain tags — the drift mixes domains at
  the phase changes, so windows tagged with another domain still carry some of the "unseen" one (up to
  ~40 % of a window): a leaky split, kept to show how much it flatters a per-window plan.
- ``captured``: ``place trace capture`` of a small random-weight Qwen3-MoE (4 MoE layers x 64 experts,
  top-4) on four prompt domains (code, prose, digits, non-ASCII text), one trace per domain;
  scenarios = the input files. ``captured-seed1``, ``captured-seed2``: the same prompts through random
  weights of other seeds (``--captured-seeds``): other models, other routings.

For each domain ``d``: the planning data is every other domain. ``compare_policies(..., plan_fraction=1,
shift=True)`` plans each policy on it and estimates, by leave-one-scenario-out *within* the planning
domains, the balancedness to expect on an unseen workload; the placement is then scored on ``d`` (the
realized unseen balancedness).

Two oracles (not methods: they see the unseen domain on purpose) bound what any static placement could
keep: ``self`` = ``--robust`` planned on the unseen domain itself, ``all`` = ``--robust`` planned on every
domain, the unseen one included (one placement for all four). With them, how far apart the domains are:
``tv_rest`` = total-variation distance between a domain's expert shares and the other domains' (mean over
layers), ``tv_window`` = between a window's shares and its own domain's (sampling noise and mix), ``corr_rest`` =
correlation of a domain's expert loads with the others', ``hot_rank_max`` = how cold (rank in the others'
loads, 0 = hottest) one of its 4 hottest experts per layer can be, ``hot_hits`` = how many of its R hottest
experts per layer a statistic of the other domains (mean, maximum, spread) ranks in its own top R (what a
hedge could know to replicate), ``coactivation`` = whether those experts fire together in the other domains'
tokens (a structure a hedge could spread). ``--stats-only`` recomputes these without planning.
Prints a table and writes ``bench/results/shift_lodo.json``.

    .venv/bin/python bench/shift_lodo.py [--tokens 60000] [--time-limit 4] [--skip-captured]
        [--synthetic-split domain,window-tag] [--variants eplb,robust,...] [--stats-only]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moeplace.foundation.cluster import make_cluster
from moeplace.foundation.files import atomic_path, write_text_atomic
from moeplace.foundation.model import load_model
from moeplace.placement.compare import compare_policies
from moeplace.placement.evaluate import evaluate
from moeplace.placement.shift import scenarios
from moeplace.placement.windows import routing_windows
from moeplace.sim.workload import load_trace_tokens
from moeplace.traces.synth import SynthConfig, synthesize

RESULTS = ROOT / "bench" / "results"
VARIANTS = {  # name -> (policy, options)
    "eplb": ("eplb", {}),
    "moeplace": ("moeplace", {}),
    "robust": ("moeplace", {"robust": True}),
}
LEAKY_VARIANTS = ("eplb", "robust")  # all that the window-tag split runs
ORACLE = ("moeplace", {"robust": True})
DOMAIN_PROMPTS = {
    "code": ["def f(x):\n    return x * {i} + 1", "for (int j = 0; j < {i}; ++j) {{ a[j] = b[j]; }}",
             "import numpy as np; y = np.zeros(({i}, 3))", "SELECT id, name FROM t WHERE k = {i};"],
    "prose": ["The river ran quietly past the old mill on day {i}.",
              "She said that the meeting would start at noon, {i} minutes late.",
              "Once upon a time there lived a king who had {i} daughters.",
              "Weather today: cloudy with a chance of rain in the afternoon {i}."],
    "digits": ["{i} {i}7 3.14159 2.71828 1.41421 {i}0", "2026-12-0{i} 12:34:56 +0000 {i}{i}",
               "{i} + {i} = {i}{i}; 17 * 23 = 391", "0x{i}F 0b1011 0o755 1e-{i}"],
    "unicode": ["Größe über {i} Äpfel — ça coûte cher", "東京都 {i} 番地 の 天気 は 晴れ",
                "Привет, как дела? {i} рублей", "αβγ δεζ ηθι {i} κλμ"],
}


def synthetic_loads(tokens: int, window_tokens: int, split: str = "domain"):  # -> (Loads, trace paths)
    """The synthetic trace's windows: one trace per domain (``split="domain"``, each token by its own tag)
    or the trace as it is (``"window-tag"``: scenarios = dominant tag per window)."""
    model = load_model("qwen3-30b-a3b")
    path = RESULTS / f"qwen-lodo-{tokens}"
    if not path.exists():
        print(f"synthesizing {tokens} tokens -> {path}", flush=True)
        synthesize(model, SynthConfig(num_tokens=tokens, seed=3, num_domains=4, drift=1.0, drift_phases=4), path)
    if split == "window-tag":
        return routing_windows([path], window_tokens=window_tokens), [path]
    import pyarrow.compute as pc  # pyarrow: polars' own dependency; a filter that keeps the file metadata
    import pyarrow.parquet as pq

    table = pq.read_table(path)  # one part file; a token's rows (one per layer) share its request's domain
    paths = []
    for dom in dict.fromkeys(table.column("domain").to_pylist()):
        out = RESULTS / f"qwen-lodo-{tokens}-by-domain" / dom
        if not out.exists():
            with atomic_path(out, directory=True) as tmp:
                pq.write_table(table.filter(pc.equal(table["domain"], dom)), Path(tmp) / "part-00000.parquet")
        paths.append(out)
    return routing_windows(paths, window_tokens=window_tokens), paths


def write_tiny_moe_config(cfg_path: Path) -> None:
    """The tiny Qwen3-MoE config.json (64 experts, top-4, 4 layers; random weights) the captured benches run,
    unless ``cfg_path`` already holds it."""
    import transformers  # optional: the [capture] extra

    if not cfg_path.exists():
        cfg = transformers.AutoConfig.for_model(
            "qwen3_moe", vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512, intermediate_size=96, num_hidden_layers=4,
            num_experts=64, num_experts_per_tok=4, moe_intermediate_size=16, norm_topk_prob=True,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
        cfg.to_json_file(str(cfg_path))


def captured_loads(window_tokens: int, seed: int = 0):  # -> (Loads, one trace path per domain)
    """The four domains' captured traces; ``seed`` seeds the random weights (and sampling): another seed is
    another model, routing the same prompts differently."""

    from moeplace.traces.capture import CaptureConfig, run_capture

    base = RESULTS / "captured-lodo"
    cfg_path = base / "config.json"
    runs = base if seed == 0 else RESULTS / f"captured-lodo-seed{seed}"
    base.mkdir(parents=True, exist_ok=True)
    write_tiny_moe_config(cfg_path)
    paths = []
    for dom, templates in DOMAIN_PROMPTS.items():
        out = runs / dom
        if not out.exists():
            prompts = base / f"{dom}.txt"
            prompts.write_text("\n".join(t.format(i=i) for i in range(1, 25) for t in templates) + "\n")
            runs.mkdir(parents=True, exist_ok=True)
            run_capture(CaptureConfig(hf_config=cfg_path, prompts=prompts, out=out, max_new_tokens=24,
                                      batch_size=16, seed=seed, sample=True, ignore_eos=True, domain=dom))
        paths.append(out)
    return routing_windows(paths, window_tokens=window_tokens), paths


def coactivation(paths: list[Path], r: int, draws: int = 50) -> dict:
    """Do an unseen domain's hot experts fire together in the planning domains' tokens (a structure a hedge
    could spread without knowing which experts will be hot)? Per domain ``d`` and layer: the co-activation
    lift ``P(i, j) / (P(i) P(j))`` over the other domains' tokens, averaged over pairs of ``d``'s ``r``
    hottest experts (``hot``) and over pairs of ``draws`` random ``r``-sets (``random``); mean over layers.
    A hot set that co-fires shows ``hot`` well above ``random``."""
    ids = {p.name: load_trace_tokens(p).expert_ids for p in paths}  # [T, L, k] each
    E = int(max(int(x.max()) for x in ids.values())) + 1
    rng = np.random.default_rng(0)
    out = {}
    for d, own in ids.items():
        seen = np.concatenate([x for o, x in ids.items() if o != d])
        hot, rand = [], []
        for layer in range(seen.shape[1]):
            x = np.zeros((seen.shape[0], E))
            np.put_along_axis(x, seen[:, layer].astype(np.int64), 1.0, axis=1)
            p = x.mean(0)
            lift = (x.T @ x) / seen.shape[0] / np.maximum(np.outer(p, p), 1e-12)

            def pairs(s, lift=lift):
                m = lift[np.ix_(s, s)]
                return float(m[~np.eye(len(s), dtype=bool)].mean())
            hot.append(pairs(np.argsort(-np.bincount(own[:, layer].ravel().astype(np.int64), minlength=E))[:r]))
            rand.append(np.mean([pairs(rng.choice(E, r, replace=False)) for _ in range(draws)]))
        out[d] = {"hot": float(np.mean(hot)), "random": float(np.mean(rand))}
    return out


def _plan(loads, idx, cluster, num_redundant, time_limit, policy, opts, shift=False):
    # the limit is moeplace's search budget; EPLB has a fixed cost and a limit would only make a loaded
    # machine skip it (its result does not depend on time)
    time_limit = time_limit if policy == "moeplace" else None
    return compare_policies(loads.select(idx), cluster, num_redundant=num_redundant, policies=[policy],
                            plan_fraction=1.0, time_limit=time_limit, options={"workers": 1, **opts},
                            shift=shift).results[0]


def _tv(a, b):
    """Mean over layers of the total-variation distance of two ``[L, E]`` count arrays' shares."""
    pa = a / np.maximum(a.sum(-1, keepdims=True), 1)
    pb = b / np.maximum(b.sum(-1, keepdims=True), 1)
    return float(0.5 * np.abs(pa - pb).sum(-1).mean())


def _hot_hits(c, ids, d, r: int) -> dict:
    """Can the planning domains tell which experts the unseen domain ``d`` will need most? Per layer, the
    share of ``d``'s ``r`` hottest experts (``r`` = redundant slots per layer: how many experts a plan can
    replicate) found among the ``r`` experts a statistic of the other domains' shares ranks highest: their
    ``mean`` (what a plan on the union balances), their ``max`` (hot in any domain) and their ``sd`` (spread
    across domains); ``random`` = ``r / E`` by chance; ``own_half`` = the domain's own other half of windows
    (how stable its hot set is within the domain: the information that exists, but not in the planning data).
    Mean over layers."""
    shares = np.stack([c[ids == k].sum(0) for k in np.unique(ids)])
    shares = shares / np.maximum(shares.sum(-1, keepdims=True), 1)  # [D, L, E]
    rest = np.delete(shares, d, axis=0)
    top = np.argsort(-shares[d], axis=1)[:, :r]

    def hit(score):  # [L, E] -> mean over layers of |top-r(d) & top-r(score)| / r
        pick = np.argsort(-score, axis=1)[:, :r]
        return float(np.mean([np.intersect1d(a, b).size / r for a, b in zip(top, pick)]))

    w = np.flatnonzero(ids == d)
    out = {"mean": hit(rest.mean(0)), "max": hit(rest.max(0)), "sd": hit(rest.std(0)), "random": r / c.shape[2]}
    if w.size >= 2:  # split-half: each half's top-r against the other's
        a, b = c[w[::2]].sum(0), c[w[1::2]].sum(0)
        out["own_half"] = float(np.mean([np.intersect1d(np.argsort(-x)[:r], np.argsort(-y)[:r]).size / r
                                         for x, y in zip(a, b)]))
    return out


def _domain_stats(c, ids, d) -> dict:
    """How unlike the others domain ``d`` is (``c``: counts ``[W, L, E]``, ``ids``: domain per window):
    ``tv_rest`` / ``tv_window`` (see the module docstring); ``corr_rest``: correlation of its expert loads
    with the other domains' summed loads (mean over layers); ``hot_rank_max``: the worst rank (0 = hottest)
    in the other domains' loads of any of its 4 hottest experts per layer — how cold in the planning data an
    expert this domain needs most can be."""
    own, rest = c[ids == d].sum(0), c[ids != d].sum(0)
    ranks = np.argsort(np.argsort(-rest, axis=1), axis=1)
    top = np.argsort(-own, axis=1)[:, :4]
    return {"tv_rest": _tv(own, rest),
            "tv_window": float(np.mean([_tv(c[w], own) for w in np.flatnonzero(ids == d)])),
            "corr_rest": float(np.mean([np.corrcoef(own[l], rest[l])[0, 1] for l in range(c.shape[1])])),
            "hot_rank_max": int(np.take_along_axis(ranks, top, axis=1).max())}


def domain_stats(loads, num_redundant: int) -> dict:
    """How far apart the domains are and how predictable an unseen one's hot experts are (no planning)."""
    ids, names, method = scenarios(loads)
    c = loads.counts.astype(np.float64)
    return {"method": method, "scenarios": names, "experts": int(loads.counts.shape[2]),
            "domains": {names[d]: {**_domain_stats(c, ids, d), "hot_hits": _hot_hits(c, ids, d, num_redundant)}
                        for d in range(len(names))}}


def lodo(loads, cluster, num_redundant: int, time_limit: float, variants=None, oracle: bool = True,
         stats_only: bool = False) -> dict:
    out = {**domain_stats(loads, num_redundant), "variants": {}}
    if stats_only:
        return out
    ids, names, _ = scenarios(loads)
    c = loads.counts.astype(np.float64)
    for vname, (policy, opts) in VARIANTS.items():
        if variants is not None and vname not in variants:
            continue
        rows = []
        load0 = os.getloadavg()[0]  # per variant: a later run of some variants keeps the others' figures
        for d in range(len(names)):
            train = np.flatnonzero(ids != d)
            test = np.flatnonzero(ids == d)
            t0 = time.perf_counter()
            r = _plan(loads, train, cluster, num_redundant, time_limit, policy, opts, shift=True)
            realized = evaluate(r.placement, loads.counts[test].astype(np.float64), model=loads.model)
            rows.append({"held_out": names[d], "in_sample": r.planning.balancedness,
                         "estimate_mean": r.shift["mean"], "estimate_worst": r.shift["worst"],
                         "realized": realized.balancedness, "realized_worst_window": realized.worst_window_balancedness,
                         "seconds": time.perf_counter() - t0})
            print(f"  {vname:16s} unseen {names[d]:10s} in-sample {rows[-1]['in_sample']:.4f}  estimate mean "
                  f"{rows[-1]['estimate_mean']:.4f} worst {rows[-1]['estimate_worst']:.4f}  realized "
                  f"{rows[-1]['realized']:.4f}", flush=True)
        real = np.array([x["realized"] for x in rows])
        out["variants"][vname] = {
            "rows": rows,  # moeplace plans are time-limited: on a loaded machine they search less
            "in_sample_mean": float(np.mean([x["in_sample"] for x in rows])),
            "estimate_mean": float(np.mean([x["estimate_mean"] for x in rows])),
            "estimate_worst_mean": float(np.mean([x["estimate_worst"] for x in rows])),
            "realized_mean": float(real.mean()), "realized_worst": float(real.min()),
            "estimate_abs_error_mean": float(np.mean([abs(x["estimate_mean"] - x["realized"]) for x in rows])),
            "loadavg": [load0, os.getloadavg()[0]],
        }
    if ORACLE_ON and oracle:
        everything = np.arange(loads.num_windows)
        every = _plan(loads, everything, cluster, num_redundant, time_limit, *ORACLE).placement
        per = {"self": [], "all": []}
        for d in range(len(names)):
            test = np.flatnonzero(ids == d)
            own = _plan(loads, test, cluster, num_redundant, time_limit, *ORACLE).placement
            for k, pl in (("self", own), ("all", every)):
                per[k].append(evaluate(pl, c[test], model=loads.model).balancedness)
        out["oracle"] = {k: {"per_domain": dict(zip(names, v)), "mean": float(np.mean(v)), "worst": float(np.min(v))}
                         for k, v in per.items()}
        print(f"  oracle: planned on the unseen domain itself worst {out['oracle']['self']['worst']:.4f}, "
              f"on every domain worst {out['oracle']['all']['worst']:.4f}", flush=True)
    return out


ORACLE_ON = True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=60000)
    ap.add_argument("--window-tokens", type=int, default=4096)
    ap.add_argument("--time-limit", type=float, default=4.0, help="seconds per moeplace plan")
    ap.add_argument("--skip-captured", action="store_true")
    ap.add_argument("--skip-synthetic", action="store_true")
    ap.add_argument("--synthetic-split", default="domain",
                    help="comma-separated: domain (one trace per domain tag, the held-out split) and/or "
                         "window-tag (dominant tag per window of the whole trace: leaks, EPLB and --robust only)")
    ap.add_argument("--captured-seeds", default="0,1,2",
                    help="random-weight models to capture with (comma-separated seeds; one dataset each)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of "
                    + ", ".join(VARIANTS))
    ap.add_argument("--no-oracle", action="store_true", help="skip the oracle ceilings")
    ap.add_argument("--stats-only", action="store_true",
                    help="recompute only the domains' statistics (no planning); the file's other figures stay")
    args = ap.parse_args()
    for v in set(VARIANTS) - set(args.variants.split(",")):
        VARIANTS.pop(v)
    global ORACLE_ON
    ORACLE_ON = not args.no_oracle
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {}
    if not args.skip_synthetic:
        for split in args.synthetic_split.split(","):
            if split not in ("domain", "window-tag"):
                ap.error(f"--synthetic-split: expected domain or window-tag, got {split!r}")
            name = "synthetic" if split == "domain" else "synthetic-window-tag"
            print(f"{name} (Qwen3-30B-A3B shape, 16 GPUs = 4 x 4, R = 16):", flush=True)
            leaky = split == "window-tag"
            loads, paths = synthetic_loads(args.tokens, args.window_tokens, split)
            result[name] = lodo(loads, make_cluster(16, "h200", 4),
                                16, args.time_limit, variants=LEAKY_VARIANTS if leaky else None, oracle=not leaky,
                                stats_only=args.stats_only)
            result[name]["split"] = split
            if not leaky:
                result[name]["coactivation"] = coactivation(paths, 16)
    for seed in ([] if args.skip_captured else [int(x) for x in args.captured_seeds.split(",")]):
        name = "captured" if seed == 0 else f"captured-seed{seed}"
        print(f"{name} (random-weight Qwen3-MoE, weights seed {seed}, 64 experts, 8 GPUs = 2 x 4, R = 8):",
              flush=True)
        loads, paths = captured_loads(256, seed)
        result[name] = lodo(loads, make_cluster(8, "h200", 4), 8, args.time_limit,
                            stats_only=args.stats_only)
        result[name]["coactivation"] = coactivation(paths, 8)
    print()
    print(f"{'data':10s} {'variant':16s} {'in-sample':>9s} {'est mean':>8s} {'est worst':>9s} {'real mean':>9s} "
          f"{'real worst':>10s} {'|err|':>6s}")
    for data, r in result.items():
        for v, s in r["variants"].items():
            print(f"{data:10s} {v:16s} {s['in_sample_mean']:9.4f} {s['estimate_mean']:8.4f} "
                  f"{s['estimate_worst_mean']:9.4f} {s['realized_mean']:9.4f} {s['realized_worst']:10.4f} "
                  f"{s['estimate_abs_error_mean']:6.4f}")
    # runs of some datasets / variants update the file's other entries instead of dropping them
    path = RESULTS / "shift_lodo.json"
    merged = json.loads(path.read_text()) if path.exists() else {}
    for data, r in result.items():
        old = merged.get(data, {"variants": {}})
        if old.get("split") != r.get("split"):  # other data under the same name: its figures do not carry over
            old = {"variants": {}}
        merged[data] = {**old, **r, "variants": {**old.get("variants", {}), **r["variants"]}}
    write_text_atomic(path, json.dumps(merged, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
