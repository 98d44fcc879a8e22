"""The tiny FLUX.1 builder (miles/models/flux/tiny.py): dev-, schnell- and Kontext-style folders whose transformer
fits the text encoders and the packed latents, and resolutions the VAE and packing cannot take refused up front."""

from __future__ import annotations

import pytest

from miles.models.flux.tiny import build_tiny_flux_pipeline
from miles.models.tiny import LATENT_CHANNELS
from tests.fast.models.tiny_checks import check_tiny_folder


@pytest.mark.parametrize(
    ("fixture", "pipeline_class", "family", "guidance_embeds"),
    [
        ("tiny_flux_dev_dir", "FluxPipeline", "flux", True),
        ("tiny_flux_schnell_dir", "FluxPipeline", "flux", False),
        ("tiny_flux_kontext_dir", "FluxKontextPipeline", "flux-kontext", True),
    ],
)
def test_each_style_is_a_flux_folder_whose_transformer_fits_its_encoders(
    request, fixture, pipeline_class, family, guidance_embeds
):
    configs = check_tiny_folder(request.getfixturevalue(fixture), pipeline_class, family, run_defaults=None)
    transformer = configs["transformer"]
    assert transformer["guidance_embeds"] is guidance_embeds
    assert transformer["in_channels"] == 4 * LATENT_CHANNELS == 4 * configs["vae"]["latent_channels"]  # 2x2 packed
    assert sum(transformer["axes_dims_rope"]) == transformer["attention_head_dim"]
    assert transformer["joint_attention_dim"] == configs["text_encoder_2"]["d_model"]  # T5's tokens
    assert transformer["pooled_projection_dim"] == configs["text_encoder"]["hidden_size"]  # CLIP's pooled vector


def test_a_resolution_the_vae_and_packing_cannot_take_is_refused():
    with pytest.raises(ValueError, match="resolution 20 must be a multiple of 8 \\(VAE factor x packing\\)"):
        build_tiny_flux_pipeline(resolution=20)
