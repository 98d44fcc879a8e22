"""The built-in model families by name, as a run knows them before importing one (torch-free): each family's module
and class, the pipeline class it handles and whether it makes video. A new built-in family is one line here, its
module in its lineage's package (`miles/models/<lineage>/`: families, lineage base, sequence-parallel file, tiny
builder)."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any, NamedTuple


class BuiltinFamily(NamedTuple):
    module: str
    pipeline_class_name: str  # the model_index.json "_class_name" it handles
    class_name: str  # its TrainPipelineConfig subclass in `module` (exported lazily by `miles.models`)
    video: bool = False  # its latents have frames: the image-only defaults (the shapes eval) are off for it
    source_images: bool = False  # it conditions on source images (editing, image-to-video): prompt records name them


# A module is imported when a run asks for its family, by name or through a folder's pipeline class, so a process
# that runs one family does not import the others' diffusers pipelines and transformers models.
# tests/fast/models/test_base.py checks this table against the classes.
BUILTIN_FAMILIES: dict[str, BuiltinFamily] = {
    "flux": BuiltinFamily("miles.models.flux.flux", "FluxPipeline", "FluxPipelineConfig"),
    "flux2": BuiltinFamily(
        "miles.models.flux2.flux2", "Flux2KleinPipeline", "Flux2KleinPipelineConfig", source_images=True
    ),
    "flux2-dev": BuiltinFamily(
        "miles.models.flux2.flux2", "Flux2Pipeline", "Flux2DevPipelineConfig", source_images=True
    ),
    "flux-kontext": BuiltinFamily(
        "miles.models.flux.flux_kontext", "FluxKontextPipeline", "FluxKontextPipelineConfig", source_images=True
    ),
    "hunyuan-video15": BuiltinFamily(
        "miles.models.hunyuan_video15.hunyuan_video15",
        "HunyuanVideo15Pipeline",
        "HunyuanVideo15PipelineConfig",
        video=True,
    ),
    "ltx2": BuiltinFamily("miles.models.ltx2.ltx2", "LTX2Pipeline", "LTX2PipelineConfig", video=True),
    "qwen-image": BuiltinFamily("miles.models.qwen.qwen_image", "QwenImagePipeline", "QwenImagePipelineConfig"),
    "qwen-image-edit": BuiltinFamily(
        "miles.models.qwen.qwen_image_edit", "QwenImageEditPipeline", "QwenImageEditPipelineConfig", source_images=True
    ),
    "qwen-image-edit-plus": BuiltinFamily(
        "miles.models.qwen.qwen_image_edit",
        "QwenImageEditPlusPipeline",
        "QwenImageEditPlusPipelineConfig",
        source_images=True,
    ),
    "sd3": BuiltinFamily("miles.models.sd3.sd3", "StableDiffusion3Pipeline", "SD3PipelineConfig"),
    "wan": BuiltinFamily("miles.models.wan.wan", "WanPipeline", "WanPipelineConfig", video=True),
    "wan-i2v": BuiltinFamily(
        "miles.models.wan.wan_i2v", "WanImageToVideoPipeline", "WanI2VPipelineConfig", video=True, source_images=True
    ),
    "z-image": BuiltinFamily("miles.models.z_image.z_image", "ZImagePipeline", "ZImagePipelineConfig"),
}


def source_image_families() -> list[str]:
    """The built-in families that condition on source images, by name."""
    return [name for name, entry in BUILTIN_FAMILIES.items() if entry.source_images]


def builtin_family_of_pipeline(class_name: str | None) -> str | None:
    """The built-in family that handles the pipeline class `class_name`, or None."""
    return next((name for name, entry in BUILTIN_FAMILIES.items() if entry.pipeline_class_name == class_name), None)


def lineage_exports(package: str) -> Callable[[str], Any]:
    """A lineage package's module `__getattr__`: its families' classes, each imported on first access, so that
    `from miles.models.sd3.sd3 import SD3PipelineConfig` imports the SD3 family only (and `miles.models.sd3.sd3.tiny`
    imports no family)."""
    classes = {entry.class_name: entry.module for entry in BUILTIN_FAMILIES.values()}
    own = {name: module for name, module in classes.items() if module.startswith(package + ".")}

    def __getattr__(name: str) -> Any:
        if name in own:
            return getattr(import_module(own[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
