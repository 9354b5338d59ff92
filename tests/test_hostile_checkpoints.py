"""Checkpoints validated before a byte moves (``place export --format checkpoint``), config numbers checked
before anything is built from them, and relabel manifests read as strictly as placements.

The checkpoints here are written by hand (an 8-byte length, a JSON header, the data), so each damage is
exactly the one named; every header the writer refuses is also one the safetensors library itself refuses
to load (checked with ``safe_open``), so nothing is refused that a real engine would read."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from fuzzkit import assert_refused, make_inputs, run_place, snapshot

from moeplace.foundation.checkpoint_files import MAX_LAYERS, read_safetensors_header
from moeplace.foundation.errors import InputError
from moeplace.foundation.formats import tag
from moeplace.foundation.model import from_hf_config
from moeplace.placement.record import Placement

E, H, I, LAYERS = 8, 4, 2, 2  # experts, hidden, expert width, MoE layers (olmoe: every layer is MoE)
CONFIG = {"model_type": "olmoe", "num_hidden_layers": LAYERS, "hidden_size": H, "num_experts": E,
          "num_experts_per_tok": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": I,
          "vocab_size": 16, "max_position_embeddings": 64}


def _tensors() -> dict[str, tuple[str, list[int]]]:
    out = {"model.embed_tokens.weight": ("F32", [16, H])}
    for layer in range(LAYERS):
        out[f"model.layers.{layer}.mlp.gate.weight"] = ("F32", [E, H])
        for e in range(E):
            for w, shape in (("gate_proj", [I, H]), ("up_proj", [I, H]), ("down_proj", [H, I])):
                out[f"model.layers.{layer}.mlp.experts.{e}.{w}.weight"] = ("BF16", shape)
    return out


def write_shard(path: Path, header: dict | None = None, data: bytes | None = None, raw: bytes | None = None):
    """A safetensors file: ``raw`` header bytes as given, else ``header`` (default: every tensor of the tiny
    model, back to back) padded to 8 bytes as safetensors pads it, then ``data`` (default: the bytes the
    header's tensors cover, distinct per tensor)."""
    if header is None:
        header, pos = {"__metadata__": {"format": "pt"}}, 0
        for name, (dt, shape) in _tensors().items():
            n = int(np.prod(shape)) * (4 if dt == "F32" else 2)
            header[name] = {"dtype": dt, "shape": shape, "data_offsets": [pos, pos + n]}
            pos += n
    if data is None:
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"
                   and isinstance(t, dict) and isinstance(t.get("data_offsets"), list)
                   and all(isinstance(x, int) for x in t["data_offsets"][1:2])), default=0)
        data = bytes(i % 251 for i in range(end))
    h = raw if raw is not None else json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def make_checkpoint(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(CONFIG))
    write_shard(root / "model.safetensors")
    return root


def make_placement(path: Path) -> Path:
    rng = np.random.default_rng(0)
    rows = np.stack([rng.permutation(E) for _ in range(LAYERS)])
    Placement(rows, 4, 4, "olmoe", E, tuple(range(LAYERS)), {}).save(path)
    return path


def _good_header() -> dict:
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        write_shard(Path(d) / "x")
        return read_safetensors_header(Path(d) / "x")[1]


def _damaged() -> dict[str, tuple[dict | None, bytes | None, bytes | None, str]]:
    """name -> (header, data, raw header bytes, what the line says)."""
    good = _good_header()
    first = next(k for k in good if k != "__metadata__")
    second = [k for k in good if k != "__metadata__"][1]

    def edit(name, key, value):
        h = json.loads(json.dumps(good))
        h[name][key] = value
        return h
    a, b = good[first]["data_offsets"]
    return {
        "deep nesting": (None, b"", b'{"a": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "nested more than"),
        "overlapping offsets": (edit(second, "data_offsets", [a, a + (good[second]["data_offsets"][1]
                                                                      - good[second]["data_offsets"][0])]),
                                None, None, "overlaps"),
        "float offsets": (edit(first, "data_offsets", [float(a), float(b)]), None, None, "data_offsets"),
        "string offsets": (edit(first, "data_offsets", [str(a), str(b)]), None, None, "data_offsets"),
        "bool offsets": (edit(first, "data_offsets", [False, b]), None, None, "data_offsets"),
        "three offsets": (edit(first, "data_offsets", [a, b, b]), None, None, "data_offsets"),
        "metadata a list": ({**good, "__metadata__": ["format", "pt"]}, None, None, "__metadata__"),
        "metadata values not strings": ({**good, "__metadata__": {"format": 1}}, None, None, "__metadata__"),
        "unknown dtype": (edit(first, "dtype", "Q7"), None, None, "not a safetensors dtype"),
        "dtype a list": (edit(first, "dtype", ["F32"]), None, None, "not a safetensors dtype"),
        "negative shape": (edit(first, "shape", [-16, H]), None, None, "'shape'"),
        "float shape": (edit(first, "shape", [16.0, H]), None, None, "'shape'"),
        "shape x dtype disagrees": (edit(first, "shape", [8, H]), None, None, "span"),
        "dtype x shape disagrees": (edit(first, "dtype", "BF16"), None, None, "span"),
        "entry not an object": ({**good, first: [1, 2]}, None, None, "dtype, shape, data_offsets"),
        "field missing": (edit(first, "dtype", None) | {first: {"shape": [16, H], "data_offsets": [a, b]}}, None,
                          None, "'dtype' missing"),
        "truncated data": (good, b"\0" * 100, None, "beyond the file"),
        "trailing bytes": (good, None, None, "no tensor covers"),  # data padded below
        "header not an object": (None, b"", b'[1, 2, 3]', "not a JSON object"),
        "header not JSON": (None, b"", b'{"a": nope}', "safetensors header"),
        "header not UTF-8": (None, b"", b'{"\xff": 1}', "safetensors header"),
        "duplicate key": (None, b"", b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "a": 1}',
                          "appears twice"),
    }


DAMAGED = _damaged()


def _library_loads(path: Path) -> list:
    """The shape of every tensor of ``path`` as the safetensors library reads it (opening validates the whole
    header against the file; numpy has no bfloat16 to load the data into)."""
    safetensors = pytest.importorskip("safetensors")
    with safetensors.safe_open(str(path), "np") as f:
        names = f.keys()
        return [f.get_slice(k).get_shape() for k in names]


@pytest.fixture
def src(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_placement(tmp_path / "p.json")
    return make_checkpoint(tmp_path / "src")


def _refused(capsys, src: Path, *names: str) -> str:
    root = src.parent
    before = snapshot(root)
    line = assert_refused(run_place(["export", root / "p.json", "--format", "checkpoint", "--model-path", src,
                                     "--out", root / "dst"], capsys), *names)
    after = snapshot(root)
    assert after == before, "the source changed or something was written"
    return line


def test_a_good_checkpoint_relabels(src, capsys):
    res = run_place(["export", src.parent / "p.json", "--format", "checkpoint", "--model-path", src, "--out",
                     src.parent / "dst"], capsys)
    assert res.rc == 0, res.err
    assert len(_library_loads(src.parent / "dst" / "model.safetensors")) == len(_tensors())


@pytest.mark.parametrize("case", list(DAMAGED))
def test_damaged_header_refused_before_a_byte_moves(src, capsys, case):
    header, data, raw, says = DAMAGED[case]
    shard = src / "model.safetensors"
    write_shard(shard, header, data, raw)
    if case == "trailing bytes":
        shard.write_bytes(shard.read_bytes() + b"\0" * 8)
    line = _refused(capsys, src, "model.safetensors")
    assert says in line, line
    # what the writer refuses, the safetensors library refuses too (the relabelled copy keeps the header)
    with pytest.raises(Exception):  # noqa: B017 - the library raises its own SafetensorError (a pyo3 type)
        _library_loads(shard)


@pytest.mark.parametrize("n,says", [(MAX_LAYERS * 2000, "over safetensors' limit"), (10**6, "the file holds")])
def test_header_length_beyond_the_limit_or_the_file(src, capsys, n, says):
    shard = src / "model.safetensors"
    shard.write_bytes(struct.pack("<Q", n) + b"{}")
    assert says in _refused(capsys, src, "model.safetensors")


@pytest.mark.parametrize("what", ["fifo", "dir", "device"])
def test_config_json_that_is_not_a_file_says_what_it_is(src, capsys, what):
    cfg = src / "config.json"
    cfg.unlink()
    if what == "fifo":
        os.mkfifo(cfg)
    elif what == "dir":
        cfg.mkdir()
    else:
        cfg.symlink_to("/dev/zero")
    line = _refused(capsys, src, "config.json")
    assert {"fifo": "FIFO", "dir": "a directory", "device": "character device"}[what] in line, line
    assert "no such" not in line


def test_shard_that_is_a_fifo_says_so(src, capsys):
    (src / "model.safetensors").unlink()
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "model-00001.safetensors" for k in _tensors()}}))
    os.mkfifo(src / "model-00001.safetensors")
    line = _refused(capsys, src, "model-00001.safetensors", "FIFO", "model.safetensors.index.json")
    assert "None" not in line


def test_a_relabelled_source_is_refused(src, capsys):
    root = src.parent
    assert run_place(["export", root / "p.json", "--format", "checkpoint", "--model-path", src, "--out",
                      root / "dst"], capsys).rc == 0
    before = snapshot(root)
    line = assert_refused(run_place(["export", root / "p.json", "--format", "checkpoint", "--model-path",
                                     root / "dst", "--out", root / "dst2"], capsys),
                          "moeplace-relabel.json", "already a relabelled checkpoint", "p.json")
    assert "relabel the original" in line
    assert snapshot(root) == before


# ----------------------------------------------------------------------- config numbers
@pytest.mark.parametrize("field,value,says", [
    ("num_experts", "8", "must be a whole number"), ("num_experts", None, "is null"),
    ("num_experts", 8.5, "must be a whole number"), ("num_experts", True, "must be a whole number"),
    ("num_experts", 70000, "1..65,535"), ("num_experts", 0, "1..65,535"),
    ("num_experts_per_tok", 9, "1..8"), ("num_hidden_layers", 10**9, "1..65,536"),
    ("num_hidden_layers", 1e9, "must be a whole number"), ("hidden_size", -4, "hidden_size"),
    ("decoder_sparse_step", 0, "decoder_sparse_step"), ("mlp_only_layers", [5], "mlp_only_layers"),
])
def test_config_numbers_of_the_wrong_type_or_range(field, value, says):
    with pytest.raises(InputError, match=f"cfg.json: field '{field}'.*") as e:
        from_hf_config({**CONFIG, field: value}, source="cfg.json")
    assert says in str(e.value)


def test_deepseek_group_numbers_checked():
    ds = {"model_type": "deepseek_v3", "num_hidden_layers": 3, "hidden_size": 16, "n_routed_experts": 8,
          "num_experts_per_tok": 2, "num_attention_heads": 2, "intermediate_size": 16, "moe_intermediate_size": 8,
          "vocab_size": 64, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4,
          "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2}
    assert from_hf_config(ds).n_group == 4
    with pytest.raises(InputError, match="topk_group 5 is more than n_group 4"):
        from_hf_config({**ds, "topk_group": 5})
    with pytest.raises(InputError, match="8 experts do not split into n_group=3"):
        from_hf_config({**ds, "n_group": 3})
    with pytest.raises(InputError, match="'first_k_dense_replace' must be a whole number"):
        from_hf_config({**ds, "first_k_dense_replace": "1"})


def test_a_billion_layers_is_refused_by_the_ceiling_not_by_memory(tmp_path, capsys):
    """num_hidden_layers 1e9 was 67 s and 5 GB of layer lists before "out of memory": now the range check
    refuses it before anything per layer exists (the same check behind every reader of a config.json)."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**CONFIG, "num_hidden_layers": 10**9}))
    line = assert_refused(run_place(["model", "show", cfg], capsys), "config.json", "num_hidden_layers")
    assert "1..65,536" in line


# ----------------------------------------------------------------------- relabel manifests
@pytest.fixture(scope="module")
def engine_inputs(tmp_path_factory):
    """An SGLang file exported from a placement of the 16-expert, 3-MoE-layer mini model (fuzzkit)."""
    root = tmp_path_factory.mktemp("manifest") / "in"
    make_inputs(root)
    return root


def _manifest(root: Path, **fields) -> Path:
    rng = np.random.default_rng(0)
    doc = {"format": tag("relabel-manifest"), "model": "mini-k3", "layout": "contiguous", "num_experts": 16,
           "moe_layers": [1, 2, 3], "num_gpus": 4, "gpus_per_node": 2,
           "new2old": [rng.permutation(16).tolist() for _ in range(3)]}
    for k, v in fields.items():
        if k == "cell":
            doc["new2old"][1][5] = v
        else:
            doc[k] = v
    p = root / "m.json"
    p.write_text(json.dumps(doc))
    return p


def _import(root: Path, manifest: Path, capsys):
    return run_place(["import-placement", root / "sglang.json", "--format", "sglang", "--model", root / "model.json",
                      "--gpus", "4", "--gpus-per-node", "2", "--out", root / "back.json", "--relabel-manifest",
                      manifest], capsys)


def test_a_good_manifest_maps_the_ids_back(engine_inputs, tmp_path, capsys):
    import shutil
    root = tmp_path / "in"
    shutil.copytree(engine_inputs, root)
    assert _import(root, _manifest(root), capsys).rc == 0


@pytest.mark.parametrize("fields,says", [
    ({"cell": 0.5}, "layer 1 position 5: expected an expert id"), ({"cell": True}, "layer 1 position 5"),
    ({"cell": False}, "layer 1 position 5"), ({"cell": "3"}, "layer 1 position 5"),
    ({"num_gpus": 0}, "'num_gpus' must be a whole number >= 1"), ({"num_gpus": 3}, "does not divide the 16 experts"),
    ({"num_gpus": 4.0}, "'num_gpus' must be a whole number"), ({"num_experts": True}, "'num_experts'"),
    ({"gpus_per_node": 3}, "'gpus_per_node' is 3"), ({"moe_layers": [1, 1, 3]}, "strictly increasing"),
    ({"moe_layers": [1, 2.0, 3]}, "moe_layers[1]"), ({"new2old": [[0] * 16] * 3}, "not a permutation"),
    ({"new2old": [list(range(16))] * 2}, "one row per MoE layer (3)"),
    ({"model": "other-model"}, "made for model 'other-model'"),
    ({"moe_layers": [0, 1, 2]}, "made for MoE layers 0-2 of 'mini-k3', but --model 'mini-k3' has MoE layers 1-3"),
])
def test_manifest_fields_checked_as_strictly_as_a_placement(engine_inputs, tmp_path, capsys, fields, says):
    import shutil
    root = tmp_path / "in"
    shutil.copytree(engine_inputs, root)
    m = _manifest(root, **fields)
    before = snapshot(root)
    line = assert_refused(_import(root, m, capsys), "m.json")
    assert says in line, line
    assert snapshot(root) == before


def test_a_partial_placement_as_manifest_says_planned_on_n_of_m_layers(engine_inputs, tmp_path, capsys):
    import shutil

    from moeplace.placement.record import load_placement
    root = tmp_path / "in"
    shutil.copytree(engine_inputs, root)
    full = load_placement(root / "placement.json")
    partial = Placement(full.phy2log[:2], full.num_gpus, full.gpus_per_node, full.model_name, full.num_experts,
                        (1, 2), {"model_moe_layers": [1, 2, 3], "layers": "2 of 3 layers"})
    partial.save(root / "partial.json")
    line = assert_refused(_import(root, root / "partial.json", capsys), "partial.json")
    assert "planned on 2 of 3 layers" in line and "MoE layers 1-2" in line and "MoE layers 1-3" in line, line


def test_the_fast_check_and_the_entry_by_entry_check_agree(src):
    """check_header's fast path (no error text built) gives what the entry-by-entry check gives on a good
    header, and steps aside on every damaged one (which the entry-by-entry check then words)."""
    from moeplace.foundation import checkpoint_files as cf

    shard = src / "model.safetensors"
    data_start, head, tensors = read_safetensors_header(shard)
    size = shard.stat().st_size
    assert cf._valid_tensors(head, data_start, size) == cf._check_header_entries(head, shard, data_start, size)
    assert tensors == cf._check_header_entries(head, shard, data_start, size)
    damaged = [case for case, (header, data, raw, _) in DAMAGED.items()
               if data is None and raw is None and case != "trailing bytes"]  # the file's damage, not the header's
    assert len(damaged) >= 10
    for case in damaged:  # the header's own damage (the file's size is the good one's)
        assert cf._valid_tensors(DAMAGED[case][0], data_start, size) is None, case
    shifted = {k: v if k == "__metadata__" else {**v, "data_offsets": [v["data_offsets"][0] + 1,
                                                                        v["data_offsets"][1] + 1]}
               for k, v in head.items()}
    assert cf._valid_tensors(shifted, data_start, size) is None  # a gap before the first tensor
