"""Range-checked argparse ``type=`` functions shared by every ``place`` command.

A bad number is refused while the command line is parsed, before any input is read or any work is done,
with one line naming the flag: ``place optimize: error: argument --seed: expected a whole number in
[0, 2147483647], got '-1'``. Floats must be finite (``nan``/``inf`` are refused everywhere).

Library records keep their own checks (a Python caller does not go through argparse); these types make the
command line fail at the flag with the flag's name and the flag's unit.
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable

# CP-SAT's random_seed is a 32-bit signed integer; numpy accepts any non-negative integer. One range for
# every --seed keeps a seed usable by every stage it reaches.
SEED_MAX = 2**31 - 1


def _int(text: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def _float(text: str) -> float:
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def int_range(lo: int | None = None, hi: int | None = None, unit: str = "") -> Callable[[str], int]:
    """A whole number in ``[lo, hi]`` (either end open when ``None``)."""
    what = _describe(lo, hi, "whole number", unit, "[", "]")

    def parse(text: str) -> int:
        v = _int(text)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v

    parse.__name__ = "int"
    return parse


def float_range(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
                hi_open: bool = False, unit: str = "") -> Callable[[str], float]:
    """A finite number in ``[lo, hi]``; ``lo_open``/``hi_open`` exclude that end."""
    what = _describe(lo, hi, "number", unit, "(" if lo_open else "[", ")" if hi_open else "]")

    def parse(text: str) -> float:
        v = _float(text)
        if lo is not None and (v < lo or (lo_open and v == lo)):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        if hi is not None and (v > hi or (hi_open and v == hi)):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v

    parse.__name__ = "float"
    return parse


def _describe(lo, hi, kind: str, unit: str, left: str, right: str) -> str:
    u = f" {unit}" if unit else ""
    f = lambda x: str(x) if isinstance(x, int) else f"{x:g}"
    if lo is not None and hi is not None:
        return f"a {kind} in {left}{f(lo)}, {f(hi)}{right}{u}"
    if lo is not None:
        return f"a {kind} {'>' if left == '(' else '>='} {f(lo)}{u}"
    if hi is not None:
        return f"a {kind} {'<' if right == ')' else '<='} {f(hi)}{u}"
    return f"a {kind}{u}"


positive_int = int_range(1)
nonneg_int = int_range(0)
seed = int_range(0, SEED_MAX)
port = int_range(1, 65535)
positive_float = float_range(0.0, lo_open=True)
nonneg_float = float_range(0.0)
fraction = float_range(0.0, 1.0, lo_open=True)          # a share in (0, 1]
probability = float_range(0.0, 1.0)                     # [0, 1]
seconds = float_range(0.0, lo_open=True, unit="seconds")
gib = float_range(0.0, unit="GiB")


def number_or(parse: Callable[[str], float], *words: str) -> Callable[[str], float | str]:
    """``parse``, or one of ``words`` as given (a rule instead of a number, e.g. ``auto``)."""

    def wrapped(text: str):
        if text.lower() in words:
            return text.lower()
        try:
            return parse(text)
        except argparse.ArgumentTypeError as e:
            # "expected a number >= 1, got 'x'" -> "expected a number >= 1 or one of auto, got 'x'"
            head, _, got = str(e).rpartition(", got ")
            raise argparse.ArgumentTypeError(f"{head} or one of {', '.join(words)}, got {got}") from None

    wrapped.__name__ = parse.__name__
    return wrapped


def optional(parse: Callable[[str], float], *off: str) -> Callable[[str], float | None]:
    """``parse``, or ``None`` for one of the words in ``off`` (a knob switched off, e.g. ``none``)."""

    def wrapped(text: str):
        if text.lower() in off:
            return None
        return parse(text)

    wrapped.__name__ = parse.__name__
    return wrapped


def layer_list(text: str) -> tuple[int, ...]:
    """Decoder-layer indices as ``0-4,7,11-12`` (the form every layer list is printed in): ascending,
    no duplicates."""
    out: list[int] = []
    for part in text.split(","):
        a, sep, b = part.strip().partition("-")
        try:
            lo, hi = int(a), int(b) if sep else int(a)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected layers like 0-4,7 (decoder-layer indices), got {text!r}") from None
        if lo < 0 or hi < lo:
            raise argparse.ArgumentTypeError(f"expected ascending ranges of layers >= 0 like 0-4,7, got {text!r}")
        out.extend(range(lo, hi + 1))
    if out != sorted(set(out)):
        raise argparse.ArgumentTypeError(f"expected each layer once, in ascending order, got {text!r}")
    return tuple(out)
