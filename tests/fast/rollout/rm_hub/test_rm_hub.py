"""The reward registry and --custom-rm-path loading (file path and registered name); --rm-type parsing's tests:
tests/fast/arguments/test_reward_spec.py."""

import asyncio

import pytest

from miles.arguments.parser import default_args
from miles.arguments.reward_spec import BUILTIN_REWARDS
from miles.rollout.rm_hub import (
    REWARD_FUNCTIONS,
    compute_rewards,
    get_reward_function,
    reward_spec_from_args,
)
from miles.utils.misc import HookLoadError
from miles.utils.types import Sample


def test_registry_holds_the_documented_names():
    assert {"shapes", "jpeg_compressibility", "jpeg_incompressibility", "clip_score", "pickscore"} <= set(
        REWARD_FUNCTIONS
    )


def test_registry_has_exactly_the_names_argument_validation_accepts():
    assert tuple(REWARD_FUNCTIONS) == BUILTIN_REWARDS


def test_custom_without_path_names_the_flag():
    with pytest.raises(ValueError, match="--custom-rm-path is not set"):
        reward_spec_from_args(default_args(rm_type="custom"))
    with pytest.raises(ValueError, match="--custom-rm-path is not set"):
        get_reward_function("custom")


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
