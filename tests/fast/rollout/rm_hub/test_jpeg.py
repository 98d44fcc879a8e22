"""JPEG rewards: -size_kB / 500 (compressibility) and +size_kB / 500 at quality 95, per image."""

import argparse
import asyncio

import numpy as np
import pytest
from PIL import Image

from miles.rollout.rm_hub.jpeg import jpeg_compressibility, jpeg_incompressibility
from miles.utils.types import Sample


def images():
    rng = np.random.default_rng(0)
    flat = np.full((64, 64, 3), 120, dtype=np.uint8)
    noisy = rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    return flat, noisy


def score(fn, imgs):
    samples = [Sample(index=i, prompt="p", image=img) for i, img in enumerate(imgs)]
    return asyncio.run(fn(argparse.Namespace(), samples))


def test_flat_image_compresses_better_than_noise():
    flat, noisy = images()
    compress = score(jpeg_compressibility, [flat, noisy])
    assert compress[0] > compress[1]
    incompress = score(jpeg_incompressibility, [flat, noisy])
    assert incompress[1] > incompress[0]


def test_formula_matches_file_size_on_disk(tmp_path):
    _, noisy = images()
    path = tmp_path / "x.jpg"
    Image.fromarray(noisy).save(path, format="JPEG", quality=95)
    size_kb = path.stat().st_size / 1000
    assert score(jpeg_compressibility, [noisy]) == pytest.approx([-size_kb / 500])
    assert score(jpeg_incompressibility, [noisy]) == pytest.approx([size_kb / 500])


def test_pil_uint8_and_float_images_agree():
    _, noisy = images()
    as_float = noisy.astype(np.float64) / 255.0
    values = score(jpeg_compressibility, [noisy, Image.fromarray(noisy), as_float])
    assert values[0] == values[1] == values[2]
