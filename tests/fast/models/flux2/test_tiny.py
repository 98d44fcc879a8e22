"""The tiny FLUX.2 builders (miles/models/flux2/tiny.py): [klein] and [dev] folders whose transformer takes the text
encoder's stacked hidden states and the patchified latents, with the resolution and hidden states they were built
for as run defaults, and resolutions the VAE and patchify cannot take refused up front."""

from __future__ import annotations

import pytest

from miles.models.flux2.tiny import (
    LATENT_CHANNELS,
    TEXT_ENCODER_OUT_LAYERS,
    TEXT_WIDTH,
    build_tiny_flux2_dev_pipeline,
    check_resolution,
)
from tests.fast.models.tiny_checks import check_tiny_folder

DEFAULTS = {"resolution": 64, "text_encoder_out_layers": list(TEXT_ENCODER_OUT_LAYERS)}


@pytest.mark.parametrize(
    ("fixture", "pipeline_class", "family"),
    [("tiny_flux2_klein_dir", "Flux2KleinPipeline", "flux2"), ("tiny_flux2_dev_dir", "Flux2Pipeline", "flux2-dev")],
)
def test_each_variant_is_a_flux2_folder_whose_transformer_fits_its_encoder(request, fixture, pipeline_class, family):
    configs = check_tiny_folder(request.getfixturevalue(fixture), pipeline_class, family, DEFAULTS)
    transformer = configs["transformer"]
    assert transformer["joint_attention_dim"] == TEXT_WIDTH * len(TEXT_ENCODER_OUT_LAYERS)  # three layers stacked
    assert transformer["in_channels"] == 4 * LATENT_CHANNELS == 4 * configs["vae"]["latent_channels"]  # 2x2 patches
    assert sum(transformer["axes_dims_rope"]) == transformer["attention_head_dim"]
    if family == "flux2":
        assert configs["text_encoder"]["hidden_size"] == TEXT_WIDTH
        assert configs["text_encoder"]["num_hidden_layers"] >= max(TEXT_ENCODER_OUT_LAYERS)


@pytest.mark.parametrize("resolution", [16, 64, 128])
def test_resolutions_of_whole_patches_are_taken(resolution):
    check_resolution(resolution)


def test_a_resolution_the_vae_and_patchify_cannot_take_is_refused_before_building():
    with pytest.raises(ValueError, match=r"resolution 36 must be a multiple of 8 \(VAE factor x patchify\)"):
        build_tiny_flux2_dev_pipeline(resolution=36)
