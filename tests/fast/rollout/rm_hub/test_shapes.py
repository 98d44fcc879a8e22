"""The shapes reward: right on true metadata, wrong on mismatched, robust to blur and noise, graded partial credit."""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFilter

from miles.data.shapes import PALETTE, shapes_items
from miles.rollout.rm_hub.shapes import label_components, score_shapes_image, shapes_reward

NUM_VALIDATION = 600


@pytest.fixture(scope="module")
def validation_items() -> list[dict]:
    return shapes_items(NUM_VALIDATION, seed=1234, split="eval")


def _blur_and_noise(image: Image.Image, rng: np.random.Generator, radius: float, sigma: float) -> np.ndarray:
    blurred = np.asarray(image.filter(ImageFilter.GaussianBlur(radius)), dtype=np.float64)
    return np.clip(blurred + rng.normal(0.0, sigma, blurred.shape), 0, 255).astype(np.uint8)


def _draw(shape: str, color: str, boxes: list[tuple[int, int, int, int]], size: int = 32) -> Image.Image:
    """A scene drawn by hand with PIL (no antialiasing), independent of `render_scene`."""
    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for x0, y0, x1, y1 in boxes:
        if shape == "square":
            draw.rectangle((x0, y0, x1, y1), fill=PALETTE[color])
        elif shape == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=PALETTE[color])
        else:
            draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=PALETTE[color])
    return image


def test_true_metadata_is_all_correct(validation_items):
    scores = shapes_reward([i["image"] for i in validation_items], [i["metadata"] for i in validation_items])
    assert np.mean([s.all_correct for s in scores]) >= 0.99
    assert np.mean([s.reward for s in scores]) >= 0.97
    assert [s.num_objects for s in scores] == [i["metadata"]["count"] for i in validation_items]


def test_shuffled_metadata_scores_low(validation_items):
    rng = np.random.default_rng(0)
    metadatas = [i["metadata"] for i in validation_items]
    shuffled = [metadatas[j] for j in rng.permutation(len(metadatas))]
    mismatched = [(i["image"], m) for i, m in zip(validation_items, shuffled) if m != i["metadata"]]
    scores = shapes_reward([image for image, _ in mismatched], [m for _, m in mismatched])
    assert len(mismatched) > 0.95 * NUM_VALIDATION
    assert np.mean([s.all_correct for s in scores]) <= 0.02
    assert np.mean([s.reward for s in scores]) <= 0.5


@pytest.mark.parametrize(("radius", "sigma"), [(0.0, 8.0), (0.6, 0.0), (0.6, 8.0)])
def test_robust_to_mild_blur_and_noise(validation_items, radius, sigma):
    rng = np.random.default_rng(1)
    items = validation_items[:300]
    images = [_blur_and_noise(i["image"], rng, radius, sigma) for i in items]
    scores = shapes_reward(images, [i["metadata"] for i in items])
    assert np.mean([s.all_correct for s in scores]) >= 0.97
    assert np.mean([s.reward for s in scores]) >= 0.95


@pytest.mark.parametrize(
    ("change", "attribute"),
    [
        ({"color": "blue"}, "color"),
        ({"shape": "circle"}, "shape"),
        ({"count": 3}, "count"),
        ({"position": "top"}, "position"),
    ],
)
def test_a_wrong_attribute_fails_only_that_attribute(change, attribute):
    image = _draw("square", "red", [(3, 6, 11, 14), (3, 18, 11, 26)])  # two red squares on the left
    truth = {"color": "red", "shape": "square", "count": 2, "position": "left"}
    right = score_shapes_image(image, truth)
    assert right.all_correct and right.reward > 0.95
    wrong = score_shapes_image(image, {**truth, **change})
    assert not wrong.all_correct
    assert getattr(wrong, attribute) <= 0.5
    for other in {"color", "shape", "count", "position"} - {attribute}:
        assert getattr(wrong, other) == pytest.approx(getattr(right, other))


def test_partial_credit_sits_between_all_wrong_and_all_right():
    image = _draw("circle", "green", [(20, 4, 28, 12), (20, 18, 28, 26)])  # two green circles on the right
    right = score_shapes_image(image, {"color": "green", "shape": "circle", "count": 2, "position": "right"})
    wrong_count = score_shapes_image(image, {"color": "green", "shape": "circle", "count": 3, "position": "right"})
    all_wrong = score_shapes_image(image, {"color": "yellow", "shape": "triangle", "count": 1, "position": "left"})
    assert all_wrong.reward < wrong_count.reward < right.reward
    assert all_wrong.reward < 0.2 and right.all_correct and not wrong_count.all_correct


def test_count_credit_halves_per_object_off():
    image = _draw("triangle", "purple", [(2, 2, 10, 10), (2, 12, 10, 20), (2, 22, 10, 30)])
    for wanted, expected in [(3, 1.0), (2, 0.5), (1, 0.25)]:
        score = score_shapes_image(image, {"color": "purple", "shape": "triangle", "count": wanted, "position": "left"})
        assert score.num_objects == 3 and score.count == expected and score.shape > 0.9


def test_hand_drawn_shapes_at_another_resolution():
    boxes = [(6, 40, 22, 56), (26, 40, 42, 56), (46, 40, 62, 56)]  # three in a row along the bottom of 64x64
    for shape in ("circle", "square", "triangle"):
        meta = {"color": "blue", "shape": shape, "count": 3, "position": "bottom"}
        assert score_shapes_image(_draw(shape, "blue", boxes, size=64), meta).all_correct, shape


def test_blank_image_scores_zero():
    score = score_shapes_image(
        np.full((32, 32, 3), 255, np.uint8), {"color": "red", "shape": "circle", "count": 1, "position": "top"}
    )
    assert score.reward == 0.0 and score.num_objects == 0 and not score.all_correct


def test_pil_uint8_and_float_inputs_agree(validation_items):
    item = validation_items[0]
    as_uint8 = np.asarray(item["image"])
    scores = [score_shapes_image(x, item["metadata"]) for x in (item["image"], as_uint8, as_uint8 / 255.0)]
    assert scores[0] == scores[1]
    assert scores[2].reward == pytest.approx(scores[0].reward, abs=1e-5)
    with pytest.raises(ValueError, match="HxWx3"):
        score_shapes_image(np.zeros((32, 32), np.uint8), item["metadata"])


def _flood_fill_partition(mask: np.ndarray) -> set[frozenset]:
    """Components by breadth-first search, 4-connectivity."""
    seen, parts = np.zeros_like(mask), set()
    for start in zip(*np.nonzero(mask)):
        if seen[start]:
            continue
        seen[start], queue, part = True, deque([start]), set()
        while queue:
            y, x = queue.popleft()
            part.add((y, x))
            for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
        parts.add(frozenset(part))
    return parts


def test_label_components_matches_flood_fill():
    rng = np.random.default_rng(0)
    masks = rng.random((20, 17, 23)) < np.linspace(0.2, 0.7, 20)[:, None, None]
    labels = label_components(masks)  # a batch: components never cross images
    for mask, label in zip(masks, labels):
        parts = {frozenset(zip(*np.nonzero(label == value))) for value in np.unique(label[label >= 0])}
        assert parts == _flood_fill_partition(mask)
        assert (label[~mask] == -1).all()


def test_scoring_is_fast(validation_items):
    """Measured at ~0.2-0.3 ms of CPU per 32x32 image in a batch; the bound leaves room for slow machines."""
    items = validation_items[:256]
    images, metadatas = [i["image"] for i in items], [i["metadata"] for i in items]
    start = time.process_time()
    shapes_reward(images, metadatas)
    assert (time.process_time() - start) / len(items) < 3e-3


def test_strict_reward_is_the_all_correct_event(validation_items):
    """`--rm-type shapes_strict` pays 1 exactly when the shapes reward's `all_correct` holds, with no partial credit."""
    import asyncio

    from miles.rollout.rm_hub import shapes_strict_rm
    from miles.utils.types import Sample

    items = validation_items[:8]
    metadatas = [items[0]["metadata"]] * len(items)  # right for the first image, wrong in some way for the others
    samples = [
        Sample(index=k, prompt="", metadata=m, image=np.asarray(i["image"], dtype=np.uint8))
        for k, (i, m) in enumerate(zip(items, metadatas))
    ]
    strict = asyncio.run(shapes_strict_rm(None, samples))
    scores = shapes_reward([i["image"] for i in items], metadatas)
    assert strict == [float(s.all_correct) for s in scores]
    assert strict[0] == 1.0 and 0.0 in strict
    assert all(s.extra["shapes"]["all_correct"] == bool(r) for s, r in zip(samples, strict))
