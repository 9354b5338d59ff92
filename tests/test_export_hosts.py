"""Launches count hosts, not NVLink domains: a GB200/GB300 NVL72 rack is one 72-GPU NVLink domain of 18
compute trays of 4 GPUs, each tray a machine running its own engine process. The engines' process flags
(vLLM ``--data-parallel-size-local`` / ``--headless`` / ``--data-parallel-start-rank`` / ``--nnodes``,
SGLang ``--nnodes``, TensorRT-LLM ``--gpus_per_node``) and the Slurm / Kubernetes files count those hosts;
the all-to-all backend still follows the NVLink domain. Commands are checked against the recorded parser
option tables (tests/test_export_launch.py checks the live parsers where the engines are importable)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from simkit import random_placement
from test_export_launch import _check_recorded, _expand

from moeplace.cli.main import main
from moeplace.foundation.cluster import GPUSpec, load_gpu, make_cluster
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import load_model
from moeplace.placement.export.flags import FlagOptions, launch_host_size, launch_spec
from moeplace.placement.record import Placement

GB = "gb300-nvl72"


@pytest.fixture(scope="module")
def k3():
    return load_model("kimi-k3")


def _launch(k3, tmp_path, fmt, G, tp, dp, gpu=GB, gpus_per_node=None, **kw):
    pl = random_placement(k3, G, 0, gpus_per_node=gpus_per_node or min(G, 72 if gpu.startswith("gb") else 8))
    return launch_spec(pl, k3, fmt, tmp_path / "p.json", FlagOptions(tp=tp, dp=dp, gpu=gpu,
                                                                     placement_path=str(tmp_path / "pl.json"), **kw))


def _arg(argv, flag):
    return argv[argv.index(flag) + 1]


# ----------------------------------------------------------------------------------- the GPU spec
def test_nvl72_presets_have_4_gpu_hosts_in_a_72_gpu_nvlink_domain():
    for name in ("gb200-nvl72", GB):
        spec = load_gpu(name)
        assert (spec.gpus_per_node, spec.gpus_per_host) == (72, 4) and "compute trays" in spec.note
    h200 = load_gpu("h200")
    assert h200.gpus_per_host == h200.gpus_per_node == 8  # not given: the whole node is one host
    c = make_cluster(16, GB)
    assert (c.num_nodes, c.gpus_per_node, c.gpus_per_host) == (1, 16, 4)
    assert c.to_dict() == {"gpu": GB, "num_nodes": 1, "gpus_per_node": 16, "gpus_per_host": 4}
    assert make_cluster(32, "h200").to_dict() == {"gpu": "h200", "num_nodes": 4, "gpus_per_node": 8}
    # --gpus-per-node resizes the node: an HGX host stays the node, a rack keeps its trays
    assert make_cluster(32, "h200", 16).gpus_per_host == 16 and make_cluster(8, "h200", 4).gpus_per_host == 4
    assert make_cluster(144, GB, 36).gpus_per_host == 4
    with pytest.raises(InputError, match="gpus_per_host must be >= 1 and divide gpus_per_node"):
        GPUSpec("x", 1e9, 1e12, 1e15, 2e15, 0, 1e11, 1e-6, 1e10, 1e-6, gpus_per_node=8, gpus_per_host=3)


@pytest.mark.parametrize("value, message", [
    (0, "field 'gpus_per_host' must be an integer >= 1, got 0"),
    ("4", "field 'gpus_per_host' must be an integer >= 1"),
    (True, "field 'gpus_per_host' must be an integer >= 1"),
    (2.0, "field 'gpus_per_host' must be an integer >= 1"),
    (5, "field 'gpus_per_host' (5) must divide gpus_per_node (8)"),
])
def test_user_gpu_spec_with_a_bad_host_size_gets_one_line_naming_the_field(tmp_path, capsys, value, message):
    spec = json.loads(json.dumps({**_spec_fields(), "gpus_per_node": 8, "gpus_per_host": value}))
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(spec))
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_gpu(str(f))
    assert main(["plan", "--model", "deepseek-v3", "--gpus", "16", "--gpu", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(f) in err and "gpus_per_host" in err and "Traceback" not in err


def _spec_fields():
    d = load_gpu("b200")
    return {"name": "rack", "hbm_bytes": d.hbm_bytes, "hbm_bw": d.hbm_bw, "flops_bf16": d.flops_bf16,
            "flops_fp8": d.flops_fp8, "flops_fp4": d.flops_fp4, "nvlink_bw": d.nvlink_bw,
            "nvlink_latency": d.nvlink_latency, "nic_bw": d.nic_bw, "nic_latency": d.nic_latency}


# ----------------------------------------------------------------------------------- the commands
def test_vllm_dep16_on_gb300_runs_4_hosts_of_4_dp_ranks(k3, tmp_path):
    lw = _launch(k3, tmp_path, "vllm-expert-map", 16, 1, 16)
    head = lw.argv()
    assert (lw.nodes, lw.gpus_per_node) == (4, 4)
    assert _arg(head, "--data-parallel-size") == "16" and _arg(head, "--data-parallel-size-local") == "4"
    # the EP group is in one NVLink domain: NVLink all-to-all, not the RDMA one
    assert _arg(head, "--all2all-backend") == "flashinfer_nvlink_one_sided"
    starts = []
    for rank in (1, 2, 3):
        w = _expand(lw.argv(worker=True), rank)
        assert "--headless" in w
        starts.append(int(_arg(w, "--data-parallel-start-rank")))
        _check_recorded(w)
    assert starts == [4, 8, 12]
    _check_recorded(_expand(head, 0))
    assert "4 hosts of 4 GPUs" in lw.text() and "nodes 1..3" in lw.text()
    assert lw.env["VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"] == "MOEPLACE_PLACEMENT"


def test_sglang_and_trtllm_on_gb300_count_hosts(k3, tmp_path):
    sg = _launch(k3, tmp_path, "sglang", 16, 1, 16)
    argv = sg.argv()
    assert _arg(argv, "--nnodes") == "4" and _arg(argv, "--tp-size") == "16" and _arg(argv, "--ep-size") == "16"
    assert (sg.nodes, sg.gpus_per_node) == (4, 4)
    _check_recorded(_expand(argv, 2)[3:], "sglang", sg.version)
    tr = _launch(k3, tmp_path, "trtllm", 16, 1, 16)
    assert _arg(tr.argv(), "--gpus_per_node") == "4" and "srun -N 4 --ntasks-per-node 4" in tr.text()
    assert tr.argv()[0] == "trtllm-llmapi-launch"


def test_tp8_on_4_gpu_hosts_spans_two_hosts_or_is_refused_in_one_line(k3, tmp_path):
    # TEP8 (one DP rank): vLLM's multi-node launcher over 2 hosts, SGLang 2 nodes of --tp-size / --nnodes = 4 GPUs
    v = _launch(k3, tmp_path, "vllm-expert-map", 8, 8, 1)
    head, worker = v.argv(), v.argv(worker=True)
    assert _arg(head, "--nnodes") == "2" and _arg(head, "--tensor-parallel-size") == "8"
    assert worker[-1] == "--headless" and "--data-parallel-size-local" not in head
    _check_recorded(_expand(head, 0))
    _check_recorded(_expand(worker, 1))
    s = _launch(k3, tmp_path, "sglang", 8, 8, 1)
    assert _arg(s.argv(), "--nnodes") == "2" and _arg(s.argv(), "--tp-size") == "8"
    # TP8 x DP2: each DP rank's TP group spans 2 hosts, which vLLM's DP launch does not express here
    with pytest.raises(InputError) as exc:
        _launch(k3, tmp_path, "vllm-expert-map", 16, 8, 2)
    msg = str(exc.value)
    assert "\n" not in msg and "spans 2 hosts of 4 GPUs" in msg and "--tp 4 --dp 4" in msg


def test_h200_launches_are_unchanged(k3, tmp_path):
    lw = _launch(k3, tmp_path, "vllm-expert-map", 16, 1, 16, gpu="h200")
    head = lw.argv()
    assert (lw.nodes, lw.gpus_per_node) == (2, 8) and _arg(head, "--data-parallel-size-local") == "8"
    assert _arg(head, "--all2all-backend") == "deepep_v2"
    assert _arg(_expand(lw.argv(worker=True), 1), "--data-parallel-start-rank") == "8"
    assert "hosts of" not in lw.text()
    sg = _launch(k3, tmp_path, "sglang", 16, 8, 2, gpu="h200")
    assert _arg(sg.argv(), "--nnodes") == "2"
    one = _launch(k3, tmp_path, "vllm-expert-map", 8, 1, 8, gpu="h200")
    assert one.nodes == 1 and "--headless" not in one.worker_line() and one.worker_extra is None


def test_the_host_size_comes_from_the_gpu_spec_the_placement_or_the_plan(k3, tmp_path):
    # a placement planned on GB300 (recorded before hosts were: no gpus_per_host key) exported without --gpu
    pl = random_placement(k3, 16, 0, gpus_per_node=16)
    old = Placement.from_phy2log(np.asarray(pl.phy2log), k3, 16, 16, {"cluster": {"gpu": GB, "num_nodes": 1,
                                                                                   "gpus_per_node": 16}})
    assert launch_host_size(old, FlagOptions()) == 4
    # a user spec recorded by name with its host size; and one given as --gpu FILE
    rec = Placement.from_phy2log(np.asarray(pl.phy2log), k3, 16, 16, {"cluster": make_cluster(16, GB).to_dict()})
    assert launch_host_size(rec, FlagOptions()) == 4
    f = tmp_path / "rack.json"
    f.write_text(json.dumps({**_spec_fields(), "gpus_per_node": 16, "gpus_per_host": 2}))
    assert launch_host_size(pl, FlagOptions(gpu=str(f))) == 2
    lw = launch_spec(pl, k3, "sglang", tmp_path / "p.json", FlagOptions(tp=1, dp=16, gpu=str(f)))
    assert _arg(lw.argv(), "--nnodes") == "8"


def test_export_files_and_plan_reports_carry_the_hosts(k3, tmp_path, capsys):
    pj = tmp_path / "pl.json"
    random_placement(k3, 16, 0, gpus_per_node=16).save(pj)
    base = ["export", str(pj), "--format", "sglang", "--flags", "--tp", "1", "--dp", "16", "--gpu", GB]
    assert main([*base, "--out", str(tmp_path / "s.json"), "--target", "slurm",
                 "--launch-out", str(tmp_path / "s.sbatch")]) == 0
    text = (tmp_path / "s.sbatch").read_text()
    assert "#SBATCH --nodes=4" in text and "#SBATCH --gpus-per-node=4" in text and "srun --nodes=4" in text
    assert main([*base, "--out", str(tmp_path / "k.json"), "--target", "k8s",
                 "--launch-out", str(tmp_path / "k.yaml")]) == 0
    lws = next(o for o in yaml.safe_load_all((tmp_path / "k.yaml").read_text()) if o["kind"] == "LeaderWorkerSet")
    tmpl = lws["spec"]["leaderWorkerTemplate"]
    assert tmpl["size"] == 4
    assert tmpl["leaderTemplate"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4
    # a user GPU spec through a plan report: the plan names it, --gpu gives the file
    f = tmp_path / "rack.json"
    f.write_text(json.dumps({**load_gpu(GB).__dict__, "name": "rack", "gpus_per_host": 2}))
    rep = tmp_path / "plan.json"
    assert main(["plan", "--model", "kimi-k3", "--gpus", "16", "--gpu", str(f), "--tp", "1", "--dp", "16",
                 "--context", "32k", "--kv-dtype", "fp8", "--report", str(rep)]) == 0
    capsys.readouterr()
    assert json.loads(rep.read_text())["cluster"]["gpus_per_host"] == 2
    assert main(["export", str(pj), "--format", "sglang", "--flags", "--plan", str(rep), "--gpu", str(f),
                 "--out", str(tmp_path / "u.json"), "--json"]) == 0
    argv = json.loads(capsys.readouterr().out)["launch"]["argv"]
    assert _arg(argv, "--nnodes") == "8"
