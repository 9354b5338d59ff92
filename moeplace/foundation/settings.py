"""Typed settings from user input: one parser for mappings that people write (sweep specs, ``--config``
files, the optimizer's options) into the fields of a frozen dataclass or a table of typed keys.

An unknown key is an :class:`InputError` naming it and the nearest valid key
(``optimize.options.robsut: unknown option; did you mean 'robust'?``); a value of the wrong type names
the key, the type expected and what was given. A field's type may carry its allowed values
(``Literal["stat", "replay"]``) and its range (``Annotated[int, Range(1)]``): then a value out of them is
an error naming the key too. Nothing here does I/O.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from moeplace.foundation.errors import InputError
from moeplace.foundation.reading import quote


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


@dataclasses.dataclass(frozen=True)
class Range:
    """The range of a number field, carried by its type: ``Annotated[float, Range(0, 1, hi_open=True)]``
    is a number in ``[0, 1)``."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def holds(self, v: float) -> bool:
        return ((self.lo is None or (v > self.lo if self.lo_open else v >= self.lo))
                and (self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)))

    def describe(self) -> str:
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        if self.lo is None:
            return f"{'<' if self.hi_open else '<='} {self.hi:g}"
        return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"


def field_types(cls: type) -> dict[str, Any]:
    """``{field name: resolved type}`` of a dataclass (string annotations resolved, ``Annotated`` kept)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _alternatives(tp: Any) -> tuple[Any, ...]:
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        return typing.get_args(tp)
    return (tp,)


def _unannotated(tp: Any) -> tuple[Any, tuple[Any, ...]]:
    if typing.get_origin(tp) is Annotated:
        base, *meta = typing.get_args(tp)
        return base, tuple(meta)
    return tp, ()


def _describe(tp: Any) -> str:
    names = {bool: "true or false", int: "a whole number", float: "a number", str: "a string",
             type(None): "null"}
    out = []
    for a in _alternatives(_unannotated(tp)[0]):
        a = _unannotated(a)[0]
        if typing.get_origin(a) is Literal:
            out.append("one of " + ", ".join(map(str, typing.get_args(a))))
        elif typing.get_origin(a) is tuple:
            out.append(f"a list of {_describe(typing.get_args(a)[0])}s")
        else:
            out.append(names.get(a, getattr(a, "__name__", str(a))))
    return " or ".join(out)


_NO = object()


def _plain(where: str, key: str, value: Any, alt: Any) -> Any:
    """``value`` as the one type ``alt``, or ``_NO``."""
    origin = typing.get_origin(alt)
    if alt is type(None):
        return None if value is None else _NO
    if alt is bool:
        return value if isinstance(value, bool) else _NO
    if alt is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO
    if alt is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return _NO
        if not math.isfinite(value):  # YAML's .inf / .nan: no setting is infinite ("no limit" is null)
            raise InputError(f"{where + '.' if where else ''}{key}: expected a finite number, got {quote(value)}")
        return float(value)
    if alt is str:
        return value if isinstance(value, str) else _NO
    if alt is Any:
        return value
    if origin is Literal:
        return value if any(value == c and type(value) is type(c) for c in typing.get_args(alt)) else _NO
    if origin is tuple and isinstance(value, (list, tuple)):  # tuple[T, ...]
        item = typing.get_args(alt)[0]
        return tuple(coerce(where, f"{key}[{i}]", v, item) for i, v in enumerate(value))
    return _NO


def coerce(where: str, key: str, value: Any, tp: Any) -> Any:
    """``value`` as type ``tp`` (``bool``, ``int``, ``float``, ``str``, ``Literal[...]``, ``tuple[T, ...]``,
    unions of them with ``None``, each possibly ``Annotated`` with a :class:`Range`); ``bool`` is never
    taken for a number and a number never for a ``bool``; an int is a float."""
    tp, meta = _unannotated(tp)
    for alt in _alternatives(tp):
        base, alt_meta = _unannotated(alt)
        v = _plain(where, key, value, base)
        if v is _NO:
            continue
        for r in (*meta, *alt_meta):
            if isinstance(r, Range) and v is not None and not isinstance(v, tuple) and not r.holds(v):
                raise InputError(f"{where + '.' if where else ''}{key}: must be {r.describe()}, got {quote(value)}")
        return v
    choices = [str(c) for a in _alternatives(tp) if typing.get_origin(_unannotated(a)[0]) is Literal
               for c in typing.get_args(_unannotated(a)[0])]
    near = nearest(value, choices) if choices and isinstance(value, str) else None
    hint = f"; did you mean '{near}'?" if near else ""
    raise InputError(f"{where + '.' if where else ''}{key}: expected {_describe(tp)}, got {quote(value)}{hint}")


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
