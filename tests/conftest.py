"""Shared fixtures. Tests make their own small data; nothing is downloaded."""
from __future__ import annotations

import pytest

from traces.model import load_model


@pytest.fixture(scope="session")
def k3():
    return load_model("kimi-k3")
