"""The tiny SD3 pipeline: it is a real diffusers pipeline folder, small, seeded, with shapes-world tokenizers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from miles.models.sd3.tiny import build_tiny_sd3_pipeline
from miles.models.tiny import SHAPES_WORDS

REQUIRED_WORDS = (
    "a an one two three four five six red green blue yellow purple orange white black gray pink cyan circle circles "
    "square squares triangle triangles on the left right top bottom in center middle of and with photo image picture"
).split()


@pytest.fixture(scope="module")
def pipe(tiny_pipeline_dir):
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_pipeline_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_plain_diffusers_loads_the_folder_and_generates_with_cfg(pipe):
    out = pipe(
        ["two red circles on the left", "a blue square"],
        num_inference_steps=2,
        guidance_scale=4.0,
        height=32,
        width=32,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    )
    images = out.images
    assert images.shape == (2, 3, 32, 32)
    assert torch.isfinite(images).all() and images.min() >= 0 and images.max() <= 1


def test_components_are_float32_eval_and_folder_is_a_few_megabytes(pipe, tiny_pipeline_dir):
    for module in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
        assert module.dtype == torch.float32 and not module.training
    size = sum(f.stat().st_size for f in Path(tiny_pipeline_dir).rglob("*") if f.is_file())
    assert size < 5 * 2**20
    assert list(Path(tiny_pipeline_dir).rglob("*.bin")) == []  # safetensors only


def test_shapes_geometry_matches_sd3_pipeline_expectations(pipe):
    assert pipe.vae_scale_factor == 4
    assert pipe.transformer.config.sample_size * pipe.vae_scale_factor == 32
    clip_widths = pipe.text_encoder.config.hidden_size + pipe.text_encoder_2.config.hidden_size
    assert pipe.transformer.config.joint_attention_dim == pipe.text_encoder_3.config.d_model >= clip_widths
    pooled = pipe.text_encoder.config.projection_dim + pipe.text_encoder_2.config.projection_dim
    assert pipe.transformer.config.pooled_projection_dim == pooled
    assert pipe.scheduler.config.shift == 3.0
    for tokenizer, encoder in ((pipe.tokenizer, pipe.text_encoder), (pipe.tokenizer_2, pipe.text_encoder_2)):
        assert encoder.config.eos_token_id == tokenizer.eos_token_id  # CLIP pools at the first eos token
    assert pipe.vae.config.shift_factor is not None and pipe.vae.config.scaling_factor > 0


def test_same_seed_same_weights_other_seed_different():
    a, b, c = (build_tiny_sd3_pipeline(seed=s).transformer.state_dict() for s in (0, 0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("tokenizer_name", ["tokenizer", "tokenizer_2", "tokenizer_3"])
def test_shapes_world_words_are_single_tokens_after_save_and_load(pipe, tokenizer_name):
    tokenizer = getattr(pipe, tokenizer_name)
    assert set(REQUIRED_WORDS) <= set(SHAPES_WORDS)
    for word in SHAPES_WORDS:
        ids = tokenizer(word, add_special_tokens=False).input_ids
        assert len(ids) == 1 and ids[0] != tokenizer.unk_token_id, (word, ids)
