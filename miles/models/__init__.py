"""Model families (ARCHITECTURE §3). A built-in family's module is imported when a run first asks for it
(`miles.models.base.BUILTIN_FAMILIES`), and so are the family classes named below: `from miles.models import
FluxPipelineConfig` imports the FLUX family only."""

from importlib import import_module
from typing import Any

from miles.models.base import (
    BUILTIN_FAMILIES,
    TRAIN_PIPELINE_CONFIGS,
    TrainPipelineConfig,
    all_family_classes,
    family_class,
    family_options,
    get_train_pipeline_config,
    register_train_pipeline_config,
)
from miles.models.conditioning import Conditioning
from miles.models.media import Media

_LAZY = {  # exported name -> the module that defines it (imported on first access)
    "FluxPipelineConfig": "miles.models.flux",
    "LTX2PipelineConfig": "miles.models.ltx2",
    "QwenImagePipelineConfig": "miles.models.qwen_image",
    "SD3PipelineConfig": "miles.models.sd3",
    "WanExperts": "miles.models.wan_experts",
    "WanPipelineConfig": "miles.models.wan",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'miles.models' has no attribute {name!r}")


__all__ = [
    "BUILTIN_FAMILIES",
    "TRAIN_PIPELINE_CONFIGS",
    "Conditioning",
    "FluxPipelineConfig",
    "LTX2PipelineConfig",
    "Media",
    "QwenImagePipelineConfig",
    "SD3PipelineConfig",
    "TrainPipelineConfig",
    "WanExperts",
    "WanPipelineConfig",
    "all_family_classes",
    "family_class",
    "family_options",
    "get_train_pipeline_config",
    "register_train_pipeline_config",
]
