"""Pair noise, shared by every prepare that draws randomness (ARCHITECTURE §6): one generator per train pair, seeded
from the pair's row in the rollout's batch, never from the rank, the micro-batch or a global generator.

A pair therefore draws the same noise (and timestep) in both passes over its window (the old-log-prob recompute and
the training pass), with or without micro-batch prefetch, at any --dp-size and --micro-batch-size."""

from __future__ import annotations

import torch

from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext
from miles.utils.seeding import stream_generator
from miles.utils.types import PAIR_INDEX, TrainPairs


def pair_generators(
    ctx: DiffusionLossContext, batch: TrainPairs, optim_step_idx: int, salt: int = 0
) -> list[torch.Generator]:
    """One generator per pair, seeded by (seed, rollout, window, the pair's row in the rollout's batch, salt): a pair
    draws the same noise and timestep in every pass over its window and on whichever rank and micro-batch it lands
    (any --dp-size: ranks are dealt rows so that window k holds the same pairs), and fresh ones in another window
    (dmd2's critic sees each pair once per window)."""
    if PAIR_INDEX not in batch:
        raise KeyError(
            f"train pairs lack {PAIR_INDEX!r} (miles.utils.types.shard_pairs adds it); columns: {sorted(batch)}"
        )
    rollout, seed = ctx.rollout_id, ctx.args.seed
    return [stream_generator(seed, rollout, optim_step_idx, int(i), salt) for i in batch[PAIR_INDEX].tolist()]


def pair_noise(generators: list[torch.Generator], shape: torch.Size) -> torch.Tensor:
    """(len(generators), *shape[1:]) float32 standard normal, row i from generator i."""
    return torch.stack([torch.randn(shape[1:], generator=g, dtype=torch.float32) for g in generators])
