"""Media for rewards: the engine's decoded images or frames handed to the samples, and an image reward on video (or
the reverse) named with what to use instead."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from miles.rollout.rm_hub.media import IMAGE, VIDEO, attach_media, media_mismatch, sample_frames
from miles.utils.types import Sample


def samples(n: int) -> list[Sample]:
    return [Sample(index=i, prompt="p") for i in range(n)]


def test_images_and_frames_with_audio_reach_their_samples_row_by_row():
    images = samples(2)
    attach_media(images, SimpleNamespace(images=np.arange(2 * 12, dtype=np.uint8).reshape(2, 2, 2, 3)))
    assert images[1].image[0, 0].tolist() == [12, 13, 14] and images[0].frames is None
    clips = samples(2)
    frames = np.zeros((2, 3, 2, 2, 3), dtype=np.uint8)
    audio = torch.full((2, 1, 4), 0.5)
    attach_media(clips, SimpleNamespace(images=frames, fps=8, audio=audio, sample_rate=16000))
    assert clips[1].frames.shape == (3, 2, 2, 3) and clips[1].fps == 8.0 and clips[1].sample_rate == 16000
    assert clips[1].audio.dtype == np.float32 and clips[1].audio.tolist() == [[0.5] * 4]
    with pytest.raises(ValueError, match="no fps"):
        attach_media(samples(2), SimpleNamespace(images=frames, fps=None, audio=None))


def test_a_reward_of_the_other_media_is_named_with_what_to_use():
    clips = samples(1)
    clips[0].frames = np.zeros((2, 2, 2, 3), dtype=np.uint8)
    assert media_mismatch("motion_direction", VIDEO, clips, ["motion_direction"]) is None
    err = media_mismatch("shapes", IMAGE, clips, ["motion_direction", "temporal_consistency"])
    assert "reward 'shapes' scores images" in err and "(motion_direction, temporal_consistency)" in err
    assert "needs a video model family" in media_mismatch("motion_direction", VIDEO, samples(1), [])


def test_frames_must_be_uint8_clips():
    sample = samples(1)[0]
    with pytest.raises(ValueError, match="sample has no video frames"):
        sample_frames(sample)
    sample.frames = np.zeros((2, 2, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"must be \(F >= 1, H, W, 3\) uint8, got shape \(2, 2, 3\)"):
        sample_frames(sample)
    sample.frames = np.ones((1, 2, 2, 3), dtype=np.uint8)
    assert sample_frames(sample).sum() == 12
