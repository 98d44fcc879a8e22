"""Video rewards: temporal_consistency (still vs flickering) and motion_direction (a square moving right vs left),
against hand-computed values, and the media check that keeps image rewards off video and video rewards off images."""

from __future__ import annotations

import argparse
import asyncio

import numpy as np
import pytest

from miles.rollout.rm_hub import RewardError, compute_rewards
from miles.rollout.rm_hub.jpeg import jpeg_compressibility
from miles.rollout.rm_hub.video import frame_consistency, rightward_motion
from miles.utils.types import Sample


def moving_square(num_frames: int, step: int, size: int = 8, width: int = 32, value: int = 255, background: int = 0):
    frames = np.full((num_frames, 32, width, 3), background, dtype=np.uint8)
    start = 2 if step > 0 else width - size - 2
    for t in range(num_frames):
        frames[t, 12 : 12 + size, start + step * t : start + step * t + size] = value
    return frames


def video_samples(videos, fps=8.0):
    return [Sample(index=i, prompt=f"clip {i}", frames=v, fps=fps) for i, v in enumerate(videos)]


def score(spec, samples):
    return asyncio.run(compute_rewards(argparse.Namespace(custom_rm_path=None), samples, spec))


def test_a_still_video_is_fully_consistent_and_a_black_white_flicker_is_not():
    still = np.repeat(np.random.default_rng(0).integers(0, 256, (1, 8, 8, 3), dtype=np.uint8), 5, axis=0)
    flicker = np.stack([np.full((8, 8, 3), 255 * (t % 2), np.uint8) for t in range(5)])
    assert frame_consistency(still) == 1.0 and frame_consistency(flicker) == 0.0
    assert frame_consistency(still[:1]) == 1.0


def test_consistency_is_one_minus_the_mean_absolute_frame_change():
    frames = np.random.default_rng(1).integers(0, 256, (4, 3, 5, 3), dtype=np.uint8)
    changes = []
    for t in range(3):
        for y in range(3):
            for x in range(5):
                for c in range(3):
                    changes.append(abs(int(frames[t + 1, y, x, c]) - int(frames[t, y, x, c])) / 255)
    assert frame_consistency(frames) == pytest.approx(1 - sum(changes) / len(changes), abs=1e-12)


def test_a_square_moving_right_scores_its_travel_in_widths_and_moving_left_the_negative():
    right, left = moving_square(9, step=2), moving_square(9, step=-2)
    assert rightward_motion(right) == pytest.approx(16 / 32)  # 8 steps of 2 pixels on a 32-pixel width
    assert rightward_motion(left) == pytest.approx(-16 / 32)
    assert rightward_motion(right[::-1]) == pytest.approx(-16 / 32)  # the same frames backwards: time matters
    assert rightward_motion(right[:1]) == 0.0 and rightward_motion(np.zeros((3, 4, 4, 3), np.uint8)) == 0.0
    # the centroid is of brightness: a dark square moving right on white moves the bright mass left
    assert rightward_motion(moving_square(9, step=2, value=0, background=255)) < 0


def test_built_in_video_rewards_score_through_compute_rewards():
    samples = video_samples([moving_square(9, step=2), moving_square(9, step=-2), moving_square(9, step=0)])
    totals, per_reward = score([("motion_direction", 1.0), ("temporal_consistency", 0.5)], samples)
    assert per_reward["motion_direction"] == pytest.approx([0.5, -0.5, 0.0])
    # the moving square changes 2 columns of 8 rows at each edge per step: 32 of 1024 pixels, all channels, fully
    assert per_reward["temporal_consistency"] == pytest.approx([1 - 32 / 1024, 1 - 32 / 1024, 1.0])
    assert totals == pytest.approx([m + 0.5 * c for m, c in zip(*per_reward.values())])


def test_an_image_reward_given_video_names_the_reward_and_the_video_rewards():
    samples = video_samples([moving_square(3, step=2)])
    with pytest.raises(
        RewardError,
        match=r"reward 'jpeg_compressibility' scores images.*these samples are video.*"
        r"temporal_consistency, motion_direction",
    ):
        score([("temporal_consistency", 1.0), ("jpeg_compressibility", 1.0)], samples)
    with pytest.raises(ValueError, match="sample is video"):  # called directly, past compute_rewards' check
        asyncio.run(jpeg_compressibility(argparse.Namespace(), samples))


def test_a_video_reward_given_images_names_the_reward():
    samples = [Sample(index=0, prompt="p", image=np.zeros((8, 8, 3), np.uint8))]
    with pytest.raises(RewardError, match="reward 'motion_direction' scores video.*these samples are images"):
        score([("motion_direction", 1.0)], samples)
