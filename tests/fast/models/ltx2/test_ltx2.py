"""The LTX-2 family beyond the family contract suite: its joint latent's geometry, the noise drawn as the pipeline
draws it, the refusals, and a generated sample written as an mp4 whose audio lasts as long as its video."""

from __future__ import annotations

import argparse
import math

import av
import pytest
import torch
from diffusers import LTX2Pipeline

from miles.algorithms import ALGORITHMS
from miles.models import get_train_pipeline_config
from miles.models.ltx2.streams import pack_audio, pack_video, unpack_audio, unpack_video
from miles.rollout.engine import DiffusionEngine
from miles.rollout.engine_api import GenerateRequest
from miles.rollout.media_files import save_media

RESOLUTION = 32


@pytest.fixture(scope="module")
def family(tiny_ltx2_dir):
    return get_train_pipeline_config(tiny_ltx2_dir)


def test_joint_latent_is_the_video_then_the_audio_latent(family):
    assert family.name == "ltx2"
    video_shape, audio_shape = family.stream_shapes(RESOLUTION)
    # 121 frames -> 16 latent frames (8x), 32 px -> 2x2 (16x); 121/24 s at 25 audio latents per second -> 126
    assert video_shape == (8, 16, 2, 2) and audio_shape == (2, 126, 4)
    assert family.latent_shape(RESOLUTION) == (math.prod(video_shape) + math.prod(audio_shape),)
    joint = torch.randn(3, *family.latent_shape(RESOLUTION))
    video, audio = family.split_latents(joint)
    assert video.shape == (3, *video_shape) and audio.shape == (3, *audio_shape)
    assert torch.equal(family.join_latents(video, audio), joint)
    patch, patch_t = family.transformer_patch_sizes
    assert torch.equal(unpack_video(pack_video(video, patch, patch_t), video_shape, patch, patch_t), video)
    assert torch.equal(unpack_audio(pack_audio(audio), audio_shape[-1]), audio)


def test_noise_is_drawn_as_the_pipeline_draws_it(family, tiny_ltx2_dir):
    pipe = LTX2Pipeline.from_pretrained(tiny_ltx2_dir, local_files_only=True)
    (channels, _, _, _), (audio_channels, audio_frames, _) = family.stream_shapes(RESOLUTION)
    generator = torch.Generator().manual_seed(5)
    video = pipe.prepare_latents(1, channels, RESOLUTION, RESOLUTION, 121, generator=generator, dtype=torch.float32)
    audio = pipe.prepare_audio_latents(
        1, audio_channels, audio_frames, pipe.audio_vae.config.mel_bins, generator=generator, dtype=torch.float32
    )
    noise = family.draw_noise(torch.Generator().manual_seed(5), RESOLUTION)
    video_part, audio_part = family.split_latents(noise[None])
    patch, patch_t = family.transformer_patch_sizes
    assert torch.equal(pack_video(video_part, patch, patch_t), video)  # the pipeline's packed token layouts
    assert torch.equal(pack_audio(audio_part), audio)


def test_refusals_name_the_problem(family, tiny_ltx2_dir):
    refused = r"trains on \(prompt, image\) dataset records \(--train-only\), which is not supported for the ltx2"
    with pytest.raises(ValueError, match=rf"--loss-type sft_loss {refused}"):  # an algorithm without engines
        family.check_run_args(argparse.Namespace(loss_type="sft_loss", train_only=False), ALGORITHMS["sft_loss"])
    with pytest.raises(ValueError, match=rf"--loss-type custom_loss {refused}"):  # any algorithm run --train-only
        family.check_run_args(argparse.Namespace(loss_type="custom_loss", train_only=True), ALGORITHMS["custom_loss"])
    for loss_type in ("policy_loss", "nft", "dmd2", "custom_loss"):  # their rollouts are generated
        family.check_run_args(argparse.Namespace(loss_type=loss_type, train_only=False), ALGORITHMS[loss_type])
    with pytest.raises(NotImplementedError, match="joint video \\+ audio latent"):
        family.encode_images(torch.zeros(1, 3, RESOLUTION, RESOLUTION))
    with pytest.raises(ValueError, match="num_frames - 1 divisible by the video VAE's temporal factor 8"):
        type(family)(tiny_ltx2_dir, num_frames=12)
    with pytest.raises(ValueError, match="multiple of 32"):
        family.latent_shape(48)
    with pytest.raises(ValueError, match="no finite σ grid"):  # shift_terminal: the pipeline's 1-step grid is NaN
        family.sampling_sigmas(1, RESOLUTION)


def test_generated_sample_mp4_has_its_frames_and_audio_as_long_as_the_video(tiny_ltx2_dir, tmp_path):
    engine = DiffusionEngine(tiny_ltx2_dir)
    result = engine.generate(
        GenerateRequest(
            prompts=["two red circles"],
            seeds=[0],
            num_steps=2,
            guidance_scale=1.0,
            negative_prompt="",
            sde_type="ode",
            noise_level=0.0,
            trained_steps=[],
            resolution=RESOLUTION,
        )
    )
    assert result.images.shape == (1, 121, RESOLUTION, RESOLUTION, 3) and result.fps == 24.0
    assert result.audio.shape[:2] == (1, 1) and result.sample_rate == 48000
    assert result.audio.abs().max() <= 1 and result.audio.std() > 0
    # the vocoder's waveform lasts as long as the video to within a frame (126 audio latents for 121 frames)
    assert abs(result.audio.shape[-1] / result.sample_rate - 121 / 24.0) <= 1 / 24.0
    paths = save_media(
        str(tmp_path),
        "rollout_0000000",
        result.images,
        fps=result.fps,
        audio=result.audio,
        sample_rate=result.sample_rate,
    )
    with av.open(paths[0]) as container:
        fps = float(container.streams.video[0].average_rate)
        frames = sum(1 for _ in container.decode(video=0))
    with av.open(paths[0]) as container:
        assert len(container.streams.audio) == 1
        rate = container.streams.audio[0].rate
        samples = sum(frame.samples for frame in container.decode(audio=0))
    assert frames == 121 and fps == pytest.approx(24.0) and rate == 48000
    assert abs(samples / rate - frames / fps) <= 1 / fps, (samples / rate, frames / fps)
