"""LTX-2's two token streams (miles/models/ltx2/streams.py) against LTX2Pipeline's own code: the packed video and
audio token layouts and their inverses, guidance rescale, one stream's guided velocity in the pipeline's order of
operations, and the video VAE's compression read from its config as the VAE computes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import LTX2Pipeline
from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

from miles.models.ltx2.streams import (
    LTX2_GUIDANCE_RESCALE,
    guided_stream_velocity,
    pack_audio,
    pack_video,
    rescale_guided,
    unpack_audio,
    unpack_video,
    vae_factors,
)


@pytest.mark.parametrize(("patch", "patch_t"), [(1, 1), (2, 1), (2, 2)])
def test_video_tokens_are_the_pipelines_packing_and_unpack_back(patch, patch_t):
    video = torch.randn(2, 3, 4, 6, 8)  # (B, C, F, H, W)
    tokens = pack_video(video, patch, patch_t)
    assert torch.equal(tokens, LTX2Pipeline._pack_latents(video, patch, patch_t))
    assert tokens.shape == (2, 4 // patch_t * 6 // patch * 8 // patch, 3 * patch * patch * patch_t)
    assert torch.equal(unpack_video(tokens, (3, 4, 6, 8), patch, patch_t), video)


def test_audio_tokens_are_the_pipelines_packing_and_unpack_back():
    audio = torch.randn(2, 3, 5, 4)  # (B, C, L, M)
    tokens = pack_audio(audio)
    assert tokens.shape == (2, 5, 12) and torch.equal(tokens, LTX2Pipeline._pack_audio_latents(audio))
    assert torch.equal(unpack_audio(tokens, 4), audio)


def test_guidance_rescale_is_the_pipelines_per_sample():
    guided, conditional = torch.randn(3, 4, 5) * 3, torch.randn(3, 4, 5)
    for rescale in (0.0, LTX2_GUIDANCE_RESCALE, 1.0):
        expected = rescale_noise_cfg(guided, conditional, guidance_rescale=rescale)
        torch.testing.assert_close(rescale_guided(guided, conditional, rescale), expected)
    full = rescale_guided(guided, conditional, 1.0)
    torch.testing.assert_close(full.std(dim=(1, 2)), conditional.std(dim=(1, 2)))


def test_a_streams_velocity_guides_in_x0_space_then_rescales():
    sample, sigma = torch.randn(2, 6, 4), torch.tensor(0.6)
    cond = torch.randn(2, 6, 4)
    # without CFG the rescale compares x0 with itself: the prediction comes back unchanged
    torch.testing.assert_close(guided_stream_velocity(sample, cond, sigma, 4.0, cfg=False), cond)
    uncond = torch.randn(2, 6, 4)
    x0_cond, x0_uncond = sample - cond * sigma, sample - uncond * sigma
    guided = x0_cond + 3.0 * (x0_cond - x0_uncond)
    x0 = rescale_noise_cfg(guided, x0_cond, guidance_rescale=LTX2_GUIDANCE_RESCALE)
    velocity = guided_stream_velocity(sample, torch.cat([uncond, cond]), sigma, 4.0, cfg=True)
    torch.testing.assert_close(velocity, (sample - x0) / sigma)
    assert not torch.allclose(velocity, cond)


def test_vae_compression_is_read_from_its_config_as_the_vae_computes_it(tiny_ltx2_dir):
    config = json.loads((Path(tiny_ltx2_dir) / "vae" / "config.json").read_text())
    assert vae_factors(config) == (16, 8)  # the tiny VAE: 32 px -> 2 x 2 latents, 121 frames -> 16 latent frames
    assert vae_factors({}) == (64, 16)  # diffusers' default LTX-2 VAE: patch 4 x 2^4, 1 x 2^4
    one_flag = {"spatio_temporal_scaling": True, "layers_per_block": (1, 1, 1), "patch_size": 2, "patch_size_t": 1}
    assert vae_factors(one_flag) == (8, 4)
    assert vae_factors({"spatial_compression_ratio": 32, "temporal_compression_ratio": 8}) == (32, 8)
