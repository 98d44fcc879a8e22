"""The proxy and the gold on the eval's samples: each sample carries its record's prompt and metadata, its eval seed
and its image, record-major; the two metrics are the means of the two rewards computed on the images directly."""

from __future__ import annotations

import numpy as np
import pytest

from miles.arguments.parser import default_args
from miles.data.shapes import shapes_items
from miles.rollout.eval_rewards import EvalRewards, eval_reward_samples
from miles.rollout.evaluation import EvalSamples, eval_seed
from miles.rollout.guard import GOLD_KEY, PROXY_KEY
from miles.rollout.rm_hub.jpeg import JPEG_SCALE_KB, jpeg_size_kb
from miles.rollout.rm_hub.shapes import shapes_reward


def eval_media(num_records: int, per_prompt: int) -> tuple[list[dict], EvalSamples]:
    """Rendered shapes scenes as the eval's records (their own image for every sample of a record)."""
    items = shapes_items(num_records, seed=4, split="eval")
    records = [{"prompt": item["prompt"], "metadata": item["metadata"]} for item in items]
    images = np.stack([np.asarray(item["image"].convert("RGB")) for item in items for _ in range(per_prompt)])
    return records, EvalSamples(images)


def test_the_samples_follow_the_evals_record_major_order():
    records, media = eval_media(3, per_prompt=2)
    samples = eval_reward_samples(records, media, num_samples_per_prompt=2, seed=7, resolution=None)
    assert [(s.index, s.group_index, s.prompt) for s in samples] == [
        (2 * i + k, i, records[i]["prompt"]) for i in range(3) for k in range(2)
    ]
    assert [s.seed for s in samples] == [eval_seed(7, i, k) for i in range(3) for k in range(2)]
    assert all(np.array_equal(s.image, media.images[s.index]) for s in samples)
    assert samples[5].metadata == records[2]["metadata"] and samples[0].source_images is None
    with pytest.raises(ValueError, match="the eval made 6 samples for 9 prompts x samples per prompt"):
        eval_reward_samples(records, media, num_samples_per_prompt=3, seed=7, resolution=None)


def test_the_proxy_is_the_trained_reward_and_the_gold_the_other_one():
    records, media = eval_media(4, per_prompt=1)
    args = default_args(rm_type="jpeg_compressibility:2.0")
    rewards = EvalRewards(args, "shapes")
    metrics = rewards.metrics(eval_reward_samples(records, media, 1, seed=0, resolution=None))
    gold = [score.reward for score in shapes_reward(list(media.images), [r["metadata"] for r in records])]
    proxy = [-2.0 * jpeg_size_kb(image) / JPEG_SCALE_KB for image in media.images]
    assert metrics == {PROXY_KEY: pytest.approx(np.mean(proxy)), GOLD_KEY: pytest.approx(np.mean(gold))}
    assert 0.5 < metrics[GOLD_KEY] <= 1.0  # the rendered scenes are what their prompts say
