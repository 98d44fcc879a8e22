"""policy_loss (Flow-GRPO), rollout side: SDE trajectories with per-step log-probs on the steps the step strategy
picks, one train pair per (sample, trained step)."""

from __future__ import annotations

import argparse

import torch

from miles.rollout.conditioning import negative_columns
from miles.rollout.engine import GenerateRequest, GenerateResult
from miles.rollout.requests import sampler_request
from miles.rollout.rollout_hub.spec import RolloutSpec
from miles.rollout.step_strategy_hub import select_trained_steps
from miles.utils.types import Sample, TrainPairs

STALE_POLICY_BATCH = (
    "the behaviour log-probs are the rollout's, recorded by the engine with the weights it sampled with, so the "
    "ratio is taken against them and clipped as usual: PPO's importance ratio for a behaviour policy one update old"
)


def sde_request(
    args: argparse.Namespace, samples: list[Sample], *, rollout_id: int, resolution: int
) -> GenerateRequest:
    """The --diffusion-sde-type kernel on the steps the step strategy picks, with CFG as configured."""
    trained = select_trained_steps(args, rollout_id)
    return sampler_request(
        args, samples, resolution=resolution, sde_type=args.diffusion_sde_type, trained_steps=trained
    )


def sde_pairs(
    args: argparse.Namespace,
    samples: list[Sample],
    result: GenerateResult,
    advantages: torch.Tensor,
    *,
    rollout_id: int,
) -> TrainPairs:
    """Sample-major pairs: sample b's K transitions are rows b·K .. b·K+K−1, so contiguous shards keep samples whole.

    `result` is the engine's record of the trained steps; `advantages` (B,) one per sample.
    """
    batch, steps = result.log_probs.shape
    if steps == 0:
        raise ValueError("the step strategy selected no trained steps: nothing to train on")
    index = torch.tensor(result.trained_steps, dtype=torch.long)
    sigmas = result.sigmas.float()

    def per_pair(x: torch.Tensor) -> torch.Tensor:  # (B, ...) -> (B·K, ...)
        return x.repeat_interleave(steps, dim=0)

    log_probs = result.log_probs.reshape(-1).float()
    pairs: TrainPairs = {
        "latents": result.latents.reshape(batch * steps, *result.latents.shape[2:]).float(),
        "next_latents": result.next_latents.reshape(batch * steps, *result.next_latents.shape[2:]).float(),
        "sigma": sigmas[index].repeat(batch),
        "sigma_next": sigmas[index + 1].repeat(batch),
        "sigma_max": sigmas[1].expand(batch * steps).clone(),
        "rollout_log_prob": log_probs.clone(),
        "old_log_prob": log_probs.clone(),
        "advantage": per_pair(advantages.float()),
        "sample_index": per_pair(torch.arange(batch)),
        "step_index": index.repeat(batch),
        **result.conditioning.repeat_interleave(steps).to_columns(),
    }
    if result.negative is not None:
        pairs |= negative_columns(result.negative, batch * steps)
    return pairs


def trained_steps_per_sample(args: argparse.Namespace, request: GenerateRequest) -> int:
    return len(request.trained_steps)


def recompute_conflict(args: argparse.Namespace) -> str | None:
    if args.diffusion_recompute_old_log_prob:
        return (
            "--diffusion-recompute-old-log-prob replaces the rollout's behaviour log-probs by the current policy's, "
            "so a batch generated one update behind would be trained as if on-policy; drop one of the two flags"
        )
    return None


SPEC = RolloutSpec(
    build_request=sde_request,
    convert=sde_pairs,
    pairs_per_sample=trained_steps_per_sample,
    stale_batch=STALE_POLICY_BATCH,
    stale_batch_conflict=recompute_conflict,
)
