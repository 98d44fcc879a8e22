"""Model families (ARCHITECTURE §3): importing this package registers the built-in ones."""

from miles.models import flux, ltx2, qwen_image, sd3, wan  # noqa: F401  (fill TRAIN_PIPELINE_CONFIGS)
from miles.models.base import (
    TRAIN_PIPELINE_CONFIGS,
    TrainPipelineConfig,
    family_options,
    get_train_pipeline_config,
    register_train_pipeline_config,
)
from miles.models.conditioning import Conditioning
from miles.models.flux import FluxPipelineConfig
from miles.models.ltx2 import LTX2PipelineConfig
from miles.models.media import Media
from miles.models.qwen_image import QwenImagePipelineConfig
from miles.models.sd3 import SD3PipelineConfig
from miles.models.wan import WanExperts, WanPipelineConfig

__all__ = [
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
    "family_options",
    "get_train_pipeline_config",
    "register_train_pipeline_config",
]
