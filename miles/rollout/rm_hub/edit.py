"""Edit rewards that need no download: how much of the source image an edit kept outside the region it was asked to
change (`edit_preservation`, a masked PSNR against the source). The instruction half of the shapes edit world is the
`shapes` reward: a `builtin:shapes-edit` record's metadata is its target scene."""

from __future__ import annotations

import argparse
import math
from typing import Any

import numpy as np

from miles.utils.types import Sample

PSNR_CAP_DB = 40.0  # a kept region this close to the source scores 1: beyond it the VAE round trip is the limit


def masked_psnr(result: np.ndarray, source: np.ndarray, keep: np.ndarray) -> float:
    """PSNR (dB, 8-bit peak) of `result` against `source` over the pixels where `keep` (H, W) is True; inf when they
    are equal there, and inf for an empty mask (nothing had to be kept)."""
    if result.shape != source.shape:
        raise ValueError(f"edit_preservation: result {result.shape} and source {source.shape} differ in size")
    if not keep.any():
        return math.inf
    diff = result.astype(np.float64)[keep] - source.astype(np.float64)[keep]
    mse = float(np.mean(diff**2))
    return math.inf if mse == 0 else 10.0 * math.log10(255.0**2 / mse)


def keep_mask(height: int, width: int, edit_box: Any) -> np.ndarray:
    """True outside the edit region: `edit_box` (x0, y0, x1, y1) in canvas fractions, or None (keep everything)."""
    keep = np.ones((height, width), dtype=bool)
    if edit_box is None:
        return keep
    if not (isinstance(edit_box, (list, tuple)) and len(edit_box) == 4):
        raise ValueError(f"metadata edit_box must be [x0, y0, x1, y1] in canvas fractions, got {edit_box!r:.80}")
    x0, y0, x1, y1 = (float(v) for v in edit_box)
    keep[
        int(math.floor(y0 * height)) : int(math.ceil(y1 * height)),
        int(math.floor(x0 * width)) : int(math.ceil(x1 * width)),
    ] = False
    return keep


def edit_preservation(args: argparse.Namespace, samples: list[Sample]) -> list[float]:
    """min(masked PSNR, 40 dB) / 40 of each result against its first source image, outside `metadata["edit_box"]`
    (the whole image when absent); needs `sample.source_images` (an editing run)."""
    scores = []
    for sample in samples:
        if not sample.source_images:
            raise ValueError(
                "edit_preservation compares the result with its source image, but this sample has none: it needs an "
                "editing run (prompts with source images)"
            )
        source = np.asarray(sample.source_images[0])
        result = np.asarray(sample.image)
        keep = keep_mask(result.shape[0], result.shape[1], sample.metadata.get("edit_box"))
        scores.append(min(masked_psnr(result, source, keep), PSNR_CAP_DB) / PSNR_CAP_DB)
    return scores
