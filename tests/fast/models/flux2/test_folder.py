"""What the FLUX.2 folders' family base adds to the contract suite: a batch mixing rows with 0, 1 and 2 reference
images predicts as each row alone, and reference images are checked as the pipeline checks them."""

from __future__ import annotations

import pytest
import torch

from miles.models import get_train_pipeline_config
from tests.fast.models.flux2.test_flux2 import _image


@pytest.fixture(scope="module")
def family(tiny_flux2_klein_dir):
    return get_train_pipeline_config(tiny_flux2_klein_dir)


def test_a_batch_of_different_reference_counts_predicts_as_each_row_alone(family):
    """Rows with 0, 1 and 2 references (zero-padded to one length in the conditioning) run as separate forwards:
    each row's velocity is the one it has in a batch of its own (with CFG: both branches)."""
    prompts = ["a red circle", "make the square blue", "put the circle of the first on the second"]
    images = [[], [_image(1)], [_image(2), _image(3)]]
    embeds, negative = family.encode_request(prompts, images, "", negative=True)
    assert embeds["image_token_counts"].tolist() == [0, 64, 128]  # 8x8 tokens per 64 px reference
    assert embeds["image_ids"][2, 64:, 0].unique().tolist() == [20]  # the second reference's time coordinate
    transformer = family.load_transformer()
    latents = torch.randn(3, *family.latent_shape(64), generator=torch.Generator().manual_seed(0))
    sigmas = torch.tensor([0.9, 0.6, 0.3])
    with torch.no_grad():
        batched = family.predict_velocity(transformer, latents, sigmas, embeds, guidance_scale=3.5, negative=negative)
        alone = [
            family.predict_velocity(
                transformer, latents[i : i + 1], sigmas[i : i + 1], embeds.rows(i), guidance_scale=3.5,
                negative=negative,
            )
            for i in range(3)
        ]  # fmt: skip
    torch.testing.assert_close(batched, torch.cat(alone), atol=1e-6, rtol=0)
    # the references change the prediction (a row is not the text-only one)
    text_only, _ = family.encode_request(prompts[1:2], None, "", negative=False)
    with torch.no_grad():
        plain = family.predict_velocity(transformer, latents[1:2], sigmas[1:2], text_only, guidance_scale=3.5,
                                        negative=negative)  # fmt: skip
    assert (plain - alone[1]).abs().max() > 1e-3


def test_reference_images_are_checked_as_the_pipeline_checks_them(family):
    with pytest.raises(ValueError, match="Image too small: 32×32"):
        family.encode_prompts(["make it blue"], images=[[_image(0, side=32)]])
    with pytest.raises(ValueError, match=r"takes 0 to 10 source image\(s\) per prompt, got prompts with 11"):
        family.encode_request(["make it blue"], [[_image(0)] * 11], "", negative=False)
    with pytest.raises(ValueError, match="no static shift"):
        family.sampling_shift(64)
