"""Token identity of imported engine logs: batch boundaries of a constant req_id, one run's per-layer
files joined (separate runs refused), partial layer coverage refused (a trace holds every MoE layer), and one
token count everywhere."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from moeplace.cli.main import main
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import load_model
from moeplace.placement.evaluate import read_token_routing
from moeplace.traces.importers import import_source
from moeplace.traces.stats import compute_stats
from moeplace.traces.validate import check_trace

TINY = Path(__file__).parent / "data" / "tiny-moe-config.json"


@pytest.fixture(scope="module")
def tiny():
    return load_model(TINY)  # MoE layers 1..3 (ordinals 0..2), 8 experts, top-2


def _log(path, batches, layers, seed=0, req="r0", meta=True, declare=True):
    """A logger-style JSONL: one fixed req_id, token_idx restarting at 0 in every batch (``batches``: the
    batch sizes), each batch logged layer by layer; ``declare``: the meta line lists ``layers_logged``.
    Returns the path."""
    rng = np.random.default_rng(seed)
    head = {"type": "meta", "model_id": "tiny-moe", "top_k": 2, **({"layers_logged": layers} if declare else {})}
    lines = [json.dumps(head)] if meta else []
    for size in batches:
        for layer in layers:
            for t in range(size):
                ids = rng.choice(8, size=2, replace=False).tolist()
                lines.append(json.dumps({"type": "route", "req_id": req, "token_idx": t, "layer": layer,
                                         "topk_ids": ids}))
    Path(path).write_text("\n".join(lines) + "\n")
    return path


def test_constant_req_id_with_restarting_token_idx_replays(tiny, tmp_path):
    src = _log(tmp_path / "log.jsonl", [5, 3, 4], [0, 1, 2])
    res = import_source("vllm-jsonl", [src], tiny, tmp_path / "t", warmup_min_run=0)
    assert res.summary["tokens"] == 12 and res.summary["requests"] == 3
    tr = read_token_routing(tmp_path / "t")  # used to fail: "(request_id, position) appears twice"
    assert tr.num_tokens == 12 and tr.present is None
    assert np.bincount(tr.request_id).tolist() == [5, 3, 4]


def test_one_runs_per_layer_files_are_joined(tiny, tmp_path):
    a = _log(tmp_path / "l0.jsonl", [4, 4], [0], seed=1)
    b = _log(tmp_path / "l1.jsonl", [4, 4], [1], seed=2)
    c = _log(tmp_path / "l2.jsonl", [4, 4], [2], seed=3)
    # two of the three layers' files: a trace of those two, declared by the files' layers_logged
    res = import_source("vllm-jsonl", [a, b], tiny, tmp_path / "two", warmup_min_run=0)
    assert res.summary["layers_covered"] == [1, 2] and res.summary["model_moe_layers"] == 3
    assert check_trace(tmp_path / "two").model.layers_label == "2 of 3 layers"
    res = import_source("vllm-jsonl", [a, b, c], tiny, tmp_path / "t", warmup_min_run=0)
    assert res.summary["tokens"] == 8 and res.summary["sessions_joined"] == 3
    assert res.summary["layers_covered"] == [1, 2, 3]
    tr = read_token_routing(tmp_path / "t")
    assert tr.num_tokens == 8 and tr.present is None
    # token 0's experts at both layers come from the first rows of each file
    first = [json.loads(x) for x in Path(a).read_text().splitlines()[1:2]] + \
            [json.loads(x) for x in Path(b).read_text().splitlines()[1:2]]
    assert tr.expert_ids[0, 0].tolist() == first[0]["topk_ids"]
    assert tr.expert_ids[0, 1].tolist() == first[1]["topk_ids"]


def test_per_layer_files_of_separate_runs_are_refused(tiny, tmp_path):
    a = _log(tmp_path / "l0.jsonl", [4, 4], [0], seed=1)
    b = _log(tmp_path / "l1.jsonl", [4, 3, 2], [1], seed=2)  # another run: other batches
    with pytest.raises(InputError) as exc:
        import_source("vllm-jsonl", [a, b], tiny, tmp_path / "t", warmup_min_run=0)
    msg = str(exc.value)
    assert "token streams differ" in msg and "l1.jsonl" in msg and "\n" not in msg
    assert not (tmp_path / "t").exists()


def test_layers_that_do_not_line_up_are_refused(tiny, tmp_path):
    src = tmp_path / "log.jsonl"
    lines = [json.dumps({"type": "meta", "top_k": 2})]
    for layer, n in ((0, 3), (1, 2)):  # layer 1 lost a row of the batch
        lines += [json.dumps({"type": "route", "req_id": "r", "token_idx": t, "layer": layer, "topk_ids": [0, 1]})
                  for t in range(n)]
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match="streams do not line up"):
        import_source("vllm-jsonl", [src], tiny, tmp_path / "t", warmup_min_run=0)


def test_every_command_counts_the_same_tokens(tiny, tmp_path, capsys):
    src = _log(tmp_path / "part.jsonl", [50, 30, 40, 60], [0, 2])  # partial coverage: 2 of 3 MoE layers
    undeclared = _log(tmp_path / "undeclared.jsonl", [50, 30, 40, 60], [0, 2], declare=False)
    with pytest.raises(InputError, match=r"does not declare the layers it holds .* no rows for 2 \(it holds 1,3\): "
                                         "declare the layers a partial log holds with --layers"):
        import_source("vllm-jsonl", [undeclared], tiny, tmp_path / "t", warmup_min_run=0)
    res = import_source("vllm-jsonl", [src], tiny, tmp_path / "part", warmup_min_run=0)  # declared: imported
    st = compute_stats(tmp_path / "part", window_tokens=45)
    assert res.summary["tokens"] == st.num_tokens == 180 and st.loads.counts.shape[1] == 2
    src = _log(tmp_path / "log.jsonl", [50, 30, 40, 60], [0, 1, 2])
    res = import_source("vllm-jsonl", [src], tiny, tmp_path / "t", warmup_min_run=0)
    st = compute_stats(tmp_path / "t", window_tokens=45)
    assert res.summary["tokens"] == st.num_tokens == 180
    assert st.loads.num_windows == 4  # windows are 45 tokens of 3 rows each
    assert main(["optimize", str(tmp_path / "t"), "--gpus", "4", "--gpus-per-node", "2", "--window-tokens",
                 "45", "--policy", "eplb", "--no-out", "--no-shift"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\b180 tokens in 4 windows", out)
    assert main(["optimize", str(tmp_path / "t"), "--gpus", "4", "--gpus-per-node", "2", "--window-tokens",
                 "45", "--policy", "eplb", "--out", str(tmp_path / "pl.json"), "--no-shift"]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "pl.json"), str(tmp_path / "t")]) == 0  # replays the import
    out = capsys.readouterr().out
    assert "180 tokens" in out
