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
# the torch-free declarations of the families (their option flags, names, built-in folders) that the parser reads
ALLOWED = {"utils": ("miles.models.options", "miles.models.registry", "miles.models.builtin")}


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
    return module.startswith(FORBIDDEN[package]) and module not in ALLOWED.get(package, ())


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
