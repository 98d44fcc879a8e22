"""Media: images and video frames with audio, their uint8 form, and the shape checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.models.media import Media


def test_images_to_uint8_match_a_per_pixel_loop():
    pixels = torch.rand(2, 3, 4, 5, generator=torch.Generator().manual_seed(0))
    media = Media(pixels)
    out = media.pixels_uint8()
    assert not media.is_video and media.batch_size == 2 and out.shape == (2, 4, 5, 3) and out.dtype == np.uint8
    for b, y, x, c in [(0, 0, 0, 0), (1, 3, 4, 2), (1, 2, 1, 1)]:
        assert out[b, y, x, c] == int(np.round(float(pixels[b, c, y, x]) * 255))
    assert media.images is pixels


def test_video_frames_keep_their_frame_axis_and_carry_audio():
    frames = torch.rand(2, 6, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    media = Media(frames, fps=8.0, audio=torch.zeros(2, 1, 1200), sample_rate=16000)
    out = media.pixels_uint8()
    assert media.is_video and out.shape == (2, 6, 4, 4, 3)
    assert np.array_equal(out[1, 5], Media(frames[:, 5]).pixels_uint8()[1])
    with pytest.raises(ValueError, match="video"):
        _ = media.images


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(pixels=torch.zeros(2, 4, 4)), "must be"),
        (dict(pixels=torch.zeros(2, 1, 4, 4)), "must be"),
        (dict(pixels=torch.zeros(2, 6, 3, 4, 4)), "positive fps"),
        (dict(pixels=torch.zeros(2, 3, 4, 4), audio=torch.zeros(2, 1, 10)), "sample_rate"),
        (dict(pixels=torch.zeros(2, 3, 4, 4), audio=torch.zeros(3, 1, 10), sample_rate=8000), "audio must be"),
    ],
)
def test_bad_shapes_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Media(**kwargs)
