"""The moving-shapes video world (`builtin:moving-shapes`): procedural clips of one coloured shape moving in a
straight line ("a red circle moving to the left"), deterministic by seed. A clip is `NUM_FRAMES` square frames
(4k + 1, as Wan's VAE wants) on the shapes world's white canvas and palette; the metadata names the colour, shape and
direction and records the trajectory (the shape's centre per frame, in canvas fractions) and size.

Scorer: `miles.rollout.rm_hub.moving_shapes`. Items of the "train" and "eval" splits come from independent seed
streams (the same 60 captions, other trajectories).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from miles.data.shapes import BACKGROUND, PALETTE, SHAPES, SPLITS
from miles.utils.seeding import stream_rng

BUILTIN_MOVING_SHAPES = "builtin:moving-shapes"  # also in miles.arguments.evaluation (torch- and data-free)
NUM_FRAMES = 5  # 4k + 1: Wan's VAE keeps the first frame apart
RESOLUTION = 32
# direction -> (unit step in image coordinates, x right and y down; the caption's words)
DIRECTIONS: dict[str, tuple[tuple[float, float], str]] = {
    "left": ((-1.0, 0.0), "moving to the left"),
    "right": ((1.0, 0.0), "moving to the right"),
    "up": ((0.0, -1.0), "moving up"),
    "down": ((0.0, 1.0), "moving down"),
}
# In canvas fractions: the shape's side, how far its centre travels from the first frame to the last, the margin
# its extent keeps from the canvas edge.
SIZE_RANGE = (0.28, 0.34)
TRAVEL_RANGE = (0.3, 0.45)
MARGIN = 1 / 32
_STREAM = 11  # the world's seed streams are independent of the shapes worlds' (same seed, other items)
_SUPERSAMPLE = 4


@dataclass(frozen=True)
class MovingScene:
    """What a caption says and the reward checks: one shape of one colour moving in one direction."""

    color: str
    shape: str
    direction: str

    def __post_init__(self) -> None:
        problems = []
        if self.color not in PALETTE:
            problems.append(f"color {self.color!r} not in {sorted(PALETTE)}")
        if self.shape not in SHAPES:
            problems.append(f"shape {self.shape!r} not in {list(SHAPES)}")
        if self.direction not in DIRECTIONS:
            problems.append(f"direction {self.direction!r} not in {list(DIRECTIONS)}")
        if problems:
            raise ValueError("invalid moving-shapes scene: " + "; ".join(problems))

    def caption(self) -> str:
        """'a red circle moving to the left', 'a blue square moving up'."""
        return f"a {self.color} {self.shape} {DIRECTIONS[self.direction][1]}"

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> MovingScene:
        """Build from a metadata dict (extra keys are ignored); raises ValueError naming what is missing or wrong."""
        if not isinstance(metadata, dict):
            raise ValueError(f"moving-shapes metadata must be a dict, got {type(metadata).__name__}")
        missing = [key for key in ("color", "shape", "direction") if key not in metadata]
        if missing:
            raise ValueError(
                f"moving-shapes metadata is missing {missing} (has {sorted(metadata)}); expected keys color, shape, "
                "direction as builtin:moving-shapes writes them"
            )
        return cls(metadata["color"], metadata["shape"], metadata["direction"])


def sample_scene(rng: np.random.Generator) -> MovingScene:
    """Uniform over palette x shapes x directions (5 * 3 * 4 = 60 captions)."""
    colors, directions = list(PALETTE), list(DIRECTIONS)
    return MovingScene(
        color=colors[rng.integers(len(colors))],
        shape=SHAPES[rng.integers(len(SHAPES))],
        direction=directions[rng.integers(len(directions))],
    )


def sample_trajectory(
    scene: MovingScene, rng: np.random.Generator, num_frames: int = NUM_FRAMES
) -> tuple[list[tuple[float, float]], float]:
    """(the shape's centre (cx, cy) per frame, its size), in canvas fractions: a straight line at constant speed,
    `TRAVEL_RANGE` long along the scene's direction, at a random place across it, inside the canvas throughout."""
    size = float(rng.uniform(*SIZE_RANGE))
    travel = float(rng.uniform(*TRAVEL_RANGE))
    low, high = MARGIN + size / 2, 1 - MARGIN - size / 2
    (dx, dy), _ = DIRECTIONS[scene.direction]
    start_along = float(rng.uniform(low, high - travel))  # along the axis of motion, in its positive sense
    across = float(rng.uniform(low, high))
    steps = np.linspace(0.0, travel, num_frames)
    centres = []
    for step in steps:
        along = start_along + step
        if dx != 0:
            x = along if dx > 0 else 1 - along
            centres.append((round(x, 5), round(across, 5)))
        else:
            y = along if dy > 0 else 1 - along
            centres.append((round(across, 5), round(y, 5)))
    return centres, round(size, 5)


def draw_frame(
    scene: MovingScene, centre: tuple[float, float], size: float, resolution: int = RESOLUTION
) -> np.ndarray:
    """One frame (H, W, 3) uint8: the shape drawn at 4x and box-downsampled (exact area antialiasing), as the
    shapes world draws."""
    big = resolution * _SUPERSAMPLE
    image = Image.new("RGB", (big, big), BACKGROUND)
    draw = ImageDraw.Draw(image)
    cx, cy = centre
    x0, y0, x1, y1 = ((cx - size / 2) * big, (cy - size / 2) * big, (cx + size / 2) * big, (cy + size / 2) * big)
    fill = PALETTE[scene.color]
    if scene.shape == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
    elif scene.shape == "square":
        draw.rectangle((x0, y0, x1, y1), fill=fill)
    else:  # upright triangle, base = height = size
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
    return np.asarray(image.resize((resolution, resolution), Image.Resampling.BOX), dtype=np.uint8).copy()


def render_clip(scene: MovingScene, trajectory: list[tuple[float, float]], size: float, resolution: int) -> np.ndarray:
    """The clip (F, H, W, 3) uint8 of `scene` along `trajectory`."""
    return np.stack([draw_frame(scene, centre, size, resolution) for centre in trajectory])


def moving_shapes_item(
    seed: int, split: str, index: int, resolution: int = RESOLUTION, *, clip: bool = True
) -> dict[str, Any]:
    """Item `index` of `split`: {"prompt", "metadata" (color, shape, direction, trajectory, size), ["image": the clip
    (F, H, W, 3) uint8, sft_loss's target, when `clip`]}; a function of (seed, split, index) only."""
    if split not in SPLITS:
        raise ValueError(f"unknown moving-shapes split {split!r}; use one of {list(SPLITS)}")
    rng = stream_rng(seed, _STREAM, SPLITS[split], index)
    scene = sample_scene(rng)
    trajectory, size = sample_trajectory(scene, rng)
    metadata = {
        "color": scene.color,
        "shape": scene.shape,
        "direction": scene.direction,
        "trajectory": [list(c) for c in trajectory],
        "size": size,
    }
    item: dict[str, Any] = {"prompt": scene.caption(), "metadata": metadata}
    if clip:
        item["image"] = render_clip(scene, trajectory, size, resolution)
    return item


def moving_shapes_items(
    num: int, seed: int, split: str = "train", resolution: int | None = RESOLUTION, *, clips: bool = True
) -> list[dict[str, Any]]:
    """`num` items (`moving_shapes_item`); item i depends only on (seed, split, i), so a longer list extends a
    shorter. `clips=False`: prompts and metadata only (cheap: what RL runs and evals read)."""
    resolution = resolution or RESOLUTION
    return [moving_shapes_item(seed, split, i, resolution, clip=clips) for i in range(num)]
