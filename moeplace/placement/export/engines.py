"""The serving-engine releases whose launch options the project checked, and the check itself.

``engine_options/<engine>-<version>.json`` holds what a released engine's own argument parser accepts:
every option string, the choices of options that have them, the deprecated ones, and for vLLM the keys
of ``--eplb-config`` (``EPLBConfig``). ``bench/engine_options.py`` writes these files from the real
parser (vLLM: ``make_arg_parser``, the parser of ``vllm serve``; SGLang: ``ServerArgs.add_cli_args``).
:func:`check_args` checks a command line against them; ``place export --flags --engine-version V`` uses
it on every command it prints, so a printed command never names an option that release would reject.

:func:`recommended_eplb_config` is the one place the recommended settings of vLLM's online EPLB live.
"""
from __future__ import annotations

import json
import re
import shlex
from functools import cache
from importlib import resources
from typing import Any

from moeplace.foundation.errors import InputError

ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}

# The open vLLM pull requests that add a placement file to --eplb-config (not in any release checked):
# `place export --flags --vllm-pr N` prints their keys; without it only released options are printed.
VLLM_PRS = {
    49572: ("vllm-expert-map", ("initial_expert_map_path",)),
    41141: ("vllm-jsonl", ("initial_mapping_path", "disable_online_rebalancing")),
}


def _version_key(v: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"[.+-]", v))


@cache
def checked_versions(engine: str) -> tuple[str, ...]:
    """The releases of ``engine`` with a recorded option list, oldest first."""
    files = resources.files("moeplace.placement.export").joinpath("engine_options")
    found = [f.name[len(engine) + 1:-5] for f in files.iterdir()
             if f.name.startswith(f"{engine}-") and f.name.endswith(".json")]
    return tuple(sorted(found, key=_version_key))


def resolve_version(engine: str, version: str | None) -> str:
    """``version`` if it is a checked release of ``engine``; the newest checked one when ``None``."""
    known = checked_versions(engine)
    if not known:
        raise InputError(f"--engine-version: no {ENGINE_NAMES.get(engine, engine)} release has a recorded option "
                         "list (the launch command is printed without a version check)")
    if version is None:
        return known[-1]
    v = version.removeprefix("v")
    if v not in known:
        raise InputError(f"--engine-version {version}: {ENGINE_NAMES.get(engine, engine)} {v} was not checked "
                         f"(checked: {', '.join(known)}; bench/engine_options.py records another release)")
    return v


@cache
def engine_options(engine: str, version: str) -> dict[str, Any]:
    """The recorded option list of ``engine`` ``version`` (a checked release)."""
    f = resources.files("moeplace.placement.export").joinpath("engine_options", f"{engine}-{version}.json")
    d = json.loads(f.read_text())
    d["options_set"] = frozenset(d["options"])
    d["takes_value_set"] = frozenset(d["takes_value"])
    return d


def accepts(engine: str, version: str, option: str) -> bool:
    """Whether ``engine`` ``version``'s parser has ``option`` (and does not mark it deprecated)."""
    d = engine_options(engine, version)
    return option in d["options_set"] and option not in d["deprecated"]


def check_args(engine: str, version: str, argv: list[str], allow_eplb_keys: tuple[str, ...] = ()) -> list[str]:
    """Problems ``engine`` ``version``'s parser would have with ``argv`` (options only, from the first
    ``--``): unknown or deprecated options, a value outside an option's choices (values holding a shell
    variable are not checked), unknown ``--eplb-config`` keys (vLLM; ``allow_eplb_keys`` are let through).
    Empty when the release accepts every option."""
    d = engine_options(engine, version)
    name = ENGINE_NAMES.get(engine, engine)
    problems: list[str] = []
    i = next((k for k, a in enumerate(argv) if a.startswith("--")), len(argv))
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            problems.append(f"{name} {version}: stray argument {arg!r}")
            i += 1
            continue
        opt, eq, val = arg.partition("=")
        if opt not in d["options_set"]:
            problems.append(f"{name} {version} has no option {opt}")
            i += 1
            continue
        if opt in d["deprecated"]:
            problems.append(f"{name} {version} marks {opt} deprecated")
        value = val if eq else None
        if value is None and opt in d["takes_value_set"] and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 1
        choices = d["choices"].get(opt)
        if choices is not None and value is not None and "$" not in value and value not in choices:
            problems.append(f"{name} {version}: {opt} {value} is not one of its choices")
        if opt == "--eplb-config" and value is not None:
            try:
                cfg = json.loads(value)
            except ValueError:
                problems.append(f"{name} {version}: --eplb-config is not JSON")
                cfg = {}
            bad = sorted(set(cfg) - set(d.get("eplb_config_keys", ())) - set(allow_eplb_keys))
            if bad:
                problems.append(f"{name} {version}: --eplb-config has no key {', '.join(bad)}")
        i += 1
    return problems


def command_argv(text: str) -> list[list[str]]:
    """The commands of a printed launch (comment lines dropped, ``\\``-continued lines joined), each as
    shell words; a heredoc or YAML after a blank line ends the commands."""
    cmds: list[list[str]] = []
    cur: list[str] = []
    for line in text.splitlines():
        if not cur and (not line.strip() or line.startswith("#")):
            if not line.strip() and cmds:
                break
            continue
        cur.append(line.rstrip("\\").strip())
        if not line.endswith("\\"):
            cmds.append(shlex.split(" ".join(cur)))
            cur = []
    return cmds


# ---------------------------------------------------------------------------------------- vLLM EPLB
# vLLM's own defaults (EPLBConfig in vllm/config/parallel.py, 0.34.0): window_size 1000 steps of load
# history, step_interval 3000 steps between rearrangements, use_async true (the new layout is computed and
# its weights moved in the background, overlapping decoding; synchronous rearrangement stalled every rank,
# 3.17x wall time in the K3 EPLB PR #50647). log_balancedness stays off (it adds a collective per step).
EPLB_WINDOW_STEPS = 1000
EPLB_INTERVAL_STEPS = 3000


def recommended_eplb_config(num_redundant_experts: int, version: str | None = None, *,
                            window_size: int = EPLB_WINDOW_STEPS, step_interval: int = EPLB_INTERVAL_STEPS,
                            log_balancedness: bool = False) -> dict[str, Any]:
    """The ``--eplb-config`` object recommended for vLLM ``version`` (default: the newest checked release).

    ``num_redundant_experts``: redundant slots per MoE layer (vLLM allocates them and its EPLB fills them);
    ``window_size`` / ``step_interval``: load-history window and steps between rearrangements (a tuning
    step may pass its own; the defaults are vLLM's). Async rearrangement is asked for explicitly where the
    release has the key. Only keys that release's ``EPLBConfig`` has are returned.
    """
    if num_redundant_experts < 0:
        raise InputError(f"num_redundant_experts must be >= 0, got {num_redundant_experts}")
    if window_size < 1 or step_interval < 1:
        raise InputError("the EPLB window and interval must be >= 1 step")
    version = resolve_version("vllm", version)
    keys = set(engine_options("vllm", version).get("eplb_config_keys", ()))
    cfg: dict[str, Any] = {"window_size": window_size, "step_interval": step_interval,
                           "num_redundant_experts": num_redundant_experts}
    if "use_async" in keys:
        cfg["use_async"] = True
    if log_balancedness:
        cfg["log_balancedness"] = True
    return {k: v for k, v in cfg.items() if k in keys}
