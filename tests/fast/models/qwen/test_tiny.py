"""The tiny Qwen-Image builder (miles/models/qwen/tiny.py): a folder whose transformer takes the text encoder's
hidden states and the 2x2-packed latents of its VAE, and resolutions the VAE and packing cannot take refused up
front."""

from __future__ import annotations

import pytest

from miles.models.qwen.tiny import LATENT_CHANNELS, TEXT_WIDTH, build_tiny_qwen_image_pipeline
from tests.fast.models.tiny_checks import check_tiny_folder


def test_the_folder_fits_its_transformer_to_its_encoder_and_latents(tiny_qwen_image_dir):
    configs = check_tiny_folder(tiny_qwen_image_dir, "QwenImagePipeline", "qwen-image", {"resolution": 32})
    transformer = configs["transformer"]
    assert transformer["joint_attention_dim"] == TEXT_WIDTH
    assert transformer["in_channels"] == 4 * LATENT_CHANNELS == 4 * configs["vae"]["z_dim"]  # 2x2 packed
    assert transformer["out_channels"] == LATENT_CHANNELS
    assert sum(transformer["axes_dims_rope"]) == transformer["attention_head_dim"]


def test_a_resolution_the_vae_and_packing_cannot_take_is_refused():
    with pytest.raises(ValueError, match=r"resolution 12 must be a multiple of 8 \(VAE factor x packing\)"):
        build_tiny_qwen_image_pipeline(resolution=12)
