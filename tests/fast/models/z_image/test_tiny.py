"""The tiny Z-Image builder (miles/models/z_image/tiny.py): a folder whose transformer takes the Qwen3 encoder's
hidden states and the VAE's latents in 2x2 patches, a tokenizer that pads to the pipeline's 512 tokens, and
resolutions the VAE and patches cannot take refused up front."""

from __future__ import annotations

import pytest

from miles.models.z_image.tiny import (
    MAX_SEQUENCE_LENGTH,
    TEXT_WIDTH,
    build_qwen3_tokenizer,
    build_tiny_z_image_pipeline,
)
from tests.fast.models.tiny_checks import check_tiny_folder


def test_the_folder_fits_its_transformer_to_its_encoder_and_latents(tiny_z_image_dir):
    configs = check_tiny_folder(tiny_z_image_dir, "ZImagePipeline", "z-image", {"resolution": 32})
    transformer = configs["transformer"]
    assert transformer["cap_feat_dim"] == configs["text_encoder"]["hidden_size"] == TEXT_WIDTH
    assert transformer["in_channels"] == configs["vae"]["latent_channels"]
    assert (
        transformer["all_patch_size"] == [2]
        and sum(transformer["axes_dims"]) == transformer["dim"] // transformer["n_heads"]
    )


def test_the_tokenizer_has_the_pipelines_length_and_keeps_think_tokens_whole():
    tokenizer = build_qwen3_tokenizer()
    assert tokenizer.model_max_length == MAX_SEQUENCE_LENGTH
    assert len(tokenizer("<think></think>", add_special_tokens=False).input_ids) == 2


def test_a_resolution_the_vae_and_patches_cannot_take_is_refused():
    with pytest.raises(ValueError, match=r"resolution 20 must be a multiple of 8 \(VAE factor 4 x 2x2 patches\)"):
        build_tiny_z_image_pipeline(resolution=20)
