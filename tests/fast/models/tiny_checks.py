"""What every tiny pipeline folder must be, checked by each lineage's `test_tiny.py` on its session folder
(`tiny_folders.py`): a diffusers folder of the pipeline class its family is found by (from model_index.json, without
importing a family), safetensors weights only for every model component, a few MiB, configs that do not name the
machine they were built on, and the run defaults it was built for."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles.models.builtin import builtin_family_name
from miles.models.diffusers_family import RUN_DEFAULTS_FILE


def check_tiny_folder(
    path: str, pipeline_class: str, family: str, run_defaults: dict[str, Any] | None, max_mib: float = 5
) -> dict[str, dict[str, Any]]:
    """Assert the folder's invariants; returns each model component's config.json by component name."""
    root = Path(path)
    index = json.loads((root / "model_index.json").read_text())
    assert index["_class_name"] == pipeline_class
    assert builtin_family_name(path) == family
    files = [f for f in root.rglob("*") if f.is_file()]
    assert not [f for f in files if f.suffix in (".bin", ".pt", ".pth")], "safetensors only"
    assert sum(f.stat().st_size for f in files) < max_mib * 2**20
    configs = {}
    for config in sorted(root.glob("*/config.json")):  # model components (tokenizers and schedulers have none)
        component = config.parent.name
        assert component in index and list(config.parent.glob("*.safetensors")), f"{component} has no weights"
        configs[component] = json.loads(config.read_text())
    for file in root.rglob("*.json"):
        data = json.loads(file.read_text())
        assert not (isinstance(data, dict) and "_name_or_path" in data), f"{file} names the build machine's path"
    defaults = root / RUN_DEFAULTS_FILE
    assert (json.loads(defaults.read_text()) if defaults.is_file() else None) == run_defaults
    return configs
