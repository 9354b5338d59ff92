"""The layer contract: foundation -> traces -> placement -> sim -> kernels -> dashboard -> moeplace, each
package importing only those to its left (``[tool.importlinter]`` in pyproject.toml). A back-edge, even
inside a function, fails here."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

importlinter_cli = pytest.importorskip("importlinter.cli")

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("foundation", "traces", "placement", "sim", "kernels", "dashboard", "moeplace")


def test_import_contracts_hold(capsys):
    rc = importlinter_cli.lint_imports(config_filename=str(REPO / "pyproject.toml"), no_cache=True,
                                       no_logo=True)
    out = capsys.readouterr().out
    assert rc == 0, out[out.find("Broken contracts"):] or out


def _imported_root(node: ast.Import | ast.ImportFrom) -> str | None:
    if isinstance(node, ast.ImportFrom):
        return None if node.level else (node.module or "").split(".")[0]
    return node.names[0].name.split(".")[0]


def _function_local_imports():
    """``(file, line number, line text, imported root, owning package)`` of every import inside a function."""
    for pkg in PACKAGES:
        for f in sorted((REPO / pkg).rglob("*.py")):
            src = f.read_text()
            lines = src.splitlines()
            for fn in ast.walk(ast.parse(src)):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        yield f.relative_to(REPO), node.lineno, lines[node.lineno - 1], _imported_root(node), pkg


def test_cross_package_imports_inside_functions_say_why():
    """Imports of another moeplace package belong at module level, where every reader (and the contract)
    sees them; one kept inside a function must say on its line why (e.g. it pulls in torch)."""
    bare = [f"{f}:{n}: {line.strip()}" for f, n, line, root, pkg in _function_local_imports()
            if root in PACKAGES and root != pkg and "#" not in line]
    assert not bare, "function-local imports of other packages without a reason:\n" + "\n".join(bare)


def test_third_party_imports_inside_functions_say_why():
    """A third-party module imported inside a function is an optional dependency (transformers, streamlit,
    ray) or one too slow to import for every caller (torch, scipy.optimize); its line says which."""
    bare = [f"{f}:{n}: {line.strip()}" for f, n, line, root, _pkg in _function_local_imports()
            if root and root not in PACKAGES and root not in sys.stdlib_module_names and "#" not in line]
    assert not bare, "function-local third-party imports without a reason:\n" + "\n".join(bare)
