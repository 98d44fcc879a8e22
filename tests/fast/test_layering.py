"""Dependencies point one way (ARCHITECTURE §3), read from the import statements of every module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "miles"

FORBIDDEN = {
    "utils": ("miles.rollout", "miles.ray", "miles.backends", "miles.models", "miles.plan"),
    "diffusion": ("miles.rollout", "miles.ray", "miles.backends"),
    "models": ("miles.rollout", "miles.ray", "miles.backends", "miles.plan"),
    "plan": ("miles.ray",),  # the planner runs the trainer and the engine in one process, without Ray
}


def imported_modules(file: Path) -> list[str]:
    """Every module an import statement in `file` names, including imports inside functions."""
    names = []
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def forbidden(package: str, module: str) -> bool:
    return module.startswith(FORBIDDEN[package])


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_nothing_from_the_layers_above(package):
    offending = {
        str(file.relative_to(PACKAGE.parent)): bad
        for file in sorted((PACKAGE / package).rglob("*.py"))
        if (bad := [m for m in imported_modules(file) if forbidden(package, m)])
    }
    assert not offending, offending


def test_the_check_sees_imports_inside_functions(tmp_path):
    file = tmp_path / "m.py"
    file.write_text("def f():\n    from miles.rollout.rm_hub import x\n")
    assert imported_modules(file) == ["miles.rollout.rm_hub"]


def test_only_the_ray_layer_creates_actors():
    creators = {
        str(file.relative_to(PACKAGE.parent))
        for file in PACKAGE.rglob("*.py")
        if "ray.remote(" in file.read_text() and file.parent.name != "ray"
    }
    assert not creators, f"Ray actors are created outside miles/ray/: {sorted(creators)}"


def test_the_rollout_engines_stay_whole_under_sequence_parallelism():
    """--sp-size is the trainer's: the engines, the rollout side and the group that starts the engines never read it,
    so an engine always runs a whole sample (docs/user-guide/video.md)."""
    engine_side = [*(PACKAGE / "rollout").rglob("*.py"), PACKAGE / "ray" / "engine_group.py"]
    assert PACKAGE / "rollout" / "engine.py" in engine_side
    readers = sorted(str(f.relative_to(PACKAGE.parent)) for f in engine_side if "sp_size" in f.read_text())
    assert not readers, f"the engine side reads --sp-size: {readers}"


# The arguments floor (ARCHITECTURE §3): utils/ is the ground and imports nothing else of miles/; miles/arguments/ sits
# above algorithms/ and models/ (whose declarations it assembles) and below every reader of the parsed flags, so
# nothing under it imports it and it imports none of the floors above it (weight_sync's flags, a leaf, aside).
UNDER_THE_ARGUMENTS = ("utils", "algorithms", "models", "diffusion", "data")
ABOVE_THE_ARGUMENTS = (
    "miles.ray",
    "miles.rollout",
    "miles.backends",
    "miles.plan",
    "miles.startup",
    "miles.weight_sync",
)


def floor_offenders(package: str, bad) -> dict[str, list[str]]:
    return {
        str(file.relative_to(PACKAGE.parent)): found
        for file in sorted((PACKAGE / package).rglob("*.py"))
        if (found := [m for m in imported_modules(file) if bad(m)])
    }


def test_utils_imports_nothing_else_of_miles():
    assert not floor_offenders("utils", lambda m: m.startswith("miles.") and not m.startswith("miles.utils"))


@pytest.mark.parametrize("package", UNDER_THE_ARGUMENTS)
def test_the_floors_under_the_parser_never_import_it(package):
    assert not floor_offenders(package, lambda m: m == "miles.arguments" or m.startswith("miles.arguments."))


def test_the_arguments_floor_imports_nothing_above_it():
    above = lambda m: m.startswith(ABOVE_THE_ARGUMENTS) and m != "miles.weight_sync.arguments"  # noqa: E731
    assert not floor_offenders("arguments", above)
