"""What the Qwen-Image family adds to the contract suite: the tiny tokenizer splits the prompt template as the real one
does, and prompt conditioning of different batches concatenates (the Qwen folders' VAE round trip: test_folder.py).
Pipeline parity is in `test_family_contract.py`."""

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
