"""JPEG-size rewards (DDPO / Flow-GRPO): how small or large an image gets when saved as JPEG at quality 95.

Also `sample_pil_image`, the one place that turns a sample's image into an RGB PIL image for the image rewards.
"""

from __future__ import annotations

import argparse
import io
import logging
from typing import Any

import numpy as np
from PIL import Image

from miles.utils.types import Sample

logger = logging.getLogger(__name__)

JPEG_QUALITY = 95
# Flow-GRPO divides the size in kB by 500 so the reward sits near [-1, 0] for 512px images.
JPEG_SCALE_KB = 500.0


def as_pil_image(image: Any) -> Image.Image:
    """RGB PIL image from a PIL image, an HxWx3 uint8 array, or an HxWx3 float array in [0, 1]."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[2] != 3:
        raise ValueError(f"expected an HxWx3 RGB image, got an array of shape {array.shape}")
    if np.issubdtype(array.dtype, np.floating):
        array = np.round(np.clip(array, 0.0, 1.0) * 255.0)
    elif array.dtype != np.uint8:
        raise ValueError(f"expected a uint8 or float RGB image, got dtype {array.dtype}")
    return Image.fromarray(array.astype(np.uint8))


def sample_pil_image(sample: Sample) -> Image.Image:
    """The sample's image as RGB PIL; a sample without an image is an error (the engine did not decode it)."""
    if sample.image is None:
        if sample.frames is not None:
            raise ValueError("sample is video (sample.frames), not an image: this reward scores images only")
        raise ValueError("sample has no image (sample.image is None)")
    return as_pil_image(sample.image)


def jpeg_size_kb(image: Any) -> float:
    """Size in kB (1000 bytes) of the image saved as JPEG at quality 95."""
    buffer = io.BytesIO()
    as_pil_image(image).save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.tell() / 1000.0


async def jpeg_compressibility(args: argparse.Namespace, samples: list[Sample]) -> list[float]:
    """-jpeg_size_kb / 500 per image (Flow-GRPO): higher for images that compress well (flat, smooth)."""
    return [-jpeg_size_kb(sample_pil_image(sample)) / JPEG_SCALE_KB for sample in samples]


async def jpeg_incompressibility(args: argparse.Namespace, samples: list[Sample]) -> list[float]:
    """+jpeg_size_kb / 500 per image: higher for busy, detailed images."""
    return [jpeg_size_kb(sample_pil_image(sample)) / JPEG_SCALE_KB for sample in samples]
