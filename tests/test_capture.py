"""Routing capture from tiny random-weight transformers MoE models (no download): the recorded top-k ids and
gate weights must equal each router's top-k recomputed independently (numpy, float64) from the hidden states
it was fed and its own weight matrix, token by token; padding and finished requests must be excluded;
positions, phases, token ids and request ids must follow generate(); the written trace must validate."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moeplace.cli.main import main
from moeplace.foundation.errors import InputError
from moeplace.traces.capture import (
    RoutingRecorder,
    capture_routing,
    find_routers,
    model_spec_of,
    read_prompts,
)
from moeplace.traces.validate import read_trace_meta, scan_trace

COMMON = {"vocab_size": 96, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 128, "intermediate_size": 48, "pad_token_id": 0, "bos_token_id": 1,
          "eos_token_id": 2}

# Tiny configs, one per family; each exercises its router's options and a layer layout with dense layers
# where the family has them (to check decoder-layer numbering).
TINY = {
    "deepseek_v3": {"model_type": "deepseek_v3", "num_hidden_layers": 3, "first_k_dense_replace": 1,
                    "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "n_shared_experts": 1,
                    "moe_intermediate_size": 16, "q_lora_rank": 16, "kv_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "num_key_value_heads": 4},
    "qwen3_moe": {"model_type": "qwen3_moe", "num_hidden_layers": 3, "num_experts": 8,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": True,
                  "mlp_only_layers": [1], "head_dim": 8},
    "qwen2_moe": {"model_type": "qwen2_moe", "num_hidden_layers": 4, "num_experts": 8,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                  "shared_expert_intermediate_size": 32, "norm_topk_prob": False, "decoder_sparse_step": 2},
    # Kimi-Linear: the K3 layout (KDA + MLA attention, sigmoid group-limited router with bias)
    "kimi_linear": {"model_type": "kimi_linear", "num_hidden_layers": 4, "first_k_dense_replace": 1,
                    "layer_types": ["linear_attention", "full_attention"] * 2,
                    "num_experts": 16, "num_experts_per_token": 4, "num_expert_group": 4, "topk_group": 2,
                    "routed_scaling_factor": 2.446, "moe_intermediate_size": 16, "q_lora_rank": None,
                    "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
                    "num_key_value_heads": 4, "linear_head_dim": 8, "linear_num_heads": 4},
    "mixtral": {"model_type": "mixtral", "num_hidden_layers": 2, "num_local_experts": 8,
                "num_experts_per_tok": 2},
    "olmoe": {"model_type": "olmoe", "num_hidden_layers": 2, "num_experts": 16, "num_experts_per_tok": 4,
              "norm_topk_prob": False},
}
EXPECTED_MOE_LAYERS = {"deepseek_v3": (1, 2), "kimi_linear": (1, 2, 3), "qwen3_moe": (0, 2),
                       "qwen2_moe": (1, 3), "mixtral": (0, 1), "olmoe": (0, 1)}
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17, 18, 19, 20]]
NEW = 5


def tiny_config(family: str):
    d = {**COMMON, **TINY[family]}
    return transformers.AutoConfig.for_model(d.pop("model_type"), **d)


def tiny_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    for _, mod in model.named_modules():
        if hasattr(mod, "e_score_correction_bias"):
            # a non-zero bias makes "bias picks, unbiased score weighs" observable
            mod.e_score_correction_bias.copy_(torch.rand(mod.e_score_correction_bias.shape) * 0.2)
    return model


def left_padded(prompts):
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


# ---------------------------------------------------------------------------- independent router twins
def ref_route(gate, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-k ids [n, k] and weights [n, k] of ``gate`` for ``hidden [n, H]``, in numpy float64, sorted by id.
    Written from the published router definitions, not from the hooked code path."""
    W = gate.weight.detach().double().numpy()
    logits = hidden @ W.T
    k = int(gate.top_k)
    if hasattr(gate, "e_score_correction_bias"):  # DeepSeek-V3 / Kimi: sigmoid, biased group-limited choice
        scores = 1.0 / (1.0 + np.exp(-logits))
        choice = scores + gate.e_score_correction_bias.detach().double().numpy()
        n, E = choice.shape
        G = int(gate.num_group)
        grouped = choice.reshape(n, G, E // G)
        group_score = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
        keep_groups = np.argsort(-group_score, axis=1, kind="stable")[:, : int(gate.topk_group)]
        allowed = np.zeros((n, G), bool)
        np.put_along_axis(allowed, keep_groups, True, axis=1)
        choice = np.where(np.repeat(allowed, E // G, axis=1), choice, -np.inf)
        ids = np.argsort(-choice, axis=1, kind="stable")[:, :k]
        w = np.take_along_axis(scores, ids, axis=1)
        if gate.norm_topk_prob:
            w = w / w.sum(1, keepdims=True)
        w = w * gate.routed_scaling_factor
    else:  # softmax routers (Qwen2/3-MoE, OLMoE; Mixtral always renormalises)
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        ids = np.argsort(-p, axis=1, kind="stable")[:, :k]
        w = np.take_along_axis(p, ids, axis=1)
        if getattr(gate, "norm_topk_prob", True):
            w = w / w.sum(1, keepdims=True)
    return sort_by_id(ids, w)


def sort_by_id(ids, w):
    order = np.argsort(ids, axis=1)
    return np.take_along_axis(ids, order, 1).astype(np.int64), np.take_along_axis(w, order, 1)


class GateInputs:
    """Test-side hooks (independent of the recorder): every router's input per forward of the model."""

    def __init__(self, model):
        prefix, sites = find_routers(model)
        stack = model.get_submodule(prefix)
        self.calls: list[dict[int, np.ndarray]] = []
        self.gates = {s.layer: model.get_submodule(s.name) for s in sites}
        self.handles = [stack.register_forward_pre_hook(lambda *a: self.calls.append({}))]
        for layer, g in self.gates.items():
            self.handles.append(g.register_forward_hook(self._hook(layer)))

    def _hook(self, layer):
        def hook(mod, args, out):
            h = args[0]
            self.calls[-1][layer] = h.reshape(-1, h.shape[-1]).detach().double().numpy()
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("family", sorted(TINY))
def test_capture_matches_router_token_by_token(family):
    model = tiny_model(family)
    model.generation_config.eos_token_id = None  # fixed length: every decode step of every request runs
    spec = model_spec_of(model)
    assert spec.moe_layers == EXPECTED_MOE_LAYERS[family]
    if family in ("deepseek_v3", "kimi_linear"):
        assert (spec.scoring, spec.n_group, spec.topk_group) == ("sigmoid", 4, 2)
    if family == "kimi_linear":
        assert spec.layers_of("kda") == (0, 2) and spec.layers_of("mla") == (1, 3)
    ids, mask = left_padded(PROMPTS)
    B, P = ids.shape
    probe = GateInputs(model)
    with RoutingRecorder(model) as rec, torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                             pad_token_id=0)
    probe.remove()
    assert len(probe.calls) == NEW  # one prefill + NEW-1 decode forwards (the last token is never fed)
    a = rec.arrays()
    L = spec.num_moe_layers
    lengths = [len(p) for p in PROMPTS]
    assert len(a["layer"]) == rec.num_rows == L * sum(n + NEW - 1 for n in lengths)
    assert rec.num_padding_tokens == sum(P - n for n in lengths)
    assert rec.num_requests == B and rec.num_steps == NEW

    # every (request, position, layer) exactly once
    keys = set(zip(a["request_id"].tolist(), a["position"].tolist(), a["layer"].tolist()))
    assert len(keys) == len(a["layer"])
    assert np.all(np.diff(a["step"]) >= 0)
    for i in range(len(a["layer"])):
        b, pos = int(a["request_id"][i]), int(a["position"][i])
        layer, step = int(a["layer"][i]), int(a["step"][i])
        n = lengths[b]
        if pos < n:  # prefill token: row b, column (left padding) + pos of the prompt forward
            assert step == 0 and a["phase"][i] == 0
            col = P - n + pos
            assert a["token_id"][i] == PROMPTS[b][pos]
            h = probe.calls[0][layer][b * P + col]
        else:  # decode step t feeds the (t-1)-th generated token at position n + t - 1
            t = pos - n + 1
            assert step == t and a["phase"][i] == 1
            assert a["token_id"][i] == int(out[b, P + t - 1])
            h = probe.calls[t][layer][b]
        want_ids, want_w = ref_route(probe.gates[layer], h[None, :])
        got_ids, got_w = sort_by_id(a["expert_ids"][i][None, :].astype(np.int64),
                                    a["gate_weights"][i][None, :])
        assert got_ids.tolist() == want_ids.tolist(), (family, b, pos, layer)
        np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-6)


def test_deepseek_bias_chooses_but_does_not_weigh():
    """With a large correction bias on expert 0, it is always chosen, yet its weight is its unbiased score."""
    model = tiny_model("deepseek_v3")
    model.generation_config.eos_token_id = None
    for _, mod in model.named_modules():
        if hasattr(mod, "e_score_correction_bias"):
            mod.e_score_correction_bias.zero_()
            mod.e_score_correction_bias[0] = 10.0
    ids, mask = left_padded(PROMPTS)
    with capture_routing(model) as rec, torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    a = rec.arrays()
    has0 = (a["expert_ids"] == 0)
    assert has0.any(axis=1).all()
    w0 = a["gate_weights"][has0]
    # renormalised sigmoid scores times 2.5: a weight > 2.5 * (something) would reveal the bias leaking in
    assert np.all(w0 < 2.5) and np.allclose(a["gate_weights"].sum(1), 2.5, rtol=1e-5)


def test_finished_requests_are_excluded():
    model = tiny_model("qwen3_moe")
    model.generation_config.eos_token_id = None
    ids, mask = left_padded(PROMPTS)
    with torch.no_grad():
        free = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                              pad_token_id=0)
    P = ids.shape[1]
    eos = int(free[0, P + 1])  # request 0 generates it as its 2nd token
    with RoutingRecorder(model, stop_tokens=(eos,)) as rec, torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                             pad_token_id=0, eos_token_id=eos)
    a = rec.arrays()
    L = 2
    gen = out.shape[1] - P
    expected = 0
    for b, p in enumerate(PROMPTS):
        fed = [int(x) for x in out[b, P:P + gen - 1]]  # decode step t feeds generated token t-1
        live = fed.index(eos) if eos in fed else len(fed)
        expected += len(p) + live
        got = a["position"][(a["request_id"] == b) & (a["phase"] == 1)]
        assert got.size == live * L
        assert not np.isin(a["token_id"][(a["request_id"] == b) & (a["phase"] == 1)], [eos]).any()
    assert rec.num_rows == expected * L
    assert rec.num_finished_tokens > 0  # request 0 really finished early: the test is not vacuous


def test_manual_loop_chunked_prefill_then_decode():
    """A user's own loop: a prompt fed in two chunks (prefill), then one token at a time (decode)."""
    model = tiny_model("mixtral")
    prompt = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with RoutingRecorder(model) as rec, torch.no_grad():
        cache = transformers.DynamicCache(config=model.config)
        model(input_ids=prompt[:, :4], cache=cache, use_cache=True)
        model(input_ids=prompt[:, 4:], cache=cache, use_cache=True)
        model(input_ids=torch.tensor([[9]]), cache=cache, use_cache=True)
        model(input_ids=torch.tensor([[10]]), cache=cache, use_cache=True)
        # a fresh prompt without cache is a new request
        model(input_ids=torch.tensor([[11, 12]]))
    a = rec.arrays()
    first = a["request_id"] == 0
    assert a["position"][first].reshape(-1, 2)[:, 0].tolist() == list(range(8))
    assert a["phase"][first].reshape(-1, 2)[:, 0].tolist() == [0] * 6 + [1, 1]
    assert a["step"][first].reshape(-1, 2)[:, 0].tolist() == [0, 0, 0, 0, 1, 1, 2, 3]
    second = a["request_id"] == 1
    assert a["position"][second].tolist() == [0, 0, 1, 1] and set(a["phase"][second].tolist()) == {0}


def test_written_trace_validates(tmp_path):
    validate = pytest.importorskip("moeplace.traces.validate")
    model = tiny_model("olmoe")
    spec = model_spec_of(model)
    ids, mask = left_padded(PROMPTS)
    out = tmp_path / "trace"
    with RoutingRecorder(model, out, flush_rows=7, keep_in_memory=True) as rec, torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert validate.validate_trace(out) == []
    m, prov = read_trace_meta(out)
    assert m == spec and prov["kind"] == "captured"
    df = scan_trace(out).collect()
    assert df.height == rec.num_rows
    a = rec.arrays()
    ids, w = sort_by_id(a["expert_ids"], a["gate_weights"])  # a trace keeps the top-k as a set, weights with it
    assert df["expert_ids"].to_numpy().tolist() == ids.tolist()
    assert np.array_equal(df["gate_weights"].to_numpy().astype(np.float32), w)
    assert len(list(out.glob("part-*.parquet"))) == 1 and rec.num_rows > 7  # several flushes, one file


def test_domain_column(tmp_path):
    model = tiny_model("olmoe")
    out = tmp_path / "trace"
    with RoutingRecorder(model, out, domain="code") as rec, torch.no_grad():
        model(input_ids=torch.tensor([[4, 5, 6]]))
    df = scan_trace(out).collect()
    assert df.height == rec.num_rows == 3 * 2 and df["domain"].to_list() == ["code"] * 6
    assert pytest.importorskip("moeplace.traces.validate").validate_trace(out) == []


def test_failed_capture_leaves_nothing(tmp_path):
    model = tiny_model("mixtral")
    out = tmp_path / "trace"
    with pytest.raises(RuntimeError), RoutingRecorder(model, out), torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
        raise RuntimeError("user loop failed")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_not_a_moe_model_is_a_clear_error():
    with pytest.raises(InputError, match="no MoE routers"):
        RoutingRecorder(torch.nn.Sequential(torch.nn.Linear(4, 4)))


# ---------------------------------------------------------------------------- CLI
def write_config(tmp_path, family="qwen3_moe"):
    path = tmp_path / "config.json"
    tiny_config(family).to_json_file(str(path))
    return path


def test_cli_capture(tmp_path, capsys):
    cfg = write_config(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\n\nab\nrouting traces for placement\n")
    out = tmp_path / "trace"
    rc = main(["trace", "capture", "--hf-config", str(cfg), "--prompts", str(prompts),
               "--max-new-tokens", "4", "--batch-size", "2", "--ignore-eos", "--out", str(out)])
    assert rc == 0
    lengths = [len(p.encode()) for p in read_prompts(prompts)]
    df = scan_trace(out).collect()
    assert df.height == 2 * sum(n + 3 for n in lengths)  # 2 MoE layers; byte tokens; 3 fed decode tokens
    assert sorted(df["request_id"].unique().to_list()) == [0, 1, 2]
    first = df.filter((df["request_id"] == 0) & (df["phase"] == 0) & (df["layer"] == 0))
    assert first["token_id"].to_list() == [b % 96 for b in b"hello world"]
    _, prov = read_trace_meta(out)
    assert prov["tokenizer"].startswith("byte-level") and prov["weights"].startswith("random")
    assert "rows" in capsys.readouterr().out
    # the rest of the trace toolchain accepts the captured trace
    assert main(["trace", "validate", str(out)]) == 0
    assert main(["trace", "stats", str(out), "--json"]) == 0


def test_cli_capture_with_local_weights_matches_in_process_capture(tmp_path):
    model = tiny_model("mixtral", seed=3)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(str(ckpt))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("abc\nrouting\n")
    out = tmp_path / "trace"
    rc = main(["trace", "capture", "--hf-config", str(ckpt / "config.json"), "--weights", str(ckpt),
               "--prompts", str(prompts), "--max-new-tokens", "3", "--ignore-eos", "--out", str(out)])
    assert rc == 0
    ids, mask = left_padded([[b % 96 for b in p.encode()] for p in read_prompts(prompts)])
    model.generation_config.eos_token_id = None
    with RoutingRecorder(model) as rec, torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    a = rec.arrays()
    df = scan_trace(out).collect()
    ids, w = sort_by_id(a["expert_ids"], a["gate_weights"])  # a trace keeps the top-k as a set, weights with it
    assert df["expert_ids"].to_numpy().tolist() == ids.tolist()
    np.testing.assert_allclose(np.stack(df["gate_weights"].to_numpy()), w, rtol=1e-6)
    spec, prov = read_trace_meta(out)
    assert prov["weights"] == str(ckpt)
    # the trace's model is its config file, so a placement planned on it exports to every engine format
    assert spec.name == str((ckpt / "config.json").resolve())
    assert main(["optimize", str(out), "--gpus", "4", "--gpus-per-node", "4", "--redundant", "0", "--policy",
                 "linear", "--no-shift", "--out", str(tmp_path / "p.json")]) == 0
    for fmt, suffix in (("sglang", ".json"), ("sglang-pt", ".pt"), ("vllm-expert-map", ".json"),
                        ("vllm-jsonl", ".jsonl"), ("vllm-ascend", ".json"), ("trtllm", ".yaml"), ("trtllm-lb", ".yaml")):
        assert main(["export", str(tmp_path / "p.json"), "--format", fmt, "--out", str(tmp_path / f"x-{fmt}{suffix}")]) == 0, fmt
    # and a placement whose model names a checkpoint directory (traces captured before) reads its config.json
    from moeplace.foundation.model import load_model

    assert load_model(str(ckpt)).num_experts == spec.num_experts


@pytest.mark.parametrize("case,needle", [
    ("missing_prompts", "no such prompts file"),
    ("empty_prompts", "no prompts"),
    ("bad_model_type", "field 'model_type'"),
    ("dense_model", "model_type 'llama' is not supported"),
    ("zero_tokens", "argument --max-new-tokens: expected a whole number >= 1"),
])
def test_cli_capture_bad_input(tmp_path, capsys, case, needle):
    cfg = write_config(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hi\n")
    n = "2"
    if case == "missing_prompts":
        prompts = tmp_path / "nope.txt"
    elif case == "empty_prompts":
        prompts.write_text("\n  \n")
    elif case == "bad_model_type":
        cfg.write_text(json.dumps({"model_type": "no_such_model", "vocab_size": 10}))
    elif case == "dense_model":
        cfg.write_text(json.dumps({"model_type": "llama", "vocab_size": 64, "hidden_size": 16,
                                   "intermediate_size": 32, "num_hidden_layers": 1,
                                   "num_attention_heads": 2}))
    elif case == "zero_tokens":
        n = "0"
    out = tmp_path / "trace"
    rc = main(["trace", "capture", "--hf-config", str(cfg), "--prompts", str(prompts), "--max-new-tokens", n,
               "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err
    assert not out.exists()
