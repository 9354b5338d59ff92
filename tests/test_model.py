"""Model presets: the numbers published for Kimi K3 (docs/design.md Sources §1) (and the other presets) must fall
out of the spec fields, not be typed in."""
from __future__ import annotations

import json

import pytest

from moeplace.cli.main import main
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import ModelSpec, from_hf_config, load_model, preset_names

GiB, MiB, KiB = 2**30, 2**20, 2**10


def test_k3_published_numbers(k3):
    assert k3.total_params == pytest.approx(2.8e12, rel=0.02)
    assert k3.active_params == pytest.approx(104e9, rel=0.02)
    assert k3.num_moe_layers == 92 and k3.moe_layers == tuple(range(1, 93))
    assert k3.num_experts == 896 and k3.top_k == 16
    assert k3.bytes_per_routed_expert == pytest.approx(17.5e6, rel=0.01)
    assert k3.kv_bytes_per_token("bf16") == 27 * KiB
    assert k3.kv_bytes_per_token("fp8") == 13.5 * KiB
    assert k3.state_bytes_per_sequence() / MiB == pytest.approx(429, rel=0.01)
    assert k3.state_bytes_per_sequence(attention_tp=4) == pytest.approx(k3.state_bytes_per_sequence() / 4)
    assert k3.checkpoint_bytes == pytest.approx(1.56e12, rel=0.05)
    # 1 M tokens of MLA cache at BF16 ~ 27 GiB
    assert k3.kv_bytes_per_token("bf16") * 2**20 / GiB == pytest.approx(27.0)


def test_k3_attention_layout(k3):
    mla = k3.layers_of("mla")
    assert len(mla) == 24 and len(k3.layers_of("kda")) == 69
    assert mla[:3] == (3, 7, 11) and mla[-3:] == (87, 91, 92)
    assert k3.dense_layers == (0,)


@pytest.mark.parametrize("name,total,active", [
    ("deepseek-v3", 671e9, 37e9), ("kimi-k2", 1.04e12, 32e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9)])
def test_other_presets_match_published_sizes(name, total, active):
    m = load_model(name)
    assert m.total_params == pytest.approx(total, rel=0.03)
    assert m.active_params == pytest.approx(active, rel=0.04)


def test_presets_roundtrip_json():
    for name in preset_names():
        m = load_model(name)
        assert ModelSpec.from_dict(json.loads(m.to_json())) == m


def test_hf_config_maps_to_same_spec_as_preset(tmp_path):
    hf = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "first_k_dense_replace": 3, "moe_layer_freq": 1,
          "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1, "moe_intermediate_size": 2048,
          "intermediate_size": 18432, "hidden_size": 7168, "num_attention_heads": 128, "q_lora_rank": 1536,
          "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
          "vocab_size": 129280, "max_position_embeddings": 163840, "n_group": 8, "topk_group": 4,
          "scoring_func": "sigmoid", "quantization_config": {"quant_method": "fp8"}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    m = load_model(path)
    ref = load_model("deepseek-v3")
    assert m.total_params == ref.total_params and m.active_params == ref.active_params
    assert m.moe_layers == ref.moe_layers and m.checkpoint_bytes == ref.checkpoint_bytes


def test_hf_qwen3_moe_config():
    m = from_hf_config({"model_type": "qwen3_moe", "num_hidden_layers": 4, "hidden_size": 64, "num_experts": 8,
                        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "intermediate_size": 128,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100,
                        "mlp_only_layers": [0]})
    assert m.moe_layers == (1, 2, 3) and m.dense_layers == (0,)
    assert m.kv_bytes_per_token("bf16") == 4 * 2 * 2 * 16 * 2


def test_hf_config_unknown_type_is_clear():
    with pytest.raises(InputError, match="model_type 'llama' is not supported"):
        from_hf_config({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8})


def test_cli_model_show(capsys):
    assert main(["model", "show", "kimi-k3", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["num_moe_layers"] == 92 and facts["top_k"] == 16
    assert main(["model", "show", "kimi-k3"]) == 0
    out = capsys.readouterr().out
    assert "2.780 T total" in out and "27.00 KiB bf16" in out and "428.6 MiB" in out


def test_cli_unknown_model_is_one_line_error(capsys):
    assert main(["model", "show", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("place: error: model 'no-such-model'") and "Traceback" not in err
