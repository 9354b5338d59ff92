"""Our generic top-level import names must not collide with what dependencies probe for (docs/design.md
"Decisions"). transformers looks for Hugging Face's hub-kernels library under the import name ``kernels``
(``importlib.util.find_spec("kernels")``, then a version from package metadata, accepted only inside
``[KERNELS_MIN_VERSION, KERNELS_MAX_VERSION)``); when accepted it imports ``get_kernel`` & co. from it and
swaps hub kernels into models (``use_kernel_forward_from_hub``, ``use_kernel_func_from_hub_with_fallback``).
Our ``kernels`` package is found by that probe and resolves to the ``moeplace`` distribution's version;
these tests pin down that transformers therefore treats hub kernels as absent and that models build and run
bit-identically with and without our package importable."""
from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent
OUR_NAMES = ("foundation", "traces", "placement", "sim", "kernels", "dashboard", "moeplace")


def test_no_installed_distribution_claims_our_top_level_names():
    """A second distribution shipping ``kernels`` (e.g. ``pip install kernels``, Hugging Face's) would
    shadow ours or be shadowed by it depending on sys.path order; fail loudly if one is installed."""
    owners = importlib.metadata.packages_distributions()
    for name in OUR_NAMES:
        others = sorted(set(owners.get(name, [])) - {"moeplace"})
        assert not others, f"import name '{name}' is also provided by {others}: it collides with moeplace's"


def test_transformers_sees_no_hub_kernels_library():
    from transformers.utils import import_utils as iu

    found, version = iu._is_package_available("kernels", return_version=True)
    if found:
        # the probe finds our package and takes the version of the distribution that ships it
        assert version == importlib.metadata.version("moeplace")
        in_window = (iu.version.parse(iu.KERNELS_MIN_VERSION) <= iu.version.parse(version)
                     < iu.version.parse(iu.KERNELS_MAX_VERSION))
        assert not in_window, (f"moeplace {version} lies in transformers' hub-kernels window "
                               f"[{iu.KERNELS_MIN_VERSION}, {iu.KERNELS_MAX_VERSION}): transformers would "
                               "import get_kernel & co. from our 'kernels' package and fail")
    assert iu.is_kernels_available() is False


def test_capture_guard_accepts_this_environment():
    from moeplace.traces.capture import check_kernels_name

    check_kernels_name()  # raises InputError if transformers took our package for the hub library


def fingerprint() -> dict:
    """Build tiny Qwen3-MoE (hub-kernel RMSNorm decorator) and Kimi-Linear (hub-kernel function fallbacks)
    models, generate under routing capture, and hash everything that could differ."""
    import hashlib
    import importlib.util

    import torch
    import transformers.integrations.hub_kernels  # imports get_kernel & co. when it thinks it may
    from transformers.utils import is_kernels_available

    from moeplace.traces.capture import RoutingRecorder

    spec = importlib.util.find_spec("kernels")
    common = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
              "num_key_value_heads": 4, "moe_intermediate_size": 16, "pad_token_id": 0, "bos_token_id": 1,
              "eos_token_id": None}
    configs = {
        "qwen3_moe": transformers.Qwen3MoeConfig(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                                                 head_dim=8, **common),
        "kimi_linear": transformers.KimiLinearConfig(
            num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], num_experts=8,
            num_experts_per_token=2, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8, linear_head_dim=8, linear_num_heads=4, **common),
    }
    out = {"found": None if spec is None else (spec.origin or list(spec.submodule_search_locations or [])),
           "is_kernels_available": is_kernels_available()}
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    for name, cfg in configs.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        with RoutingRecorder(model) as rec, torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        a = rec.arrays()
        h = hashlib.sha256()
        for t in (gen.sequences, *gen.logits):
            h.update(t.numpy().tobytes())
        h.update(a["expert_ids"].tobytes())
        h.update(a["gate_weights"].tobytes())
        out[name] = {"sha256": h.hexdigest(), "rows": int(rec.num_rows),
                     "use_kernels": bool(model.use_kernels)}
    return out


# The same fingerprint in a fresh interpreter where the name ``kernels`` is unresolvable
# (importlib.util.find_spec answers None for a name mapped to None in sys.modules).
_HIDDEN = (
    "import json, sys; sys.modules['kernels'] = None; sys.path.insert(0, sys.argv[1]); "
    "from test_import_names import fingerprint; print(json.dumps(fingerprint()))"
)


def test_models_run_identically_with_and_without_our_kernels_package():
    import moeplace.kernels  # noqa: F401  ours, imported before anything probes the name

    # the fresh interpreter runs while this one computes its own fingerprint
    p = subprocess.Popen([sys.executable, "-c", _HIDDEN, str(REPO / "tests")], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ours = fingerprint()
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr[-2000:]
    hidden = json.loads(stdout.strip().splitlines()[-1])
    found = ours["found"] if isinstance(ours["found"], list) else [str(Path(ours["found"]).parent)]
    assert any(Path(f).resolve() == REPO / "kernels" for f in found if not f.startswith("__editable__"))
    assert hidden["found"] is None
    assert ours["is_kernels_available"] is False and hidden["is_kernels_available"] is False
    for name in ("qwen3_moe", "kimi_linear"):
        assert ours[name]["rows"] > 0 and not ours[name]["use_kernels"]
        assert ours[name] == hidden[name], name
