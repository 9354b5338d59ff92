"""Loading a bench script as a module in tests: bench/ holds scripts, not a package."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent


def load_bench(name: str, module: str | None = None) -> ModuleType:
    """``bench/<name>.py`` executed as module ``module`` (default ``bench_<name>``)."""
    spec = importlib.util.spec_from_file_location(module or f"bench_{name}", REPO / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
