"""No function of trtspec over 120 lines and no module over 600: past that, a function or a module does several
things, and is split by what each part is responsible for.

A function counts from its `def` line to its last line (its decorators not included, its docstring, comments and
blank lines included), nested functions and methods each counted on their own as well as inside the function that
holds them. A module counts every line of its file.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "trtspec"
MAX_FUNCTION_LINES = 120
MAX_MODULE_LINES = 600


def oversized(package: Path = PACKAGE) -> list[str]:
    """'path: N lines' for each module over MAX_MODULE_LINES, 'path:line name: N lines' for each function over
    MAX_FUNCTION_LINES."""
    found = []
    for path in sorted(package.rglob("*.py")):
        source = path.read_text()
        where = path.relative_to(package.parent)
        lines = len(source.splitlines())
        if lines > MAX_MODULE_LINES:
            found.append(f"{where}: {lines} lines (module; at most {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{where}:{node.lineno} {node.name}: {length} lines (function; at most "
                                 f"{MAX_FUNCTION_LINES})")
    return found


def test_the_count_starts_at_def_and_takes_nested_functions_on_their_own(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 1))
    (tmp_path / "fits.py").write_text(f"@decorator\ndef f():\n{body}\n")  # def + 119 lines: 120
    inner = "\n".join(f"        y{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "nested.py").write_text(f"def outer():\n    def inner():\n{inner}\n")
    (tmp_path / "long.py").write_text("\n" * MAX_MODULE_LINES + "x = 1\n")
    assert oversized(tmp_path) == [
        f"{tmp_path.name}/long.py: {MAX_MODULE_LINES + 1} lines (module; at most {MAX_MODULE_LINES})",
        f"{tmp_path.name}/nested.py:1 outer: {MAX_FUNCTION_LINES + 2} lines (function; at most {MAX_FUNCTION_LINES})",
        f"{tmp_path.name}/nested.py:2 inner: {MAX_FUNCTION_LINES + 1} lines (function; at most {MAX_FUNCTION_LINES})",
    ]


def test_no_function_or_module_of_trtspec_is_oversized():
    found = oversized()
    assert not found, f"{len(found)} oversized (tests/test_sizes.py):\n" + "\n".join(found)
