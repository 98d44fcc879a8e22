"""--rm-type parsing (names and weights, every bad spec named) and the run's reward spec from its flags."""

import pytest

from miles.arguments.parser import default_args
from miles.arguments.reward_spec import parse_reward_spec, reward_spec_from_args


def test_single_name_has_weight_one():
    assert parse_reward_spec("shapes") == [("shapes", 1.0)]


def test_weighted_list_keeps_order_and_weights():
    spec = parse_reward_spec("shapes:1.0, jpeg_compressibility:0.1,clip_score:-2")
    assert spec == [("shapes", 1.0), ("jpeg_compressibility", 0.1), ("clip_score", -2.0)]


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


def test_custom_path_left_out_of_spec_is_an_error():
    with pytest.raises(ValueError, match="does not include 'custom'"):
        reward_spec_from_args(default_args(rm_type="shapes", custom_rm_path="m.fn"))
