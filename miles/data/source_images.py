"""Source images of editing and image-to-video prompts: the paths a prompt record names (`image` or `images`,
relative to its file), checked at start-up (a missing or undecodable file names the file and line), and loaded as
(H, W, 3) uint8 arrays at the run's resolution."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

SOURCE_IMAGE_KEYS = ("image", "images")  # one path, or a list of paths


def source_image_paths(row: dict[str, Any], base: str, where: str) -> list[str]:
    """The source image paths of one JSONL row, resolved against `base` (the file's folder) and checked to decode;
    `where` ("FILE:LINE") prefixes every error."""
    single, several = row.get("image"), row.get("images")
    if single is not None and several is not None:
        raise ValueError(f"{where}: give the source image as 'image' or the source images as 'images', not both")
    if single is None and several is None:
        raise ValueError(
            f"{where}: no source image: this model edits or animates an image, so every record needs an "
            "'image' path (or an 'images' list), relative to the prompt file"
        )
    paths = [single] if several is None else several
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p for p in paths):
        raise ValueError(f"{where}: 'images' must be a non-empty list of image paths, got {several!r:.80}")
    resolved = []
    for k, path in enumerate(paths):
        full = path if os.path.isabs(path) else os.path.join(base, path)
        check_image_file(full, f"{where}: source image {k} ({path})")
        resolved.append(full)
    return resolved


def check_image_file(path: str, where: str) -> None:
    """`path` exists and decodes as an image (PIL's header check and `verify`); errors start with `where`."""
    if not os.path.isfile(path):
        raise ValueError(f"{where}: file {path} not found")
    try:
        with Image.open(path) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise ValueError(f"{where}: {path} is not a readable image ({exc})") from None


def load_source_image(image: Any, resolution: int) -> np.ndarray:
    """A path, a PIL image or an (H, W, 3) uint8 array -> (resolution, resolution, 3) uint8, RGB, resized bicubic
    (the same resize as sft_loss's target images) when its size differs."""
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ValueError(f"a source image array must be (H, W, 3) uint8, got {image.shape} {image.dtype}")
        if image.shape[:2] == (resolution, resolution):
            return image
        image = Image.fromarray(image)
    elif isinstance(image, str):
        try:
            with Image.open(image) as opened:
                image = opened.convert("RGB")
        except (UnidentifiedImageError, OSError) as exc:
            raise ValueError(f"cannot read source image {image}: {exc}") from None
    image = image.convert("RGB")
    if image.size != (resolution, resolution):
        image = image.resize((resolution, resolution), Image.BICUBIC)
    return np.asarray(image, dtype=np.uint8).copy()


def load_source_images(images: list[Any] | None, resolution: int) -> list[np.ndarray] | None:
    """A record's source images (paths or arrays) loaded at `resolution`; None stays None (a text-only prompt)."""
    if images is None:
        return None
    return [load_source_image(image, resolution) for image in images]
