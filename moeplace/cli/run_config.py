"""A run in one file: ``--config FILE`` gives a command's flags as a mapping, the command line overrides it,
and the command records the fully resolved flags (``settings_record``) in what it writes, so
``--config <that record>`` runs it again with the same settings.

The file is YAML or JSON: either a plain mapping ``{flag: value}`` (a flag's name with ``-`` or ``_``:
``max-seqs`` or ``max_seqs``), or a moeplace output that carries a ``settings`` record (``place simulate``'s
``config.json``, a placement JSON written by ``place optimize``, either command's ``--json``). Values go
through the flag's own parser, so a file and a flag are checked by the same code: an unknown key names the
nearest flag; a bad value is the flag's own error. Positional inputs (the trace) stay on the command line;
a record's ``inputs`` are shown for information and never read.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from moeplace.foundation import reading
from moeplace.foundation.errors import InputError
from moeplace.foundation.settings import nearest

CONFIG_HELP = ("take this command's flags from a YAML/JSON file (or from the settings a previous run recorded "
               "in its output); flags on the command line override the file")
_SKIP = {"help", "config", "force", "func", "place", "_parser"}  # force stays an explicit act


def add_config(p: argparse.ArgumentParser) -> None:
    """The ``--config FILE`` flag of a command whose settings can live in a file."""
    p.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    p.set_defaults(_parser=p)


def _options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in p._actions if a.option_strings and a.dest not in _SKIP}


def _read(path: str) -> dict[str, Any]:
    p = Path(path)
    missing = "no such --config file"
    # the one hardened reader: regular files only, no deep nesting or huge integers, unique YAML keys
    raw = reading.read_json(p, missing) if p.suffix == ".json" else reading.read_yaml(p, missing)
    if not isinstance(raw, dict):
        raise InputError(f"{p}: a --config file is a mapping of flag -> value")
    for holder in (raw, raw.get("provenance") if isinstance(raw.get("provenance"), dict) else None):
        if holder is not None and isinstance(holder.get("settings"), dict) and "flags" in holder["settings"]:
            flags = holder["settings"]["flags"]  # a record a previous run wrote
            if not isinstance(flags, dict):
                where = "settings.flags" if holder is raw else "provenance.settings.flags"
                raise InputError(f"{p}: field '{where}': expected a mapping of flag -> value, got "
                                 f"{reading.quote(flags)}")
            return flags
    return raw


def _value(path: str, key: str, action: argparse.Action, v: Any) -> Any:
    """``v`` through the flag's own parser (its ``type`` and ``choices``)."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(v, bool):
            raise InputError(f"{path}: {key}: expected true or false, got {reading.quote(v)}")
        return v
    many = isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*")
    items = v if isinstance(v, list) else [v]
    if not many and isinstance(v, list):
        raise InputError(f"{path}: {key}: expected one value, got a list")
    out = []
    for x in items:
        if x is None:  # a null inside a list (a null value as a whole is "not given": config_defaults)
            raise InputError(f"{path}: {key}: expected a value, got null")
        if isinstance(x, (dict, list)):
            raise InputError(f"{path}: {key}: expected a value, got {type(x).__name__}")
        text = str(x).lower() if isinstance(x, bool) else str(x)
        try:
            y = action.type(text) if action.type is not None else text
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            raise InputError(f"{path}: {key}: {exc}") from None
        if action.choices is not None and y not in action.choices:
            raise InputError(f"{path}: {key}: expected one of {', '.join(map(str, action.choices))}, got "
                             f"{reading.quote(x)}")
        out.append(y)
    return out if many else out[0]


def _takes_none(action: argparse.Action) -> bool:
    """The flag's parser turns the word ``none`` into ``None`` (a knob that can be switched off)."""
    try:
        return action.type is not None and action.type("none") is None
    except (argparse.ArgumentTypeError, ValueError, TypeError):
        return False


def config_defaults(path: str, p: argparse.ArgumentParser) -> dict[str, Any]:
    """The file's flags as parsed defaults of the subcommand ``p``: ``{dest: value}``."""
    opts = _options(p)
    by_name = {**{d: d for d in opts}, **{s.lstrip("-").replace("-", "_"): a.dest
                                         for a in opts.values() for s in a.option_strings}}
    out: dict[str, Any] = {}
    for key, v in _read(path).items():
        dest = by_name.get(str(key).replace("-", "_"))
        if dest is None:
            near = nearest(str(key).replace("-", "_"), by_name)
            hint = f"; did you mean '{near}'?" if near else ""
            raise InputError(f"{path}: {str(key)[:reading.QUOTE]}: unknown flag of 'place {p.prog.split(' ', 1)[-1]}'{hint}")
        if v is None:  # null: the flag's "off" word where it has one (--cv none), else not given: its default
            if _takes_none(opts[dest]):
                out[dest] = None
            continue
        out[dest] = _value(path, str(key), opts[dest], v)
    return out


def apply_config(parser: argparse.ArgumentParser, argv: list[str] | None, args: argparse.Namespace
                 ) -> argparse.Namespace:
    """Re-parse ``argv`` with the ``--config`` file's flags as the subcommand's defaults (flags on the
    command line win; a repeatable flag given on the command line replaces the file's list)."""
    sub = getattr(args, "_parser", None)
    if sub is None or not getattr(args, "config", None):
        return args
    values = config_defaults(args.config, sub)
    given = set(argv if argv is not None else [])
    for dest, action in _options(sub).items():
        on_line = any(t == s or t.startswith(s + "=") for t in given for s in action.option_strings)
        if dest in values and on_line and isinstance(action, argparse._AppendAction):
            values.pop(dest)
    sub.set_defaults(**values)
    return parser.parse_args(argv)


def settings_record(args: argparse.Namespace, inputs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fully resolved flags of this run (``{"command", "flags", "inputs"}``): what ``--config`` reads
    back. JSON-ready (paths as strings)."""
    sub = getattr(args, "_parser", None)
    dests = _options(sub) if sub is not None else {}

    def plain(v):
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v if v is None or isinstance(v, (bool, int, float, str)) else str(v)

    return {"command": sub.prog if sub is not None else None,
            "flags": {d: plain(getattr(args, d)) for d in dests if hasattr(args, d)},
            "inputs": {k: plain(v) for k, v in (inputs or {}).items()}}
