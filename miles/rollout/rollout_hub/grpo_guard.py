"""grpo_guard (GRPO-Guard), rollout side: Flow-GRPO's SDE request with the engine also recording each trained step's
mean μ_old, and its pairs with that mean as the `rollout_mean` / `old_mean` columns (Flow-DPPO uses them too)."""

from __future__ import annotations

import argparse
import dataclasses

import torch

from miles.rollout.engine import GenerateRequest, GenerateResult
from miles.rollout.rollout_hub.flow_grpo import recompute_conflict, sde_pairs, sde_request, trained_steps_per_sample
from miles.rollout.rollout_hub.spec import RolloutSpec
from miles.utils.types import Sample, TrainPairs

STALE_MEAN_BATCH = (
    "the behaviour step means and log-probs are the rollout's, recorded by the engine with the weights it sampled "
    "with, so the ratio is taken against the policy one update old that drew the transitions"
)


def mean_recording_request(
    args: argparse.Namespace, samples: list[Sample], *, rollout_id: int, resolution: int
) -> GenerateRequest:
    """Flow-GRPO's request (the kernel on the step strategy's steps), asking the engine for the step means too."""
    request = sde_request(args, samples, rollout_id=rollout_id, resolution=resolution)
    return dataclasses.replace(request, record_means=True)


def sde_pairs_with_means(
    args: argparse.Namespace,
    samples: list[Sample],
    result: GenerateResult,
    advantages: torch.Tensor,
    *,
    rollout_id: int,
) -> TrainPairs:
    """Flow-GRPO's sample-major pairs plus μ_old of each transition: `rollout_mean` (the engine's, for the parity
    metric) and `old_mean` (the ratio's, overwritten by --diffusion-recompute-old-log-prob)."""
    if result.means is None:
        raise ValueError(
            f"--loss-type {args.loss_type} needs the engine's step means (GenerateResult.means): the request sets "
            "record_means, so an engine that ignores it (a serving engine) must be taught to return them"
        )
    pairs = sde_pairs(args, samples, result, advantages, rollout_id=rollout_id)
    batch, steps = result.means.shape[:2]
    means = result.means.reshape(batch * steps, *result.means.shape[2:]).float()
    return pairs | {"rollout_mean": means, "old_mean": means.clone()}


SPEC = RolloutSpec(
    build_request=mean_recording_request,
    convert=sde_pairs_with_means,
    pairs_per_sample=trained_steps_per_sample,
    stale_batch=STALE_MEAN_BATCH,
    stale_batch_conflict=recompute_conflict,
)
