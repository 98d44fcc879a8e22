"""The Wan image-to-video family beyond the contract suite: what it refuses (folders of other Wan image-to-video
layouts, runs it cannot do, prompts without their one source image) and the conditioning it builds. Its parity with
WanImageToVideoPipeline is in test_family_contract.py (cases wan-i2v, wan-i2v-2-experts)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from miles.arguments.parser import parse_args
from miles.models import get_train_pipeline_config
from miles.startup import check_startup

PROMPTS = ["a red circle", "a blue square"]


def images(n_prompts: int = 2, per_prompt: int = 1) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(0)
    return [[rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for _ in range(per_prompt)] for _ in range(n_prompts)]


def edited_folder(source: str, tmp_path: Path, file: str, **changes) -> str:
    """`source` with `changes` written into its JSON `file` (the other components linked, not copied)."""
    out = tmp_path / "pipeline"
    out.mkdir()
    edited = Path(file).parts[0]
    for child in Path(source).iterdir():
        if child.name == edited:
            (shutil.copytree if child.is_dir() else shutil.copy)(child, out / child.name)
        else:
            (out / child.name).symlink_to(child)
    config = json.loads((out / file).read_text())
    config.update(changes)
    (out / file).write_text(json.dumps(config))
    return str(out)


def test_wan_2_2_ti2v_first_frame_conditioning_is_refused(tiny_wan_i2v_dir, tmp_path):
    folder = edited_folder(tiny_wan_i2v_dir, tmp_path, "model_index.json", expand_timesteps=True)
    with pytest.raises(ValueError, match=r"Wan 2.2 TI2V-5B-style folder \(expand_timesteps\)"):
        get_train_pipeline_config(folder)


def test_first_last_frame_folders_are_refused(tiny_wan_i2v_dir, tmp_path):
    folder = edited_folder(tiny_wan_i2v_dir, tmp_path, "transformer/config.json", pos_embed_seq_len=34)
    with pytest.raises(ValueError, match=r"first-last-frame \(FLF2V\).*last_image"):
        get_train_pipeline_config(folder)


def test_a_text_to_video_transformer_is_refused(tiny_wan_dir):
    with pytest.raises(ValueError, match="takes 4 input channels, not an image-to-video transformer's 12"):
        get_train_pipeline_config(tiny_wan_dir, "wan-i2v")


def test_an_image_branch_without_image_encoder_is_refused(tiny_wan_i2v_dir, tmp_path):
    folder = edited_folder(tiny_wan_i2v_dir, tmp_path, "model_index.json", image_encoder=[None, None])
    with pytest.raises(ValueError, match="image branch .* no image_encoder"):
        get_train_pipeline_config(folder)


def test_prompts_take_exactly_one_source_image(tiny_wan_i2v_dir):
    family = get_train_pipeline_config(tiny_wan_i2v_dir)
    for wrong in (None, images(per_prompt=0), images(per_prompt=2)):
        with pytest.raises(ValueError, match=r"takes 1 source image\(s\) per prompt"):
            family.encode_request(PROMPTS, wrong, "", negative=False)
    with pytest.raises(ValueError, match=r"\(H, W, 3\) uint8"):
        family.encode_prompts(PROMPTS, images=[[np.zeros((32, 32, 3), np.float32)]] * 2)


def test_text_only_conditioning_is_refused_by_the_velocity(tiny_wan_i2v_dir):
    family = get_train_pipeline_config(tiny_wan_i2v_dir)
    text_only = family.encode_prompts(PROMPTS)  # what the negative branch takes, never a sample's conditioning
    latents = torch.zeros(2, *family.latent_shape(32))
    with pytest.raises(ValueError, match="encode the prompts with their source images"):
        family.predict_velocity(family.load_transformer(), latents, torch.tensor([0.5, 0.5]), text_only)


def test_the_condition_is_the_first_frame_mask_then_the_image_latents(tiny_wan_i2v_dir):
    """Against the VAE run by hand: mask channels 1 on the first latent frame only, then the normalized latents of
    the image followed by zero frames; the image embeddings are the CLIP tower's penultimate states."""
    family = get_train_pipeline_config(tiny_wan_i2v_dir)
    sources = images()
    embeds = family.encode_prompts(PROMPTS, images=sources)
    assert set(embeds) == {"prompt_embeds", "condition", "image_embeds"}
    condition = embeds["condition"]
    channels, frames, side, _ = family.latent_shape(32)
    assert condition.shape == (2, 4 + channels, frames, side, side)
    assert (condition[:, :4, 0] == 1).all() and (condition[:, :4, 1:] == 0).all()
    vae = family.cached_vae()
    clip = np.zeros((3, family.num_frames, 32, 32), np.float32)
    clip[:, 0] = sources[1][0].transpose(2, 0, 1) / 127.5 - 1.0
    with torch.no_grad():
        z = vae.encode(torch.from_numpy(clip)[None]).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    torch.testing.assert_close(condition[1:, 4:], (z - mean) / std, atol=1e-5, rtol=1e-5)
    pipe = family.text_pipeline()
    assert embeds["image_embeds"].shape == (2, 17, pipe.image_encoder.config.hidden_size)  # 4x4 patches + CLS


def test_startup_refuses_what_a_wan_i2v_run_cannot_do(tiny_wan_i2v_dir, tiny_wan_i2v_2_experts_dir):
    """The driver's start-up check, before Ray: LoRA on two experts, sequence parallelism."""

    def check(path, *flags):
        check_startup(parse_args(["--hf-checkpoint", path, "--num-frames", "5", "--eval-interval", "0", *flags]))

    check(tiny_wan_i2v_dir, "--use-lora")
    check(tiny_wan_i2v_2_experts_dir, "--wan-trained-experts", "low-noise", "--diffusion-guidance-scale-2", "2")
    check(tiny_wan_i2v_dir, "--loss-type", "sft_loss", "--train-only")  # (first frame, caption, video) triples
    with pytest.raises(ValueError, match="--use-lora with a two-expert Wan folder"):
        check(tiny_wan_i2v_2_experts_dir, "--use-lora")
    with pytest.raises(ValueError, match="--sp-size 2: the wan-i2v family does not support sequence parallelism"):
        check(tiny_wan_i2v_dir, "--sp-size", "2")
