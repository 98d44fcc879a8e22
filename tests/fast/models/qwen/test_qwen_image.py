"""What the Qwen-Image family adds to the contract suite: the tiny tokenizer splits the prompt template as the real one
does, prompt conditioning of different batches concatenates, and the VAE round trip runs on one frame with Qwen's
per-channel normalization. Pipeline parity is in `test_family_contract.py`."""

from __future__ import annotations

import pytest
import torch

from miles.models import get_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.models.tiny import SHAPES_WORDS


@pytest.fixture(scope="module")
def family(tiny_qwen_image_dir):
    return get_train_pipeline_config(tiny_qwen_image_dir)


def test_tokenizer_splits_the_template_system_part_into_the_tokens_the_pipeline_drops(family):
    pipe = family.load_text_encoders()  # the saved tokenizer, loaded back
    template = pipe.prompt_template_encode
    system_part = template[: template.index("{}")]
    ids = pipe.tokenizer(system_part).input_ids
    assert len(ids) == pipe.prompt_template_encode_start_idx == 34
    words = pipe.tokenizer(" ".join(SHAPES_WORDS)).input_ids
    assert len(words) == len(SHAPES_WORDS)  # one token per shapes word, so prompts keep their words


def test_prompt_conditioning_masks_padding_and_concatenates_across_batches(family):
    one = family.encode_prompts(["two red circles on the left", "a blue square"])
    other = family.encode_prompts(["a circle"])
    assert list(one) == ["prompt_embeds", "prompt_embeds_mask"] and one["prompt_embeds_mask"].dtype == torch.long
    assert one["prompt_embeds_mask"].sum(dim=1).tolist() == [11, 8]  # prompt tokens + the template's 5 closing ones
    both = Conditioning.cat([other, one])
    assert both["prompt_embeds"].shape[1] == 11 and both["prompt_embeds_mask"].sum(dim=1).tolist() == [7, 11, 8]
    latents = torch.randn(3, *family.latent_shape(32), generator=torch.Generator().manual_seed(0))
    transformer = family.load_transformer()
    with torch.no_grad():
        joined = family.predict_velocity(transformer, latents, torch.full((3,), 0.6), both)
        alone = family.predict_velocity(transformer, latents[:1], torch.full((1,), 0.6), other)
    torch.testing.assert_close(joined[:1], alone, atol=1e-6, rtol=0)  # padding changes nothing


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
