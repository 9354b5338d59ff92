"""Reading user files safely, in one place: every JSON, JSONL and YAML reader of moeplace goes through here.

A file a command reads may be hostile or broken; whatever its structure, the command answers with one line
(:class:`~moeplace.foundation.errors.InputError`) naming the file, never a traceback and never a hang:

- only regular files are opened: a FIFO, a device or a socket named like an input (``placement.json``,
  ``part-00000.parquet``) is refused before ``open`` (:func:`require_regular`; opening a FIFO for reading
  blocks until a writer appears, forever in a directory scan), and checked again on the open descriptor;
- nesting deeper than :data:`MAX_DEPTH` levels is refused (no moeplace or engine format nests more than a
  handful; the parsers' own limit is Python's recursion limit, which raises ``RecursionError``, and a
  structure just under it breaks numpy, which stops at 64 dimensions);
- an integer literal longer than Python's int-string limit (4300 digits) is refused (``ValueError`` from
  the parser), as is a file that is not UTF-8, not JSON or not YAML;
- mapping keys must be unique, in JSON as in YAML (both parsers keep the last of two silently; here it is
  an error naming the key, and for YAML both lines); YAML is read with the safe loader only;
- YAML aliases may not expand a document by more than :data:`MAX_ALIAS_NODES` nodes (a "billion laughs"
  tree is tiny in memory but anything that walks or prints it expands it);
- error messages quote at most :data:`QUOTE` characters of any value taken from the file.

Field types (a ``true`` where an integer goes, ``bool`` being an ``int`` subclass) are each reader's own
checks; :func:`is_int` is the one test they share.
"""
from __future__ import annotations

import json
import numbers
import os
import reprlib
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moeplace.foundation.errors import InputError

MAX_DEPTH = 64  # levels of nested arrays/objects a file may hold (numpy's own limit on dimensions)
MAX_ALIAS_NODES = 100_000  # nodes YAML aliases may add to a document once expanded (specs use a few)
QUOTE = 60  # characters of a value from a file that an error message quotes
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxtuple, _REPR.maxset = 3, 8, 6, 8, 6
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = QUOTE


def quote(value: Any, limit: int = QUOTE) -> str:
    """``repr(value)`` of at most about ``limit`` characters: what an error message may quote of a value read
    from a file, whatever its size. Containers are shown to a few items and levels only (``reprlib``), so a
    YAML alias tree is never expanded; a small value reads as its plain ``repr``."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def special_kind(mode: int) -> str | None:
    """What a non-regular file is (``"a FIFO (named pipe)"``, ...), or None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def require_regular(path: str | os.PathLike, what: str = "") -> os.stat_result:
    """``os.stat(path)`` of a regular file (links followed); anything else is an :class:`InputError`
    ``"<path>: is a FIFO (named pipe), not a regular file; ..."``. A missing file raises
    :class:`FileNotFoundError` (the caller words that), other stat failures an :class:`InputError`."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the name
        raise InputError(f"{os.fspath(path)}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    kind = special_kind(st.st_mode)
    if kind is not None:
        raise InputError(f"{os.fspath(path)}: is {kind}, not a regular file{' (' + what + ')' if what else ''}; "
                         "refusing to read it")
    return st


def is_regular(path: str | os.PathLike) -> bool:
    """``path`` is a regular file (links followed); False for anything else, missing included. For scans
    that skip what they cannot read."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def open_regular(path: str | os.PathLike, what: str = ""):
    """A binary file object for a regular file: :func:`require_regular`, then opened without blocking (a
    FIFO swapped in between the two is refused on the descriptor, never waited on)."""
    require_regular(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise InputError(f"{os.fspath(path)}: cannot be read ({exc.strerror or exc})") from None
    kind = special_kind(os.fstat(fd).st_mode)
    if kind is not None:
        os.close(fd)
        raise InputError(f"{os.fspath(path)}: is {kind}, not a regular file; refusing to read it")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_bytes(path: str | os.PathLike, what: str = "") -> bytes:
    """The bytes of a regular file (see :func:`open_regular`)."""
    with open_regular(path, what) as fh:
        try:
            return fh.read()
        except OSError as exc:
            raise InputError(f"{os.fspath(path)}: cannot be read ({exc.strerror or exc})") from None


def read_text(path: str | os.PathLike, what: str = "") -> str:
    """The UTF-8 text of a regular file; bytes that are not UTF-8 are an :class:`InputError` naming the
    line."""
    data = read_bytes(path, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise InputError(f"{os.fspath(path)}: line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at "
                         f"offset {exc.start})") from None


def is_int(v: Any) -> bool:
    """An integer that is not a bool (``True`` is an ``int`` in Python, never an id or a count here)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and type(v).__name__ != "bool_"


# ---------------------------------------------------------------------------- structure
_CONTAINERS = (list, dict, tuple, set)  # what json and YAML's safe loader build (tuples: !!omap / !!pairs)
_CONTAINER_SET = frozenset(_CONTAINERS)


def may_be_too_deep(text: str | bytes) -> bool:
    """Whether JSON ``text`` holds enough brackets to nest past :data:`MAX_DEPTH` (a C-speed count
    that spares the walk of :func:`too_deep` for almost every file)."""
    if isinstance(text, str):
        return text.count("[") + text.count("{") > MAX_DEPTH
    return text.count(b"[") + text.count(b"{") > MAX_DEPTH


def too_deep(obj: Any, limit: int = MAX_DEPTH) -> bool:
    """``obj`` nests lists/dicts more than ``limit`` levels. Walked level by level, never recursively; a
    container reached twice in one level (YAML aliases) is walked once, so a self-referencing one ends at
    the limit and a "billion laughs" document costs its distinct containers only."""
    level = [obj] if isinstance(obj, _CONTAINERS) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        nxt: dict[int, Any] = {}
        for o in level:
            items = o.values() if isinstance(o, dict) else o
            if _CONTAINER_SET.isdisjoint(map(type, items)):  # numbers and strings only (C speed)
                continue
            for x in items:
                if isinstance(x, _CONTAINERS):
                    nxt[id(x)] = x
        level = list(nxt.values())
    return False


def _structure_error(where: str, exc: BaseException, what: str) -> InputError:
    if isinstance(exc, RecursionError):
        return _deep(where)
    text = str(exc)
    if "integer string conversion" in text or "int_max_str_digits" in text:
        return InputError(f"{where}: holds an integer of more than {_int_digits()} digits; no field moeplace "
                          "reads holds one (corrupt file?)")
    return InputError(f"{where}: not {what} ({text.splitlines()[0] if text else type(exc).__name__})")


def _deep(where: str) -> InputError:
    return InputError(f"{where}: arrays/objects nested more than {MAX_DEPTH} levels deep; no file moeplace reads "
                      "nests that deep (corrupt file?)")


def _int_digits() -> int:
    get = getattr(sys, "get_int_max_str_digits", None)
    return get() if get else 4300


def check_depth(obj: Any, where: str) -> Any:
    """``obj`` itself, or the depth :class:`InputError` when it nests past :data:`MAX_DEPTH` (for a
    document a caller parsed itself)."""
    if too_deep(obj):
        raise _deep(where)
    return obj


def _checked(obj: Any, text: str | bytes, where: str) -> Any:
    if may_be_too_deep(text) and too_deep(obj):
        raise _deep(where)
    return obj


# ---------------------------------------------------------------------------- JSON
class _DuplicateJSONKey(ValueError):
    pass


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json``'s ``object_pairs_hook``: the object, or an error naming a key given twice (the stdlib
    parser keeps the last silently, so ``{"every": 10, "every": 20}`` would mean 20 without a word)."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateJSONKey(f"key {quote(k)} appears twice in one object; JSON keys must be unique")
            seen.add(k)
    return d


def loads(text: str | bytes) -> Any:
    """``json.loads`` with duplicate keys refused (``ValueError``); NaN and Infinity are kept (Python's
    ``json.dumps`` writes them; each reader's field checks word them)."""
    return json.loads(text, object_pairs_hook=_unique_pairs)


def has_duplicate_keys(obj: Any, text: str | bytes) -> bool:
    """Whether ``text`` (which a parser that keeps the last of two keys turned into ``obj``) may have held
    a key twice in one object: the parsed keys are fewer than the ``":`` tokens of the text only then, or
    when a string holds such a token; the caller settles it with :func:`loads`. Costs two C-speed counts
    for a flat object (an engine log's line)."""
    colon, spaced = ('":', '" :') if isinstance(text, str) else (b'":', b'" :')
    tokens = text.count(colon) + text.count(spaced)
    keys = len(obj) if isinstance(obj, dict) else 0
    if keys >= tokens:
        return False
    level = [obj]
    keys = 0
    while level and keys < tokens:
        nxt = []
        for o in level:
            if isinstance(o, dict):
                keys += len(o)
                nxt.extend(v for v in o.values() if isinstance(v, (dict, list)))
            elif isinstance(o, list):
                nxt.extend(v for v in o if isinstance(v, (dict, list)))
        level = nxt
    return keys < tokens


def parse_json(text: str | bytes, where: str, what: str = "valid JSON") -> Any:
    """Parse JSON text; any problem (syntax, depth, a huge integer, bad UTF-8) is one :class:`InputError`
    ``"<where>: ..."``."""
    try:
        obj = loads(text)
    except _DuplicateJSONKey as exc:
        raise InputError(f"{where}: {exc}") from None
    except (RecursionError, ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise _structure_error(where, exc, what) from None
    return _checked(obj, text, where)


def read_json(path: str | os.PathLike, missing: str = "no such file", unreadable: str = "not readable JSON",
              what: str = "") -> Any:
    """Parse a JSON file (a regular file only: see the module docstring); a missing file is
    ``"<path>: <missing>"``, anything else unusable ``"<path>: <unreadable> (<why>)"`` or the depth / size
    line."""
    p = Path(path)
    try:
        data = read_bytes(p, what)
    except FileNotFoundError:
        raise InputError(f"{p}: {missing}") from None
    try:
        obj = loads(data)
    except _DuplicateJSONKey as exc:
        raise InputError(f"{p}: {exc}") from None
    except RecursionError as exc:
        raise _structure_error(str(p), exc, unreadable) from None
    except (ValueError, UnicodeDecodeError) as exc:
        if "integer string conversion" in str(exc):
            raise _structure_error(str(p), exc, unreadable) from None
        raise InputError(f"{p}: {unreadable} ({exc})") from None
    return _checked(obj, data, str(p))


def json_lines(path: str | os.PathLike, what: str = "") -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` of a regular file, blank lines skipped."""
    with open_regular(path, what) as fh:
        for lineno, line in enumerate(fh, start=1):
            if line.strip():
                yield lineno, line


# ---------------------------------------------------------------------------- YAML
class _DuplicateKey(Exception):
    pass


def _unique_key_loader():
    import yaml  # PyYAML: ~20 ms to import, and most commands read no YAML

    class UniqueKeyLoader(yaml.SafeLoader):
        """The safe loader, refusing a mapping that holds one key twice."""

        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen: dict[Any, Any] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":  # '<<' merges, it is not a key
                        continue
                    key = self.construct_object(key_node, deep=True)
                    try:
                        first = seen.get(key)
                    except TypeError:  # an unhashable key: the base loader words it
                        break
                    if first is not None:
                        raise _DuplicateKey(f"line {key_node.start_mark.line + 1}: key {quote(key)} appears twice in "
                                            f"one mapping (first at line {first.line + 1}); YAML keys must be "
                                            "unique")
                    seen[key] = key_node.start_mark
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


_LOADER = None


def parse_yaml(text: str, where: str, what: str = "valid YAML") -> Any:
    """Parse YAML text with the safe loader, duplicate keys refused; any problem is one
    :class:`InputError` ``"<where>: line N: ..."``."""
    import yaml  # PyYAML: ~20 ms to import, and most commands read no YAML

    global _LOADER
    if _LOADER is None:
        _LOADER = _unique_key_loader()
    try:
        loader = _LOADER(text)  # a SafeLoader subclass
        try:
            node = loader.get_single_node()
            if node is not None:
                _check_aliases(node, where)
            obj = None if node is None else loader.construct_document(node)
        finally:
            loader.dispose()
    except _DuplicateKey as exc:
        raise InputError(f"{where}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"{where}: {line}not {what} ({problem})") from None
    except (RecursionError, ValueError, TypeError, OverflowError) as exc:
        raise _structure_error(where, exc, what) from None
    if too_deep(obj):  # always walked: indentation and aliases nest without brackets
        raise _deep(where)
    return obj


def _check_aliases(root, where: str) -> None:
    """Refuse a YAML node graph whose aliases expand it by more than :data:`MAX_ALIAS_NODES` nodes. Sizes
    are counted once per distinct node (memoised, iteratively), so the check costs the document's own size
    even for a "billion laughs" tree of 10**9 expanded nodes."""
    import yaml  # PyYAML: ~20 ms to import, and most commands read no YAML

    size: dict[int, int] = {}
    started: set[int] = set()
    distinct = 0
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        kids = []
        if isinstance(node, yaml.SequenceNode):
            kids = node.value
        elif isinstance(node, yaml.MappingNode):
            kids = [x for kv in node.value for x in kv]
        if not done:
            if id(node) in started:
                continue
            started.add(id(node))
            stack.append((node, True))
            stack.extend((k, False) for k in kids if id(k) not in started)
            continue
        distinct += 1
        size[id(node)] = 1 + sum(size.get(id(k), 1) for k in kids)  # a cycle back to an ancestor counts 1
        if size[id(node)] - distinct > MAX_ALIAS_NODES:
            raise InputError(f"{where}: its aliases (*name) expand it by more than {MAX_ALIAS_NODES:,} "
                             "values; no file moeplace reads needs that (an alias bomb?)")


def read_yaml(path: str | os.PathLike, missing: str = "no such file", what: str = "valid YAML") -> Any:
    """A YAML file (a regular file only), parsed by :func:`parse_yaml`."""
    p = Path(path)
    try:
        text = read_text(p)
    except FileNotFoundError:
        raise InputError(f"{p}: {missing}") from None
    return parse_yaml(text, str(p), what)


# ---------------------------------------------------------------------------- .npz
def npz_declared(path: str | os.PathLike, what: str = ".npz file") -> dict[str, tuple[tuple[int, ...], Any]]:
    """What each array of an ``.npz`` says it holds, read from the ``.npy`` headers inside the zip without
    reading (or inflating) any data: ``{name: (shape, dtype)}``. A compressed ``.npz`` of zeros declaring
    ``(10^7, 48, 128)`` is a few MB on disk and 458 GiB once loaded; callers check the declared sizes
    (:func:`npz_bytes`) against the memory they may use before ``np.load``. A member that is not a readable
    ``.npy`` header is an :class:`InputError` naming the file and the array."""
    import zipfile

    import numpy as np  # only the .npz readers need numpy; the JSON/YAML readers here stay light

    out: dict[str, tuple[tuple[int, ...], Any]] = {}
    try:
        with open_regular(path) as fh, zipfile.ZipFile(fh) as z:
            for info in z.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                name = info.filename[:-4]
                try:
                    with z.open(info) as m:
                        version = np.lib.format.read_magic(m)
                        read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                                       (2, 0): np.lib.format.read_array_header_2_0}.get(version)
                        if read_header is None:  # format 3.0 (utf-8 field names): no public reader
                            shape, _fortran, dtype = np.lib.format._read_array_header(m, version)
                        else:
                            shape, _fortran, dtype = read_header(m)
                except Exception as exc:  # noqa: BLE001  (numpy's header parser raises tokenize's and ast's errors too)
                    raise InputError(f"{os.fspath(path)}: array '{name[:80]}': not a readable .npy header "
                                     f"({str(exc)[:200]})") from None
                out[name] = (tuple(int(d) for d in shape), dtype)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise InputError(f"{os.fspath(path)}: not a readable {what} ({str(exc)[:200]})") from None
    return out


def npz_bytes(declared: dict[str, tuple[tuple[int, ...], Any]]) -> float:
    """Bytes the arrays of :func:`npz_declared` take once loaded (a float: a hostile shape overflows int64)."""
    total = 0.0
    for shape, dtype in declared.values():
        n = 1.0
        for d in shape:
            n *= max(0, d)
        total += n * max(1, getattr(dtype, "itemsize", 1) or 1)
    return total

