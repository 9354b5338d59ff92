"""Loading a bench script as a module in tests: bench/ holds scripts, not a package."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent


def load_bench(name: str, module: str | None = None) -> ModuleType:
    """``bench/<name>.py`` executed as module ``module`` (default ``bench_<name>``). The script's
    ``_timing`` import puts bench/ on ``sys.path``; it is taken off again afterwards, or bench/kernels.py
    would answer a later ``import kernels`` in this process (transformers probes Hugging Face's
    ``kernels`` library)."""
    spec = importlib.util.spec_from_file_location(module or f"bench_{name}", REPO / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path[:] = saved
    return mod
