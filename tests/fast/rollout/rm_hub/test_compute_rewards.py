"""compute_rewards: weighted totals, per-reward values, shapes extras, and errors that name reward and sample."""

import asyncio
import math

import numpy as np
import pytest

from miles.arguments.parser import default_args
from miles.data.shapes import shapes_items
from miles.rollout.rm_hub import RewardError, compute_rewards, reward_metrics
from miles.rollout.rm_hub.shapes import score_shapes_image
from miles.utils.misc import function_registry
from miles.utils.types import Sample


def shape_samples(num):
    items = shapes_items(num, seed=3)
    return [
        Sample(index=10 + i, prompt=it["prompt"], metadata=it["metadata"], image=it["image"])
        for i, it in enumerate(items)
    ]


def run_custom(fn, samples, spec=(("custom", 1.0),)):
    with function_registry.temporary("test_rm_hub.custom", fn) as name:
        args = default_args(custom_rm_path=name)
        return asyncio.run(compute_rewards(args, samples, list(spec)))


def text_samples():
    return [Sample(index=i, prompt=p) for i, p in enumerate(["a red circle", "two blue squares", "bad one"])]


def test_batch_raise_names_the_failing_sample():
    async def rm(args, samples):
        for s in samples:
            if s.prompt.startswith("bad"):
                raise KeyError("no color")
        return [1.0] * len(samples)

    with pytest.raises(RewardError, match=r"reward 'custom' raised on sample index=2 prompt='bad one': KeyError"):
        run_custom(rm, text_samples())


def test_raise_that_no_single_sample_reproduces_names_the_batch():
    async def rm(args, samples):
        if len(samples) > 1:
            raise RuntimeError("batch too big")
        return [0.0]

    with pytest.raises(RewardError, match=r"the batch of 3 samples \(indices 0..2.*batch too big"):
        run_custom(rm, text_samples())


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_value_names_the_sample(bad):
    async def rm(args, samples):
        return [1.0, bad, 0.0]

    with pytest.raises(
        RewardError, match=rf"reward 'custom' returned {bad} for sample index=1 prompt='two blue squares'"
    ):
        run_custom(rm, text_samples())


def test_too_few_values_names_the_first_sample_without_one():
    async def rm(args, samples):
        return [1.0, 2.0]

    with pytest.raises(
        RewardError, match=r"'custom' returned 2 values for 3 samples: sample index=2 prompt='bad one' has no value"
    ):
        run_custom(rm, text_samples())


def test_too_many_values_is_an_error():
    async def rm(args, samples):
        return np.zeros(len(samples) + 1)

    with pytest.raises(RewardError, match=r"returned 4 values for 3 samples: sample index=2"):
        run_custom(rm, text_samples())


def test_non_number_and_non_list_are_errors():
    async def words(args, samples):
        return ["high"] * len(samples)

    async def scalar(args, samples):
        return 1.0

    with pytest.raises(RewardError, match=r"non-number 'high' for sample index=0 prompt='a red circle'"):
        run_custom(words, text_samples())
    with pytest.raises(RewardError, match=r"returned float, expected one float per sample"):
        run_custom(scalar, text_samples())


def test_weighted_sum_and_per_reward_values():
    samples = shape_samples(4)
    custom_values = [0.5, -1.0, 2.0, 0.25]

    async def rm(args, batch):
        return custom_values

    totals, per_reward = run_custom(rm, samples, [("shapes", 1.5), ("custom", -0.5)])
    shapes_values = [score_shapes_image(s.image, s.metadata).reward for s in samples]
    assert list(per_reward) == ["shapes", "custom"]
    assert per_reward["shapes"] == pytest.approx(shapes_values)
    assert per_reward["custom"] == custom_values
    expected = [1.5 * a - 0.5 * b for a, b in zip(shapes_values, custom_values)]
    assert totals == pytest.approx(expected)


def test_shapes_extras_feed_metrics():
    samples = shape_samples(4)
    totals, per_reward = asyncio.run(compute_rewards(default_args(), samples, [("shapes", 2.0)]))
    scores = [score_shapes_image(s.image, s.metadata) for s in samples]
    for sample, score in zip(samples, scores):
        assert sample.extra["shapes"]["all_correct"] == score.all_correct
        assert sample.extra["shapes"]["color"] == pytest.approx(score.color)
    metrics = reward_metrics(totals, per_reward, samples)
    assert metrics["rollout/reward_shapes_mean"] == pytest.approx(np.mean([s.reward for s in scores]))
    assert metrics["rollout/reward_mean"] == pytest.approx(2 * np.mean([s.reward for s in scores]))
    assert metrics["rollout/shapes_all_correct_mean"] == pytest.approx(np.mean([s.all_correct for s in scores]))


def test_sample_without_image_is_named():
    samples = shape_samples(2)
    samples[1].image = None
    with pytest.raises(RewardError, match=r"reward 'shapes' raised on sample index=11 .*has no image"):
        asyncio.run(compute_rewards(default_args(), samples, [("shapes", 1.0)]))


def test_empty_batch_gives_empty_lists():
    assert asyncio.run(compute_rewards(default_args(), [], [("shapes", 1.0)])) == ([], {"shapes": []})
