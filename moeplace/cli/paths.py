"""Every path a command line names, checked in one place before the command runs (``cli.main`` calls
:func:`check_args` once the flags are parsed and a ``--config`` file merged).

:data:`PATH_ARGS` says, for every command, which of its arguments name a file or directory it reads and
what it expects there; every other argument of every parser is listed in :data:`NOT_PATHS` (values, names,
and the outputs, which :class:`foundation.files.Outputs` checks when the command claims them). A test walks
the parsers and fails on any argument in neither table, so a new flag cannot skip the checks.

What is checked, the same for every path (one line naming the flag, exit 2, the JSON error object under
``--json``): not empty; no NUL byte; each name within the file system's ``NAME_MAX`` and the whole within
its ``PATH_MAX`` (past them every lookup fails with ``ENAMETOOLONG``); the kind of what is there: a FIFO, a
device, a socket or a directory where a file is read (or a file where a directory is) is refused before
anything opens it; and where the table names what is expected, that it exists. A name that may be a preset
or a policy instead of a file (``--model kimi-k3``, ``--placement eplb``) is checked as a path when it is
not one of those names; its absence is then the loader's to word ("not a preset ... and no such file").
"""
from __future__ import annotations

import argparse
import os
import stat
from dataclasses import dataclass

from moeplace.foundation.cluster import gpu_preset_names
from moeplace.foundation.errors import InputError
from moeplace.foundation.files import check_path_length, display
from moeplace.foundation.model import preset_names
from moeplace.foundation.reading import special_kind
from moeplace.placement.policies import policy_names
from moeplace.sim.inputs import parse_phases

FILE, DIR, TREE, NAME_OR_FILE, NAME_OR_DIR, PHASES, GROUPS, POOLS, TAGS = (
    "file", "dir", "tree", "name-or-file", "name-or-dir", "phases", "groups", "pools", "tags")


@dataclass(frozen=True)
class PathArg:
    """``kind``: ``file`` (a regular file), ``dir`` (a directory), ``tree`` (either: a trace is a Parquet
    file or a directory of them), ``name-or-file`` / ``name-or-dir`` (a preset, policy or Hugging Face id,
    else a path of that kind), ``phases`` (``SRC:SECONDS,...``, each SRC a tree), ``groups``
    (``NAME=PATH[,PATH...]``), ``tags`` (``PATH:KEY=VALUE[,...]``, the path before the last ':' ahead of the
    first '='), ``pools`` (``--pools``: pool words ``ROLE:key=value,...``, or one YAML/JSON
    file). ``per_pool``: the value may be ``prefill=A,decode=B`` (``export --pools``), each a path of ``kind``.
    ``noun``: what the command reads there; given, a missing path is refused here
    as ``no such <noun>`` (else the command's reader words it)."""

    kind: str
    noun: str | None = None
    per_pool: bool = False


_TRACE = PathArg(TREE)  # a trace file/directory or a Loads .npz: the readers say which they looked for
_MODEL = PathArg(NAME_OR_FILE)  # a preset or a config.json
_GPU = PathArg(NAME_OR_FILE)  # a GPU preset or a JSON spec
_PLACEMENT = PathArg(FILE)  # a placement JSON: load_placement says "no such placement file"
_MANIFEST = PathArg(FILE)

# (command, dest) -> what the argument names; a command is its words: "simulate", "trace import"
PATH_ARGS: dict[tuple[str, str], PathArg] = {
    ("calibrate", "results"): PathArg(FILE, "benchmark result file"),
    ("calibrate", "deployment"): PathArg(FILE, "deployment file"),
    ("calibrate", "model"): PathArg(NAME_OR_FILE, "model config file"),
    ("calibrate", "gpu"): PathArg(NAME_OR_FILE, "GPU spec file"),
    ("calibrate", "trace"): PathArg(TREE, "routing trace"),
    ("dashboard", "run_dir"): PathArg(DIR),
    ("demo", "gpu"): _GPU,
    ("engines", "model"): _MODEL,
    ("evaluate", "placement"): _PLACEMENT,
    ("evaluate", "routing"): _TRACE,
    ("evaluate", "model"): _MODEL,
    ("export", "placement"): PathArg(FILE, per_pool=True),  # one placement JSON, or one per --pools pool
    ("export", "model"): _MODEL,
    ("export", "loads"): _TRACE,
    ("export", "plan"): PathArg(FILE),
    ("export", "model_path"): PathArg(NAME_OR_DIR, per_pool=True),  # an HF id, or the checkpoint directory
    ("export", "pools"): PathArg(POOLS),
    ("export", "verify"): PathArg(DIR, "relabelled checkpoint directory"),
    ("export", "check_logs"): PathArg(FILE, "log file"),
    ("export", "gpu"): _GPU,
    ("import-placement", "file"): PathArg(FILE),
    ("import-placement", "model"): _MODEL,
    ("import-placement", "relabel_manifest"): _MANIFEST,
    ("model show", "name"): _MODEL,
    ("optimize", "inputs"): _TRACE,
    ("optimize", "group"): PathArg(GROUPS),
    ("optimize", "tag"): PathArg(TAGS),
    ("optimize", "gpu"): _GPU,
    ("optimize", "model"): _MODEL,
    ("optimize", "config"): PathArg(FILE),
    ("optimize", "from_placement"): _PLACEMENT,
    ("optimize", "pools"): PathArg(POOLS),
    ("plan", "model"): _MODEL,
    ("plan", "gpu"): _GPU,
    ("plan", "pools"): PathArg(POOLS),
    ("rebalance", "trace"): _TRACE,
    ("rebalance", "phases"): PathArg(PHASES),
    ("rebalance", "gpu"): _GPU,
    ("simulate", "traces"): _TRACE,
    ("simulate", "phases"): PathArg(PHASES),
    ("simulate", "placement"): PathArg(NAME_OR_FILE),  # a placement JSON or a policy name
    ("simulate", "config"): PathArg(FILE),
    ("simulate", "gpu"): _GPU,
    ("simulate", "model"): _MODEL,
    ("simulate", "profile"): PathArg(FILE),
    ("simulate", "pools"): PathArg(POOLS),
    ("simulate", "calibration"): PathArg(FILE, "calibration file"),
    ("rebalance", "calibration"): PathArg(FILE, "calibration file"),
    ("sweep", "spec"): PathArg(FILE),
    ("sweep", "calibration"): PathArg(FILE, "calibration file"),
    ("trace capture", "hf_config"): PathArg(FILE, "Hugging Face config.json"),
    ("trace capture", "prompts"): PathArg(FILE, "prompts file"),
    ("trace capture", "weights"): PathArg(DIR, "checkpoint directory"),
    ("trace capture", "tokenizer"): PathArg(DIR, "tokenizer directory"),
    ("trace import", "srcs"): _TRACE,
    ("trace import", "model"): _MODEL,
    ("trace import", "relabel_manifest"): _MANIFEST,
    ("trace stats", "path"): _TRACE,
    ("trace synth", "model"): _MODEL,
    ("trace validate", "paths"): _TRACE,
}

# Outputs: checked (length, kind, what they would replace) by foundation.files.Outputs when claimed
OUTPUTS = {("calibrate", "out"), ("demo", "out"), ("demo", "traces"), ("export", "out"), ("export", "launch_out"),
           ("import-placement", "out"), ("kernels bench", "out"), ("kernels bench", "report"),
           ("optimize", "out"), ("optimize", "save_all"), ("optimize", "report"), ("plan", "report"),
           ("rebalance", "report"), ("simulate", "out"), ("simulate", "chrome_trace"), ("sweep", "out"),
           ("trace capture", "out"), ("trace import", "out"), ("trace stats", "out"), ("trace synth", "out")}

# Every other argument that takes a value: numbers, names, choices, specs -- never a path
NOT_PATHS = {
    "calibrate": {"gpus", "gpus_per_node", "engine", "attention_tp", "attention_dp", "ep", "expert_dtype",
                  "weight_dtype", "kv_dtype", "mtp", "max_seqs", "max_batched_tokens", "kernel_build", "placement"},
    "dashboard": {"port", "address"},
    "demo": {"tokens", "gpus", "duration", "seed"},
    "engines": {"engine"},
    "evaluate": {"engine", "batch_tokens", "dispatch_dtype", "seed", "vllm_rule", "sglang_variant"},
    "export": {"pool", "format", "window_tokens", "layout", "tp", "dp", "kv_cache_dtype", "max_model_len", "eplb_window",
               "eplb_interval", "moe_backend", "engine_version", "vllm_pr", "vllm_static", "target", "image",
               "k8s_rdma", "k8s_shm_size", "k8s_weights", "k8s_weights_mount", "k8s_hf_secret"},
    "import-placement": {"format", "gpus", "gpus_per_node", "relabel_layout"},
    "kernels bench": {"world_size", "backend", "hidden", "intermediate", "experts", "top_k", "redundant", "dtype",
                      "train_tokens", "test_tokens", "test_skews", "reps", "seed"},
    "kernels verify": {"world_size", "backend"},
    "optimize": {"phase", "batch", "attention_tp", "max_trace_tokens", "gpus", "gpus_per_node", "redundant", "policy", "engine", "plan_fraction", "shift_layers",
                 "window_tokens", "seed", "time_limit", "objective", "traffic_weight", "max_moves", "workers"},
    "plan": {"gpus", "gpus_per_node", "tp", "dp", "ep", "dense_tp", "redundant", "dcp", "context", "context_mix",
             "kv_dtype", "gpu_memory_utilization", "max_batched_tokens", "max_num_seqs", "state_slots",
             "pool_split", "page_size", "other_reserve", "min_seqs", "sweep_gpus", "sweep_ep", "sweep_redundant"},
    "rebalance": {"gpus", "gpus_per_node", "engine", "attention_tp", "concurrency", "context_mix", "output_len",
                  "splits", "budget", "max_trace_tokens", "seed"},
    "simulate": {"gpus", "gpus_per_node", "redundant", "prefill_gpus", "expert_dtype", "weight_dtype", "rate",
                 "concurrency", "arrival", "rate_end", "burstiness", "context_mix", "output_len", "isl", "osl",
                 "random_range_ratio", "max_requests", "max_trace_tokens", "engine", "attention_tp",
                 "max_batched_tokens", "max_seqs", "kv_dtype", "preemption", "pool_split", "gpu_memory_utilization",
                 "deepep_mode", "cuda_graph_max_bs", "kernel_build", "kernels_per_layer", "mtp", "prefix_hit",
                 "moe_tp", "attention_dtype", "admission", "prefill_batches", "dp_balance", "phase", "duration", "warmup", "mode",
                 "cost_model", "cost_engine", "rebalance", "recommend_splits", "recommend_budget", "recommend_moves",
                 "recommend_time", "seed"},
    "sweep": {"ray", "workers", "max_points"},
    "trace capture": {"max_new_tokens", "batch_size", "dtype", "device", "seed", "domain"},
    "trace import": {"format", "layer_numbering", "warmup_min_run", "layers", "iteration", "max_tokens",
                     "relabel_layout"},
    "trace stats": {"window_tokens", "sample_tokens", "seed", "workers", "ray"},
    "trace synth": {"tokens", "seed", "skew", "skew_depth_ratio", "cv", "domains", "domain_correlation", "drift",
                    "drift_phases", "affinity", "token_effect", "theme", "themes", "locality", "arrival_rate",
                    "prompt_median", "output_median", "long_fraction", "max_prefill_tokens", "max_decode_tokens", "workers"},
    "trace validate": {"max_per_kind"},
}


def command_of(args: argparse.Namespace) -> str:
    """The words of the command ``args`` were parsed for (``"simulate"``, ``"trace import"``)."""
    cmd = getattr(args, "command", None) or ""
    sub = getattr(args, f"{cmd}_command", None)
    return f"{cmd} {sub}" if sub else cmd


def _names(dest: str) -> set[str]:
    """Names the value of ``dest`` may be instead of a path (presets, policies)."""
    if dest in ("model", "name"):
        return set(preset_names())
    if dest == "gpu":
        return set(gpu_preset_names())
    if dest == "placement":
        return set(policy_names())
    return set()


def check_path(value: str, where: str, arg: PathArg) -> None:
    """One path: not empty, a lookup can take it, and what is there is of the kind ``arg`` expects."""
    if not value:
        raise InputError(f"{where.rstrip()}: empty, a path is expected")
    check_path_length(value, where)
    try:
        st = os.stat(value)
    except FileNotFoundError:
        if arg.noun:
            raise InputError(f"{where}: no such {arg.noun}") from None
        return  # the command's reader says what it looked for
    except NotADirectoryError:
        raise InputError(f"{where}: a name in the path is a file, not a directory") from None
    except OSError as exc:  # a loop of links, permissions
        raise InputError(f"{where}: cannot be read ({exc.strerror or exc})") from None
    want_dir = arg.kind in (DIR, NAME_OR_DIR)
    is_dir = stat.S_ISDIR(st.st_mode)
    if want_dir and not is_dir:
        what = "a regular file" if stat.S_ISREG(st.st_mode) else special_kind(st.st_mode)
        raise InputError(f"{where}: is {what}, not a directory")
    if is_dir and arg.kind in (FILE, NAME_OR_FILE):
        raise InputError(f"{where}: is a directory, not a file")
    if not is_dir and not stat.S_ISREG(st.st_mode):
        raise InputError(f"{where}: is {special_kind(st.st_mode)}, not a regular file; refusing to read it")


def _where(flag: str | None, value: str) -> str:
    return f"{flag} {display(value)}" if flag else display(value)


def _items(arg: PathArg, value: str, flag: str | None):
    """``(path, where)`` of every path in one argument value."""
    if arg.kind == POOLS:
        if ":" not in value:  # a pool word names its role before a colon; anything else is the file
            yield value, _where(flag, value)
    elif arg.per_pool and "=" in value:
        for part in value.split(","):
            role, _, p = part.partition("=")
            if p:
                yield p, f"{flag or 'PLACEMENT'} {display(role)}={display(p)}"
    elif arg.kind == PHASES:
        for ph in parse_phases(value):
            yield ph.source, f"{flag} entry {display(ph.source)}"
    elif arg.kind == GROUPS:
        _, _, paths = value.partition("=")
        for p in paths.split(","):
            if p:
                yield p, f"{flag} {display(value.partition('=')[0])}={display(p)}"
    elif arg.kind == TAGS:  # the split optimize's parse_tags makes; a value without one is its error to word
        eq = value.find("=")
        colon = value.rfind(":", 0, eq) if eq > 0 else -1
        if colon > 0:
            yield value[:colon], f"{flag} {display(value[:colon])}"
    else:
        yield value, _where(flag, value)


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, only: set[str] | None = None) -> None:
    """Check every path argument of the command ``args`` were parsed for (:data:`PATH_ARGS`); ``only``:
    these dests alone (``--config``, read before the others are merged from it)."""
    cmd = command_of(args)
    for (c, dest), arg in PATH_ARGS.items():
        if c != cmd or (only is not None and dest not in only):
            continue
        value = getattr(args, dest, None)
        if value is None:
            continue
        flag = _flag(parser, cmd, dest)
        names = _names(dest) if arg.kind in (NAME_OR_FILE, NAME_OR_DIR) else set()
        for v in value if isinstance(value, list) else [value]:
            if not v:
                raise InputError(f"{flag or dest}: empty, a path{' or a name' if names else ''} is expected")
            if v in names:
                continue
            split = arg.per_pool and "=" in str(v)
            if arg.kind in (NAME_OR_FILE, NAME_OR_DIR) and not split and not _looks_like_path(v, arg):
                check_path_length(v, _where(flag, v))  # a name: only what a lookup of it needs
                continue
            for path, where in _items(arg, str(v), flag):
                if split and arg.kind == NAME_OR_DIR and not _looks_like_path(path, arg):
                    check_path_length(path, where)
                    continue
                inner = (PathArg(TREE, None) if arg.kind in (PHASES, GROUPS, TAGS) else PathArg(FILE) if arg.kind == POOLS
                         else arg)
                check_path(path, where, inner)


def _looks_like_path(value: str, arg: PathArg) -> bool:
    """A name-or-path value is taken as a path when something is there or it is written like one."""
    if arg.kind == NAME_OR_DIR:  # an HF id (org/name) looks like a relative path: a path only if it exists
        return os.path.lexists(value) if _short_enough(value) else True
    return True


def _short_enough(value: str) -> bool:
    try:
        check_path_length(value, "")
        return True
    except InputError:
        return False


def _flag(parser: argparse.ArgumentParser, cmd: str, dest: str) -> str | None:
    """The option string of ``dest`` in ``cmd``'s parser (``None`` for a positional argument)."""
    sub = subparser(parser, cmd)
    for a in sub._actions if sub is not None else ():
        if a.dest == dest:
            return max(a.option_strings, key=len) if a.option_strings else None
    return f"--{dest.replace('_', '-')}"


def subparser(parser: argparse.ArgumentParser, cmd: str) -> argparse.ArgumentParser | None:
    """The parser of command ``cmd`` (its words, as :func:`command_of` gives them)."""
    p = parser
    for word in cmd.split():
        sub = next((a for a in p._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or word not in sub.choices:
            return None
        p = sub.choices[word]
    return p
