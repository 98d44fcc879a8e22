"""The FLUX.1 family (miles/models/flux/flux.py) on the tiny dev folder: prompts encoded as the pipeline's
`encode_prompt` (the T5 sequence, CLIP's pooled vector), and the velocity of unpacked latents: each sample's
independent of its batch-mates, the embedded guidance used, odd latent sides refused (parity with the pipeline: the
family contract suite)."""

from __future__ import annotations

import pytest
import torch

from miles.models.flux.flux import FluxPipelineConfig


@pytest.fixture(scope="module")
def dev(tiny_flux_dev_dir):
    family = FluxPipelineConfig(tiny_flux_dev_dir)
    return family, family.load_transformer().eval(), family.encode_prompts(["a red circle", "two blue squares"])


def test_prompts_encode_to_the_t5_sequence_and_clips_pooled_vector(dev):
    family, _, embeds = dev
    assert list(embeds) == ["prompt_embeds", "pooled_prompt_embeds"]
    assert embeds["prompt_embeds"].shape == (2, family.max_sequence_length, 64) and embeds[
        "pooled_prompt_embeds"
    ].shape == (2, 32)
    alone = family.encode_prompts(["two blue squares"])
    assert all(torch.equal(alone[k][0], embeds[k][1]) for k in embeds)  # prompt_cache_exact: rows are batch-free


def test_each_samples_velocity_is_its_own_and_the_embedded_guidance_takes_the_scale(dev):
    family, transformer, embeds = dev
    latents, sigmas = torch.randn(2, 4, 8, 8), torch.tensor([0.2, 0.7])
    with torch.no_grad():
        velocity = family.predict_velocity(transformer, latents, sigmas, embeds, guidance_scale=3.5)
        second = family.predict_velocity(
            transformer, latents[1:], sigmas[1:], embeds.rows(slice(1, 2)), guidance_scale=3.5
        )
        other_guidance = family.predict_velocity(transformer, latents, sigmas, embeds, guidance_scale=1.0)
    assert velocity.shape == latents.shape and velocity.dtype == torch.float32
    torch.testing.assert_close(second[0], velocity[1], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(other_guidance, velocity)  # the guidance embedding takes the scale


def test_odd_latent_sides_cannot_pack_2x2_patches(dev):
    family, transformer, embeds = dev
    with pytest.raises(ValueError, match="FLUX latents pack 2x2 patches: height and width must be even, got 7x8"):
        family.predict_velocity(transformer, torch.zeros(2, 4, 7, 8), torch.zeros(2), embeds)
