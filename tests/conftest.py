"""Shared fixtures. Tests make their own small data; nothing is downloaded."""
from __future__ import annotations

from dataclasses import replace

import pytest

from moeplace.foundation.model import load_model


@pytest.fixture(scope="session")
def k3():
    return load_model("kimi-k3")


@pytest.fixture(scope="session")
def tiny(k3):
    """A 1-MoE-layer, 4-expert, top-2 model with K3's expert shape (width 3584, MXFP4) for hand-worked
    placements and metrics."""
    return replace(k3, name="tiny", num_layers=2, moe_layers=(1,), num_experts=4, top_k=2,
                   attention=("kda", "kda"), mla=None)
