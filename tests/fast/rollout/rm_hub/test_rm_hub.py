"""--rm-type parsing, the reward registry and --custom-rm-path loading (file path and registered name)."""

import asyncio

import pytest

from miles.arguments.parser import default_args
from miles.arguments.reward_spec import BUILTIN_REWARDS
from miles.rollout.rm_hub import (
    REWARD_FUNCTIONS,
    compute_rewards,
    get_reward_function,
    parse_reward_spec,
    reward_spec_from_args,
)
from miles.utils.misc import HookLoadError
from miles.utils.types import Sample


def test_single_name_has_weight_one():
    assert parse_reward_spec("shapes") == [("shapes", 1.0)]


def test_weighted_list_keeps_order_and_weights():
    spec = parse_reward_spec("shapes:1.0, jpeg_compressibility:0.1,clip_score:-2")
    assert spec == [("shapes", 1.0), ("jpeg_compressibility", 0.1), ("clip_score", -2.0)]


def test_registry_holds_the_documented_names():
    assert {"shapes", "jpeg_compressibility", "jpeg_incompressibility", "clip_score", "pickscore"} <= set(
        REWARD_FUNCTIONS
    )


def test_registry_has_exactly_the_names_argument_validation_accepts():
    assert tuple(REWARD_FUNCTIONS) == BUILTIN_REWARDS


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown reward 'shape'.*valid rewards: shapes, jpeg_compressibility"):
        parse_reward_spec("shape:1.0")


@pytest.mark.parametrize("text", ["shapes:abc", "shapes:", "shapes:nan", "shapes:1.0,pickscore:inf"])
def test_bad_weight_is_named(text):
    with pytest.raises(ValueError, match="is not a finite number"):
        parse_reward_spec(text)


@pytest.mark.parametrize("text", ["", "  "])
def test_empty_spec_is_an_error(text):
    with pytest.raises(ValueError, match="--rm-type is empty"):
        parse_reward_spec(text)


def test_duplicate_reward_is_an_error():
    with pytest.raises(ValueError, match="listed twice"):
        parse_reward_spec("shapes:1,shapes:2")


def test_spec_from_args_defaults():
    assert reward_spec_from_args(default_args()) == [("shapes", 1.0)]
    assert reward_spec_from_args(default_args(custom_rm_path="m.fn")) == [("custom", 1.0)]
    spec = reward_spec_from_args(default_args(rm_type="custom:2,shapes:0.5", custom_rm_path="m.fn"))
    assert spec == [("custom", 2.0), ("shapes", 0.5)]


def test_custom_without_path_names_the_flag():
    with pytest.raises(ValueError, match="--custom-rm-path is not set"):
        reward_spec_from_args(default_args(rm_type="custom"))
    with pytest.raises(ValueError, match="--custom-rm-path is not set"):
        get_reward_function("custom")


def test_custom_path_left_out_of_spec_is_an_error():
    with pytest.raises(ValueError, match="does not include 'custom'"):
        reward_spec_from_args(default_args(rm_type="shapes", custom_rm_path="m.fn"))


def test_get_reward_function():
    assert get_reward_function(None) is REWARD_FUNCTIONS["shapes"]
    assert get_reward_function("pickscore") is REWARD_FUNCTIONS["pickscore"]
    with pytest.raises(ValueError, match="valid rewards"):
        get_reward_function("nope")
    with pytest.raises(HookLoadError, match="does not exist"):
        get_reward_function("custom", "/no/such/file.py:rm")


@pytest.mark.parametrize("keyword", ["async def", "def"])
def test_custom_reward_from_file(tmp_path, keyword):
    path = tmp_path / "my_rm.py"
    path.write_text(f"{keyword} rm(args, samples):\n    return [len(s.prompt) * args.scale for s in samples]\n")
    args = default_args(custom_rm_path=f"{path}:rm")
    args.scale = 0.5  # what the user's reward reads
    samples = [Sample(index=i, prompt="x" * (i + 1)) for i in range(3)]
    totals, per_reward = asyncio.run(compute_rewards(args, samples, reward_spec_from_args(args)))
    assert per_reward == {"custom": [0.5, 1.0, 1.5]}
    assert totals == [0.5, 1.0, 1.5]
