"""User-facing errors. The CLI turns these into one line on stderr and a non-zero exit code, never a
traceback; library code raises them for anything a user can get wrong (bad files, bad arguments)."""
from __future__ import annotations


class MoeplaceError(Exception):
    """Base of every error a user can cause. ``exit_code`` is what the CLI exits with. The message is kept
    on one line: text quoted from a library (pyarrow, YAML) can carry newlines, and a user error is one
    line."""

    exit_code = 2

    def __init__(self, *args) -> None:
        if len(args) == 1 and isinstance(args[0], str):
            args = (" ".join(line.strip() for line in args[0].splitlines() if line.strip()),)
        super().__init__(*args)


class InputError(MoeplaceError):
    """Bad input: a file, a row, a field or an argument that is not what was expected.

    Messages name the file, the row (or row group / line) and the field, then what was expected.
    """


def where(path=None, row=None, field=None) -> str:
    """Format the location prefix of an error message: ``file.parquet: row 12: field 'expert_ids': ``."""
    parts = []
    if path is not None:
        parts.append(str(path))
    if row is not None:
        parts.append(row if isinstance(row, str) else f"row {row}")
    if field is not None:
        parts.append(f"field '{field}'")
    return ": ".join(parts) + (": " if parts else "")
