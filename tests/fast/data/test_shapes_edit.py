"""The shapes edit world: deterministic triples whose target differs from the source only inside `edit_box`, and
whose metadata (the target scene) the shapes reward finds in the target image and not in the source."""

from __future__ import annotations

import numpy as np
import pytest

from miles.data.shapes import ShapeScene
from miles.data.shapes_edit import EDITS, shapes_edit_item, shapes_edit_items
from miles.rollout.rm_hub.edit import keep_mask
from miles.rollout.rm_hub.shapes import score_shapes_image

ITEMS = shapes_edit_items(60, seed=3, targets=True)


def test_items_are_a_function_of_seed_split_and_index():
    again = shapes_edit_item(3, "train", 17, target=True)
    assert again["prompt"] == ITEMS[17]["prompt"] and again["metadata"] == ITEMS[17]["metadata"]
    assert np.array_equal(again["source_images"][0], ITEMS[17]["source_images"][0])
    other = shapes_edit_items(60, seed=3, split="eval")
    assert [i["metadata"] for i in other] != [i["metadata"] for i in ITEMS]
    with pytest.raises(ValueError, match="split"):
        shapes_edit_item(3, "test", 0)


def test_every_edit_kind_occurs_and_changes_exactly_its_attribute():
    kinds = {item["metadata"]["edit"] for item in ITEMS}
    assert kinds == set(EDITS)
    attribute = {"recolor": "color", "reshape": "shape", "move": "position"}
    for item in ITEMS:
        meta = item["metadata"]
        source, target = meta["source"], ShapeScene.from_metadata(meta).to_metadata()
        changed = {k for k in source if source[k] != target[k]}
        assert changed == {attribute[meta["edit"]]}, item["prompt"]
        assert str(target[attribute[meta["edit"]]]) in item["prompt"]


def test_the_target_equals_the_source_outside_the_edit_box():
    for item in ITEMS:
        source, target = item["source_images"][0], np.asarray(item["image"])
        keep = keep_mask(*source.shape[:2], item["metadata"]["edit_box"])
        assert keep.mean() > 0.1, item["metadata"]  # something is left to preserve
        assert np.array_equal(source[keep], target[keep]), item["prompt"]
        assert not np.array_equal(source, target)


def test_the_shapes_reward_finds_the_target_scene_in_the_target_and_not_in_the_source():
    target_correct = [score_shapes_image(np.asarray(i["image"]), i["metadata"]).all_correct for i in ITEMS]
    source_correct = [score_shapes_image(i["source_images"][0], i["metadata"]).all_correct for i in ITEMS]
    assert np.mean(target_correct) >= 0.9, np.mean(target_correct)
    assert np.mean(source_correct) <= 0.1, np.mean(source_correct)
