"""The family contract's base: no family imports another's modules or private names, and a pickled family carries its
path, not its loaded models (the registry's tests: test_family_registry.py; the folders' checks:
loading/test_pretrained.py; a run of one family importing no other: test_models.py)."""

from __future__ import annotations

import ast
import os
import pickle
from pathlib import Path

import torch

from miles.models import (
    BUILTIN_FAMILIES,
    get_train_pipeline_config,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_no_family_imports_another_family_or_its_private_names():
    """Families share the neutral base (DiffusersFamily, packing), never a sibling's module (ARCHITECTURE §12)."""
    modules = {entry.module for entry in BUILTIN_FAMILIES.values()}
    for module in modules:
        tree = ast.parse(Path(ROOT, *module.split(".")).with_suffix(".py").read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not imported & (modules - {module}), (module, imported & modules)
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("miles")
                 for a in n.names]  # fmt: skip
        assert not [name for name in names if name.startswith("_")], (module, names)


def test_pickled_config_carries_the_path_not_loaded_models(tiny_pipeline_dir):
    config = get_train_pipeline_config(tiny_pipeline_dir)
    config._loaded["vae"] = torch.nn.Linear(1000, 1000)
    restored = pickle.loads(pickle.dumps(config))
    assert restored.path == config.path and restored._loaded == {}
    assert "vae" in config._loaded
