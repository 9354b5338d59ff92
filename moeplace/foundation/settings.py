"""Typed settings from user input: one parser for mappings that people write (sweep specs, ``--config``
files, the optimizer's options) into the fields of a frozen dataclass or a table of typed keys.

An unknown key is an :class:`InputError` naming it and the nearest valid key
(``optimize.options.robsut: unknown option; did you mean 'robust'?``); a value of the wrong type names
the key, the type expected and what was given. Nothing here does I/O.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from moeplace.foundation.errors import InputError


def nearest(name: str, choices: Iterable[str]) -> str | None:
    """The valid key closest to ``name`` (difflib's ratio >= 0.6), or ``None``."""
    found = difflib.get_close_matches(str(name), sorted(choices), n=1)
    return found[0] if found else None


def unknown_key(where: str, key: str, choices: Iterable[str], what: str = "key") -> InputError:
    """The error for an unknown ``key`` at ``where`` (``where`` names the enclosing mapping)."""
    choices = sorted(choices)
    near = nearest(key, choices)
    hint = f"; did you mean '{near}'?" if near else f" (expected one of {', '.join(choices)})"
    return InputError(f"{where + '.' if where else ''}{key}: unknown {what}{hint}")


def field_types(cls: type) -> dict[str, Any]:
    """``{field name: resolved type}`` of a dataclass (string annotations resolved)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _alternatives(tp: Any) -> tuple[Any, ...]:
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        return typing.get_args(tp)
    return (tp,)


def _describe(tp: Any) -> str:
    names = {bool: "true or false", int: "a whole number", float: "a number", str: "a string",
             type(None): "null"}
    alts = _alternatives(tp)
    return " or ".join(names.get(a, getattr(a, "__name__", str(a))) for a in alts)


def coerce(where: str, key: str, value: Any, tp: Any) -> Any:
    """``value`` as type ``tp`` (``bool``, ``int``, ``float``, ``str``, unions of them with ``None``);
    ``bool`` is never taken for a number and a number never for a ``bool``; an int is a float."""
    for alt in _alternatives(tp):
        if alt is type(None) and value is None:
            return None
        if alt is bool and isinstance(value, bool):
            return value
        if alt is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if alt is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if alt is str and isinstance(value, str):
            return value
        if alt is Any:
            return value
    raise InputError(f"{where + '.' if where else ''}{key}: expected {_describe(tp)}, got {value!r}")


def parse_keys(where: str, raw: Any, types_: Mapping[str, Any], what: str = "key") -> dict[str, Any]:
    """Check a user mapping against ``{key: type}``: every key known, every value of its type. Returns the
    coerced values of the keys present (defaults are the caller's)."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise InputError(f"{where}: expected a mapping of {what}s, got {type(raw).__name__}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or key not in types_:
            raise unknown_key(where, str(key), types_, what)
        out[key] = coerce(where, key, value, types_[key])
    return out


def build(cls: type, where: str, raw: Any, *, exclude: Iterable[str] = (), **fixed: Any):
    """An instance of the dataclass ``cls`` from a user mapping: keys checked against its fields (less
    ``exclude`` and the ``fixed`` ones, which the caller sets), values against their types; the
    dataclass's own ``__post_init__`` then checks ranges."""
    allowed = {k: v for k, v in field_types(cls).items() if k not in set(exclude) | set(fixed)}
    return cls(**parse_keys(where, raw, allowed), **fixed)
