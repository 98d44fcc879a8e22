"""The shapes world: determinism, captions against metadata, splits, the JSONL format, metadata validation."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from miles.data.shapes import (
    BUILTIN_SHAPES,
    PALETTE,
    ShapeScene,
    render_scene,
    sample_scene,
    shapes_items,
    shapes_prompts,
    write_shapes_jsonl,
)

# The whole words the tiny tokenizer knows.
VOCABULARY = set(
    "a an one two three four red green blue yellow purple orange white black circle circles square squares "
    "triangle triangles on the left right top bottom in center".split()
)


def _parse_caption(caption: str) -> dict:
    """A hand-written reading of '<count> <color> <shape(s)> on the <position>'."""
    count_word, color, noun, on, the, position = caption.split(" ")
    assert (on, the) == ("on", "the")
    count = {"a": 1, "one": 1, "two": 2, "three": 3, "four": 4}[count_word]
    assert noun.endswith("s") == (count > 1), caption
    return {"color": color, "shape": noun.removesuffix("s"), "count": count, "position": position}


def _pixels(items: list[dict]) -> list[bytes]:
    return [np.asarray(item["image"]).tobytes() for item in items]


def test_builtin_name():
    assert BUILTIN_SHAPES == "builtin:shapes"


def test_items_are_deterministic_by_seed_and_split():
    first, again = shapes_items(12, seed=7), shapes_items(12, seed=7)
    assert [item["prompt"] for item in first] == [item["prompt"] for item in again]
    assert _pixels(first) == _pixels(again)
    assert _pixels(first) != _pixels(shapes_items(12, seed=8))


def test_a_longer_list_extends_a_shorter_one():
    assert _pixels(shapes_items(5, seed=3)) == _pixels(shapes_items(9, seed=3))[:5]


def test_prompts_match_items_without_rendering():
    items = shapes_items(20, seed=5, split="eval")
    prompts = shapes_prompts(20, seed=5, split="eval")
    assert [(p["prompt"], p["metadata"]) for p in prompts] == [(i["prompt"], i["metadata"]) for i in items]


def test_captions_agree_with_metadata_and_use_known_words():
    for item in shapes_prompts(300, seed=0):
        assert _parse_caption(item["prompt"]) == item["metadata"]
        assert set(item["prompt"].split()) <= VOCABULARY


def test_every_attribute_value_is_sampled():
    prompts = shapes_prompts(500, seed=1)
    for key, values in [
        ("color", set(PALETTE)),
        ("shape", {"circle", "square", "triangle"}),
        ("count", {1, 2, 3}),
        ("position", {"left", "right", "top", "bottom"}),
    ]:
        seen = Counter(p["metadata"][key] for p in prompts)
        assert set(seen) == values
        assert min(seen.values()) > 500 / len(values) / 2  # roughly uniform


def test_eval_split_is_an_independent_stream():
    """Documented: eval draws from its own seed stream; captions may repeat (180 exist), images never do."""
    train, evaluation = shapes_items(200, seed=0), shapes_items(200, seed=0, split="eval")
    assert not set(_pixels(train)) & set(_pixels(evaluation))
    assert [i["prompt"] for i in train] != [i["prompt"] for i in evaluation]
    with pytest.raises(ValueError, match="unknown shapes split 'test'"):
        shapes_prompts(1, seed=0, split="test")


def test_rendered_pixels_are_background_or_the_scene_color_in_the_right_half():
    """Checked without the scorer: every pixel is a blend of white and the caption's color, and the ink sits in the
    captioned half of the canvas."""
    for item in shapes_items(60, seed=2):
        meta = item["metadata"]
        image = np.asarray(item["image"], dtype=np.float64)
        assert image.shape == (32, 32, 3)
        direction = np.array(PALETTE[meta["color"]], dtype=np.float64) - 255.0
        offset = image - 255.0
        alpha = offset @ direction / (direction @ direction)
        residual = np.linalg.norm(offset - alpha[..., None] * direction, axis=-1)
        assert residual.max() < 2.0 and alpha.min() > -0.01 and alpha.max() < 1.01
        ys, xs = np.mgrid[0:32, 0:32]
        side = {"left": xs < 16, "right": xs >= 16, "top": ys < 16, "bottom": ys >= 16}[meta["position"]]
        assert alpha[~side].max() < 0.01, item["prompt"]


def test_resolution_is_honoured():
    rng = np.random.default_rng(0)
    assert render_scene(sample_scene(rng), rng, resolution=64).size == (64, 64)


def test_write_shapes_jsonl_round_trips_with_relative_paths(tmp_path: Path):
    path = write_shapes_jsonl(tmp_path / "data" / "shapes.jsonl", num=6, seed=11)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    expected = shapes_items(6, seed=11)
    assert len(lines) == 6
    for line, item in zip(lines, expected):
        assert set(line) == {"prompt", "image", "metadata"}
        assert not Path(line["image"]).is_absolute()
        assert line["prompt"] == item["prompt"] and line["metadata"] == item["metadata"]
        assert ShapeScene.from_metadata(line["metadata"]).caption() == line["prompt"]
        loaded = np.asarray(Image.open(path.parent / line["image"]).convert("RGB"))
        np.testing.assert_array_equal(loaded, np.asarray(item["image"]))


def test_metadata_round_trip_and_extra_keys_are_ignored():
    scene = ShapeScene("blue", "triangle", 3, "top")
    assert ShapeScene.from_metadata({**scene.to_metadata(), "source": "x"}) == scene
    assert scene.caption() == "three blue triangles on the top"
    assert ShapeScene("red", "circle", 1, "left").caption() == "a red circle on the left"


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"color": "red", "shape": "circle", "count": 1}, r"missing \['position'\]"),
        ({"color": "pink", "shape": "circle", "count": 1, "position": "left"}, "color 'pink'"),
        ({"color": "red", "shape": "star", "count": 1, "position": "left"}, "shape 'star'"),
        ({"color": "red", "shape": "circle", "count": "2", "position": "left"}, "count '2'"),
        ({"color": "red", "shape": "circle", "count": True, "position": "left"}, "count True"),
        ({"color": "red", "shape": "circle", "count": 7, "position": "left"}, "count 7"),
        ({"color": "red", "shape": "circle", "count": 1, "position": "middle"}, "position 'middle'"),
        (["red", "circle"], "must be a dict"),
    ],
)
def test_from_metadata_rejects_bad_input_clearly(metadata, message):
    with pytest.raises(ValueError, match=message):
        ShapeScene.from_metadata(metadata)
