"""The family registry: auto-detection, clear errors for bad folders, pickling."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from miles.models import TRAIN_PIPELINE_CONFIGS, SD3PipelineConfig, get_train_pipeline_config


def test_auto_detects_sd3_from_model_index(tiny_pipeline_dir):
    config = get_train_pipeline_config(tiny_pipeline_dir)
    assert type(config) is SD3PipelineConfig
    assert TRAIN_PIPELINE_CONFIGS["sd3"] is SD3PipelineConfig
    assert type(get_train_pipeline_config(tiny_pipeline_dir, family="sd3")) is SD3PipelineConfig


def test_missing_folder_error_names_path_and_flag(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope.*--hf-checkpoint"):
        get_train_pipeline_config(str(missing))


def test_folder_without_model_index_error_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}.*model_index.json.*--hf-checkpoint"):
        SD3PipelineConfig(str(tmp_path))


def test_unknown_pipeline_class_lists_known_families(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(ValueError, match=r"FluxPipeline.*sd3 \(StableDiffusion3Pipeline\)"):
        get_train_pipeline_config(str(tmp_path))


def test_unknown_family_name_lists_known_families(tiny_pipeline_dir):
    with pytest.raises(ValueError, match="unknown model family 'wan'.*sd3"):
        get_train_pipeline_config(tiny_pipeline_dir, family="wan")


def test_pickled_config_carries_the_path_not_loaded_models(tiny_pipeline_dir):
    config = get_train_pipeline_config(tiny_pipeline_dir)
    config._loaded["vae"] = torch.nn.Linear(1000, 1000)
    restored = pickle.loads(pickle.dumps(config))
    assert restored.path == config.path and restored._loaded == {}
    assert "vae" in config._loaded

