"""GenEval-like reward for the tiny shapes world: color, shape, count and position of the drawn objects.
Objects are 4-connected components of non-background pixels; each attribute is scored on its own, so samples get
graded partial credit (`reward`) besides the strict `all_correct`."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from miles.data.shapes import BACKGROUND, PALETTE, ShapeScene, position_axis

logger = logging.getLogger(__name__)

_COLOR_NAMES = list(PALETTE)
_COLORS = np.array([PALETTE[name] for name in _COLOR_NAMES], dtype=np.float32)
_BACKGROUND = np.array(BACKGROUND, dtype=np.float32)
_DIRECTIONS = _COLORS - _BACKGROUND
_DIRECTION_NORMS2 = (_DIRECTIONS**2).sum(axis=1)

# Shape cues, measured on rendered scenes (clean, and blurred + noisy): an upright triangle's ink sits low in its
# extent (skew ~0.13 vs 0 for the others); a square fills its extent (fill ~1.0 vs ~0.78 for a circle).
_SHAPE_NAMES = ("circle", "square", "triangle")
_TRIANGLE_SKEW, _SKEW_SCALE = 0.06, 0.012
_SQUARE_FILL, _FILL_SCALE = 0.87, 0.02
_FOREGROUND_ALPHA = 0.5
_INK_FLOOR = 0.1  # alpha below this is background noise
_MIN_AREA_FRACTION = 0.005
_MAX_OBJECTS = 16
_POSITION_RAMP = 0.1


@dataclass(frozen=True)
class ShapeScore:
    """Per-attribute scores in [0, 1], the objects found, whether every attribute is right (strict, GenEval's
    "correct"), and `reward`, the mean of the four attribute scores (partial credit)."""

    color: float
    shape: float
    count: float
    position: float
    num_objects: int
    all_correct: bool
    reward: float


def _to_rgb_array(image: np.ndarray | Image.Image) -> np.ndarray:
    """HxWx3 float32 in [0, 255] from a PIL image, a uint8 array, or a float array in [0, 1]."""
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"), dtype=np.float32)
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[2] != 3:
        raise ValueError(f"shapes reward expects an HxWx3 RGB image, got shape {array.shape}")
    if np.issubdtype(array.dtype, np.floating):
        return np.clip(array, 0.0, 1.0).astype(np.float32) * 255.0
    return array.astype(np.float32)


def classify_pixels(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per pixel of (..., 3) RGB: the palette color whose background-to-color line passes nearest, and its blend
    weight alpha. Reading a pixel as alpha * color + (1 - alpha) * background handles antialiased and blurred edges."""
    # Channel planes and elementwise products rather than a (pixels, 3) @ (3, colors) matmul: on a few cores a
    # threaded BLAS call this small is slower and far less predictable.
    planes = rgb.reshape(-1, 3).T - _BACKGROUND[:, None]
    dots = sum(_DIRECTIONS[:, c, None] * planes[c] for c in range(3))
    alphas = np.clip(dots / _DIRECTION_NORMS2[:, None], 0.0, 1.0)
    # |offset - alpha * direction|^2 less the constant |offset|^2, which does not change the argmin.
    residuals = alphas * (alphas * _DIRECTION_NORMS2[:, None] - 2 * dots)
    labels = residuals.argmin(axis=0)
    alpha = alphas[labels, np.arange(labels.size)]
    return labels.reshape(rgb.shape[:-1]), alpha.reshape(rgb.shape[:-1])


def label_components(mask: np.ndarray) -> np.ndarray:
    """4-connected component labels of a boolean (..., H, W) mask, each image on its own: a pixel gets the smallest
    flat H*W index in its component, background -1. Min-propagation plus pointer jumping: a few vectorised passes."""
    height, width = mask.shape[-2:]
    sentinel = mask.size
    labels = np.where(mask, np.arange(sentinel).reshape(mask.shape), sentinel)
    while True:
        new = labels.copy()
        np.minimum(new[..., 1:, :], labels[..., :-1, :], out=new[..., 1:, :])
        np.minimum(new[..., :-1, :], labels[..., 1:, :], out=new[..., :-1, :])
        np.minimum(new[..., :, 1:], labels[..., :, :-1], out=new[..., :, 1:])
        np.minimum(new[..., :, :-1], labels[..., :, 1:], out=new[..., :, :-1])
        new[~mask] = sentinel
        flat = np.append(new.ravel(), sentinel)
        new = flat[flat[new]]  # jump twice along the chain of smaller labels
        if np.array_equal(new, labels):
            break
        labels = new
    return np.where(mask, labels % (height * width), -1)


def shape_features(ink: np.ndarray) -> tuple[float, float]:
    """(fill, skew) of one object's soft ink in a window around it.

    fill: ink mass over the product of its soft extents (sums of the row and column maxima): ~1 square, ~pi/4
    circle, ~1/2 triangle, and stable under blur. skew: how far the ink centroid sits below the center of the
    vertical extent, in units of that extent: ~1/6 for an upright triangle, 0 for a circle or a square.
    """
    row_max, col_max = ink.max(axis=1), ink.max(axis=0)
    height, width, mass = row_max.sum(), col_max.sum(), ink.sum()
    rows = np.arange(ink.shape[0])
    skew = ((ink.sum(axis=1) @ rows) / mass - (row_max @ rows) / height) / height
    return float(mass / (height * width)), float(skew)


def shape_likeness(fill: float, skew: float) -> tuple[float, float, float]:
    """Soft (circle, square, triangle) probabilities: triangle or not by skew, then square or circle by fill."""
    triangle = 1 / (1 + math.exp(-(skew - _TRIANGLE_SKEW) / _SKEW_SCALE))
    square = 1 / (1 + math.exp(-(fill - _SQUARE_FILL) / _FILL_SCALE))
    return (1 - triangle) * (1 - square), (1 - triangle) * square, triangle


def score_shapes_image(image: np.ndarray | Image.Image, metadata: dict[str, Any]) -> ShapeScore:
    """Score one image (PIL, HxWx3 uint8, or float in [0, 1]) against its scene metadata (`ShapeScene` keys)."""
    return shapes_reward([image], [metadata])[0]


def shapes_reward(images: Sequence[np.ndarray | Image.Image], metadatas: list[dict[str, Any]]) -> list[ShapeScore]:
    """Score a batch: one `ShapeScore` per (image, metadata) pair; same-size images are scored together."""
    if len(images) != len(metadatas):
        raise ValueError(f"shapes_reward got {len(images)} images but {len(metadatas)} metadata dicts")
    scenes = [ShapeScene.from_metadata(metadata) for metadata in metadatas]
    arrays = [_to_rgb_array(image) for image in images]
    scores: dict[int, ShapeScore] = {}
    for size in {array.shape for array in arrays}:
        indices = [i for i, array in enumerate(arrays) if array.shape == size]
        batch = _score_batch([scenes[i] for i in indices], np.stack([arrays[i] for i in indices]))
        scores.update(zip(indices, batch))
    return [scores[i] for i in range(len(arrays))]


def _score_batch(scenes: list[ShapeScene], rgb: np.ndarray) -> list[ShapeScore]:
    """Score (B, H, W, 3) images. Objects: components of at least `_MIN_AREA_FRACTION` of the canvas.

    color: share of the objects' ink in the wanted color; shape: mean likeness of the objects to the wanted
    shape; count: 0.5 ** |objects - wanted|; position: lead of the ink centroid toward the wanted side (a ramp).
    """
    num, height, width = rgb.shape[:3]
    color_labels, alpha = classify_pixels(rgb)
    labels = label_components(alpha >= _FOREGROUND_ALPHA)

    # Per image, per component root (column 0: background): its area, whether it is an object, its pixels' weights.
    slots = (labels + 1).reshape(num, -1)
    offsets = np.arange(num)[:, None] * (height * width + 1)
    areas = np.bincount((slots + offsets).ravel(), minlength=num * (height * width + 1)).reshape(num, -1)
    is_object = areas >= max(2, math.ceil(_MIN_AREA_FRACTION * height * width))
    is_object[:, 0] = False
    weights = np.where(is_object[np.arange(num)[:, None], slots].reshape(alpha.shape), alpha, 0.0)
    totals = np.maximum(weights.sum(axis=(1, 2)), 1e-8)

    wanted_colors = np.array([_COLOR_NAMES.index(scene.color) for scene in scenes])
    colors = np.where(color_labels == wanted_colors[:, None, None], weights, 0.0).sum(axis=(1, 2)) / totals
    centroids_x = weights.sum(axis=1) @ np.arange(width) / totals
    centroids_y = weights.sum(axis=2) @ np.arange(height) / totals
    # Centroid offsets from the canvas center in half-canvas units, [-1, 1].
    offsets_xy = np.stack(
        [2 * centroids_x / width - (width - 1) / width, 2 * centroids_y / height - (height - 1) / height]
    )
    ink = np.clip((alpha - _INK_FLOOR) / (1 - 2 * _INK_FLOOR), 0.0, 1.0)

    scores = []
    for k, scene in enumerate(scenes):
        roots = np.flatnonzero(is_object[k]) - 1
        if roots.size == 0:
            scores.append(ShapeScore(0.0, 0.0, 0.0, 0.0, 0, False, 0.0))
            continue
        if roots.size > _MAX_OBJECTS:
            roots = roots[np.argsort(-areas[k, roots + 1], kind="stable")[:_MAX_OBJECTS]]
        shape, shape_ok = _shape_score(scene.shape, labels[k], ink[k], roots)
        num_objects = int(is_object[k].sum())
        count = 0.5 ** abs(num_objects - scene.count)
        axis, direction = position_axis(scene.position)
        lead = direction * offsets_xy[axis, k] - abs(offsets_xy[1 - axis, k])
        position = float(min(max(lead / _POSITION_RAMP, 0.0), 1.0))
        color = float(colors[k])
        all_correct = color > 0.5 and shape_ok and count == 1.0 and position >= 0.5
        reward = (color + shape + count + position) / 4
        scores.append(ShapeScore(color, shape, count, position, num_objects, all_correct, reward))
    return scores


def _shape_score(wanted: str, labels: np.ndarray, ink: np.ndarray, roots: np.ndarray) -> tuple[float, bool]:
    """Mean likeness of the objects to the wanted shape, and whether it is each object's likeliest shape."""
    wanted_index = _SHAPE_NAMES.index(wanted)
    likeness, all_match = 0.0, True
    for root in roots:
        # The object's soft ink in its bounding box grown by a pixel (blur spreads past the mask), minus other objects.
        component = labels == root
        rows, cols = np.flatnonzero(component.any(axis=1)), np.flatnonzero(component.any(axis=0))
        window = (slice(max(rows[0] - 1, 0), rows[-1] + 2), slice(max(cols[0] - 1, 0), cols[-1] + 2))
        others = (labels[window] >= 0) & ~component[window]
        probs = shape_likeness(*shape_features(np.where(others, 0.0, ink[window])))
        likeness += probs[wanted_index]
        all_match = all_match and max(range(3), key=probs.__getitem__) == wanted_index
    return likeness / len(roots), all_match
