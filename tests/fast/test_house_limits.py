"""The house limits on the library's size (issue 50 item 4): every function in miles/ is at most 60 lines (its
decorators and docstring included) and every .py file at most 400. Measured with `ast`, no imports: a split that
goes over fails here, naming the function or file.

Data tables aside: miles/plan/configs/ holds JSON (not .py, so not measured). No .py file is exempt today; a .py table
would be named in `TABLES` with the reason it is one."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "miles"
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 400
TABLES: dict[str, str] = {}  # "miles/path.py": why it is a data table rather than code


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if str(p.relative_to(ROOT)) not in TABLES)


def function_lengths(source: str) -> list[tuple[int, str, int]]:
    """(line, name, lines from its first decorator to its last line) of every function and method in `source`."""
    lengths = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            lengths.append((node.lineno, node.name, (node.end_lineno or node.lineno) - start + 1))
    return lengths


def test_the_measure_counts_decorators_docstrings_and_nested_functions():
    source = "@decorator\ndef outer():\n    '''doc\n    more'''\n    def inner():\n        return 1\n    return inner\n"
    assert function_lengths(source) == [(2, "outer", 7), (5, "inner", 2)]


def test_every_function_in_miles_is_at_most_60_lines():
    over = [
        f"{path.relative_to(ROOT)}:{line} {name} ({length} lines)"
        for path in _sources()
        for line, name, length in function_lengths(path.read_text())
        if length > MAX_FUNCTION_LINES
    ]
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): {over}"


def test_every_file_in_miles_is_at_most_400_lines():
    sizes = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in _sources()}
    assert len(sizes) > 100, f"found only {len(sizes)} modules under {PACKAGE}: the test looks in the wrong place"
    over = sorted(f"{path} ({lines} lines)" for path, lines in sizes.items() if lines > MAX_FILE_LINES)
    assert not over, f"files over {MAX_FILE_LINES} lines (split them into cohesive modules): {over}"


def test_the_named_tables_exist():
    missing = [path for path in TABLES if not (ROOT / path).is_file()]
    assert not missing, f"TABLES names files that are gone (drop them from the list): {missing}"
