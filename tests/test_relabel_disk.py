"""Relabelling at disk speed and proving it (issue 41 items 2 and 3), on a small checkpoint in Kimi K3's tensor
layout (moeplace/placement/export/sample_checkpoint.py: per expert w1/w2/w3 weight_packed / weight_scale /
weight_shape, router, bias; compressed-tensors quantization_config) -- no torch."""
from __future__ import annotations

import errno
import json
import os
import struct
import time
from dataclasses import replace

import numpy as np
import pytest

from moeplace.cli.main import main
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import load_model
from moeplace.placement.export import checkpoint as ck
from moeplace.placement.export.sample_checkpoint import write_k3_like
from moeplace.placement.export.verify import VerifyFailed, verify
from moeplace.placement.record import Placement, load_placement
from moeplace.placement.relabel import CONTIGUOUS

E, GPUS = 16, 4


def small_k3():
    k3 = load_model("kimi-k3")
    return replace(k3, name="k3-small", num_layers=4, moe_layers=(1, 2, 3), num_experts=E, top_k=4,
                   attention=("mla", "kda", "kda", "mla"))


@pytest.fixture
def src(tmp_path):
    write_k3_like(tmp_path / "src", small_k3(), shards=3)
    return tmp_path / "src"


def _placement(tmp_path, seed=1):
    rng = np.random.default_rng(seed)
    p = Placement(np.stack([rng.permutation(E) for _ in range(3)]), GPUS, GPUS, "k3-small", E, (1, 2, 3))
    p.save(tmp_path / "p.json")
    return tmp_path / "p.json"


def _export(p, src, dst, *extra):
    return main(["export", str(p), "--format", "checkpoint", "--model-path", str(src), "--out", str(dst), *extra])


def _header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return n, json.loads(f.read(n))


def test_a_relabelling_is_a_renaming_and_verify_proves_it(src, tmp_path, capsys):
    p = _placement(tmp_path)
    assert _export(p, src, tmp_path / "dst") == 0
    capsys.readouterr()
    assert main(["export", "--verify", str(tmp_path / "dst"), str(p)]) == 0
    assert "verified" in capsys.readouterr().out
    man = json.loads((tmp_path / "dst" / "moeplace-relabel.json").read_text())
    for s in man["source_shards"]:
        n0, h0 = _header(src / s)
        n1, h1 = _header(tmp_path / "dst" / s)
        # the same length (or whole blocks more): the data section keeps its offset within a block
        assert (n1 - n0) % ck.BLOCK == 0
        # the data section is SRC's, byte for byte, but for the permuted router / bias rows
        routers = {k for k in h0 if k.endswith(("gate.weight", "e_score_correction_bias"))}
        d0, d1 = (src / s).read_bytes()[8 + n0:], (tmp_path / "dst" / s).read_bytes()[8 + n1:]
        keep = np.ones(len(d0), bool)
        for k in routers:
            a, b = h0[k]["data_offsets"]
            keep[a:b] = False
        assert len(d0) == len(d1) and np.array_equal(np.frombuffer(d0, np.uint8)[keep], np.frombuffer(d1, np.uint8)[keep])
        # names renamed, each at its source's offsets; __metadata__ names the relabelling (weight caches)
        assert h1.pop("__metadata__")[ck.METADATA_KEY] == man["relabel_tag"]
        h0.pop("__metadata__")
        assert sorted(v["data_offsets"] for v in h1.values()) == sorted(v["data_offsets"] for v in h0.values())
    idx = json.loads((tmp_path / "dst" / "model.safetensors.index.json").read_text())["weight_map"]
    for name, shard in idx.items():  # the index maps every renamed tensor to the shard its bytes are in
        assert name in _header(tmp_path / "dst" / shard)[1]


def test_verify_fails_on_a_single_scale_tensor_swapped(src, tmp_path, capsys):
    p = _placement(tmp_path)
    assert _export(p, src, tmp_path / "dst") == 0
    dst = tmp_path / "dst"
    full = ck.scan(dst)
    a = full.tensors["language_model.model.layers.2.mlp.experts.3.w2.weight_scale"]
    b = full.tensors["language_model.model.layers.2.mlp.experts.9.w2.weight_scale"]
    assert a.shard == b.shard and a.nbytes == b.nbytes
    with open(dst / a.shard, "r+b") as f:
        f.seek(a.start)
        x = f.read(a.nbytes)
        f.seek(b.start)
        y = f.read(b.nbytes)
        assert x != y
        f.seek(a.start)
        f.write(y)
        f.seek(b.start)
        f.write(x)
    capsys.readouterr()
    assert main(["export", "--verify", str(dst)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress lines of the shards that matched
    assert err.startswith("place: error: ") and "weight_scale" in err and "must be original expert" in err


def test_verify_fails_on_router_rows_a_changed_source_and_another_placement(src, tmp_path):
    p = _placement(tmp_path)
    assert _export(p, src, tmp_path / "dst") == 0
    dst = tmp_path / "dst"
    # another placement than the manifest's
    with pytest.raises(VerifyFailed, match="permutation is not"):
        verify(dst, placement=Placement(np.tile(np.arange(E), (3, 1)), GPUS, GPUS, "k3-small", E, (1, 2, 3)))
    # a router row out of place
    r = ck.scan(dst).tensors["language_model.model.layers.1.mlp.gate.weight"]
    with open(dst / r.shard, "r+b") as f:
        f.seek(r.start)
        row = f.read(r.nbytes // E)
        f.seek(r.start)
        f.write(bytes(255 - x for x in row))
    with pytest.raises(VerifyFailed, match="gate.weight .*row 0 is not SRC's row"):
        verify(dst)
    # SRC is not the checkpoint the relabelling read
    s = min(src.glob("*.safetensors"))
    with open(s, "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(VerifyFailed, match="not the shard the relabelling read"):
        verify(dst)


def test_per_expert_quantization_entries_are_renamed_or_refused(src, tmp_path):
    cfg = json.loads((src / "config.json").read_text())
    q = cfg["quantization_config"]
    q["ignore"] += ["language_model.model.layers.2.mlp.experts.5.w1", "re:.*experts\\.\\d+\\.w3$"]
    (src / "config.json").write_text(json.dumps(cfg))
    p = _placement(tmp_path)
    assert _export(p, src, tmp_path / "dst") == 0
    got = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]["ignore"]
    n2o = np.array(json.loads((tmp_path / "dst" / "moeplace-relabel.json").read_text())["new2old"])
    new = int(np.flatnonzero(n2o[1] == 5)[0])  # layer 2 is the second MoE layer
    assert got[-2] == f"language_model.model.layers.2.mlp.experts.{new}.w1" and got[-1] == q["ignore"][-1]
    verify(tmp_path / "dst")
    # a pattern that picks out some experts cannot be renamed: refused before anything is written
    q["ignore"][-1] = "re:.*layers\\.2\\.mlp\\.experts\\.(1|2)\\..*"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="names some experts of MoE layer 2"):
        ck.plan(ck.scan(src, full=False), load_placement(p), CONTIGUOUS)


def test_dry_run_says_what_it_needs_and_writes_nothing(src, tmp_path, capsys):
    p = _placement(tmp_path)
    capsys.readouterr()
    assert _export(p, src, tmp_path / "dst", "--dry-run", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    size = sum(os.path.getsize(f) for f in src.glob("*.safetensors"))
    assert doc["checkpoint_bytes"] == size and doc["write_bytes"] + doc["reflink_bytes"] >= size
    assert doc["free_bytes"] > 0 and not (tmp_path / "dst").exists()
    assert not [f for f in os.listdir(tmp_path) if "moeplace-tmp" in f]
    n = ck.Needs(write=10**15, reflink=0, hardlink=0, free=10**9, reflinks=False)
    with pytest.raises(InputError, match="needs 1,000,000.00 GB of new data but its file system has 1.00 GB free"):
        ck.check_space(n, tmp_path / "dst")


def test_copy_region_shares_blocks_where_it_can_and_copies_where_it_cannot(tmp_path):
    """Off a reflink file system (this one, or across devices) the region is copied in full and correctly."""
    a = tmp_path / "a"
    a.write_bytes(os.urandom(3 * ck.BLOCK + 123))
    fa = os.open(a, os.O_RDONLY)
    fb = os.open(tmp_path / "b", os.O_RDWR | os.O_CREAT)
    try:
        shared = ck.copy_region(fa, fb, 100, 100 + ck.BLOCK, 3 * ck.BLOCK, a, reflink=True)
    finally:
        os.close(fa)
        os.close(fb)
    assert (tmp_path / "b").read_bytes()[100 + ck.BLOCK:] == a.read_bytes()[100:100 + 3 * ck.BLOCK]
    assert shared in (0, 2 * ck.BLOCK)
    assert ck._aligned(100, 100 + ck.BLOCK, 3 * ck.BLOCK) == (ck.BLOCK - 100, 2 * ck.BLOCK, 100)
    assert ck._aligned(100, 101, 3 * ck.BLOCK) == (3 * ck.BLOCK, 0, 0)  # different offsets in the block: no reflink


def test_round_robin_is_refused_where_vllm_would_place_linearly(src, tmp_path, capsys):
    """vLLM 0.34.0 lays out a model with one expert group (K3, Qwen3) linearly whatever the strategy: a
    round_robin relabelling would serve another layout than the placement's, so it is refused."""
    p = _placement(tmp_path)
    capsys.readouterr()
    assert _export(p, src, tmp_path / "dst", "--layout", "round_robin") == 2
    err = capsys.readouterr().err
    assert "one expert group" in err and "--layout contiguous" in err and not (tmp_path / "dst").exists()


def test_flags_print_the_launches_that_serve_the_relabelled_checkpoint(src, tmp_path, capsys):
    p = _placement(tmp_path)
    capsys.readouterr()
    assert _export(p, src, tmp_path / "dst", "--flags", "--tp", "2", "--dp", "2", "--gpu", "h100",
                   "--model", str(src / "config.json"), "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    by = {(x["engine"], bool(x["env"])): x for x in doc["launches"]}
    dst, source = str((tmp_path / "dst").resolve()), str(src.resolve())
    vllm, sglang, plugin = by[("vllm", False)], by[("sglang", False)], by[("vllm", True)]
    assert vllm["argv"][:3] == ["vllm", "serve", dst] and "--enable-expert-parallel" in vllm["argv"]
    assert "--expert-placement-strategy" not in vllm["argv"] and "--enable-eplb" not in vllm["argv"]
    assert sglang["model_path"] == dst and "--init-expert-location" not in sglang["argv"]
    assert plugin["argv"][:3] == ["vllm", "serve", source]
    assert plugin["env"] == {"MOEPLACE_PLACEMENT": str(p.resolve()), "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY": "MOEPLACE_PLACEMENT"}
    # a layout the memory plan or the engines refuse leaves nothing behind
    assert _export(p, src, tmp_path / "dst2", "--flags", "--tp", "3", "--model", str(src / "config.json")) == 2
    assert not (tmp_path / "dst2").exists()


# ---------------------------------------------------------------------------- planning while copying
def _four_shards(tmp_path):
    """Shard 1 holds the dense layer 0 (nothing in it changes: hard-linked), shards 2-4 one MoE layer each."""
    write_k3_like(tmp_path / "src4", small_k3(), shards=4)
    return tmp_path / "src4", sorted(f.name for f in (tmp_path / "src4").glob("*.safetensors"))


def _tree(root):
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


def _left_behind(where):
    return [f for f in os.listdir(where) if "moeplace-tmp" in f]


def test_planning_while_copying_writes_the_bytes_planning_first_writes(tmp_path, capsys):
    src, shards = _four_shards(tmp_path)
    p = _placement(tmp_path)
    capsys.readouterr()
    assert _export(p, src, tmp_path / "dst") == 0
    assert "each planned while the one before it is copied" in capsys.readouterr().err
    c = ck.scan(src, full=False)
    pl = load_placement(p)
    ck.write_checkpoint(c, ck.plan(c, pl, CONTIGUOUS), pl, p, tmp_path / "serial")
    assert _tree(tmp_path / "dst") == _tree(tmp_path / "serial")  # every shard, the index, config and manifest
    man = json.loads((tmp_path / "dst" / ck.MANIFEST).read_text())
    assert [man["shards"][s]["how"] for s in shards] == ["linked", "rewritten", "rewritten", "rewritten"]
    assert os.stat(tmp_path / "dst" / shards[0]).st_ino == os.stat(src / shards[0]).st_ino
    verify(tmp_path / "dst")


def test_a_problem_found_while_copying_leaves_nothing_behind(tmp_path, monkeypatch):
    """A damaged third shard is read after the first two were written: the error is the plan-first route's,
    the temporary directory is gone and DST never appears; a writer that fails stops the planning."""
    src, shards = _four_shards(tmp_path)
    pl = load_placement(_placement(tmp_path))
    data = (src / shards[2]).read_bytes()
    (src / shards[2]).write_bytes(data[:-100])  # its header whole, its data short
    with pytest.raises(InputError) as serial:
        ck.plan(ck.scan(src, full=False), pl, CONTIGUOUS)
    lines: list[str] = []
    real = ck.read_shard

    def after_two_written(c, s, **kw):
        if s == shards[2]:  # the writer has finished shards 1 and 2 before shard 3's header is read
            for _ in range(1000):
                if len(lines) >= 2:
                    break
                time.sleep(0.01)
        return real(c, s, **kw)

    monkeypatch.setattr(ck, "read_shard", after_two_written)
    c, _ = ck.open_checkpoint(src)
    planner = ck.Planner(c, pl, CONTIGUOUS)
    bound = ck.space_bound(c, tmp_path / "dst", planner.relabel)
    with pytest.raises(InputError) as piped:
        ck.relabel_checkpoint(c, planner, pl, tmp_path / "p.json", tmp_path / "dst", space=bound,
                              progress=lines.append)
    assert len(lines) == 2 and str(piped.value) == str(serial.value) and "data_offsets beyond the file" in str(piped.value)
    assert not (tmp_path / "dst").exists() and not _left_behind(tmp_path)
    # the writer fails on shard 2: its error, at once, and nothing left
    (src / shards[2]).write_bytes(data)
    monkeypatch.setattr(ck, "read_shard", real)
    real_write = ck._write_shard

    def failing(c, s, *a, **kw):
        if s == shards[1]:
            raise OSError(errno.EIO, "Input/output error", str(tmp_path / "dst"))
        return real_write(c, s, *a, **kw)

    monkeypatch.setattr(ck, "_write_shard", failing)
    c, _ = ck.open_checkpoint(src)
    planner = ck.Planner(c, pl, CONTIGUOUS)
    with pytest.raises(OSError, match="Input/output error"):
        ck.relabel_checkpoint(c, planner, pl, tmp_path / "p.json", tmp_path / "dst", space=bound)
    assert not (tmp_path / "dst").exists() and not _left_behind(tmp_path)


def test_without_room_for_every_shard_rewritten_the_plan_comes_first(tmp_path, monkeypatch, capsys):
    """The bound (every shard rewritten) does not fit but the exact figure (a shard hard-linked) does: the
    plan-first route, with the exact figure, and the same bytes; when neither fits, the same refusal."""
    src, shards = _four_shards(tmp_path)
    p = _placement(tmp_path)
    pl = load_placement(p)
    c, _ = ck.open_checkpoint(src)
    bound = ck.space_bound(c, tmp_path / "dst", ck.Planner(c, pl, CONTIGUOUS).relabel)
    c = ck.scan(src, full=False)
    exact = ck.needs(c, ck.plan(c, pl, CONTIGUOUS), tmp_path / "dst")
    assert bound.write >= exact.write + os.path.getsize(src / shards[0])  # the linked shard counted as written
    monkeypatch.setattr(ck, "_space_facts", lambda *a: ((bound.write + exact.write) // 2 + (1 << 20), False, True))
    capsys.readouterr()
    assert _export(p, src, tmp_path / "dst") == 0
    err = capsys.readouterr().err
    assert "3 with renamed tensors, 1 to link" in err and "each planned while" not in err
    ck.write_checkpoint(c, ck.plan(c, pl, CONTIGUOUS), pl, p, tmp_path / "serial")
    assert _tree(tmp_path / "dst") == _tree(tmp_path / "serial")
    monkeypatch.setattr(ck, "_space_facts", lambda *a: (exact.write // 2, False, True))
    assert _export(p, src, tmp_path / "dst2") == 2
    err = capsys.readouterr().err
    assert "needs" in err and "GB of new data but its file system has" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "dst2").exists() and not _left_behind(tmp_path)


def test_the_space_bound_holds_for_every_shard_rewritten(tmp_path):
    """The bound checked before planning is at least the exact figure when nothing is linked (--copy)."""
    src, _ = _four_shards(tmp_path)
    for seed in (1, 2, 3):
        pl = load_placement(_placement(tmp_path, seed))
        c, _ = ck.open_checkpoint(src)
        bound = ck.space_bound(c, tmp_path / "dst", ck.Planner(c, pl, CONTIGUOUS).relabel)
        c = ck.scan(src, full=False)
        exact = ck.needs(c, ck.plan(c, pl, CONTIGUOUS), tmp_path / "dst", link=False)
        assert exact.write <= bound.write


def test_a_relabelled_copy_without_its_manifest_is_known_by_any_rewritten_shard(tmp_path):
    """The first shard (the dense layer) is hard-linked, unchanged: only the later ones name the relabelling."""
    src, shards = _four_shards(tmp_path)
    assert _export(_placement(tmp_path), src, tmp_path / "dst") == 0
    assert ck.relabelled_reason(src) is None
    (tmp_path / "dst" / ck.MANIFEST).unlink()
    assert ck.METADATA_KEY not in _header(tmp_path / "dst" / shards[0])[1].get("__metadata__", {})
    why = ck.relabelled_reason(tmp_path / "dst")
    assert why is not None and f"{shards[1]}'s __metadata__ names a relabelling" in why


def test_the_exact_figure_counts_every_file_the_copy_writes(tmp_path):
    """A tokenizer in a subdirectory is copied to DST, so the exact figure counts it (it counted the top
    level only); a hidden file is neither copied nor counted."""
    src, _ = _four_shards(tmp_path)
    pl = load_placement(_placement(tmp_path))
    c = ck.scan(src, full=False)
    before = ck.needs(c, ck.plan(c, pl, CONTIGUOUS), tmp_path / "dst", link=False).write
    (src / "tokenizer").mkdir()
    (src / "tokenizer" / "vocab.txt").write_bytes(b"x" * 300_000)
    (src / ".cache").write_bytes(b"y" * 50_000)
    c = ck.scan(src, full=False)
    assert ck.needs(c, ck.plan(c, pl, CONTIGUOUS), tmp_path / "dst", link=False).write == before + 300_000
    assert _export(_placement(tmp_path), src, tmp_path / "dst") == 0
    assert (tmp_path / "dst" / "tokenizer" / "vocab.txt").stat().st_size == 300_000
    assert not (tmp_path / "dst" / ".cache").exists()
