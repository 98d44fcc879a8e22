"""The test tree mirrors the package: `miles/<path>/<module>.py` has its tests in
`tests/fast/<path>/test_<module>.py` (a package's `__init__.py` with logic: `tests/fast/<path>/test_<package>.py`
inside the package's own test folder), so a reader finds a module's tests without searching. Modules without logic
(re-exports, constants, data tables, protocols) need no file of their own."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Issue 50 asks for 90%. What is true today (2026-12-06, session 9): 205 of 205 modules with logic have a test at the
# mirrored path (tests moved to their module's name, new unit tests where a module had none). A new module brings its
# test file; raise this as files move, never lower it.
MIN_MIRRORED_PERCENT = 95


def _is_trivial(body: list[ast.stmt]) -> bool:
    """A function body that does nothing: a docstring, `...` or `pass` (protocols, abstract stubs)."""
    return all(
        isinstance(stmt, ast.Pass) or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))
        for stmt in body
    )


def has_logic(source: str) -> bool:
    """Whether a module defines a function or method that does something (not only imports, constants, tables,
    dataclasses without methods, protocols)."""
    module = ast.parse(source)
    for node in module.body:  # functions and methods: a nested one is inside a function that counts already
        members = node.body if isinstance(node, ast.ClassDef) else [node]
        for member in members:
            if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_trivial(member.body):
                return True
    return False


def mirrored_test(module: str) -> str:
    """The test file path that mirrors a module path relative to the repository ('miles/a/b.py')."""
    parts = module.split("/")[1:]
    if parts[-1] == "__init__.py":
        return os.path.join("tests", "fast", *parts[:-1], f"test_{parts[-2]}.py")
    return os.path.join("tests", "fast", *parts[:-1], f"test_{parts[-1]}")


def modules_with_logic() -> list[str]:
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "miles")):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as handle:
                    if has_logic(handle.read()):
                        found.append(os.path.relpath(path, ROOT).replace(os.sep, "/"))
    return sorted(found)


def test_logic_detection():
    assert not has_logic("from .a import b\n__all__ = ['b']\nTABLE = {'x': 1}\n")
    assert not has_logic("class P(Protocol):\n    def f(self) -> int:\n        ...\n")
    assert has_logic("def f(x):\n    return x + 1\n")
    assert mirrored_test("miles/models/wan/folder.py") == "tests/fast/models/wan/test_folder.py"
    assert mirrored_test("miles/rollout/rm_hub/__init__.py") == "tests/fast/rollout/rm_hub/test_rm_hub.py"


def test_test_tree_mirrors_the_package():
    modules = modules_with_logic()
    missing = [m for m in modules if not os.path.exists(os.path.join(ROOT, mirrored_test(m)))]
    mirrored = len(modules) - len(missing)
    assert 100 * mirrored >= MIN_MIRRORED_PERCENT * len(modules), (
        f"{mirrored} of the {len(modules)} modules with logic have a test at the mirrored path "
        f"(tests/fast/<path under miles>/test_<module>.py), below {MIN_MIRRORED_PERCENT}%; without one:\n"
        + "\n".join(f"  {m} -> {mirrored_test(m)}" for m in missing)
    )
