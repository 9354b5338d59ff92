"""Cluster topology (foundation/cluster.py)."""
from __future__ import annotations

import itertools

import pytest

from moeplace.foundation.cluster import gpu_preset_names, load_gpu, make_cluster
from moeplace.foundation.errors import InputError


def test_default_is_four_h200_nodes():
    c = make_cluster(32)
    assert (c.num_nodes, c.gpus_per_node, c.num_gpus, c.gpu.name) == (4, 8, 32, "h200")
    assert c.name == "4x8 h200"
    # docs/design.md Sources §2: 141 GB HBM3e, 4.8 TB/s, 450 GB/s NVLink per direction, NDR 400 Gb/s = 50 GB/s
    assert c.gpu.hbm_bytes == 141e9 and c.gpu.hbm_bw == 4.8e12
    assert c.gpu.nvlink_bw == 450e9 and c.gpu.nic_bw == 50e9
    assert c.to_dict() == {"gpu": "h200", "num_nodes": 4, "gpus_per_node": 8}


def test_presets_present():
    assert {"h200", "h100", "b200", "b300", "gb300-nvl72"} <= set(gpu_preset_names())
    assert make_cluster(72, "gb300-nvl72").num_nodes == 1
    assert load_gpu("h200").flops("mxfp4") == load_gpu("h200").flops_fp8  # Hopper: no FP4 cores
    assert load_gpu("b200").flops("mxfp4") == load_gpu("b200").flops_fp4


def test_links_bandwidth_latency():
    c = make_cluster(16)
    assert [c.node_of(g) for g in (0, 7, 8, 15)] == [0, 0, 1, 1]
    assert (c.link(3, 3), c.link(0, 7), c.link(7, 8)) == ("local", "nvlink", "nic")
    assert c.bandwidth(0, 7) == 450e9 and c.bandwidth(0, 8) == 50e9 and c.bandwidth(2, 2) == 4.8e12
    assert c.latency(0, 0) == 0 and c.latency(0, 1) == pytest.approx(3e-6)
    assert c.latency(0, 9) == pytest.approx(11e-6)


def test_graph_and_paths():
    c = make_cluster(16)
    g = c.graph
    gpus = [n for n, d in g.nodes(data=True) if d["kind"] == "gpu"]
    assert len(gpus) == 16
    assert g.number_of_edges() == 16 + 16  # one NVLink and one NIC edge per GPU
    assert c.path(0, 3) == [("gpu", 0), ("nvswitch", 0), ("gpu", 3)]
    p = c.path(0, 12)
    assert p[0] == ("gpu", 0) and p[-1] == ("gpu", 12) and ("fabric", 0) in p
    assert min(g.edges[e]["bandwidth"] for e in itertools.pairwise(p)) == c.bandwidth(0, 12)
    single = make_cluster(8)
    assert not any(d["kind"] == "nic" for *_, d in single.graph.edges(data=True))


def test_small_and_bad_clusters():
    assert make_cluster(4).gpus_per_node == 4  # fewer GPUs than a node: one partial node
    with pytest.raises(InputError, match="not a multiple"):
        make_cluster(12)
    with pytest.raises(InputError, match="unknown"):
        make_cluster(8, "a100x")
    with pytest.raises(InputError, match=">= 1"):
        make_cluster(0)


def test_device_reported_memory_is_its_own_field(tmp_path):
    """The marketing capacity stays what it is; the total CUDA reports (what the engines' memory fractions
    apply to) is a field of its own, optional in a spec file, and the plan sizes from it where it is known."""
    import json

    h200, gb300 = load_gpu("h200"), load_gpu("gb300-nvl72")
    assert h200.hbm_bytes == 141e9 and h200.device_memory_bytes == 150.12e9 and h200.memory_bytes == 150.12e9
    assert gb300.device_memory_bytes is None and gb300.memory_bytes == gb300.hbm_bytes  # not established
    spec = {k: v for k, v in h200.__dict__.items() if k != "name"}
    f = tmp_path / "g.json"
    for value, want in ((100e9, 100e9), (None, None)):  # null (a GPUSpec written back) means not given
        f.write_text(json.dumps({**spec, "device_memory_bytes": value}))
        assert load_gpu(str(f)).device_memory_bytes == want
    for bad in (-1, 0, "150e9"):
        f.write_text(json.dumps({**spec, "device_memory_bytes": bad}))
        with pytest.raises(InputError, match="device_memory_bytes"):
            load_gpu(str(f))
