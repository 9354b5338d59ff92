"""The synthetic router: the knobs mean what they say (realized statistics hit their targets), the
request/engine structure is consistent, and everything is deterministic per seed."""
from __future__ import annotations

import numpy as np
import pytest

from moeplace.foundation.errors import InputError
from moeplace.foundation.model import load_model
from moeplace.traces.format import PHASE_DECODE, PHASE_PREFILL
from moeplace.traces.measures import topk_overlap
from moeplace.traces.stats import affinity_lift, skew_and_cv
from moeplace.traces.synth import (
    SynthConfig,
    build_design,
    drift_anchor_mixes,
    engine_batches,
    mean_domain_correlation,
    num_themes,
    quantize,
    synth_chunks,
    synthesize,
)

# Short requests: many requests (so every domain shows up) in a small token budget.
SHORT = {"prompt_median": 96, "prompt_sigma": 0.6, "output_median": 48, "long_fraction": 0.0}


def run(model, **kw):
    """All chunks of a synthetic trace, concatenated: token arrays [n] and experts [n, L, k]."""
    design = build_design(model, SynthConfig(**kw))
    chunks = list(synth_chunks(design))
    out = {key: np.concatenate([c[key] for c in chunks]) for key in chunks[0]}
    return design, out


def layer_loads(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """[n, L, k] -> counts [L, E]."""
    _n, num_layers, _k = experts.shape
    idx = (np.arange(num_layers)[None, :, None] * num_experts + experts.astype(np.int64)).ravel()
    return np.bincount(idx, minlength=num_layers * num_experts).reshape(num_layers, num_experts)


def consecutive_overlap(b: dict) -> float:
    """Mean top-k overlap of consecutive tokens of the same request (positions p, p+1)."""
    order = np.lexsort((b["position"], b["request_id"]))
    rid, pos, ex = b["request_id"][order], b["position"][order], b["experts"][order]
    i = np.flatnonzero((rid[1:] == rid[:-1]) & (pos[1:] == pos[:-1] + 1))
    return float(topk_overlap(ex[i], ex[i + 1]).mean())


@pytest.fixture(scope="module")
def k3_default(k3):
    return run(k3, num_tokens=12_000, seed=7, **SHORT)


@pytest.fixture(scope="module")
def qwen():
    return load_model("qwen3-30b-a3b")


def test_config_rejects_bad_knobs():
    for field, value in [("skew", 0.5), ("domain_correlation", 1.5), ("num_domains", 0), ("affinity", 1.0),
                         ("locality", 0.95), ("num_tokens", 0), ("cv", -1.0), ("theme", 1.0), ("themes", 0)]:
        with pytest.raises(InputError, match=f"field '{field}'"):
            SynthConfig(**{field: value})


def test_quantize_sums_exactly():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(37), size=(3, 2))
    q = quantize(p, 1000)
    assert (q.sum(-1) == 1000).all() and (q >= 0).all()
    assert np.abs(q - p * 1000).max() < 1.0


def test_default_k3_rows_are_valid_topk(k3, k3_default):
    _, b = k3_default
    ex = b["experts"]
    assert ex.shape == (12_000, k3.num_moe_layers, k3.top_k)
    assert ex.max() < k3.num_experts
    s = np.sort(ex, axis=-1)
    assert not (s[..., 1:] == s[..., :-1]).any(), "an expert repeats within a token's top-k"


def test_default_k3_skew_cv_and_depth(k3, k3_default):
    _plan, b = k3_default
    skew, cv = skew_and_cv(layer_loads(b["experts"], k3.num_experts))
    # target 6x (median layer), CV ~1; the tolerance covers sampling noise at 12k tokens and the slight
    # flattening of re-drawn duplicates
    assert 5.4 <= np.median(skew) <= 6.7
    assert 0.8 <= np.median(cv) <= 1.2
    assert skew[-15:].mean() > 1.5 * skew[:15].mean()  # skew grows with depth (ratio 2.5 requested)
    # REFERENCE: 15-38% of experts get < 1/10 of the mean load
    counts = layer_loads(b["experts"], k3.num_experts)
    cold = (counts < 0.1 * counts.mean(axis=1, keepdims=True)).mean(axis=1)
    assert 0.05 <= np.median(cold) <= 0.45


def test_default_k3_domains_correlation_and_drift(k3, k3_default):
    design, b = k3_default
    num_domains = design.config.num_domains
    per_domain = np.stack([layer_loads(b["experts"][b["domain"] == d], k3.num_experts)
                           for d in range(num_domains)], axis=1)  # [L, D, E]
    assert (per_domain.sum(axis=(0, 2)) > 0).all(), "every domain has requests"
    assert abs(mean_domain_correlation(per_domain.astype(float)) - 0.5) < 0.1
    # drift: the domain mix of the first and last fifth of the trace differ
    n = len(b["domain"])
    first = np.bincount(b["domain"][: n // 5], minlength=num_domains) / (n // 5)
    last = np.bincount(b["domain"][-n // 5:], minlength=num_domains) / (n // 5)
    assert np.abs(first - last).sum() > 0.4


def test_default_k3_locality_and_token_identity(k3, k3_default):
    _plan, b = k3_default
    assert abs(consecutive_overlap(b) - 0.15) < 0.03
    # two occurrences of the same token id (in one domain) share more experts than two random tokens
    key = b["token_id"].astype(np.int64) * 64 + b["domain"]
    _ids, inv, cnt = np.unique(key, return_inverse=True, return_counts=True)
    rng = np.random.default_rng(0)
    same = []
    for t in np.flatnonzero((cnt >= 2) & (cnt <= 5))[:300]:
        i, j = np.flatnonzero(inv == t)[:2]
        same.append(topk_overlap(b["experts"][i], b["experts"][j]).mean())
    a, c = rng.integers(0, len(inv), (2, 300))
    rand = topk_overlap(b["experts"][a], b["experts"][c]).mean()
    assert np.mean(same) > 2 * rand


def test_affinity_knob(qwen):
    """Within one workload domain the coupling makes layer l predict layer l+1; the lift grows with the
    knob and is ~1 without it."""
    def lift(aff):
        _, b = run(qwen, num_tokens=6000, seed=1, affinity=aff, token_effect=0.0, theme=0.0, locality=None,
                   num_domains=1, **SHORT)
        return np.nanmean(affinity_lift(b["experts"].astype(np.int32), qwen.num_experts)[1])

    off, mid, high = lift(0.0), lift(0.5), lift(0.9)
    assert 0.93 <= off <= 1.07
    assert 1.1 < mid < high
    assert high > 1.3


@pytest.mark.parametrize("corr", [0.05, 0.8])
def test_domain_correlation_knob(qwen, corr):
    design, b = run(qwen, num_tokens=20_000, seed=3, domain_correlation=corr, drift=0.0, **SHORT)
    per_domain = np.stack([layer_loads(b["experts"][b["domain"] == d], qwen.num_experts)
                           for d in range(design.config.num_domains)], axis=1)
    assert abs(mean_domain_correlation(per_domain.astype(float)) - corr) < 0.1


def test_flat_mixtral_like_setting(qwen):
    _plan, b = run(qwen, num_tokens=20_000, seed=2, skew=1.2, cv=None, skew_depth_ratio=1.0, **SHORT)
    skew, cv = skew_and_cv(layer_loads(b["experts"], qwen.num_experts))
    assert 1.1 <= np.median(skew) <= 1.35
    assert np.median(cv) < 0.15


def test_deterministic_per_seed(qwen):
    _, a = run(qwen, num_tokens=1500, seed=11, **SHORT)
    _, b = run(qwen, num_tokens=1500, seed=11, **SHORT)
    _, c = run(qwen, num_tokens=1500, seed=12, **SHORT)
    for key in a:
        assert np.array_equal(a[key], b[key]), key
    assert not np.array_equal(a["experts"], c["experts"])


def test_engine_loop_structure(k3):
    cfg = SynthConfig(num_tokens=60_000, seed=5, long_fraction=0.3, max_prefill_tokens=512)
    rng = np.random.default_rng(0)  # the engine loop needs only the drift anchors, not a full design
    anchors = drift_anchor_mixes(cfg, rng)
    batches = list(engine_batches(cfg, k3, anchors, rng))
    b = {key: np.concatenate([x[key] for x in batches]) for key in batches[0]}
    assert len(b["position"]) == cfg.num_tokens  # the token budget is spent exactly
    assert (np.diff(b["step"]) >= 0).all()
    assert np.bincount(b["step"]).max() <= cfg.max_batch_tokens
    order = np.lexsort((b["seq"], b["request_id"]))
    rid, pos, phase = b["request_id"][order], b["position"][order], b["phase"][order]
    same = rid[1:] == rid[:-1]
    assert (pos[1:][same] > pos[:-1][same]).all()  # positions increase within a request
    assert not ((phase[1:] == PHASE_PREFILL) & (phase[:-1] == PHASE_DECODE) & same).any()  # prefill first
    # long-context tail: prompts far beyond the represented sample, up to the model's context
    assert b["position"].max() > 32_768
    assert b["position"].max() < k3.max_context
    assert len(np.unique(b["request_id"])) > 20


def test_cli_synth_writes_a_self_describing_trace(tmp_path, capsys):
    import pyarrow.parquet as pq

    from moeplace.cli.main import main
    from moeplace.traces.validate import read_trace_meta, trace_num_rows

    out = tmp_path / "tr"
    assert main(["trace", "synth", "--model", "qwen3-30b-a3b", "--tokens", "400", "--out", str(out),
                 "--seed", "3", "--gate-weights", "--prompt-median", "64", "--output-median", "16"]) == 0
    assert "B/selection" in capsys.readouterr().out
    model, prov = read_trace_meta(out)
    assert model.name == "qwen3-30b-a3b" and prov["kind"] == "synthetic" and prov["config"]["seed"] == 3
    assert trace_num_rows(out) == 400 * model.num_moe_layers
    t = pq.read_table(next(out.glob("*.parquet")))
    assert {"gate_weights", "token_id", "domain"} <= set(t.column_names)
    g = t.column("gate_weights").combine_chunks().values.to_numpy().reshape(-1, model.top_k)
    assert np.allclose(g.sum(axis=1), 1, atol=1e-5)
    # weights stay with their experts (stored by expert id): the router's descending order is theirs
    assert not (np.diff(g, axis=1) <= 0).all() and (np.diff(-np.sort(-g, axis=1), axis=1) <= 0).all()
    assert main(["trace", "synth", "--tokens", "10", "--out", str(tmp_path / "x"), "--skew", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("place: error: argument --skew: expected a number >= 1") and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def _file_bytes(path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.glob("*.parquet"))}


def test_writer_process_writes_the_same_files(tmp_path, qwen):
    """Parquet encoding in the forked writer process gives byte-identical files to writing in-process,
    run after run (same seed), over many batches, whatever the number of sampling workers (a pipeline of
    layer ranges: 1, 3); the rows are the sampled tokens."""
    from moeplace.traces.validate import scan_trace

    cfg = SynthConfig(num_tokens=2500, seed=13, chunk_tokens=512, **SHORT)
    a = synthesize(qwen, cfg, tmp_path / "a", writer_process=True, workers=1)
    b = synthesize(qwen, cfg, tmp_path / "b", writer_process=False)
    c = synthesize(qwen, cfg, tmp_path / "c", writer_process=True, workers=3)
    assert (a["sample_workers"], b["sample_workers"], c["sample_workers"]) == (1, 1, 3)
    fa = _file_bytes(tmp_path / "a")
    assert len(fa) == 1 and fa == _file_bytes(tmp_path / "b") == _file_bytes(tmp_path / "c")
    assert a["rows"] == b["rows"] == c["rows"] == 2500 * qwen.num_moe_layers
    assert a["requests"] == b["requests"] and a["bytes"] == b["bytes"]
    _, mem = run(qwen, num_tokens=2500, seed=13, chunk_tokens=512, **SHORT)
    t = scan_trace(tmp_path / "a").collect()
    ex = np.stack(t["expert_ids"].to_numpy()).reshape(mem["experts"].shape)
    assert np.array_equal(ex, np.sort(mem["experts"], axis=-1))  # each token's top-k as a set, ascending
    assert np.array_equal(t["request_id"].to_numpy()[:: qwen.num_moe_layers], mem["request_id"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]  # no temporaries left


def test_writer_process_failures_leave_nothing(tmp_path, qwen, monkeypatch):
    """A failure on either side of the writer process: the error surfaces in the caller, no directory
    or temporary is left, and the writer process is gone."""
    import multiprocessing as mp

    import moeplace.traces.synth.writer as synth_mod  # synthesize() reads synth_chunks from there

    cfg = SynthConfig(num_tokens=1500, seed=1, chunk_tokens=256, **SHORT)
    (tmp_path / "file").write_text("x")
    for writer_process in (False, True):  # the writer cannot create its directory under a regular file
        with pytest.raises(FileExistsError):
            synthesize(qwen, cfg, tmp_path / "file" / "out", writer_process=writer_process)

    def failing_chunks(design):
        it = synth_chunks(design)
        yield next(it)
        yield next(it)
        raise RuntimeError("sampler failed")

    monkeypatch.setattr(synth_mod, "synth_chunks", failing_chunks)
    with pytest.raises(RuntimeError, match="sampler failed"):
        synthesize(qwen, cfg, tmp_path / "out", writer_process=True, workers=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    assert not [p for p in mp.active_children() if p.name == "moeplace-synth-writer"]

    # a sampling worker of the layer pipeline fails at its second chunk: the same
    import moeplace.traces.synth.pipeline as pipe_mod  # the workers call sample_chunk from there

    real = pipe_mod.sample_chunk

    def failing_sample(sampler, seed, chunk, *a):
        if chunk == 1 and sampler.layers.start > 0:
            raise RuntimeError("worker failed")
        return real(sampler, seed, chunk, *a)

    monkeypatch.setattr(pipe_mod, "sample_chunk", failing_sample)
    with pytest.raises(RuntimeError, match="worker failed"):
        synthesize(qwen, cfg, tmp_path / "out", writer_process=True, workers=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    assert not [p for p in mp.active_children() if p.name.startswith("moeplace-synth")]


def _modal_theme_share(design, experts: np.ndarray, layers) -> float:
    """Mean over tokens and ``layers`` of the share of a token's top-k in its most used theme group."""
    T = num_themes(design.model, design.config)
    shares = []
    for li in layers:
        th = design.theme_of[li][experts[:, li].astype(np.int64)]  # [n, k]
        counts = np.zeros((len(th), T))
        np.add.at(counts, (np.arange(len(th))[:, None], th), 1)
        shares.append(counts.max(axis=1).mean() / th.shape[1])
    return float(np.mean(shares))


def _span(node_of_expert: np.ndarray, experts: np.ndarray) -> float:
    """Mean number of distinct nodes per row of ``experts [n, k]``."""
    s = np.sort(node_of_expert[experts.astype(np.int64)], axis=1)
    return float((1 + (np.diff(s, axis=1) != 0).sum(axis=1)).mean())


def test_theme_knob_clusters_tokens_without_moving_the_load(k3, k3_default):
    """With themes on (default), a token's experts concentrate in its theme group, each group carries
    1/T of the load, and co-locating groups on nodes cuts the nodes a token touches; without the knob
    neither happens."""
    design, b = k3_default
    T = num_themes(design.model, design.config)
    assert design.config.theme > 0 and T == 8
    off_plan, off = run(k3, num_tokens=3000, seed=7, theme=0.0, **SHORT)
    layers = (5, 30, 60, 85)
    on_share = _modal_theme_share(design, b["experts"], layers)
    # 16 uniform draws over 8 groups put ~26 % in the most used one; the default gives ~60 %
    off_share = _modal_theme_share(design, off["experts"], layers)
    assert off_share < 0.3
    assert on_share > 0.5
    loads = layer_loads(b["experts"], k3.num_experts)
    for li in layers:
        share = np.bincount(design.theme_of[li], weights=loads[li], minlength=T) / loads[li].sum()
        assert np.abs(share * T - 1).max() < 0.15, share  # equal load per theme (marginal kept)
        # 4 nodes of 2 theme groups each, vs a random equal split: >= 8 % fewer nodes per token
        by_theme = design.theme_of[li].astype(np.int64) * 4 // T
        rnd = np.random.default_rng(li).permutation(np.arange(k3.num_experts) % 4)
        x = b["experts"][:, li]
        assert _span(by_theme, x) < 0.92 * _span(rnd, x)
        # without the knob the same grouping is as good as random
        xo = off["experts"][:, li]
        assert abs(_span(by_theme, xo) / _span(rnd, xo) - 1) < 0.01
    assert (off_plan.theme_of == 0).all()


def test_extreme_skew_still_gives_distinct_topk(qwen):
    """A popularity so concentrated that a domain layout has fewer than k experts of non-zero width: the
    duplicate re-draws fall back to the shared grid instead of looping forever."""
    design, b = run(qwen, num_tokens=400, seed=3, skew=60.0, cv=None, skew_depth_ratio=1.0, **SHORT)
    widths = quantize(design.pi)
    assert ((widths > 0).sum(axis=-1) < qwen.top_k).any()  # the case this test is about
    ex = np.sort(b["experts"].astype(np.int64), axis=-1)
    assert (np.diff(ex, axis=-1) > 0).all()


def test_small_k3_style_config_without_a_context_length(tmp_path, capsys):
    """A Hugging Face-style kimi_k3 config with few layers and experts and no max_position_embeddings (issue
    41: a traceback at 3,000 tokens, no end at 10,000): the context counts as unknown (1 M tokens, as the
    simulator takes it), so every request adds tokens and the budget is spent exactly."""
    import json

    from moeplace.cli.main import main
    from moeplace.traces.validate import trace_num_rows

    cfg = {"model_type": "kimi_k3", "num_hidden_layers": 4, "first_k_dense_replace": 1, "hidden_size": 64,
           "intermediate_size": 128, "vocab_size": 1000, "n_routed_experts": 16, "num_experts_per_tok": 4,
           "moe_intermediate_size": 16, "n_shared_experts": 1, "num_attention_heads": 4, "q_lora_rank": 16,
           "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
           "linear_attn_config": {"kda_layers": [1, 3], "num_heads": 4, "head_dim": 8}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = load_model(str(tmp_path / "config.json"))
    assert model.max_context == 0 and model.num_moe_layers == 3
    out = tmp_path / "tr"
    assert main(["trace", "synth", "--model", str(tmp_path / "config.json"), "--tokens", "3000",
                 "--out", str(out)]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert trace_num_rows(out) == 3000 * 3
    # 10,000 tokens: the request stream ends (it used to add requests of no tokens forever)
    c = SynthConfig(num_tokens=10_000, seed=0)
    batches = list(engine_batches(c, model, drift_anchor_mixes(c, np.random.default_rng(0)), np.random.default_rng(0)))
    pos = np.concatenate([b["position"] for b in batches])
    assert len(pos) == 10_000 and pos.min() >= 0




@pytest.mark.parametrize("model_name,kw", [
    ("kimi-k3", {}),  # 8 themes (a power of two), locality on
    ("qwen3-30b-a3b", {"themes": 3, "gate_weights": True}),  # themes not a power of two
    ("qwen3-30b-a3b", {"theme": 0.0, "locality": 0.0}),  # no theme source, no copies
])
def test_compiled_loops_draw_the_same_experts(model_name, kw, monkeypatch):
    """The numba loops (the [fast] extra, traces.jit) draw exactly the experts of the numpy code,
    from the same streams: a trace's bytes do not depend on whether numba is installed."""
    pytest.importorskip("numba")
    from moeplace.traces import jit

    assert jit.loop("layer") is not None and jit.loop("dedup") is not None
    model = load_model(model_name)
    _, fast = run(model, num_tokens=1500, seed=5, chunk_tokens=512, **SHORT, **kw)
    monkeypatch.setattr(jit, "loaded", lambda name: None)
    _, ref = run(model, num_tokens=1500, seed=5, chunk_tokens=512, **SHORT, **kw)
    assert fast.keys() == ref.keys()
    for key in ref:
        assert np.array_equal(fast[key], ref[key]), key


def test_compiled_dedup_matches_numpy_under_heavy_repeats(k3):
    """A layout where most draws repeat (a few experts own the circle): many re-draw rounds, the shared
    grid after DEDUP_ROUNDS, and more draws than the loop's first buffer holds: the same experts and the
    same stream position as the numpy code."""
    pytest.importorskip("numba")
    from moeplace.traces import jit
    from moeplace.traces.synth.sampler import ExpertSampler

    design = build_design(k3, SynthConfig(num_tokens=64, seed=1, **SHORT))
    assert jit.loop("dedup") is not None
    sampler = ExpertSampler(design, None, 4, 0.0)
    assert sampler._dedup_loop is jit.loaded("dedup")
    table = sampler.table.copy()
    d = design.config.num_domains
    table[0, : d << 16] = np.arange(d << 16) % 3  # the domains' layouts: 3 experts only
    sampler.table = table
    n, k = 3000, k3.top_k  # one block of rows (<= ExpertSampler.block_tokens)
    e0 = np.random.default_rng(2).integers(0, 3, (n, k)).astype(np.uint16)
    dom_key = (np.random.default_rng(3).integers(0, d, n).astype(np.uint32) << np.uint32(16))[:, None]
    outs, ends = [], []
    for compiled in (True, False):
        rng = np.random.default_rng(9)
        sampler._dedup_loop = jit.loop("dedup") if compiled else None
        e = sampler._dedup(0, e0.copy(), dom_key, sampler._row_key[:n], sampler._slot_ids[:n], rng)
        outs.append(e)
        ends.append(rng.bit_generator.random_raw(4))
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(ends[0], ends[1])
    assert (np.diff(np.sort(outs[0], axis=1), axis=1) > 0).all()  # distinct top-k


def test_compiled_loops_load_only_for_big_traces(tmp_path, qwen, monkeypatch):
    """numba's start-up (~0.5 s) is paid only by traces of jit.MIN_SELECTIONS or more: a small synthesis
    (a simulator point, a test) keeps the numpy code and never imports numba."""
    import threading

    from moeplace.traces import jit

    calls = []

    def preload():
        calls.append(1)
        t = threading.Thread(target=lambda: None)
        t.start()
        return t

    monkeypatch.setattr(jit, "preload", preload)
    cfg = SynthConfig(num_tokens=300, seed=2, **SHORT)
    synthesize(qwen, cfg, tmp_path / "small", writer_process=False)
    assert calls == []
    monkeypatch.setattr(jit, "MIN_SELECTIONS", 300 * qwen.num_moe_layers * qwen.top_k)
    synthesize(qwen, cfg, tmp_path / "big", writer_process=False)
    assert calls == [1]
