"""The shapes edit world (`builtin:shapes-edit`): procedural (source image, instruction, target) triples over the
tiny shapes world, deterministic by seed. An edit recolours, reshapes or moves the one group of shapes; the target
scene is in the metadata (what `miles.rollout.rm_hub.shapes_edit` scores against), with the edit region."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from miles.data.shapes import PALETTE, POSITIONS, SHAPES, SPLITS, ShapeScene, draw_layout, sample_layout, sample_scene
from miles.utils.seeding import stream_rng

logger = logging.getLogger(__name__)

BUILTIN_SHAPES_EDIT = "builtin:shapes-edit"  # also in miles.arguments.evaluation (torch- and data-free)
EDITS: tuple[str, ...] = ("recolor", "reshape", "move")
_EDIT_STREAM = 7  # the edit world's streams are independent of the shapes world's (same seed, other items)


def plural(scene: ShapeScene) -> str:
    return scene.shape if scene.count == 1 else scene.shape + "s"


def sample_edit(scene: ShapeScene, rng: np.random.Generator) -> tuple[str, ShapeScene, str]:
    """(edit kind, target scene, instruction) of one uniformly drawn edit of `scene`; the new value always differs."""
    kind = EDITS[rng.integers(len(EDITS))]
    if kind == "recolor":
        color = _other(list(PALETTE), scene.color, rng)
        target = ShapeScene(color, scene.shape, scene.count, scene.position)
        return kind, target, f"make the {scene.color} {plural(scene)} {color}"
    if kind == "reshape":
        shape = _other(list(SHAPES), scene.shape, rng)
        target = ShapeScene(scene.color, shape, scene.count, scene.position)
        noun = f"a {shape}" if scene.count == 1 else shape + "s"
        return kind, target, f"turn the {scene.color} {plural(scene)} into {noun}"
    position = _other(list(POSITIONS), scene.position, rng)
    target = ShapeScene(scene.color, scene.shape, scene.count, position)
    return kind, target, f"move the {scene.color} {plural(scene)} to the {position}"


def _other(values: list[str], current: str, rng: np.random.Generator) -> str:
    others = [v for v in values if v != current]
    return others[rng.integers(len(others))]


def shapes_edit_item(seed: int, split: str, index: int, resolution: int = 32, *, target: bool = True) -> dict[str, Any]:
    """One triple: {"prompt" (the instruction), "metadata" (the target scene, `edit`, `source` scene, `edit_box`),
    "source_images" [(H, W, 3) uint8], ["image" the target, a PIL image, when `target`]}.

    A recolour or reshape keeps the source layout (the same shapes, sizes and places); a move draws a new layout in
    the new half. `edit_box` (x0, y0, x1, y1 in canvas fractions) bounds what the edit may change: the source's and
    the target's shapes; outside it the target equals the source (the preservation reward's region)."""
    if split not in SPLITS:
        raise ValueError(f"unknown shapes-edit split {split!r}; use one of {list(SPLITS)}")
    rng = stream_rng(seed, _EDIT_STREAM, SPLITS[split], index)
    scene = sample_scene(rng)
    kind, goal, instruction = sample_edit(scene, rng)
    source_layout = sample_layout(scene, rng)
    # a recolour or reshape redraws the same places; a move draws the group anew in its new half
    target_layout = sample_layout(goal, rng) if kind == "move" else source_layout
    source_image = draw_layout(scene, source_layout, resolution)
    boxes = source_layout + target_layout
    x0, y0 = min(cx - s / 2 for cx, _, s in boxes), min(cy - s / 2 for _, cy, s in boxes)
    x1, y1 = max(cx + s / 2 for cx, _, s in boxes), max(cy + s / 2 for _, cy, s in boxes)
    metadata = {
        **goal.to_metadata(),
        "edit": kind,
        "source": scene.to_metadata(),
        "edit_box": [round(max(0.0, x0), 4), round(max(0.0, y0), 4), round(min(1.0, x1), 4), round(min(1.0, y1), 4)],
    }
    item: dict[str, Any] = {
        "prompt": instruction,
        "metadata": metadata,
        "source_images": [np.asarray(source_image, dtype=np.uint8).copy()],
    }
    if target:
        item["image"] = draw_layout(goal, target_layout, resolution)
    return item


def shapes_edit_items(
    num: int, seed: int, split: str = "train", resolution: int | None = 32, *, targets: bool = False
) -> list[dict[str, Any]]:
    """`num` triples (`shapes_edit_item`); item i depends only on (seed, split, i). `targets`: with the target image
    (sft_loss's pairs)."""
    resolution = resolution or 32
    return [shapes_edit_item(seed, split, i, resolution, target=targets) for i in range(num)]


def write_shapes_edit_jsonl(path: str | Path, num: int, seed: int, split: str = "train", resolution: int = 32) -> Path:
    """Write `num` triples as PNGs in `<stem>_images/` beside a JSONL of {"prompt", "image" (the source),
    "target" (sft_loss's target), "metadata"}: the editing data format (docs/user-guide/editing.md)."""
    path = Path(path)
    image_dir = path.parent / f"{path.stem}_images"
    image_dir.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for index, item in enumerate(shapes_edit_items(num, seed, split, resolution, targets=True)):
            source, target = image_dir / f"{index:06d}_source.png", image_dir / f"{index:06d}_target.png"
            Image.fromarray(item["source_images"][0]).save(source)
            item["image"].save(target)
            record = {
                "prompt": item["prompt"],
                "image": source.relative_to(path.parent).as_posix(),
                "target": target.relative_to(path.parent).as_posix(),
                "metadata": item["metadata"],
            }
            f.write(json.dumps(record) + "\n")
    logger.info("wrote %d shapes-edit triples (%s, seed %d) to %s", num, split, seed, path)
    return path
