"""The models package's names (miles/models/__init__.py): each imported on first access from the module that
defines it (a run of one family imports no other, in a fresh interpreter), every built-in family's class among them,
and an unknown name refused as a module refuses it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import miles.models
from miles.models import BUILTIN_FAMILIES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_every_name_is_the_one_its_module_defines():
    import importlib

    from miles.models.family_registry import get_train_pipeline_config
    from miles.models.flux.flux import FluxPipelineConfig

    assert miles.models.get_train_pipeline_config is get_train_pipeline_config
    assert miles.models.FluxPipelineConfig is FluxPipelineConfig
    for entry in BUILTIN_FAMILIES.values():
        assert getattr(miles.models, entry.class_name) is getattr(
            importlib.import_module(entry.module), entry.class_name
        )


def test_the_names_are_listed_and_an_unknown_one_is_refused():
    assert miles.models.__all__[0] == "BUILTIN_FAMILIES" and miles.models.__all__[1:] == sorted(miles.models._LAZY)
    assert {"DiffusersFamily", "Conditioning", "SD3PipelineConfig"} <= set(miles.models.__all__)
    with pytest.raises(AttributeError, match="module 'miles.models' has no attribute 'NoSuchFamily'"):
        miles.models.NoSuchFamily  # noqa: B018


def test_a_run_of_one_family_imports_no_other(tiny_pipeline_dir):
    """Auto-detection and the package's names import the family asked for only (in a fresh interpreter)."""
    code = (
        "import sys\n"
        "from miles.models import get_train_pipeline_config\n"
        f"config = get_train_pipeline_config({str(tiny_pipeline_dir)!r})\n"
        "from miles.models import SD3PipelineConfig\n"
        "assert type(config) is SD3PipelineConfig\n"
        "print(sorted(m for m in ('flux', 'ltx2', 'qwen_image', 'qwen_image_edit', 'wan', 'sd3') if 'miles.models.' + m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['sd3']"
