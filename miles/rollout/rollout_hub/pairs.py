"""Samples -> train pairs conversions several algorithms share: the recorded SDE transitions (Flow-GRPO, GRPO-Guard,
Flow-DPPO, custom_loss), with the engine's step means when a loss takes them, the clean latents at chosen grid
timesteps (DiffusionNFT, AWM), and one recorded ODE step with the prompt metadata a differentiable reward scores
against (the reward-gradient losses). Also what a transition-based loss does with a stale batch under --async-rollout."""

from __future__ import annotations

import argparse

import torch

from miles.rollout.conditioning import negative_columns
from miles.rollout.engine_api import GenerateRequest, GenerateResult
from miles.utils.json_column import encode_json_column
from miles.utils.types import Sample, TrainPairs

REWARD_METADATA = "reward_metadata"  # the JSON column the trainer's differentiable reward reads (loss_hub.reward_grad)

STALE_POLICY_BATCH = (
    "the behaviour log-probs are the rollout's, recorded by the engine with the weights it sampled with, so the "
    "ratio is taken against them and clipped as usual: PPO's importance ratio for a behaviour policy one update old"
)
STALE_MEAN_BATCH = (
    "the behaviour step means and log-probs are the rollout's, recorded by the engine with the weights it sampled "
    "with, so the ratio is taken against the policy one update old that drew the transitions"
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


def sde_pairs_with_means(
    args: argparse.Namespace,
    samples: list[Sample],
    result: GenerateResult,
    advantages: torch.Tensor,
    *,
    rollout_id: int,
) -> TrainPairs:
    """`sde_pairs` plus μ_old of each transition: `rollout_mean` (the engine's, for the parity
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


def trained_steps_per_sample(args: argparse.Namespace, request: GenerateRequest) -> int:
    return len(request.trained_steps)


def recompute_conflict(args: argparse.Namespace) -> str | None:
    if args.diffusion_recompute_old_log_prob:
        return (
            "--diffusion-recompute-old-log-prob replaces the rollout's behaviour log-probs by the current policy's, "
            "so a batch generated one update behind would be trained as if on-policy; drop one of the two flags"
        )
    return None


def clean_latent_pairs(result: GenerateResult, advantages: torch.Tensor, index: torch.Tensor, steps: int) -> TrainPairs:
    """Sample-major pairs of clean latents: sample b's `steps` pairs are rows b·K .. b·K+K−1, pair i at the grid σ
    `result.sigmas[index[i]]`. Columns: x0 (the clean latent), t (that σ), advantage, the conditioning (`cond/*`),
    sample_index (and the negative conditioning `negative_cond/*` when the engine sampled with CFG)."""
    batch = result.final_latents.shape[0]
    if advantages.shape != (batch,):
        raise ValueError(f"expected one advantage per sample ({batch},), got {tuple(advantages.shape)}")

    def per_pair(x: torch.Tensor) -> torch.Tensor:  # (B, ...) -> (B·K, ...)
        return x.repeat_interleave(steps, dim=0)

    pairs: TrainPairs = {
        "x0": per_pair(result.final_latents.float()),
        "t": result.sigmas.float()[index].clone(),
        "advantage": per_pair(advantages.float()),
        **result.conditioning.repeat_interleave(steps).to_columns(),
        "sample_index": per_pair(torch.arange(batch)),
    }
    if result.negative is not None:
        pairs |= negative_columns(result.negative, batch * steps)
    return pairs


def recorded_step_pairs(
    args: argparse.Namespace,
    samples: list[Sample],
    result: GenerateResult,
    advantages: torch.Tensor,
    *,
    rollout_id: int,
) -> TrainPairs:
    """One pair per sample, in sample order, from an `ode` run that recorded one grid step j (advantages unused).

    Columns: latents (x_j: the initial noise for j = 0), next_latents (the engine's Euler output x_{j+1}), sigma
    (σ_j), sigma_next (σ_{j+1}), sigma_tail (the grid from σ_j to 0: a DRaFT unroll's), final_latents (x_N, the clean sample), reward_metadata (each sample's prompt
    metadata with its `prompt`, as JSON), the conditioning (`cond/*`), the negative conditioning (`negative_cond/*`,
    with CFG), sample_index, step_index.
    """
    batch, steps = result.latents.shape[:2]
    if steps != 1:
        raise ValueError(
            f"--loss-type {args.loss_type} trains from one recorded step per sample, the engine recorded {steps}"
        )
    step = int(result.trained_steps[0])
    metadatas = [{**(sample.metadata or {}), "prompt": sample.prompt} for sample in samples]
    pairs: TrainPairs = {
        "latents": result.latents[:, 0].float().contiguous(),
        "next_latents": result.next_latents[:, 0].float().contiguous(),
        "sigma": result.sigmas[step].float().expand(batch).clone(),
        "sigma_next": result.sigmas[step + 1].float().expand(batch).clone(),
        "sigma_tail": result.sigmas[step:].float().expand(batch, -1).clone(),
        "final_latents": result.final_latents.float().contiguous(),
        REWARD_METADATA: encode_json_column(metadatas),
        **result.conditioning.to_columns(),
        "sample_index": torch.arange(batch),
        "step_index": torch.full((batch,), step, dtype=torch.long),
    }
    if result.negative is not None:
        pairs |= negative_columns(result.negative, batch)
    return pairs


def one_pair_per_sample(args: argparse.Namespace, request: GenerateRequest) -> int:
    return 1
