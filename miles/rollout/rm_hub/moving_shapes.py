"""The reward of the moving-shapes video world (`builtin:moving-shapes`): per clip, the colour, the shape and the
direction of motion of what is drawn, each scored on its own (partial credit), and the strict `all_correct`.

Per frame, pixels are read as blends of the background and one palette colour (`shapes.classify_pixels`: robust to
antialiasing and blur); the frame's object is its largest 4-connected component of ink. colour: the share of the
objects' ink in the wanted colour; shape: the object's likeness to the wanted shape (`shapes.shape_likeness` of its
soft ink); both averaged over the frames. direction: the ink centroid's travel over the clip (the least-squares
line through its per-frame positions, first frame to last), its component along the wanted direction less the
absolute component across it, as a ramp reaching 1 at `DIRECTION_RAMP` of the canvas (the world's shapes travel
0.3-0.45)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from miles.data.moving_shapes import DIRECTIONS, MovingScene
from miles.data.shapes import PALETTE
from miles.rollout.rm_hub.shapes import (
    _FOREGROUND_ALPHA,
    _INK_FLOOR,
    _MIN_AREA_FRACTION,
    _SHAPE_NAMES,
    _to_rgb_array,
    classify_pixels,
    label_components,
    shape_features,
    shape_likeness,
)

DIRECTION_RAMP = 0.15  # canvas fractions of travel along the wanted direction (net of drift across it) for a 1
_COLOR_NAMES = list(PALETTE)  # classify_pixels labels pixels by their index in the palette


@dataclass(frozen=True)
class MovingShapeScore:
    """Attribute scores in [0, 1], the mean objects per frame, the travel (dx, dy) of the ink centroid in canvas
    fractions, whether every attribute is right (`all_correct`: colour share > 0.5, the wanted shape the likeliest
    on average, direction >= 0.5) and `reward`, the mean of the three attribute scores."""

    color: float
    shape: float
    direction: float
    num_objects: float
    travel: tuple[float, float]
    all_correct: bool
    reward: float


def _to_clip(frames: Any) -> np.ndarray:
    """(F, H, W, 3) float32 in [0, 255] from uint8 frames or floats in [0, 1]."""
    array = np.asarray(frames)
    if array.ndim != 4 or array.shape[-1] != 3 or array.shape[0] < 2:
        raise ValueError(f"the moving_shapes reward scores clips (F >= 2, H, W, 3), got shape {array.shape}")
    return np.stack([_to_rgb_array(frame) for frame in array])


def score_clip(frames: Any, metadata: dict[str, Any]) -> MovingShapeScore:
    """Score one clip (F, H, W, 3) against its scene metadata (`MovingScene` keys)."""
    return moving_shapes_reward([frames], [metadata])[0]


def moving_shapes_reward(clips: list[Any], metadatas: list[dict[str, Any]]) -> list[MovingShapeScore]:
    """One `MovingShapeScore` per (clip, metadata) pair."""
    if len(clips) != len(metadatas):
        raise ValueError(f"moving_shapes_reward got {len(clips)} clips but {len(metadatas)} metadata dicts")
    return [_score(_to_clip(clip), MovingScene.from_metadata(meta)) for clip, meta in zip(clips, metadatas)]


def _score(rgb: np.ndarray, scene: MovingScene) -> MovingShapeScore:
    num, height, width = rgb.shape[:3]
    labels_color, alpha = classify_pixels(rgb)  # (F, H, W) each
    components = label_components(alpha >= _FOREGROUND_ALPHA)
    ink = np.clip((alpha - _INK_FLOOR) / (1 - 2 * _INK_FLOOR), 0.0, 1.0)
    min_area = max(2, math.ceil(_MIN_AREA_FRACTION * height * width))
    wanted_color, wanted_shape = _COLOR_NAMES.index(scene.color), _SHAPE_NAMES.index(scene.shape)
    colors, shapes, counts, centroids, inked = [], [], [], [], []
    for f in range(num):
        roots, areas = np.unique(components[f][components[f] >= 0], return_counts=True)
        objects = roots[areas >= min_area]
        counts.append(len(objects))
        if len(objects) == 0:
            colors.append(0.0)
            shapes.append(0.0)
            continue
        on_objects = np.isin(components[f], objects)
        weights = np.where(on_objects, alpha[f], 0.0)
        total = max(float(weights.sum()), 1e-8)
        colors.append(float(weights[labels_color[f] == wanted_color].sum()) / total)
        ys, xs = np.indices((height, width))
        inked.append(f)
        centroids.append(((weights * (xs + 0.5)).sum() / total / width, (weights * (ys + 0.5)).sum() / total / height))
        # the largest object's soft ink in its bounding box grown by a pixel, other objects' ink removed
        largest = objects[np.argmax(areas[areas >= min_area])]
        component = components[f] == largest
        rows, cols = np.flatnonzero(component.any(axis=1)), np.flatnonzero(component.any(axis=0))
        window = (slice(max(rows[0] - 1, 0), rows[-1] + 2), slice(max(cols[0] - 1, 0), cols[-1] + 2))
        others = (components[f][window] >= 0) & ~component[window]
        probs = shape_likeness(*shape_features(np.where(others, 0.0, ink[f][window])))
        shapes.append(float(probs[wanted_shape]))
    travel = _travel(centroids, inked, num)
    (ux, uy), _ = DIRECTIONS[scene.direction]
    along = travel[0] * ux + travel[1] * uy
    across = abs(travel[0] * uy - travel[1] * ux)
    direction = float(min(max((along - across) / DIRECTION_RAMP, 0.0), 1.0))
    color, shape = float(np.mean(colors)), float(np.mean(shapes))
    all_correct = color > 0.5 and shape >= 0.5 and direction >= 0.5 and min(counts) >= 1
    return MovingShapeScore(
        color=color,
        shape=shape,
        direction=direction,
        num_objects=float(np.mean(counts)),
        travel=(round(float(travel[0]), 5), round(float(travel[1]), 5)),
        all_correct=bool(all_correct),
        reward=(color + shape + direction) / 3,
    )


def _travel(centroids: list[tuple[float, float]], frames: list[int], num_frames: int) -> tuple[float, float]:
    """The centroid's travel from the first frame to the last: the slope of the least-squares line through its
    positions at the frames that have ink, times the clip's length; (0, 0) with fewer than two such frames."""
    if len(frames) < 2:
        return 0.0, 0.0
    t = np.asarray(frames, dtype=np.float64)
    points = np.asarray(centroids, dtype=np.float64)
    slope = ((t - t.mean())[:, None] * (points - points.mean(axis=0))).sum(axis=0) / ((t - t.mean()) ** 2).sum()
    return float(slope[0] * (num_frames - 1)), float(slope[1] * (num_frames - 1))
