"""Runs SGLang 0.5.23's own ``python -m sglang.bench_serving`` (sglang.benchmark.serving.cli_main) on a CPU-only
machine: its import chain reaches sglang.srt.configs, whose multimodal configs import torchvision at module
level; the CPU torch here has no torchvision build, so an empty module stands in for it (the benchmark
client and its result writer never call torchvision)."""
import importlib.machinery
import runpy
import sys
import types


class _AnyMeta(type):
    def __getattr__(cls, attr):  # class attributes read at import (e.g. InterpolationMode.BICUBIC)
        if attr.startswith("__"):
            raise AttributeError(attr)
        return f"{cls.__name__}.{attr}"


for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional", "torchvision.io",
             "torchvision.transforms.v2", "torchvision.transforms.v2.functional"):
    mod = types.ModuleType(name)
    mod.__path__ = []
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod.__file__ = f"<stand-in for {name}>"
    mod.__version__ = "0.28.0"  # the release that pairs with torch 2.13
    # any public name imported from it (dunder lookups, e.g. inspect's, fail as for a plain module)
    mod.__getattr__ = lambda attr: _AnyMeta(attr, (), {}) if not attr.startswith("__") else (_ for _ in ()).throw(
        AttributeError(attr))
    sys.modules[name] = mod
    parent, _, leaf = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], leaf, mod)
sys.argv[0] = "sglang.bench_serving"
runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)
