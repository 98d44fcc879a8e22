"""The moving_shapes reward: it scores the world's own clips right and reversed, recoloured or hand-made wrong ones
low, by attribute, with a strict all-correct event beside the partial credit."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFilter

from miles.data.moving_shapes import moving_shapes_items
from miles.data.shapes import PALETTE
from miles.rollout.rm_hub.moving_shapes import moving_shapes_reward, score_clip

ITEMS = moving_shapes_items(120, seed=3)
OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}


def test_the_reward_scores_the_worlds_clips_right_and_reversed_or_recoloured_ones_low():
    clips, metas = [i["image"] for i in ITEMS], [i["metadata"] for i in ITEMS]
    truth = moving_shapes_reward(clips, metas)
    assert np.mean([s.all_correct for s in truth]) >= 0.95 and min(s.reward for s in truth) >= 0.9
    reversed_ = moving_shapes_reward([c[::-1] for c in clips], metas)  # played backwards: the opposite direction
    assert not any(s.all_correct for s in reversed_) and max(s.direction for s in reversed_) == 0.0
    opposite = moving_shapes_reward(clips, [{**m, "direction": OPPOSITE[m["direction"]]} for m in metas])
    assert max(s.direction for s in opposite) == 0.0
    recoloured = [{**m, "color": "green" if m["color"] != "green" else "red"} for m in metas]
    assert max(s.color for s in moving_shapes_reward(clips, recoloured)) < 0.1
    blurred = [
        np.stack([np.asarray(Image.fromarray(f).filter(ImageFilter.GaussianBlur(0.7))) for f in c]) for c in clips
    ]
    assert np.mean([s.all_correct for s in moving_shapes_reward(blurred, metas)]) >= 0.9


def _hand_clip(shape: str, color: str, boxes: list[tuple[int, int, int, int]], size: int = 32) -> np.ndarray:
    """A clip drawn by hand with PIL (no antialiasing), a box per frame, independent of the world's renderer."""
    frames = []
    for x0, y0, x1, y1 in boxes:
        image = Image.new("RGB", (size, size), (255, 255, 255))
        draw = ImageDraw.Draw(image)
        if shape == "square":
            draw.rectangle((x0, y0, x1, y1), fill=PALETTE[color])
        elif shape == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=PALETTE[color])
        else:
            draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=PALETTE[color])
        frames.append(np.asarray(image))
    return np.stack(frames)


RIGHTWARD = [(2 + 3 * f, 12, 12 + 3 * f, 22) for f in range(5)]  # 10 px moving 12 px to the right


@pytest.mark.parametrize("shape", ["circle", "square", "triangle"])
def test_hand_drawn_clips_score_by_attribute(shape):
    clip = _hand_clip(shape, "blue", RIGHTWARD)
    truth = {"color": "blue", "shape": shape, "direction": "right"}
    right = score_clip(clip, truth)
    assert right.all_correct and right.reward > 0.9 and right.travel[0] == pytest.approx(12 / 32, abs=0.02)
    for change, attribute in (({"color": "yellow"}, "color"), ({"direction": "left"}, "direction")):
        wrong = score_clip(clip, {**truth, **change})
        assert not wrong.all_correct and getattr(wrong, attribute) < 0.1, change
        for other in {"color", "shape", "direction"} - {attribute}:
            assert getattr(wrong, other) == pytest.approx(getattr(right, other))
    other_shape = {"circle": "square", "square": "triangle", "triangle": "circle"}[shape]
    assert not score_clip(clip, {**truth, "shape": other_shape}).all_correct
    # moving up and down are told apart from sideways drift: a clip moving right is neither
    assert score_clip(clip, {**truth, "direction": "up"}).direction == 0.0


def test_the_strict_reward_pays_the_all_correct_event_beside_the_partial_credit_one():
    """`--rm-type moving_shapes:1,moving_shapes_strict:1`: the strict reward is 1 exactly for an all-correct clip, 0
    for a clip played backwards (two attributes right of three), and both store the same score for metrics."""
    import argparse
    import asyncio

    from miles.rollout.rm_hub import compute_rewards
    from miles.utils.types import Sample

    clips, metas = [ITEMS[0]["image"], ITEMS[1]["image"][::-1]], [ITEMS[0]["metadata"], ITEMS[1]["metadata"]]
    samples = [Sample(index=k, prompt="", metadata=m, frames=c, fps=8.0) for k, (c, m) in enumerate(zip(clips, metas))]
    spec = [("moving_shapes", 1.0), ("moving_shapes_strict", 1.0)]
    totals, per_reward = asyncio.run(compute_rewards(argparse.Namespace(custom_rm_path=None), samples, spec))
    scores = moving_shapes_reward(clips, metas)
    assert [s.all_correct for s in scores] == [True, False] and scores[1].reward > 0.6  # partial credit only
    assert per_reward["moving_shapes_strict"] == [1.0, 0.0]
    assert per_reward["moving_shapes"] == pytest.approx([s.reward for s in scores])
    assert totals == pytest.approx([scores[0].reward + 1.0, scores[1].reward])
    assert [s.extra["moving_shapes"]["all_correct"] for s in samples] == [True, False]


def test_partial_credit_a_still_clip_and_a_blank_clip():
    still = _hand_clip("square", "red", [(10, 10, 20, 20)] * 5)
    score = score_clip(still, {"color": "red", "shape": "square", "direction": "down"})
    assert score.direction == 0.0 and score.color > 0.99 and score.shape > 0.9 and not score.all_correct
    assert score.reward == pytest.approx(2 / 3, abs=0.05)
    upward = _hand_clip("square", "red", [(10, 20 - 3 * f, 20, 30 - 3 * f) for f in range(5)])
    assert score_clip(upward, {"color": "red", "shape": "square", "direction": "up"}).all_correct
    gappy = _hand_clip("circle", "green", RIGHTWARD)
    gappy[2] = 255  # a frame without the shape: colour and shape lose a fifth, the direction still reads
    score = score_clip(gappy, {"color": "green", "shape": "circle", "direction": "right"})
    assert score.direction == 1.0 and score.color == pytest.approx(0.8, abs=0.02) and score.num_objects == 0.8
    blank = np.full((5, 32, 32, 3), 255, np.uint8)
    empty = score_clip(blank, {"color": "red", "shape": "circle", "direction": "left"})
    assert empty.reward == 0.0 and empty.num_objects == 0 and not empty.all_correct
    with pytest.raises(ValueError, match="clips"):
        score_clip(blank[0], {"color": "red", "shape": "circle", "direction": "left"})
