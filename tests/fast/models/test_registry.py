"""A family is one folder (ARCHITECTURE §3, §12), checked by listing and by the import statements, torch-free: every
built-in family and tiny builder lives in its lineage's package `miles/models/<lineage>/`, the top level holds only
the neutral contract and toolkit, no lineage imports another's modules, no module imports another's private name,
and `models/` imports nothing from `algorithms/` (start-up hands the families the algorithm's record)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from miles.models.builtin import TINY_FOLDERS
from miles.models.registry import BUILTIN_FAMILIES, lineage_exports

MODELS = Path(__file__).resolve().parents[3] / "miles" / "models"
# the packages of the neutral toolkit beside the contract (every lineage may import them; they import no lineage)
SHARED_PACKAGES = ("loading",)
LINEAGES = sorted(p.name for p in MODELS.iterdir() if (p / "__init__.py").is_file() and p.name not in SHARED_PACKAGES)


def module_file(module: str) -> Path:
    return MODELS.parent.parent / (module.replace(".", "/") + ".py")


def lineage_of(module: str) -> str | None:
    """The lineage of `miles.models.<lineage>` or a module in it; None for any other module."""
    parts = module.split(".")
    return parts[2] if len(parts) >= 3 and parts[:2] == ["miles", "models"] and parts[2] in LINEAGES else None


def imports_of(file: Path) -> list[ast.ImportFrom | ast.Import]:
    return [n for n in ast.walk(ast.parse(file.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))]


def imported_names(file: Path) -> list[tuple[str, str | None]]:
    """(module, name) of every import in `file`, inside functions too; name None for `import module`."""
    found: list[tuple[str, str | None]] = []
    for node in imports_of(file):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif node.level == 0 and node.module:
            found += [(node.module, alias.name) for alias in node.names]
    return found


def test_the_lineages_are_packages():
    assert {"sd3", "flux", "flux2", "qwen", "wan", "ltx2", "hunyuan_video15", "z_image"} <= set(LINEAGES)


@pytest.mark.parametrize("name", sorted(BUILTIN_FAMILIES))
def test_every_builtin_family_lives_in_a_lineage_package(name):
    module = BUILTIN_FAMILIES[name].module
    assert lineage_of(module) and module.count(".") == 3, f"family {name}: {module} is not miles.models.<lineage>.<x>"
    assert module_file(module).is_file(), module
    assert f"class {BUILTIN_FAMILIES[name].class_name}(" in module_file(module).read_text()


@pytest.mark.parametrize("name", sorted(TINY_FOLDERS))
def test_every_tiny_builder_lives_in_its_familys_lineage(name):
    folder = TINY_FOLDERS[name]
    module, function = folder.builder.split(":")
    assert lineage_of(module) == lineage_of(BUILTIN_FAMILIES[folder.family].module), (name, module)
    assert f"def {function}(" in module_file(module).read_text()


def test_the_top_level_holds_no_family_and_imports_no_lineage():
    """The flat modules and the shared packages are the neutral contract, registry and toolkit: none registers a
    family or reaches into a lineage (the registry names modules as strings, imported on use)."""
    assert all((MODELS / name / "__init__.py").is_file() for name in SHARED_PACKAGES)
    shared = [file for name in SHARED_PACKAGES for file in sorted((MODELS / name).glob("*.py"))]
    for file in [*sorted(MODELS.glob("*.py")), *shared]:
        assert "@register_train_pipeline_config" not in file.read_text(), file.name
        reached = [m for m, _ in imported_names(file) if lineage_of(m)]
        assert not reached, (file.name, reached)


def test_no_lineage_imports_another_lineage():
    offending = {
        str(file.relative_to(MODELS)): bad
        for file in sorted(MODELS.glob("*/*.py"))
        if (bad := [m for m, _ in imported_names(file) if lineage_of(m) not in (None, file.parent.name)])
    }
    assert not offending, offending


def imports_matching(rule) -> dict[str, list[str]]:
    """Per models/ file, the imports `rule(module, name)` flags, as `module` or `module.name`."""
    found = {}
    for file in sorted(MODELS.rglob("*.py")):
        if bad := [m if n is None else f"{m}.{n}" for m, n in imported_names(file) if rule(m, n)]:
            found[str(file.relative_to(MODELS))] = bad
    return found


def test_no_module_imports_another_modules_private_name():
    private = imports_matching(lambda m, n: m.startswith("miles.") and n is not None and n.startswith("_"))
    assert not private, f"private names imported across modules: {private}"


def test_models_import_nothing_from_algorithms():
    upward = imports_matching(lambda m, n: m == "miles.algorithms" or m.startswith("miles.algorithms."))
    assert not upward, f"models/ imports algorithms/ (start-up passes the algorithm's record instead): {upward}"


def test_a_lineage_package_exports_its_families_only():
    exports = lineage_exports("miles.models.flux")
    with pytest.raises(AttributeError, match="'miles.models.flux' has no attribute 'SD3PipelineConfig'"):
        exports("SD3PipelineConfig")
