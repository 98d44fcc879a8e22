"""Source images of editing and image-to-video prompts: the paths a prompt record names (`image` or `images`,
relative to its file) or a folder of pairs holds, checked at start-up (a missing or undecodable file names the file
and line), and loaded as (H, W, 3) uint8 arrays at the run's resolution."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

SOURCE_IMAGE_KEYS = ("image", "images")  # one path, or a list of paths
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
TARGET_SUFFIX = "_target"  # a folder of pairs' sft_loss target: NAME_target.png beside NAME.png


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
        image = image.resize((resolution, resolution), Image.Resampling.BICUBIC)
    return np.asarray(image, dtype=np.uint8).copy()


def load_source_images(images: list[Any] | None, resolution: int) -> list[np.ndarray] | None:
    """A record's source images (paths or arrays) loaded at `resolution`; None stays None (a text-only prompt)."""
    if images is None:
        return None
    return [load_source_image(image, resolution) for image in images]


def read_pairs_folder(folder: str, *, targets: bool, flag: str = "--prompt-data") -> list[dict[str, Any]]:
    """Records of a folder of pairs: each `NAME.txt` holds an instruction, `NAME.png` (or .jpg, .jpeg, .webp) is its
    source image, `NAME.json` its metadata (optional) and, with `targets` (sft_loss), `NAME_target.png` its target.
    Records in name order; a missing or undecodable file is an error naming it."""
    root = Path(folder)
    records = []
    for text in sorted(root.glob("*.txt")):
        where = f"{flag} {folder}: {text.name}"
        prompt = text.read_text(encoding="utf-8").strip()
        if not prompt:
            raise ValueError(f"{where}: empty instruction")
        source = _image_beside(text.with_suffix(""), where, "source image")
        record: dict[str, Any] = {"prompt": prompt, "metadata": {}, "source_images": [str(source)]}
        meta = text.with_suffix(".json")
        if meta.is_file():
            try:
                record["metadata"] = json.loads(meta.read_text(encoding="utf-8"))
            except ValueError as exc:
                raise ValueError(f"{flag} {folder}: {meta.name} is not JSON ({exc})") from None
            if not isinstance(record["metadata"], dict):
                raise ValueError(f"{flag} {folder}: {meta.name} must hold a JSON object")
        if targets:
            record["image"] = str(_image_beside(text.with_name(text.stem + TARGET_SUFFIX), where, "target image"))
        records.append(record)
    if not records:
        raise ValueError(f"{flag} {folder}: no NAME.txt instructions in the folder (a folder of editing pairs)")
    return records


def _image_beside(stem: Path, where: str, what: str) -> Path:
    for suffix in IMAGE_SUFFIXES:
        path = stem.with_name(stem.name + suffix)
        if path.is_file():
            check_image_file(str(path), f"{where}: {what}")
            return path
    raise ValueError(f"{where}: no {what} {stem.name}{{{','.join(IMAGE_SUFFIXES)}}} beside it")
