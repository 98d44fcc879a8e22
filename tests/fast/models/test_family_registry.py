"""The family registry: auto-detection from the folder's pipeline class, the built-in table against the classes,
which families make video, and unknown classes or names answered with the known families."""

from __future__ import annotations

import json
from importlib import import_module

import pytest

from miles.models import (
    BUILTIN_FAMILIES,
    TRAIN_PIPELINE_CONFIGS,
    SD3PipelineConfig,
    all_family_classes,
    get_train_pipeline_config,
)
from miles.models.diffusers_family import DiffusersFamily


def test_auto_detects_sd3_from_model_index(tiny_pipeline_dir):
    config = get_train_pipeline_config(tiny_pipeline_dir)
    assert type(config) is SD3PipelineConfig
    assert TRAIN_PIPELINE_CONFIGS["sd3"] is SD3PipelineConfig
    assert type(get_train_pipeline_config(tiny_pipeline_dir, family="sd3")) is SD3PipelineConfig


def test_the_built_in_table_matches_the_family_classes():
    families = all_family_classes()
    for name, entry in BUILTIN_FAMILIES.items():
        cls = families[name]
        assert (cls.name, cls.pipeline_class_name, cls.__module__) == (name, entry.pipeline_class_name, entry.module)
        assert cls.__name__ == entry.class_name and issubclass(cls, DiffusersFamily)
        assert entry.source_images == (cls.source_image_range[1] > 0), name  # what the data checks name
        assert getattr(import_module("miles.models"), cls.__name__) is cls  # the package's lazy export


def test_the_registry_says_which_families_make_video(family_case):
    """`video` in BUILTIN_FAMILIES (read before any family is imported) against each case's latent rank."""
    case, path = family_case
    family = get_train_pipeline_config(path, **case.family_options)
    assert BUILTIN_FAMILIES[case.family].video == (len(family.latent_shape(case.resolution)) != 3)


def test_unknown_pipeline_class_lists_known_families(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "CogVideoXPipeline"}))
    with pytest.raises(
        ValueError,
        match=r"CogVideoXPipeline.*flux \(FluxPipeline\), flux-kontext \(FluxKontextPipeline\), flux2 \(Flux2KleinPipeline\), flux2-dev \(Flux2Pipeline\), hunyuan-video15 \(HunyuanVideo15Pipeline\), ltx2 \(LTX2Pipeline\), "
        r"qwen-image \(QwenImagePipeline\), qwen-image-edit \(QwenImageEditPipeline\), "
        r"qwen-image-edit-plus \(QwenImageEditPlusPipeline\), sd3 \(StableDiffusion3Pipeline\), "
        r"wan \(WanPipeline\), wan-i2v \(WanImageToVideoPipeline\), z-image \(ZImagePipeline\)",
    ):
        get_train_pipeline_config(str(tmp_path))


def test_unknown_family_name_lists_known_families(tiny_pipeline_dir):
    with pytest.raises(ValueError, match="unknown model family 'cogvideox'.*sd3.*wan"):
        get_train_pipeline_config(tiny_pipeline_dir, family="cogvideox")
