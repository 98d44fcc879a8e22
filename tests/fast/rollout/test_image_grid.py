"""A rollout's image grid: a square-ish grid (or the columns asked), row-major, white where no image is, capped."""

from __future__ import annotations

import numpy as np
from PIL import Image

from miles.rollout.image_grid import save_image_grid


def test_images_fill_a_square_ish_grid_row_major_with_white_after_the_last(tmp_path):
    images = np.stack([np.full((2, 3, 3), 10 * i, dtype=np.uint8) for i in range(5)])
    path = save_image_grid(images, str(tmp_path / "new" / "grid.png"))  # its folder is made
    grid = np.asarray(Image.open(path))
    assert grid.shape == (2 * 2, 3 * 3, 3)  # 5 images: 3 columns, 2 rows
    assert [grid[r * 2, c * 3, 0] for r in range(2) for c in range(3)] == [0, 10, 20, 30, 40, 255]


def test_columns_and_the_cap_are_honoured(tmp_path):
    images = np.zeros((10, 2, 2, 3), dtype=np.uint8)
    grid = np.asarray(Image.open(save_image_grid(images, str(tmp_path / "g.png"), columns=4, max_images=6)))
    assert grid.shape == (2 * 2, 4 * 2, 3) and grid[2:, 4:].min() == 255  # 6 images: the last two cells white
