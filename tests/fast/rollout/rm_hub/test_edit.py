"""edit_preservation: a masked PSNR against the source outside the edit box, checked against a hand computation."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest

from miles.rollout.rm_hub.edit import PSNR_CAP_DB, edit_preservation, keep_mask, masked_psnr
from miles.utils.types import Sample


def test_masked_psnr_is_the_psnr_of_the_kept_pixels():
    rng = np.random.default_rng(0)
    source = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    result = source.copy()
    result[0, 0] = np.clip(source[0, 0].astype(int) + 10, 0, 255)  # one changed pixel, kept
    result[7, 7] = 0  # one changed pixel in the edit region
    keep = np.ones((8, 8), bool)
    keep[6:, 6:] = False
    diff = (result[0, 0].astype(float) - source[0, 0]) ** 2
    expected = 10 * math.log10(255**2 / (diff.sum() / (keep.sum() * 3)))
    assert masked_psnr(result, source, keep) == pytest.approx(expected, rel=1e-12)
    assert masked_psnr(source, source, keep) == math.inf


def test_keep_mask_covers_the_box_in_canvas_fractions():
    keep = keep_mask(10, 20, [0.5, 0.0, 1.0, 0.25])
    assert not keep[:3, 10:].any() and keep[3:, :].all() and keep[:, :10].all()
    assert keep_mask(4, 4, None).all()
    with pytest.raises(ValueError, match="edit_box"):
        keep_mask(4, 4, [0.1, 0.2])


def test_edit_preservation_rewards_keeping_the_outside_only():
    source = np.full((16, 16, 3), 255, np.uint8)
    inside = source.copy()
    inside[:8, :8] = 0  # changed only where the edit may change
    outside = source.copy()
    outside[8:, 8:] = 0
    meta = {"edit_box": [0.0, 0.0, 0.5, 0.5]}
    samples = [
        Sample(index=i, prompt="p", metadata=meta, image=img, source_images=[source])
        for i, img in enumerate([source, inside, outside])
    ]
    scores = edit_preservation(argparse.Namespace(), samples)
    assert scores[0] == 1.0 and scores[1] == 1.0
    assert scores[2] == pytest.approx(masked_psnr(outside, source, keep_mask(16, 16, meta["edit_box"])) / PSNR_CAP_DB)
    assert scores[2] < 0.2
    with pytest.raises(ValueError, match="needs an editing run"):
        edit_preservation(argparse.Namespace(), [Sample(index=0, prompt="p", image=source)])
