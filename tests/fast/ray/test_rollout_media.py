"""The rollout manager's media: `_score` hands video rewards frames, fps and audio in the documented format (a
`--custom-rm-path` reward through the reward pool), and `save_rollout_media` writes mp4s with sound and a contact sheet."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import av
import numpy as np
import pytest
import torch

from miles.arguments.parser import default_args
from miles.arguments.records import RolloutFlags
from miles.models.conditioning import Conditioning
from miles.ray.reward_workers import RewardWorkerPool
from miles.ray.rollout_manager import REWARD_TERMS, RolloutManager
from miles.rollout.engine_api import GenerateResult
from miles.rollout.media_files import save_rollout_media
from miles.utils.types import Sample

FPS, RATE, FRAMES = 8.0, 16000, 6

# Checks the documented format, then scores the brightness centroid's rightward speed in widths per second.
CUSTOM_VIDEO_RM = """
import numpy as np


def speed(args, samples):
    out = []
    for s in samples:
        assert s.image is None, "video samples carry frames, not an image"
        assert isinstance(s.frames, np.ndarray) and s.frames.dtype == np.uint8 and s.frames.ndim == 4
        assert s.frames.shape[-1] == 3 and isinstance(s.fps, float)
        assert s.audio.dtype == np.float32 and s.audio.ndim == 2 and isinstance(s.sample_rate, int)
        luma = s.frames.mean(axis=(1, 3))  # (F, W)
        xs = (luma * (np.arange(luma.shape[1]) + 0.5)).sum(1) / luma.sum(1) / luma.shape[1]
        seconds = (len(s.frames) - 1) / s.fps
        out.append(float(xs[-1] - xs[0]) / seconds + float(np.abs(s.audio).max()))
    return out
"""


def square_video(step: int) -> np.ndarray:
    frames = np.zeros((FRAMES, 32, 32, 3), dtype=np.uint8)
    start = 4 if step > 0 else 20
    for t in range(FRAMES):
        frames[t, 8:16, start + step * t : start + step * t + 8] = 255
    return frames


def video_result(steps: list[int], audio_level: list[float]) -> GenerateResult:
    batch = len(steps)
    seconds = FRAMES / FPS
    audio = torch.stack([torch.full((2, int(seconds * RATE)), level) for level in audio_level])
    return GenerateResult(
        images=np.stack([square_video(step) for step in steps]),
        final_latents=torch.zeros(batch, 4, 2, 4, 4),
        latents=torch.zeros(batch, 0, 4, 2, 4, 4),
        next_latents=torch.zeros(batch, 0, 4, 2, 4, 4),
        log_probs=torch.zeros(batch, 0),
        sigmas=torch.linspace(1, 0, 3),
        trained_steps=[],
        conditioning=Conditioning({"prompt_embeds": torch.zeros(batch, 1, 1)}),
        negative=None,
        weights_version=0,
        fps=FPS,
        audio=audio,
        sample_rate=RATE,
    )


def test_a_custom_reward_reads_frames_fps_and_audio_through_the_score_step(tmp_path):
    path = tmp_path / "video_rm.py"
    path.write_text(CUSTOM_VIDEO_RM)
    args = argparse.Namespace(custom_rm_path=f"{path}:speed")
    pool = RewardWorkerPool(args, [("custom", 1.0), ("motion_direction", 2.0)], num_workers=0)
    samples = [Sample(index=i, prompt=f"clip {i}") for i in range(3)]
    result = video_result([2, -2, 0], audio_level=[0.25, 0.5, 0.0])
    RolloutManager._score(SimpleNamespace(rewards=pool), samples, result)
    travel = 2 * (FRAMES - 1) / 32  # widths from the first frame to the last
    seconds = (FRAMES - 1) / FPS
    expected_custom = [travel / seconds + 0.25, -travel / seconds + 0.5, 0.0]
    for sample, custom, motion in zip(samples, expected_custom, [travel, -travel, 0.0]):
        assert sample.extra[REWARD_TERMS]["custom"] == pytest.approx(custom, abs=1e-6)
        assert sample.extra[REWARD_TERMS]["motion_direction"] == pytest.approx(motion, abs=1e-6)
        assert sample.reward == pytest.approx(custom + 2 * motion, abs=1e-6)
    assert np.array_equal(samples[1].frames, result.images[1]) and samples[1].fps == FPS
    assert samples[1].audio.shape == (2, int(FRAMES / FPS * RATE)) and samples[1].sample_rate == RATE


def test_every_interval_a_rollout_saves_bounded_mp4s_with_sound_and_a_contact_sheet(tmp_path):
    args = default_args(output_dir=str(tmp_path), image_grid_interval=2, n_samples_per_prompt=2, media_max_samples=2)
    flags = RolloutFlags.from_args(args)
    result = video_result([2, -2, 0], audio_level=[0.25, 0.5, 0.0])
    save_rollout_media(flags, 3, result, [])
    assert not (tmp_path / "media").exists()
    save_rollout_media(flags, 4, result, [])
    folder = tmp_path / "media" / "rollout_0000004"
    assert sorted(p.name for p in folder.iterdir()) == ["sample_0.mp4", "sample_1.mp4"]
    assert (tmp_path / "images" / "rollout_0000004.png").is_file()
    with av.open(str(folder / "sample_1.mp4")) as container:
        video, sound = container.streams.video[0], container.streams.audio[0]
        assert video.frames == FRAMES and float(video.average_rate) == FPS and sound.rate == RATE
        assert abs(float(sound.duration * sound.time_base) - FRAMES / FPS) <= 1 / FPS
