"""The gate's problems and where they go (``traces.validate``): a :class:`Problem` is one line naming the
file, the row (or row group) and the field; a sink receives them — :class:`Raise` (readers: the first
problem is an :class:`~foundation.errors.InputError`), :class:`Collect` (``place trace validate``: every
problem counted, a few per kind listed, into a :class:`ValidationReport`) or :class:`Detect` (fast paths:
only whether there is one)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from moeplace.foundation.errors import InputError, where
from moeplace.foundation.model import ModelSpec

DEFAULT_MAX_PER_KIND = 5


@dataclass(frozen=True)
class Problem:
    """One violation. ``kind`` groups problems for the per-kind listing limit (e.g. ``"expert_range"``)."""

    kind: str
    path: str
    row: int | str | None
    field: str | None
    message: str

    def __str__(self) -> str:
        return where(self.path, self.row, self.field) + self.message


@dataclass
class ValidationReport:
    """Outcome of :func:`validate_report`. ``ok`` depends on every problem found (``total``), never on how
    many are listed: ``problems`` holds the first problem found and then up to ``max_per_kind`` per kind;
    ``suppressed`` counts the rest per kind."""

    problems: list[Problem] = field(default_factory=list)
    num_files: int = 0
    num_rows: int = 0
    num_tokens: int = 0
    model: ModelSpec | None = None
    suppressed: Counter = field(default_factory=Counter)  # kind -> problems found but not listed
    total: int = 0

    @property
    def ok(self) -> bool:
        return self.total == 0

    @property
    def first(self) -> Problem | None:
        """The problem every reader of this trace stops at (its one-line error)."""
        return self.problems[0] if self.problems else None

    def lines(self) -> list[str]:
        """One line per listed problem (the first is the readers' error), then one per kind with problems
        not listed."""
        out = [str(p) for p in self.problems]
        for kind, n in sorted(self.suppressed.items()):
            out.append(f"... and {n} more '{kind}' problem(s) not listed")
        return out

    def summary(self) -> str:
        m = self.model
        model = (
            f"model '{m.name}': {m.num_moe_layers}{' of ' + str(len(m.model_moe_layers)) if m.is_partial else ''} "
            f"MoE layers x {m.num_experts} experts, top-{m.top_k}"
            if m is not None
            else "no model"
        )
        return f"OK: {self.num_files} file(s), {self.num_rows:,} rows, {self.num_tokens:,} tokens ({model})"


class Raise:
    """Sink of the gate: the first problem is an :class:`InputError`."""

    collecting = False

    def add(self, kind: str, path, row, fld, message: str) -> None:
        raise InputError(str(Problem(kind, str(path), row, fld, message)))

    def add_rows(self, kind: str, path, bad: np.ndarray, row0: int, fld: str, msg_of_index) -> None:
        """Report the rows where boolean mask ``bad`` is set; ``msg_of_index(i)`` words local row ``i``."""
        if bad.any():
            i = int(np.argmax(bad))
            self.add(kind, path, row0 + i, fld, msg_of_index(i))

    def more(self, kind: str, n: int) -> None:  # pragma: no cover - never reached: add raised
        pass


class ProblemFound(Exception):
    """Raised by a :class:`Detect` sink: the checks found a problem (not worded)."""


class Detect:
    """Sink that only tells whether there is a problem: the first raises :class:`ProblemFound`, no message
    is built. For fast paths that, on a problem, run the checks again with a reporting sink."""

    collecting = False

    def add(self, kind: str, path, row, fld, message: str) -> None:
        raise ProblemFound(kind)

    def add_rows(self, kind: str, path, bad: np.ndarray, row0: int, fld: str, msg_of_index) -> None:
        if bad.any():
            raise ProblemFound(kind)

    def more(self, kind: str, n: int) -> None:  # pragma: no cover - never reached: add raised
        pass


class Collect:
    """Sink of ``place trace validate``: counts every problem, lists the first one and up to
    ``max_per_kind`` of each kind."""

    collecting = True

    def __init__(self, report: ValidationReport, max_per_kind: int) -> None:
        self.report = report
        self.max_per_kind = max(int(max_per_kind), 0)
        self.listed: Counter = Counter()

    def add(self, kind: str, path, row, fld, message: str) -> None:
        rep = self.report
        rep.total += 1
        if rep.total == 1 or self.listed[kind] < self.max_per_kind:
            rep.problems.append(Problem(kind, str(path), row, fld, message))
            self.listed[kind] += 1
        else:
            rep.suppressed[kind] += 1

    def more(self, kind: str, n: int) -> None:
        """``n`` further problems of ``kind`` that were found but not worded."""
        if n > 0:
            self.report.total += n
            self.report.suppressed[kind] += n

    def add_rows(self, kind: str, path, bad: np.ndarray, row0: int, fld: str, msg_of_index) -> None:
        idx = np.flatnonzero(bad)
        if idx.size == 0:
            return
        room = max(self.max_per_kind - self.listed[kind], 1 if self.report.total == 0 else 0)
        for i in idx[:room]:
            self.add(kind, path, row0 + int(i), fld, msg_of_index(int(i)))
        self.more(kind, idx.size - min(room, idx.size))
