"""The family registry and PromptEmbeds: auto-detection, clear errors for bad folders, batch helpers."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from miles.models import TRAIN_PIPELINE_CONFIGS, PromptEmbeds, SD3PipelineConfig, get_train_pipeline_config


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


def _embeds(batch: int) -> PromptEmbeds:
    return PromptEmbeds(torch.arange(batch * 6.0).view(batch, 3, 2), torch.arange(batch * 4.0).view(batch, 4))


def test_prompt_embeds_index_cat_expand_roundtrip():
    e = _embeds(3)
    assert len(e[1]) == 1 and torch.equal(e[1].prompt_embeds, e.prompt_embeds[1:2])
    assert torch.equal(e[-1].pooled_prompt_embeds, e.pooled_prompt_embeds[2:])
    joined = PromptEmbeds.cat([e[0:2], e[2]])
    assert torch.equal(joined.prompt_embeds, e.prompt_embeds)
    assert torch.equal(joined.pooled_prompt_embeds, e.pooled_prompt_embeds)
    wide = e[1].expand(4)
    assert wide.prompt_embeds.shape == (4, 3, 2) and torch.equal(wide.prompt_embeds[3], e.prompt_embeds[1])
    rep = e.repeat_interleave(2)
    assert torch.equal(rep.pooled_prompt_embeds[2], e.pooled_prompt_embeds[1])
    half = e.to(dtype=torch.bfloat16)
    assert half.prompt_embeds.dtype == half.pooled_prompt_embeds.dtype == torch.bfloat16


def test_prompt_embeds_rejects_mismatched_batches():
    with pytest.raises(ValueError, match="batch sizes differ"):
        PromptEmbeds(torch.zeros(2, 3, 4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="expand a batch of 1"):
        _embeds(2).expand(4)
