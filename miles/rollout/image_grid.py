"""Image grids of a rollout's samples: one row per prompt group, saved as PNG."""

from __future__ import annotations

import math
import os

import numpy as np
from PIL import Image


def save_image_grid(images: np.ndarray, path: str, columns: int | None = None, max_images: int = 64) -> str:
    """`images` (N, H, W, 3) uint8 -> one PNG; `columns` defaults to a square-ish grid."""
    images = images[:max_images]
    count, height, width, _ = images.shape
    columns = columns or math.ceil(math.sqrt(count))
    rows = math.ceil(count / columns)
    grid = np.full((rows * height, columns * width, 3), 255, dtype=np.uint8)
    for i, image in enumerate(images):
        r, c = divmod(i, columns)
        grid[r * height : (r + 1) * height, c * width : (c + 1) * width] = image
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    Image.fromarray(grid).save(path)
    return path
