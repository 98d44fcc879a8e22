"""What the Qwen-Image folders' family base adds to the contract suite: the VAE round trip runs on one frame with
Qwen's per-channel normalization."""

from __future__ import annotations

import pytest
import torch

from miles.models import get_train_pipeline_config


@pytest.fixture(scope="module")
def family(tiny_qwen_image_dir):
    return get_train_pipeline_config(tiny_qwen_image_dir)


def test_vae_round_trip_uses_one_frame_and_per_channel_normalization(family):
    coarse = torch.rand(2, 3, 4, 4, generator=torch.Generator().manual_seed(1)) * 2 - 1
    images = torch.nn.functional.interpolate(coarse, size=(32, 32), mode="bilinear")
    latents = family.encode_images(images)
    assert latents.shape == (2, *family.latent_shape(32)) and latents.dtype == torch.float32
    vae = family.load_vae()
    z = vae.encode(images.unsqueeze(2)).latent_dist.mode()[:, :, 0]
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1)
    torch.testing.assert_close(latents, (z - mean) / std, atol=1e-5, rtol=1e-5)
    decoded = family.decode_latents(latents).images
    with torch.no_grad():
        expected = vae.decode((latents * std + mean).unsqueeze(2)).sample[:, :, 0] / 2 + 0.5
    assert decoded.shape == images.shape and 0 <= decoded.min() and decoded.max() <= 1
    torch.testing.assert_close(decoded, expected.clamp(0, 1), atol=1e-5, rtol=1e-5)


def test_vae_tiling_on_decodes_in_spatial_tiles_and_off_is_the_default(tiny_qwen_image_dir, tiny_ltx2_dir):
    """--vae-tiling reaches the VAE of every family that declares it (Qwen-Image's folder base and LTX-2's own
    loader), off by default: untiled samples stay the pipeline's."""
    for folder in (tiny_qwen_image_dir, tiny_ltx2_dir):
        assert not get_train_pipeline_config(folder).load_vae().use_tiling
        assert get_train_pipeline_config(folder, vae_tiling="on").load_vae().use_tiling
