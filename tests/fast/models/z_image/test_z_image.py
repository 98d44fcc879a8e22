"""What the Z-Image family adds to the contract suite: prompts are Qwen3's chat template read at the text encoder's
second-to-last layer, padding across batches changes nothing, the CFG options combine each row as the pipeline's loop
(computed here one row and one forward at a time), the VAE decodes as the pipeline, and the options are the family's
alone. Pipeline parity is in `test_family_contract.py`."""

from __future__ import annotations

import pytest
import torch

from miles.arguments.parser import parse_args
from miles.models import get_train_pipeline_config
from miles.models.conditioning import Conditioning

PROMPTS = ["two red circles on the left", "a blue square", "a circle"]


@pytest.fixture(scope="module")
def family(tiny_z_image_dir):
    return get_train_pipeline_config(tiny_z_image_dir)


def test_prompts_are_the_chat_template_read_at_the_second_to_last_layer(family):
    embeds = family.encode_prompts(PROMPTS)
    pipe = family.load_text_encoders()
    for i, prompt in enumerate(PROMPTS):
        text = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"  # Qwen3's, thinking enabled
        ids = pipe.tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = pipe.text_encoder(input_ids=ids, output_hidden_states=True).hidden_states[-2][0]
        mask = embeds["prompt_embeds_mask"][i]
        assert int(mask.sum()) == ids.shape[1] and bool(mask[: ids.shape[1]].all())
        torch.testing.assert_close(embeds["prompt_embeds"][i, : ids.shape[1]], expected, atol=1e-5, rtol=0)
        assert not embeds["prompt_embeds"][i, ids.shape[1] :].any()  # zero padding


def test_padding_across_batches_changes_no_velocity(family):
    one, other = family.encode_prompts(PROMPTS[:2]), family.encode_prompts(PROMPTS[2:])
    both = Conditioning.cat([other, one])  # `other` zero-padded to the longest prompt
    assert both["prompt_embeds"].shape[1] == one["prompt_embeds"].shape[1] > other["prompt_embeds"].shape[1]
    latents = torch.randn(3, *family.latent_shape(32), generator=torch.Generator().manual_seed(0))
    transformer = family.load_transformer()
    with torch.no_grad():
        joined = family.predict_velocity(transformer, latents, torch.full((3,), 0.6), both)
        alone = family.predict_velocity(transformer, latents[:1], torch.full((1,), 0.6), other)
    torch.testing.assert_close(joined[:1], alone, atol=1e-6, rtol=0)


def test_cfg_options_combine_each_row_as_the_pipeline_loop(tiny_z_image_dir):
    """Rows at different σ in one batch: those with 1 − σ above the truncation unguided, the others guided and
    renormalized, each computed here by the loop's formulas from one forward per row and branch."""
    family = get_train_pipeline_config(tiny_z_image_dir, cfg_normalization=1.0, cfg_truncation=0.2)
    transformer = family.load_transformer()
    embeds, negative = family.encode_prompts(PROMPTS), family.encode_negative(1)
    latents = torch.randn(3, *family.latent_shape(32), generator=torch.Generator().manual_seed(1))
    sigmas = torch.tensor([1.0, 0.9, 0.5])  # 1 − σ: 0 and 0.1 guided, 0.5 past the truncation
    w = 4.0

    def forward(i: int, cond: Conditioning) -> torch.Tensor:
        tokens = cond["prompt_embeds"][0][cond["prompt_embeds_mask"][0].bool()]
        time = (1000 - sigmas[i : i + 1] * 1000) / 1000
        return transformer([latents[i].unsqueeze(1)], time, [tokens], return_dict=False)[0][0].squeeze(1)

    expected, renormalized = [], 0
    with torch.no_grad():
        for i in range(3):
            pos = forward(i, embeds.rows(i))
            if i < 2:
                pred = pos + (w - 1) * (pos - forward(i, negative))
                if pred.norm() > pos.norm():
                    pred, renormalized = pred * (pos.norm() / pred.norm()), renormalized + 1
                pos = pred
            expected.append(-pos)
        velocity = family.predict_velocity(transformer, latents, sigmas, embeds, guidance_scale=w, negative=negative)
        plain = get_train_pipeline_config(tiny_z_image_dir).predict_velocity(
            transformer, latents, sigmas, embeds, guidance_scale=w, negative=negative
        )
        unguided = family.predict_velocity(transformer, latents, sigmas, embeds, guidance_scale=1.0)
    assert renormalized == 2  # the normalization acted on both guided rows
    torch.testing.assert_close(velocity, torch.stack(expected), atol=1e-5, rtol=0)
    torch.testing.assert_close(velocity[2], unguided[2], atol=1e-6, rtol=0)  # truncated: the conditional branch
    assert (plain[2] - velocity[2]).abs().max() > 1e-3  # which the options changed
    assert ((plain[:2] - velocity[:2]).flatten(1).norm(dim=1) > 1e-3).all()


def test_vae_decodes_as_the_pipeline(family):
    x0 = torch.randn(2, *family.latent_shape(32), generator=torch.Generator().manual_seed(2))
    vae = family.load_vae()
    with torch.no_grad():
        pixels = vae.decode(x0 / vae.config.scaling_factor + vae.config.shift_factor).sample
    images = family.decode_latents(x0).images
    torch.testing.assert_close(images, (pixels / 2 + 0.5).clamp(0, 1), atol=1e-6, rtol=0)
    encoded = family.encode_images(pixels.clamp(-1, 1))
    assert encoded.shape == x0.shape and encoded.dtype == torch.float32


def test_the_cfg_options_are_the_families_own_and_range_checked(tiny_pipeline_dir, capsys):
    with pytest.raises(ValueError, match=r"--z-image-cfg-truncation does not apply to the sd3 family"):
        get_train_pipeline_config(tiny_pipeline_dir, cfg_truncation=0.5)
    with pytest.raises(SystemExit):
        parse_args(["--hf-checkpoint", "/tmp/x", "--z-image-cfg-normalization", "-1"])
    assert "--z-image-cfg-normalization must be ≥ 0, got -1" in capsys.readouterr().err
