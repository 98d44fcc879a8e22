"""The rollout as named steps (ARCHITECTURE §7): sample -> generate -> score -> filter -> advantages -> convert ->
order -> shard. Each step is a short function of plain values; `RolloutManager` runs them in order, and the path
flags (`miles/rollout/hook_paths.py`) replace single steps or the whole rollout."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from miles.arguments.reward_spec import reward_spec_from_args
from miles.data.source_images import load_source_images
from miles.rollout.advantages import compute_grpo_advantages, per_reward_group_advantages
from miles.utils.box import Box, put_box
from miles.utils.seeding import stream_rng, stream_seed
from miles.utils.types import Sample, TrainPairs, shard_pairs

logger = logging.getLogger(__name__)
_ORDER_STREAM = 7  # the pair-order permutation's stream id within (rollout seed, rollout id)
_REFILL_STREAM = 0x52464C  # the prompts drawn to refill a batch after dynamic-sampling drops
REWARD_TERMS = "reward_terms"  # Sample.extra key: the sample's value of each weighted reward


def sample_seed(rollout_seed: int, rollout_id: int, index: int) -> int:
    """Per-sample noise seed from (--rollout-seed, rollout id, index in the rollout)."""
    return stream_seed(rollout_seed, rollout_id, index)


# ---- sample ---------------------------------------------------------------------------------------------------------
def make_samples(
    args: argparse.Namespace,
    records: Sequence[dict[str, Any]],
    record_indices: Sequence[int],
    rollout_id: int,
    *,
    first_index: int = 0,
    first_group: int = 0,
    resolution: int | None = None,
) -> list[Sample]:
    """--n-samples-per-prompt samples per record, consecutive per prompt group, seeded by their rollout index; a
    record's source images (editing, image-to-video) are loaded at `resolution` and shared by its group."""
    samples: list[Sample] = []
    for group, record_index in enumerate(record_indices, start=first_group):
        record = records[record_index]
        sources = record.get("source_images")
        if sources is not None:
            if resolution is None:
                raise ValueError("make_samples: records with source images need the run's resolution")
            sources = load_source_images(sources, resolution)
        for _ in range(args.n_samples_per_prompt):
            index = first_index + len(samples)
            samples.append(
                Sample(
                    index=index,
                    prompt=record["prompt"],
                    metadata=record.get("metadata") or {},
                    group_index=group,
                    seed=sample_seed(args.rollout_seed, rollout_id, index),
                    source_images=sources,
                )
            )
    return samples


def refill_record_indices(num_records: int, count: int, *, seed: int, rollout_id: int, round_index: int) -> list[int]:
    """Prompts for a dynamic-sampling refill round: `count` records drawn without replacement (with, when the data
    has fewer), from a stream of (--rollout-seed, rollout id, round)."""
    rng = stream_rng(seed, rollout_id, round_index, _REFILL_STREAM)
    return rng.choice(num_records, size=count, replace=count > num_records).tolist()


# ---- filter ---------------------------------------------------------------------------------------------------------
def split_groups(samples: list[Sample]) -> list[list[Sample]]:
    """Consecutive samples of one prompt group together, in order."""
    groups: list[list[Sample]] = []
    for sample in samples:
        if groups and groups[-1][0].group_index == sample.group_index:
            groups[-1].append(sample)
        else:
            groups.append([sample])
    return groups


def keeps_group(filter_fn: Callable[..., Any], args: argparse.Namespace, group: list[Sample]) -> bool:
    """A dynamic-sampling filter's verdict on one group: a bool, or an object with a `keep` attribute."""
    verdict = filter_fn(args, group)
    return bool(getattr(verdict, "keep", verdict))


def select_rows(result: Any, rows: Sequence[int]) -> Any:
    """The engine result of the given samples (per-sample fields indexed, shared ones such as the σ grid and the
    negative conditioning kept)."""
    batch, index = result.batch_size, torch.as_tensor(list(rows), dtype=torch.long)
    changes = {}
    for field in dataclasses.fields(result):
        value = getattr(result, field.name)
        if field.name == "sigmas" or field.name.startswith("negative") or value is None:
            continue
        if isinstance(value, np.ndarray) and value.shape[:1] == (batch,):
            changes[field.name] = value[index.numpy()]
        elif isinstance(value, torch.Tensor) and value.shape[:1] == (batch,):
            changes[field.name] = value[index]
        elif hasattr(value, "rows") and getattr(value, "batch_size", None) == batch:  # a Conditioning
            changes[field.name] = value.rows(index)
    return dataclasses.replace(result, **changes)


def renumber(samples: list[Sample]) -> None:
    """Indices 0.. and prompt groups 0.. in batch order, after filtering picked samples from several rounds."""
    for index, sample in enumerate(samples):
        sample.index = index
    for group_index, group in enumerate(split_groups(samples)):
        for sample in group:
            sample.group_index = group_index


# ---- advantages -----------------------------------------------------------------------------------------------------
def compute_advantages(
    args: argparse.Namespace,
    samples: list[Sample],
    rewards: torch.Tensor,
    post_process: Callable[..., Any] | None = None,
) -> torch.Tensor:
    """GRPO advantages per prompt group (of the weighted reward, or with --per-reward-group-norm the weighted sum of
    each reward's own), or --custom-reward-post-process-path's; samples a --rollout-sample-filter-path marked
    `remove_sample` get 0 (no policy gradient under policy_loss; r = ½ under nft)."""
    if post_process is not None:
        advantages = torch.as_tensor(post_process(args, samples, rewards)).float()
    elif args.per_reward_group_norm:
        weights = dict(reward_spec_from_args(args))
        missing = [s.index for s in samples if set(s.extra.get(REWARD_TERMS, {})) != set(weights)]
        if missing:
            raise ValueError(
                f"--per-reward-group-norm needs each sample's value of every reward in --rm-type; samples "
                f"{missing[:5]} have no extra[{REWARD_TERMS!r}] with them (a custom rollout must store them)"
            )
        terms = {
            name: torch.tensor([s.extra[REWARD_TERMS][name] for s in samples], dtype=torch.float64) for name in weights
        }
        advantages = per_reward_group_advantages(
            terms,
            weights,
            args.n_samples_per_prompt,
            globalize_std=args.globalize_reward_std,
            normalize_std=not args.disable_grpo_std_normalization,
        )
    else:
        advantages = compute_grpo_advantages(
            rewards,
            args.n_samples_per_prompt,
            globalize_std=args.globalize_reward_std,
            normalize_std=not args.disable_grpo_std_normalization,
        )
    if advantages.shape != rewards.shape:
        raise ValueError(f"advantages have shape {tuple(advantages.shape)}, expected one per sample {len(samples)}")
    removed = torch.tensor([s.remove_sample for s in samples], dtype=torch.bool)
    return advantages.masked_fill(removed, 0.0) if bool(removed.any()) else advantages


class ZeroAdvantageWatch:
    """`rollout/zero_advantage_groups`, the fraction of prompt groups whose advantages are all 0, for a loss that
    trains on group advantages (`Algorithm.group_advantages`). When a rollout's are all 0 it trains nothing from its
    rewards (every group scored alike: a reward that saturated, or one that returns a constant): a warning, said
    again only after a rollout that trained."""

    def __init__(self, enabled: bool, group_size: int) -> None:
        self.enabled, self.group_size, self.warned = enabled, group_size, False

    def check(self, rollout_id: int, rewards: torch.Tensor, advantages: torch.Tensor) -> dict[str, float]:
        if not self.enabled or advantages.numel() % self.group_size:
            return {}
        fraction = float((advantages.reshape(-1, self.group_size) == 0).all(dim=1).float().mean())
        if fraction == 1.0 and not self.warned:
            values = sorted({round(v, 4) for v in rewards.tolist()})
            shown = ", ".join(map(str, values[:3])) + (f" and {len(values) - 3} more" if len(values) > 3 else "")
            logger.warning(
                "rollout %d trains nothing from its rewards: every prompt group's samples scored alike (rewards %s), "
                "so every advantage is 0. A reward that saturated (the task is learned) or that returns a constant "
                "(check --rm-type / --custom-rm-path); said again after a rollout that trains",
                rollout_id,
                shown,
            )
        self.warned = fraction == 1.0
        return {"rollout/zero_advantage_groups": fraction}


# ---- order and shard ------------------------------------------------------------------------------------------------
def order_pairs(pairs: TrainPairs, num_samples: int, per_sample: int, *, seed: int, rollout_id: int) -> TrainPairs:
    """Whole samples (their `per_sample` consecutive pairs) in a seeded order, so every window mixes prompt groups."""
    order = torch.from_numpy(stream_rng(seed, rollout_id, _ORDER_STREAM).permutation(num_samples))
    rows = (order[:, None] * per_sample + torch.arange(per_sample)[None, :]).reshape(-1)
    return {key: value[rows] for key, value in pairs.items()}


def shard(pairs: TrainPairs, dp_size: int) -> list[Box]:
    """One box per data-parallel rank, its contiguous equal share of the pairs in the object store."""
    return [put_box(part) for part in shard_pairs(pairs, dp_size)]


def per_reward(samples: list[Sample]) -> dict[str, list[float]]:
    """Each weighted reward's raw values (`extra[REWARD_TERMS]`), in sample order ({} for a single unnamed reward)."""
    names = list(samples[0].extra.get(REWARD_TERMS, {})) if samples else []
    return {name: [s.extra[REWARD_TERMS][name] for s in samples] for name in names}
