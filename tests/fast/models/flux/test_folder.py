"""What every FLUX.1 folder shares (miles/models/flux/folder.py), on the tiny dev (guidance-embedding) and schnell
(true CFG) folders: the blocks FSDP shards, the T5 length, the geometry of unpacked latents, the resolution-dependent
shift as the pipelines compute it, and the guided velocity: the embedded guidance, or uncond + w (cond - uncond) in
one batched forward, which needs a negative."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from miles.models.conditioning import Conditioning
from miles.models.flux.flux import FluxPipelineConfig
from miles.models.packing import pack_latents, packed_position_ids


@pytest.fixture(scope="module")
def schnell(tiny_flux_schnell_dir):
    family = FluxPipelineConfig(tiny_flux_schnell_dir)
    return family, family.load_transformer().eval()


def text(batch: int, value: float) -> Conditioning:
    return Conditioning(
        {"prompt_embeds": torch.full((batch, 5, 64), value), "pooled_prompt_embeds": torch.ones(batch, 32)}
    )


def test_the_folders_guidance_blocks_text_length_and_geometry(tiny_flux_dev_dir, schnell):
    dev, (flux, transformer) = FluxPipelineConfig(tiny_flux_dev_dir), schnell
    assert dev.guidance_embeds and not flux.guidance_embeds
    assert len(flux.transformer_blocks(transformer)) == 2  # one double-stream, one single-stream block
    assert flux.max_sequence_length == 32  # the tiny T5 tokenizer's limit, under the pipelines' 512
    assert (flux.vae_scale_factor, flux.patch_size, flux.default_resolution) == (4, 2, 32)
    assert flux.latent_shape() == (4, 8, 8) and flux.latent_shape(64) == (4, 16, 16)
    with pytest.raises(ValueError, match=r"resolution 36 must be a multiple of 8 \(VAE factor x patch size\)"):
        flux.latent_shape(36)


def test_the_shift_follows_the_generated_images_packed_tokens(schnell):
    flux, _ = schnell
    assert flux.mu(64) == calculate_shift(8 * 8, 256, 4096, 0.5, 1.15)  # 16 x 16 latents: 64 packed tokens
    assert flux.mu(64) > flux.mu(32) and flux.scheduler_shift == 1.0  # dynamic shifting: an unshifted table
    assert flux.sampling_shift(32) == pytest.approx(math.exp(flux.mu(32)))
    sigmas = flux.sampling_sigmas(2, 32)
    s = flux.sampling_shift(32)
    torch.testing.assert_close(sigmas, torch.tensor([1.0, s * 0.5 / (1 + (s - 1) * 0.5), 0.0]))


def test_true_cfg_is_uncond_plus_w_times_the_difference_and_needs_a_negative(schnell):
    flux, transformer = schnell
    hidden, ids = pack_latents(torch.randn(2, 4, 4, 4)), packed_position_ids(2, 2, "cpu", torch.float32)
    sigmas = torch.tensor([0.3, 0.9])
    with torch.no_grad():
        cond = flux.guided_velocity(transformer, hidden, ids, sigmas, text(2, 0.5), guidance_scale=1.0, negative=None)
        uncond = flux.guided_velocity(
            transformer, hidden, ids, sigmas, text(2, -1.0), guidance_scale=1.0, negative=None
        )
        guided = flux.guided_velocity(
            transformer, hidden, ids, sigmas, text(2, 0.5), guidance_scale=3.0, negative=text(1, -1.0)
        )
    torch.testing.assert_close(guided, uncond + 3.0 * (cond - uncond), rtol=1e-4, atol=1e-5)
    assert guided.dtype == torch.float32 and guided.shape == hidden.shape
    with pytest.raises(ValueError, match="true CFG .* needs negative embeddings"):
        flux.guided_velocity(transformer, hidden, ids, sigmas, text(2, 0.5), guidance_scale=3.0, negative=None)
