"""Dependencies point one way (ARCHITECTURE §3), read from the import statements of every module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "miles"

FORBIDDEN = {
    "utils": ("miles.rollout", "miles.ray", "miles.backends", "miles.models", "miles.plan"),
    # an algorithm's declaration stands on utils/ alone (ARCHITECTURE §3): every other floor of miles is above it
    "algorithms": tuple(
        f"miles.{floor}"
        for floor in ("rollout", "ray", "backends", "models", "plan", "diffusion", "data", "weight_sync", "startup")
    ),
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


# ---- algorithms share through neutral rooms, never through a sibling's module (ARCHITECTURE §3, §12) ---------------
# Each floor an algorithm spans, with the modules on it that belong to no one algorithm. Every other module there is
# an algorithm's: on algorithms/, loss_hub/ and rollout_hub/ it is named like the algorithm's declaration file
# (algorithms/<name>.py), in diffusion/ it is listed in DIFFUSION_MATHS.
FLOORS = {
    "miles.algorithms": ("__init__", "base", "registry", "roles"),
    "miles.backends.fsdp_utils.loss_hub": ("__init__", "types", "noise", "policy", "reward_grad"),
    "miles.rollout.rollout_hub": ("__init__", "spec", "pairs", "dataset"),
    "miles.diffusion": ("__init__", "schedule", "sde", "dpm_solver", "policy", "shadow", "reward_grad"),
}
DIFFUSION_MATHS = {"awm": "awm", "dmd": "dmd2", "dpo": "dpo", "dppo": "flow_dppo", "guard": "grpo_guard", "nft": "nft"}


def floor_dir(floor: str) -> Path:
    return PACKAGE.parent.joinpath(*floor.split("."))


def algorithm_names() -> set[str]:
    return {f.stem for f in floor_dir("miles.algorithms").glob("*.py")} - set(FLOORS["miles.algorithms"])


def owner(module: str) -> str | None:
    """The algorithm whose module `module` is, or None for a neutral one (or one outside the four floors)."""
    floor, _, stem = module.rpartition(".")
    if floor not in FLOORS or stem in FLOORS[floor]:
        return None
    return DIFFUSION_MATHS.get(stem, stem) if floor == "miles.diffusion" else stem


def named_modules(file: Path) -> list[str]:
    """`imported_modules`, plus `pkg.name` for each `from pkg import name` where that name is a module file."""
    names = imported_modules(file)
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            package = floor_dir(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names if (package / f"{a.name}.py").is_file()]
    return names


def cross_algorithm_imports() -> list[str]:
    found = []
    for floor in FLOORS:
        for file in sorted(floor_dir(floor).glob("*.py")):
            mine = owner(f"{floor}.{file.stem}")
            if mine is None:
                continue
            theirs = sorted({m for m in named_modules(file) if owner(m) not in (None, mine)})
            found += [f"{file.relative_to(PACKAGE.parent)} -> {m}" for m in theirs]
    return found


def test_every_module_on_an_algorithm_floor_is_neutral_or_an_algorithms():
    names = algorithm_names()
    unplaced = [
        f"{floor}.{file.stem}"
        for floor in FLOORS
        for file in floor_dir(floor).glob("*.py")
        if (who := owner(f"{floor}.{file.stem}")) is not None and who not in names
    ]
    assert not unplaced, f"name them after an algorithm (algorithms/<name>.py) or list them as neutral: {unplaced}"


def test_no_algorithm_module_imports_another_algorithms_module():
    """What several algorithms use lives in a neutral module (loss_hub/noise.py, loss_hub/policy.py,
    rollout/requests.py, rollout_hub/pairs.py, rollout_hub/dataset.py, algorithms/base.py, diffusion/policy.py,
    diffusion/shadow.py), so that adding an algorithm never means learning which sibling it borrows from."""
    assert cross_algorithm_imports() == []


def test_the_cross_algorithm_check_sees_from_package_imports(tmp_path, monkeypatch):
    hub = tmp_path / "miles" / "rollout" / "rollout_hub"
    hub.mkdir(parents=True)
    (hub / "nft.py").write_text("from miles.rollout.rollout_hub import pairs\n")
    (hub / "awm.py").write_text("def f():\n    from miles.rollout.rollout_hub import nft, pairs\n")
    (hub / "dpo.py").write_text("from miles.algorithms.dpo import read\nfrom miles.diffusion.guard import x\n")
    (hub / "sft.py").write_text("from miles.rollout.rollout_hub import ROLLOUT_SPECS\n")  # a name, not a module
    monkeypatch.setitem(globals(), "PACKAGE", tmp_path / "miles")
    assert cross_algorithm_imports() == [
        "miles/rollout/rollout_hub/awm.py -> miles.rollout.rollout_hub.nft",
        "miles/rollout/rollout_hub/dpo.py -> miles.diffusion.guard",
    ]


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
