"""Import and validation throughput on generated inputs in each engine format.

Generates (in a temporary directory) inputs shaped like real dumps of the named models, imports each with
:func:`traces.importers.import_source`, and reports records/s (the format's own unit: route lines, EPLB
records, SGLang steps / forward-pass records) and expert selections/s, plus trace validation speed. Prints
the figures and writes ``bench/results/import_throughput.json``.

    .venv/bin/python bench/import_throughput.py [--scale 1.0]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from _timing import peak_rss_mb, timed, write_result  # before any project import: sets sys.path

from moeplace.foundation.model import load_model
from moeplace.traces.format import TraceWriter
from moeplace.traces.importers import import_source
from moeplace.traces.validate import validate_report


def _size(path: Path) -> int:
    """Bytes of a file, or of every file under a directory."""
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _timed_import(label: str, fmt: str, src: Path, model, out: Path, *, records: int | None = None,
                  loads: bool = False) -> dict:
    """Import ``src`` with ``import_source(fmt)`` and time it; one result row. ``records``: the input's
    record count when the importer does not report one; a trace import's selections are its written rows
    x top-k, a Loads import (``loads``) reports its own."""
    with timed() as t:
        res = import_source(fmt, [src], model, out)
    s = res.summary
    row = {"format": label, "model": model.name,
           "records": s["records_read"] if records is None else records, "seconds": t.wall_s, "cpu_s": t.cpu_s}
    selections = s["selections"] if loads else s["rows_written"] * model.top_k
    row.update(records_per_s=row["records"] / t.wall_s, selections_per_s=selections / t.wall_s)
    if not loads:
        row["rows_written"] = s["rows_written"]
    if "warmup_rows_dropped" in s:
        row["warmup_rows_dropped"] = s["warmup_rows_dropped"]
    row["input_bytes"] = _size(src)
    return row


def _topk(rng: np.random.Generator, n: int, num_experts: int, k: int) -> np.ndarray:
    """``[n, k]`` distinct expert ids per row, skewed (Zipf-like popularity), int64."""
    logpop = -0.8 * np.log(np.arange(1, num_experts + 1))
    out = np.empty((n, k), dtype=np.int64)
    for s in range(0, n, 8192):  # Gumbel top-k = sampling without replacement; chunked to bound memory
        g = rng.gumbel(size=(min(8192, n - s), num_experts)) + logpop[None, :]
        out[s : s + 8192] = np.argpartition(-g, k, axis=1)[:, :k]
    return out


def bench_vllm_jsonl(tmp: Path, rng, scale: float) -> dict:
    m = load_model("kimi-k3")
    n_tok, layers, warm = int(20_000 * scale), list(range(8)), 2_000  # 8 logged MoE layers (ordinals)
    src = tmp / "routes.jsonl"
    with open(src, "w") as fh:
        meta = {"type": "meta", "model_id": "moonshotai/Kimi-K3", "layers_logged": layers, "top_k": m.top_k}
        fh.write(json.dumps(meta) + "\n")
        wid = list(range(m.top_k))
        for layer in layers:
            fh.writelines(
                json.dumps(
                    {
                        "type": "route",
                        "req_id": "r0",
                        "token_idx": t,
                        "layer": layer,
                        "topk_ids": wid,
                        "topk_weights": [1 / 16] * 16,
                    }
                )
                + "\n"
                for t in range(warm)
            )
        ids = _topk(rng, n_tok * len(layers), m.num_experts, m.top_k).reshape(n_tok, len(layers), -1)
        w = rng.dirichlet(np.ones(m.top_k), size=(n_tok, len(layers))).round(6)
        for t in range(n_tok):
            for li, layer in enumerate(layers):
                fh.write(
                    json.dumps(
                        {
                            "type": "route",
                            "req_id": f"r{t // 500}",
                            "token_idx": t % 500,
                            "layer": layer,
                            "topk_ids": ids[t, li].tolist(),
                            "topk_weights": w[t, li].tolist(),
                        }
                    )
                    + "\n"
                )
    return _timed_import("vllm-jsonl", "vllm-jsonl", src, m, tmp / "vllm_trace")


def bench_vllm_eplb(tmp: Path, rng, scale: float) -> dict:
    m = load_model("kimi-k3")
    num_records, num_slots = max(int(100 * scale), 2), m.num_experts + 128  # EP32, 4 slots/rank redundant
    src = tmp / "eplb.jsonl"
    with open(src, "w") as fh:
        fh.write(json.dumps({"record_type": "eplb_load_meta", "version": 1, "num_ranks": 32}) + "\n")
        for step in range(num_records):
            p2l = np.concatenate(
                [
                    np.tile(np.arange(m.num_experts), (m.num_moe_layers, 1)),
                    rng.integers(0, m.num_experts, (m.num_moe_layers, 128)),
                ],
                axis=1,
            )
            load = rng.poisson(200, (m.num_moe_layers, num_slots))
            fh.write(
                json.dumps(
                    {
                        "record_type": "eplb_load_stats",
                        "version": 1,
                        "step": step * 100,
                        "num_ranks": 32,
                        "expert_load": load.tolist(),
                        "p2l_map": p2l.tolist(),
                    }
                )
                + "\n"
            )
    return _timed_import("vllm-eplb", "vllm-eplb", src, m, tmp / "eplb.npz", records=num_records, loads=True)


def bench_sglang_stat(tmp: Path, rng, scale: float) -> dict:
    m = load_model("kimi-k3")
    steps = max(int(200 * scale), 2)
    count = np.zeros((steps, m.num_layers, m.num_experts), dtype=np.int32)
    count[:, list(m.moe_layers)] = rng.poisson(30, (steps, m.num_moe_layers, m.num_experts))
    src = tmp / "expert_distribution_recorder_1.pt"
    torch.save(
        {"rank": 0, "logical_count": torch.from_numpy(count), "average_utilization_rate_over_window": None},
        src,
    )
    import moeplace.traces.importers.sglang  # noqa: F401  (import torch-using module before timing)

    return _timed_import("sglang stat", "sglang", src, m, tmp / "sglang.npz", records=steps, loads=True)


def bench_sglang_per_token(tmp: Path, rng, scale: float) -> dict:
    # per_token keeps 8 experts per token (SGLang's _TOP_K_NUM): DeepSeek-V3 (top-8, 61 layers, 256 experts)
    m = load_model("deepseek-v3")
    passes, n_tok, num_phys = max(int(40 * scale), 2), 512, m.num_experts + 32
    p2l = np.concatenate(
        [
            np.tile(np.arange(m.num_experts), (m.num_layers, 1)),
            rng.integers(0, m.num_experts, (m.num_layers, 32)),
        ],
        axis=1,
    )
    records = []
    for fp in range(passes):
        ids = np.full((m.num_layers, n_tok, 8), -1, dtype=np.int32)
        logical = _topk(rng, m.num_moe_layers * n_tok, m.num_experts, 8).reshape(m.num_moe_layers, n_tok, 8)
        # route half the tokens of a replicated expert to its redundant slot, as SGLang's dispatch would
        phys = logical.copy()
        for li, layer in enumerate(m.moe_layers):
            red = np.full(m.num_experts, -1)
            red[p2l[layer, m.num_experts :]] = np.arange(m.num_experts, num_phys)
            alt = red[logical[li]]
            use = (alt >= 0) & (rng.random(alt.shape) < 0.5)
            phys[li][use] = alt[use]
        ids[list(m.moe_layers)] = phys
        decode = fp % 2 == 1
        records.append(
            {
                "forward_pass_id": fp,
                "rank": 0,
                "gatherer_key": "primary",
                "input_ids": rng.integers(0, 1000, n_tok).tolist(),
                "positions": list(range(n_tok)) if not decode else [100 + fp] * n_tok,
                "extend_seq_lens": None if decode else [n_tok // 4] * 4,
                "forward_mode": 2 if decode else 1,
                "topk_ids_of_layer": torch.from_numpy(ids),
                "misc_objects": [],
            }
        )
    src = tmp / "expert_distribution_recorder_1_0.pt"
    torch.save({"records": records, "last_physical_to_logical_map": torch.from_numpy(p2l)}, src)
    del records
    return _timed_import("sglang per_token", "sglang", src, m, tmp / "sglang_trace", records=passes)


def bench_trtllm_stats_raw(tmp: Path, rng, scale: float) -> dict:
    # TensorRT-LLM EXPERT_STATISTIC_PATH dump of DeepSeek-V3 (its load-balancer architecture): 2 ranks,
    # raw token_selected_experts per (iteration, MoE layer) plus the per-expert counts
    from safetensors.numpy import save_file

    m = load_model("deepseek-v3")
    iters, n_tok, ranks = max(int(20 * scale), 2), 512, 2
    d = tmp / "expert_statistic"
    d.mkdir()
    (d / "meta_info.json").write_text(json.dumps({"num_experts": m.num_experts, "num_experts_per_token": m.top_k}))
    for r in range(ranks):
        raw, counts = {}, {}
        for it in range(100, 100 + iters):
            for layer in m.moe_layers:
                ids = _topk(rng, n_tok, m.num_experts, m.top_k).astype(np.int32)
                raw[f"{it}_{layer}"] = ids
                counts[f"{it}_{layer}"] = np.bincount(ids.ravel(), minlength=m.num_experts).astype(np.int64)
        save_file(raw, str(d / f"rank{r}_raw.safetensors"))
        save_file(counts, str(d / f"rank{r}.safetensors"))
    return _timed_import("trtllm-stats raw", "trtllm-stats", d, m, tmp / "trtllm_trace")


def bench_vllm_routed(tmp: Path, rng, scale: float) -> dict:
    # responses of `vllm serve --enable-return-routed-experts` for Kimi K3 (mainline form: base64 .npy
    # [prompt + generated - 1, 93 decoder layers, 16] uint16), one per JSONL line
    import base64
    import io

    m = load_model("kimi-k3")
    n_resp, n_prompt, n_gen = max(int(40 * scale), 2), 384, 128
    src = tmp / "routed.jsonl"
    with open(src, "w") as fh:
        for i in range(n_resp):
            n = n_prompt + n_gen - 1
            arr = np.zeros((n, m.num_layers, m.top_k), dtype=np.uint16)
            arr[:, list(m.moe_layers)] = _topk(rng, n * m.num_moe_layers, m.num_experts, m.top_k).reshape(
                n, m.num_moe_layers, m.top_k)
            buf = io.BytesIO()
            np.save(buf, arr, allow_pickle=False)
            fh.write(json.dumps({"id": f"chatcmpl-{i}", "prompt_token_ids": list(range(n_prompt)),
                                 "choices": [{"index": 0, "token_ids": list(range(n_gen)),
                                              "routed_experts": base64.b64encode(buf.getvalue()).decode()}]}) + "\n")
    return _timed_import("vllm-routed-experts", "vllm-routed-experts", src, m, tmp / "routed_trace")


def bench_flame(tmp: Path, rng, scale: float) -> dict:
    # FLAME-MoE-290M shape (9 layers, MoE layers 2-9 1-based, 64 experts, top-6): samples + one iteration
    import dataclasses

    import pyarrow as pa
    import pyarrow.parquet as pq

    base = load_model("qwen3-30b-a3b")
    m = dataclasses.replace(base, name="flame-moe-290m-like", num_layers=9, moe_layers=tuple(range(1, 9)),
                            attention=base.attention[:9],
                            num_experts=64, top_k=6)
    n_tok = int(200_000 * scale)
    root = tmp / "flame-moe-290m"
    (root / "samples").mkdir(parents=True)
    it = root / "actives" / "iter_5473"
    it.mkdir(parents=True)
    pq.write_table(pa.table({"token_id": pa.array(rng.integers(0, 50_000, n_tok).astype(np.int32))}),
                   root / "samples" / "000.parquet")
    for layer in range(2, 10):
        ids = _topk(rng, n_tok, 64, 6).astype(np.int16)
        sc = np.sort(rng.random((n_tok, 6)), axis=1)[:, ::-1].astype(np.float16)
        pq.write_table(pa.table({"scores": pa.FixedSizeListArray.from_arrays(pa.array(sc.ravel()), 6),
                                 "indices": pa.FixedSizeListArray.from_arrays(pa.array(ids.ravel()), 6)}),
                       it / f"layer_{layer:02d}.parquet")
    return _timed_import("flame-moe", "flame-moe", root, m, tmp / "flame_trace")


def bench_validate(tmp: Path, rng, scale: float) -> dict:
    m = load_model("kimi-k3")
    n_tok = int(20_000 * scale)
    out = tmp / "k3_trace"
    with TraceWriter(out, m, {"kind": "synthetic", "bench": "import_throughput"}, gate_weights=True) as w:
        for s in range(0, n_tok, 2000):
            n = min(2000, n_tok - s)
            rows = n * m.num_moe_layers
            w.write(
                request_id=np.repeat(np.arange(s, s + n) // 100, m.num_moe_layers),
                position=np.repeat(np.arange(s, s + n) % 100, m.num_moe_layers),
                phase=np.zeros(rows),
                step=np.repeat(np.arange(s, s + n), m.num_moe_layers),
                layer=np.tile(m.moe_layers, n),
                expert_ids=_topk(rng, rows, m.num_experts, m.top_k),
                gate_weights=rng.random((rows, m.top_k), dtype=np.float32),
            )
    with timed() as t:
        rep = validate_report(out)
    assert rep.ok, rep.lines()
    return {"format": "validate (kimi-k3 trace, gate weights)", "model": m.name, "records": rep.num_rows,
            "seconds": t.wall_s, "cpu_s": t.cpu_s, "records_per_s": rep.num_rows / t.wall_s,
            "selections_per_s": rep.num_rows * m.top_k / t.wall_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="input size multiplier (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="moeplace-import-bench-") as d:
        for fn in (
            bench_vllm_jsonl,
            bench_vllm_eplb,
            bench_sglang_stat,
            bench_sglang_per_token,
            bench_trtllm_stats_raw,
            bench_vllm_routed,
            bench_flame,
            bench_validate,
        ):
            r = fn(Path(d), rng, args.scale)
            results.append(r)
            print(
                f"{r['format']:<42} {r['records']:>10,} records  {r['seconds']:7.2f} s  "
                f"{r['records_per_s']:>12,.0f} records/s  {r['selections_per_s'] / 1e6:8.2f} M selections/s",
                flush=True,
            )
    peak_rss = peak_rss_mb() * 2**20
    print(f"peak RSS {peak_rss / 2**30:.2f} GiB")
    write_result("import_throughput", {"scale": args.scale, "seed": args.seed, "peak_rss_bytes": peak_rss,
                                       "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
