"""Model families (ARCHITECTURE §3, §12). Every name here is imported on first access, so the torch-free modules
(`registry`, `options`, `builtin`) load without diffusers, and `from miles.models import FluxPipelineConfig`
imports the FLUX family only."""

from importlib import import_module
from typing import Any

from miles.models.registry import BUILTIN_FAMILIES

_LAZY = {  # exported name -> the module that defines it; the built-in family classes come from BUILTIN_FAMILIES
    "TRAIN_PIPELINE_CONFIGS": "miles.models.family_registry",
    "TrainPipelineConfig": "miles.models.base",
    "all_family_classes": "miles.models.family_registry",
    "family_class": "miles.models.family_registry",
    "get_train_pipeline_config": "miles.models.family_registry",
    "register_train_pipeline_config": "miles.models.family_registry",
    "family_options": "miles.models.options",
    "FamilyOption": "miles.models.options",
    "add_family_arguments": "miles.models.options",
    "Conditioning": "miles.models.conditioning",
    "Media": "miles.models.media",
    "DiffusersFamily": "miles.models.diffusers_family",
    "WanExperts": "miles.models.wan.experts",
    **{entry.class_name: entry.module for entry in BUILTIN_FAMILIES.values()},
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'miles.models' has no attribute {name!r}")


__all__ = ["BUILTIN_FAMILIES", *sorted(_LAZY)]
