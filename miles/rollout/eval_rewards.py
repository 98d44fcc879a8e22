"""The proxy and the gold on the held-out eval (`--gold-rm-type`, docs/user-guide/rewards.md "Guards"): the eval's
samples scored by the reward the run trains on (the proxy, `--rm-type`) and by a second reward it never trains on
(the gold), in the driver; the proxy-gold divergence monitor (`miles.rollout.guard`) compares the two."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import numpy as np

from miles.arguments.reward_spec import parse_reward_spec, reward_spec_from_args
from miles.rollout.evaluation import EvalSamples, eval_seed, eval_source_images
from miles.rollout.guard import GOLD_KEY, PROXY_KEY
from miles.rollout.rm_hub import compute_rewards
from miles.rollout.rm_hub.media import attach_media
from miles.utils.types import Sample


def eval_reward_samples(
    records: list[dict[str, Any]], media: EvalSamples, num_samples_per_prompt: int, seed: int, resolution: int | None
) -> list[Sample]:
    """The eval's samples as rewards see them, record-major as `generate_eval_samples` made them: prompt, metadata,
    seed, source images (editing) and the decoded media."""
    sources = eval_source_images(records, num_samples_per_prompt, resolution)
    samples = [
        Sample(
            index=i * num_samples_per_prompt + k,
            prompt=record["prompt"],
            metadata=dict(record.get("metadata") or {}),
            group_index=i,
            seed=eval_seed(seed, i, k),
        )
        for i, record in enumerate(records)
        for k in range(num_samples_per_prompt)
    ]
    if len(samples) != len(media.images):
        raise ValueError(f"the eval made {len(media.images)} samples for {len(samples)} prompts x samples per prompt")
    if sources is not None:  # editing / image-to-video prompts: what a source-image reward compares with
        for sample, images in zip(samples, sources):
            sample.source_images = images
    attach_media(samples, media)
    return samples


class EvalRewards:
    """The proxy's and the gold's weighted totals on the eval samples, scored in the driver (`compute_rewards`)."""

    def __init__(self, args: argparse.Namespace, gold_rm_type: str) -> None:
        self.args = args
        self.proxy = reward_spec_from_args(args)
        self.gold = parse_reward_spec(gold_rm_type)

    def metrics(self, samples: list[Sample]) -> dict[str, float]:
        """`eval/proxy_reward` and `eval/gold_reward`: the mean over the eval samples of each spec's weighted total."""
        proxy, _ = asyncio.run(compute_rewards(self.args, samples, self.proxy))
        gold, _ = asyncio.run(compute_rewards(self.args, samples, self.gold))
        return {PROXY_KEY: float(np.mean(proxy)), GOLD_KEY: float(np.mean(gold))}
