"""The tiny shapes world: procedural text-to-image items (a group of colored shapes and its caption), deterministic by seed.

Scorer: `miles.rollout.rm_hub.shapes`. On-disk format: `write_shapes_jsonl` (what `--prompt-data file.jsonl` reads).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from miles.utils.seeding import stream_rng

logger = logging.getLogger(__name__)

BUILTIN_SHAPES = "builtin:shapes"

# Saturated colors far apart in RGB (pairwise distance >= 125) and far from the white background.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (225, 30, 30),
    "green": (25, 160, 45),
    "blue": (30, 70, 230),
    "yellow": (240, 200, 0),
    "purple": (150, 40, 200),
}
BACKGROUND: tuple[int, int, int] = (255, 255, 255)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
COUNTS: tuple[int, ...] = (1, 2, 3)
POSITIONS: tuple[str, ...] = ("left", "right", "top", "bottom")
COUNT_WORDS: dict[int, str] = {1: "a", 2: "two", 3: "three"}
SPLITS: dict[str, int] = {"train": 0, "eval": 1}

# Layout, in fractions of the canvas side: shape size range, gap between shapes, margin to the canvas edge, and the
# least lead of the group centroid along its position's axis over the other axis (so "left" is never "top").
SIZE_RANGE = (0.2, 0.25)
GAP = 2 / 32
MARGIN = 1 / 32
MIN_POSITION_LEAD = 0.2
_SUPERSAMPLE = 4


@dataclass(frozen=True)
class ShapeScene:
    """One group of identical shapes: what a caption says and the scorer checks."""

    color: str
    shape: str
    count: int
    position: str

    def __post_init__(self) -> None:
        problems = []
        if self.color not in PALETTE:
            problems.append(f"color {self.color!r} not in {sorted(PALETTE)}")
        if self.shape not in SHAPES:
            problems.append(f"shape {self.shape!r} not in {list(SHAPES)}")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count not in COUNTS:
            problems.append(f"count {self.count!r} not an int in {list(COUNTS)}")
        if self.position not in POSITIONS:
            problems.append(f"position {self.position!r} not in {list(POSITIONS)}")
        if problems:
            raise ValueError("invalid shapes scene: " + "; ".join(problems))

    def caption(self) -> str:
        """'a red circle on the left', 'three blue triangles on the top'."""
        noun = self.shape if self.count == 1 else self.shape + "s"
        return f"{COUNT_WORDS[self.count]} {self.color} {noun} on the {self.position}"

    def to_metadata(self) -> dict[str, Any]:
        return {"color": self.color, "shape": self.shape, "count": self.count, "position": self.position}

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> ShapeScene:
        """Build from a metadata dict (extra keys are ignored); raises ValueError naming what is missing or wrong."""
        if not isinstance(metadata, dict):
            raise ValueError(f"shapes metadata must be a dict, got {type(metadata).__name__}")
        missing = [key for key in ("color", "shape", "count", "position") if key not in metadata]
        if missing:
            raise ValueError(
                f"shapes metadata is missing {missing} (has {sorted(metadata)}); "
                "expected keys color, shape, count, position as written by write_shapes_jsonl"
            )
        return cls(metadata["color"], metadata["shape"], metadata["count"], metadata["position"])


def sample_scene(rng: np.random.Generator) -> ShapeScene:
    """Uniform over palette x shapes x counts x positions (5 * 3 * 3 * 4 = 180 scenes)."""
    colors = list(PALETTE)
    return ShapeScene(
        color=colors[rng.integers(len(colors))],
        shape=SHAPES[rng.integers(len(SHAPES))],
        count=int(COUNTS[rng.integers(len(COUNTS))]),
        position=POSITIONS[rng.integers(len(POSITIONS))],
    )


def position_axis(position: str) -> tuple[int, float]:
    """(axis: 0 for x, 1 for y; direction, +1 or -1, from the canvas center toward the named side along it)."""
    return {"left": (0, -1.0), "right": (0, 1.0), "top": (1, -1.0), "bottom": (1, 1.0)}[position]


def _position_lead(
    scene: ShapeScene, xs: np.ndarray, ys: np.ndarray, sizes: np.ndarray, axis: int, direction: float
) -> float:
    """How far the group's mass centroid leads along its position's axis over the other, in half-canvas units."""
    weights = sizes**2
    if scene.shape == "triangle":
        ys = ys + sizes / 6  # an upright triangle's centroid sits a third of the way up from its base
    offsets = 2 * (np.array([np.average(xs, weights=weights), np.average(ys, weights=weights)]) - 0.5)
    return float(direction * offsets[axis] - abs(offsets[1 - axis]))


def sample_layout(scene: ShapeScene, rng: np.random.Generator) -> list[tuple[float, float, float]]:
    """Shape centers and sizes (cx, cy, size) in canvas fractions: a column of shapes in the scene's half-canvas.

    Shapes line up along the half's long side with random sizes and spacing (gaps >= GAP) and jitter across it;
    draws repeat until the group's centroid clearly reads as the scene's position.
    """
    axis, direction = position_axis(scene.position)
    for _ in range(100):
        sizes = rng.uniform(*SIZE_RANGE, size=scene.count)
        spare = 1 - 2 * MARGIN - sizes.sum() - GAP * (scene.count - 1)
        slack = spare * rng.dirichlet(np.ones(scene.count + 1))
        before = np.concatenate([[0.0], np.cumsum(sizes + GAP + slack[1:])[:-1]])
        along = MARGIN + slack[0] + before + sizes / 2
        # Across: inside the half, between the canvas edge margin and the midline.
        lo, hi = (MARGIN + sizes / 2, 0.5 - sizes / 2) if direction < 0 else (0.5 + sizes / 2, 1 - MARGIN - sizes / 2)
        across = rng.uniform(lo, hi)
        xs, ys = (across, along) if axis == 0 else (along, across)
        if _position_lead(scene, xs, ys, sizes, axis, direction) >= MIN_POSITION_LEAD:
            break
    else:  # pragma: no cover - the draws above almost never all fail; fall back to a centered column
        along = along - along.mean() + 0.5
        xs, ys = (across, along) if axis == 0 else (along, across)
    return [(float(x), float(y), float(s)) for x, y, s in zip(xs, ys, sizes)]


def render_scene(scene: ShapeScene, rng: np.random.Generator, resolution: int = 32) -> Image.Image:
    """Draw the scene (layout from `rng`) at 4x resolution and box-downsample: exact area antialiasing."""
    return draw_layout(scene, sample_layout(scene, rng), resolution)


def draw_layout(scene: ShapeScene, layout: list[tuple[float, float, float]], resolution: int = 32) -> Image.Image:
    """The scene's shapes at the given (cx, cy, size) places (`sample_layout`), drawn as `render_scene` draws."""
    big = resolution * _SUPERSAMPLE
    image = Image.new("RGB", (big, big), BACKGROUND)
    draw = ImageDraw.Draw(image)
    fill = PALETTE[scene.color]
    for cx, cy, size in layout:
        x0, y0, x1, y1 = ((cx - size / 2) * big, (cy - size / 2) * big, (cx + size / 2) * big, (cy + size / 2) * big)
        if scene.shape == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif scene.shape == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        else:  # upright triangle, base = height = size, so it fills half its bounding box
            draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
    return image.resize((resolution, resolution), Image.Resampling.BOX)


def _item_rng(seed: int, split: str, index: int) -> np.random.Generator:
    if split not in SPLITS:
        raise ValueError(f"unknown shapes split {split!r}; use one of {list(SPLITS)}")
    return stream_rng(seed, SPLITS[split], index)


def shapes_prompts(num: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """`shapes_items` without the images (cheap): [{"prompt", "metadata"}], same scenes for the same arguments."""
    items = []
    for index in range(num):
        scene = sample_scene(_item_rng(seed, split, index))
        items.append({"prompt": scene.caption(), "metadata": scene.to_metadata()})
    return items


def shapes_items(num: int, seed: int, split: str = "train", resolution: int = 32) -> list[dict[str, Any]]:
    """[{"prompt", "metadata", "image"}]; item i depends only on (seed, split, i), so a longer list extends a shorter.

    The "eval" split draws from its own seed stream: same distribution, independent layouts. Only 180 captions
    exist, so captions repeat across splits; images do not.
    """
    items = []
    for index in range(num):
        rng = _item_rng(seed, split, index)
        scene = sample_scene(rng)
        image = render_scene(scene, rng, resolution)
        items.append({"prompt": scene.caption(), "metadata": scene.to_metadata(), "image": image})
    return items


def write_shapes_jsonl(path: str | Path, num: int, seed: int, split: str = "train", resolution: int = 32) -> Path:
    """Write `num` items as PNGs in `<stem>_images/` beside a JSONL of {"prompt", "image" (relative path), "metadata"}."""
    path = Path(path)
    image_dir = path.parent / f"{path.stem}_images"
    image_dir.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for index, item in enumerate(shapes_items(num, seed, split, resolution)):
            image_path = image_dir / f"{index:06d}.png"
            item["image"].save(image_path)
            record = {
                "prompt": item["prompt"],
                "image": image_path.relative_to(path.parent).as_posix(),
                "metadata": item["metadata"],
            }
            f.write(json.dumps(record) + "\n")
    logger.info("wrote %d shapes items (%s, seed %d) to %s", num, split, seed, path)
    return path
