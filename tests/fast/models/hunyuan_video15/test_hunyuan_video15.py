"""What the hunyuan-video15 family refuses at start-up, naming why (its parity is the family contract suite's)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from miles.algorithms import ALGORITHMS
from miles.models import get_train_pipeline_config

POLICY = ALGORITHMS["policy_loss"]


def test_lora_save_hf_and_a_scale_below_one_are_refused(tiny_hunyuan_video15_dir):
    family = get_train_pipeline_config(tiny_hunyuan_video15_dir)
    family.check_run_args(argparse.Namespace(use_lora=True, save_hf=None, diffusion_guidance_scale=3.5), POLICY)
    with pytest.raises(ValueError, match="--use-lora with --save-hf: .*HunyuanVideo15Pipeline has no LoRA loader"):
        family.check_run_args(argparse.Namespace(use_lora=True, save_hf="/out", diffusion_guidance_scale=1.0), POLICY)
    with pytest.raises(ValueError, match="--diffusion-guidance-scale 0.5: .*guider runs CFG at any scale but 1"):
        family.check_run_args(argparse.Namespace(use_lora=False, save_hf=None, diffusion_guidance_scale=0.5), POLICY)


def test_a_guider_whose_maths_miles_does_not_run_is_refused(tiny_hunyuan_video15_dir, tmp_path):
    folder = Path(shutil.copytree(tiny_hunyuan_video15_dir, tmp_path / "pipeline"))
    config = folder / "guider" / "guider_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "guidance_rescale": 0.7}))
    with pytest.raises(ValueError, match="guider_config.json sets {'guidance_rescale': 0.7}"):
        get_train_pipeline_config(str(folder))


def test_num_frames_must_fit_the_vae_temporal_factor(tiny_hunyuan_video15_dir):
    with pytest.raises(ValueError, match="--num-frames 6: .*e.g. 5 or 9"):
        get_train_pipeline_config(tiny_hunyuan_video15_dir, num_frames=6)


def test_vae_tiling_on_decodes_in_spatial_tiles_and_off_is_the_default(tiny_hunyuan_video15_dir):
    assert not get_train_pipeline_config(tiny_hunyuan_video15_dir).load_vae().use_tiling
    family = get_train_pipeline_config(tiny_hunyuan_video15_dir, vae_tiling="on")
    assert family.load_vae().use_tiling
