"""The moving-shapes video world: clips are a function of (seed, split, index), the splits differ, every clip
shows its caption's shape moving its way inside the canvas, and a run on the world evaluates with its reward (the
reward's own tests: tests/fast/rollout/rm_hub/test_moving_shapes.py)."""

from __future__ import annotations

import numpy as np
import pytest

from miles.data.moving_shapes import (
    DIRECTIONS,
    NUM_FRAMES,
    RESOLUTION,
    MovingScene,
    moving_shapes_item,
    moving_shapes_items,
)

ITEMS = moving_shapes_items(120, seed=3)


def test_items_are_a_function_of_seed_split_and_index():
    again = moving_shapes_item(3, "train", 17)
    assert again["prompt"] == ITEMS[17]["prompt"] and again["metadata"] == ITEMS[17]["metadata"]
    assert np.array_equal(again["image"], ITEMS[17]["image"])
    assert ITEMS[17]["image"].shape == (NUM_FRAMES, RESOLUTION, RESOLUTION, 3) and ITEMS[17]["image"].dtype == np.uint8
    cheap = moving_shapes_items(20, seed=3, clips=False)
    assert [i["metadata"] for i in cheap] == [i["metadata"] for i in ITEMS[:20]] and "image" not in cheap[0]
    other = moving_shapes_items(120, seed=3, split="eval", clips=False)
    assert [i["metadata"] for i in other] != [i["metadata"] for i in ITEMS]
    assert not any(o["metadata"]["trajectory"] == i["metadata"]["trajectory"] for o, i in zip(other, ITEMS))
    with pytest.raises(ValueError, match="split"):
        moving_shapes_item(3, "test", 0)


def test_captions_name_the_metadata_and_the_trajectory_moves_that_way_inside_the_canvas():
    assert {i["metadata"]["direction"] for i in ITEMS} == set(DIRECTIONS)
    for item in ITEMS:
        meta = item["metadata"]
        assert item["prompt"] == MovingScene(meta["color"], meta["shape"], meta["direction"]).caption()
        path = np.array(meta["trajectory"])
        (ux, uy), _ = DIRECTIONS[meta["direction"]]
        travel = path[-1] - path[0]
        assert 0.29 <= travel @ (ux, uy) <= 0.46 and abs(travel @ (uy, ux)) < 1e-9, item["prompt"]
        assert path.min() - meta["size"] / 2 > 0 and path.max() + meta["size"] / 2 < 1
    assert MovingScene("red", "circle", "left").caption() == "a red circle moving to the left"
    with pytest.raises(ValueError, match="direction 'sideways'"):
        MovingScene("red", "circle", "sideways")


def test_a_run_on_the_world_evaluates_on_its_eval_split_with_its_reward():
    from miles.algorithms import algorithm_of
    from miles.arguments.parser import parse_args
    from miles.arguments.reward_spec import reward_spec_from_args

    model = ["--hf-checkpoint", "builtin:tiny-moving-shapes", "--prompt-data", "builtin:moving-shapes"]
    args = parse_args([*model, "--loss-type", "nft"])
    assert args.eval_prompt_data == "builtin:moving-shapes"
    assert args.eval_interval == algorithm_of(args).shapes_eval_interval is not None
    assert reward_spec_from_args(args) == [("moving_shapes", 1.0)]
    from miles.ray.evaluator import MOVING_SHAPES_EVAL, load_eval_records

    args.eval_num_prompts = 7
    kind, records = load_eval_records(args)
    assert kind == MOVING_SHAPES_EVAL and records == moving_shapes_items(
        7, seed=args.eval_seed, split="eval", clips=False
    )
    other = parse_args(
        [*model, "--loss-type", "nft", "--eval-prompt-data", "prompts.jsonl", "--rm-type", "motion_direction"]
    )
    assert other.eval_prompt_data == "prompts.jsonl" and reward_spec_from_args(other) == [("motion_direction", 1.0)]
