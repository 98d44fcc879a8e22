"""Plain data that crosses process boundaries: samples and columnar train pairs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# Train pairs are columnar: every value is a tensor whose first dimension indexes the pair.
TrainPairs = dict[str, torch.Tensor]
PAIR_INDEX = "pair_index"  # the column `shard_pairs` adds: a pair's row in its rollout's whole batch


@dataclass
class Sample:
    """One generated or dataset item; for RL it also carries its denoising trajectory and reward."""

    index: int
    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)
    group_index: int = 0
    seed: int = 0
    # What rewards see (docs/user-guide/media.md): an image family fills `image` (H, W, 3) uint8; a video family
    # fills `frames` (F, H, W, 3) uint8 played at `fps`, and `audio` (channels, samples) float32 in [-1, 1] at
    # `sample_rate` Hz when it has sound.
    image: Any = None
    # editing / image-to-video: the prompt's source images, each (H, W, 3) uint8 at the run's resolution (rewards
    # compare the result with them; the engine conditions on them); None for text-only prompts
    source_images: list[Any] | None = None
    frames: Any = None
    fps: float | None = None
    audio: Any = None
    sample_rate: int | None = None
    reward: float | None = None
    remove_sample: bool = False  # set by a --rollout-sample-filter-path hook: trains with advantage 0
    extra: dict[str, Any] = field(default_factory=dict)


def num_pairs(pairs: TrainPairs) -> int:
    """Number of pairs; every column must agree."""
    lengths = {key: value.shape[0] for key, value in pairs.items()}
    if not lengths:
        return 0
    if len(set(lengths.values())) != 1:
        raise ValueError(f"train pair columns disagree in length: {lengths}")
    return next(iter(lengths.values()))


def slice_pairs(pairs: TrainPairs, start: int, end: int) -> TrainPairs:
    """Rows [start, end) as views, so a hook writing into a slice writes into the pairs."""
    return {key: value[start:end] for key, value in pairs.items()}


def shard_pairs(pairs: TrainPairs, dp_size: int) -> list[TrainPairs]:
    """Deal pairs to `dp_size` equal shards, rank i taking rows i, i + dp_size, i + 2·dp_size, ...; each row also gets
    `pair_index`, its row in `pairs`. Dealt this way, window k of every rank's schedule (equal windows of its rows,
    `build_microbatch_schedule`) holds its share of window k of the whole batch at any dp size, so an optimizer step
    sees the same pairs whatever the layout; `pair_index` keys the trainer's per-pair draws (noise, timesteps)."""
    total = num_pairs(pairs)
    if total % dp_size != 0:
        raise ValueError(f"{total} train pairs cannot be split evenly over {dp_size} data-parallel ranks")
    indexed = {**pairs, PAIR_INDEX: torch.arange(total)}
    return [{k: v[r::dp_size].clone() for k, v in indexed.items()} for r in range(dp_size)]
