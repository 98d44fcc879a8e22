"""The flux-kontext family beyond the family contract (`test_family_contract.py`, its guidance-distilled case): the
pipeline's true CFG of a folder without a guidance embedding, and what a run accepts and refuses at start-up."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from miles.arguments.parser import parse_args
from miles.models import get_train_pipeline_config
from miles.models.flux.tiny import save_tiny_flux_pipeline
from miles.startup import startup_checks
from tests.fast.models.family_cases import FAMILY_CASES
from tests.fast.models.test_family_contract import PROMPTS, TOLERANCE, run_pipeline, source_images

KONTEXT = next(case for case in FAMILY_CASES if case.id == "flux-kontext")


def test_true_cfg_pairs_the_negative_text_with_the_source_image(tmp_path):
    """Without a guidance embedding, w > 1 is the pipeline's true_cfg_scale with a negative prompt: its negative
    branch sees the same source image tokens."""
    path = str(tmp_path / "pipeline")
    save_tiny_flux_pipeline(path, seed=3, guidance_embeds=False, kontext=True)
    case = dataclasses.replace(
        KONTEXT, cfg_kwargs=lambda w: {"true_cfg_scale": w, "negative_prompt": "", "guidance_scale": 0.0}
    )
    _, steps, sigmas = run_pipeline(case, path, 3.5, num_steps=1)
    family = get_train_pipeline_config(path)
    embeds, negative = family.encode_request(PROMPTS, source_images(case), "", negative=True)
    assert list(negative) == ["prompt_embeds", "pooled_prompt_embeds"] and negative.batch_size == 1  # text only
    ((pipeline_velocity, sample),) = steps
    with torch.no_grad():
        velocity = family.predict_velocity(
            family.load_transformer(), sample, sigmas[0].expand(2), embeds, guidance_scale=3.5, negative=negative
        )
    assert (velocity - pipeline_velocity).abs().max().item() <= TOLERANCE  # measured 2e-6: batched vs two forwards


def test_a_run_refuses_what_kontext_does_not_support(tiny_flux_kontext_dir):
    def check(*flags):
        data = ["--prompt-data", "builtin:shapes-edit"]
        startup_checks(parse_args(["--hf-checkpoint", tiny_flux_kontext_dir, *data, *flags]))

    check("--loss-type", "policy_loss", "--eval-interval", "0")
    check("--loss-type", "sft_loss", "--train-only")  # (source, instruction, target) triples
    check("--loss-type", "nft")  # its default eval: the shapes edit world's eval split
    with pytest.raises(ValueError, match="--eval-prompt-data builtin:ocr holds text prompts"):
        check("--loss-type", "nft", "--eval-prompt-data", "builtin:ocr")
    with pytest.raises(ValueError, match="--prompt-data builtin:shapes holds text prompts"):
        check("--eval-interval", "0", "--prompt-data", "builtin:shapes")
    with pytest.raises(ValueError, match="--negative-prompt with the guidance-distilled"):
        check("--eval-interval", "0", "--negative-prompt", "blurry")
    family = get_train_pipeline_config(tiny_flux_kontext_dir)
    with pytest.raises(ValueError, match=r"takes 1 source image\(s\) per prompt, got prompts with 0"):
        family.encode_request(PROMPTS, None, "", negative=False)
    with pytest.raises(ValueError, match=r"takes 1 source image\(s\) per prompt, got prompts with 2"):
        family.encode_request(PROMPTS[:1], [source_images(KONTEXT)[0] * 2], "", negative=False)
    with pytest.raises(ValueError, match="needs each prompt's source image latents"):
        text_only = family.encode_prompts(PROMPTS)
        family.predict_velocity(
            family.load_transformer(), torch.zeros(2, *family.latent_shape(32)), torch.ones(2), text_only
        )
