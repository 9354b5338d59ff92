"""Record the launch options a released serving engine's own argument parser accepts.

    VLLM_TARGET_DEVICE=cpu python bench/engine_options.py vllm      # in an environment with vllm installed
    python bench/engine_options.py sglang                            # in an environment with sglang installed

Builds the engine's real parser -- vLLM: ``vllm.entrypoints.common.cli_args.make_arg_parser`` (what ``vllm
serve`` uses) and the ``EPLBConfig`` dataclass behind ``--eplb-config``; SGLang:
``ServerArgs.add_cli_args`` (what ``python -m sglang.launch_server`` uses) -- and writes
``moeplace/placement/export/engine_options/<engine>-<version>.json``: every option string, the choices of
options that have them, the options whose action is a deprecation, and for vLLM the keys of
``--eplb-config``. ``place export --flags --engine-version V`` prints only options found there, and
tests/test_export_launch.py checks every printed command against these files (and against the live parser
when the engine is importable).

The engines need not be fully installed: ``pip install --no-deps`` of the wheel plus the few pure-Python
modules its argument code imports is enough (docs/export.md, "Checked engine releases"). This script
imports nothing from moeplace, so it runs in such a scratch environment.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

# bench/ is first on sys.path when this runs as a script; its kernels.py would shadow the `kernels` package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
OUT_DIR = Path(__file__).resolve().parent.parent / "moeplace" / "placement" / "export" / "engine_options"


def _describe(parser: argparse.ArgumentParser) -> dict:
    options: set[str] = set()
    choices: dict[str, list[str]] = {}
    deprecated: list[str] = []
    takes_value: list[str] = []
    for action in parser._actions:  # argparse keeps no public list of its actions
        if not action.option_strings:
            continue
        options.update(action.option_strings)
        name = max(action.option_strings, key=len)
        if action.choices is not None:
            choices[name] = sorted(str(c) for c in action.choices)
        if "deprecat" in type(action).__name__.lower() or "deprecated" in (action.help or "").lower()[:40]:
            deprecated.extend(action.option_strings)
        if action.nargs != 0:
            takes_value.extend(action.option_strings)
    return {"options": sorted(options), "takes_value": sorted(takes_value), "choices": choices,
            "deprecated": sorted(deprecated)}


def vllm_options() -> dict:
    import vllm
    from vllm.config.parallel import EPLBConfig
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    d = _describe(make_arg_parser(FlexibleArgumentParser()))
    d["eplb_config_keys"] = sorted(f.name for f in dataclasses.fields(EPLBConfig))
    return {"engine": "vllm", "version": vllm.__version__,
            "parser": "vllm.entrypoints.common.cli_args.make_arg_parser (vllm serve)", **d}


def sglang_options() -> dict:
    from importlib.metadata import version

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return {"engine": "sglang", "version": version("sglang"),
            "parser": "sglang.srt.server_args.ServerArgs.add_cli_args (python -m sglang.launch_server)",
            **_describe(parser)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", choices=["vllm", "sglang"])
    ap.add_argument("--out-dir", default=str(OUT_DIR))
    args = ap.parse_args()
    d = vllm_options() if args.engine == "vllm" else sglang_options()
    out = Path(args.out_dir) / f"{d['engine']}-{d['version']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(d, indent=1, sort_keys=True) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, out)
    print(f"wrote {out}: {len(d['options'])} options, {len(d['deprecated'])} deprecated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
