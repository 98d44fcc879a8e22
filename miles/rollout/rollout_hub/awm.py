"""awm (advantage-weighted matching), rollout side: the policy's own samples (ODE by default, or SDE), kept as clean
latents with prompt and advantage; per sample --awm-train-timesteps grid timesteps, one per stratum of the indices
[1, int(--awm-timestep-fraction·N)). The fresh noise ε of a pair is drawn by `loss_hub.awm.prepare_awm_batch`."""

from __future__ import annotations

import argparse

import torch

from miles.diffusion.awm import stratified_indices
from miles.rollout.engine_api import GenerateRequest, GenerateResult
from miles.rollout.requests import ode_request, sde_request
from miles.rollout.rollout_hub.pairs import clean_latent_pairs
from miles.rollout.rollout_hub.spec import RolloutSpec
from miles.utils.seeding import stream_rng
from miles.utils.types import Sample, TrainPairs

# Keeps the per-sample stratum draws apart from other seeded streams of the same (seed, rollout, sample).
_TIMESTEP_SALT = 0x41574D


def awm_request(
    args: argparse.Namespace, samples: list[Sample], *, rollout_id: int, resolution: int
) -> GenerateRequest:
    """--awm-sampler ode: the deterministic request; sde: the --diffusion-sde-type kernel on the step strategy's steps."""
    request = sde_request if args.awm_sampler == "sde" else ode_request
    return request(args, samples, rollout_id=rollout_id, resolution=resolution)


def awm_pairs_count(args: argparse.Namespace, request: GenerateRequest) -> int:
    return args.awm_train_timesteps


def draw_stratified_indices(
    num_steps: int, count: int, fraction: float, *, seed: int, rollout_id: int, sample: int
) -> torch.Tensor:
    """Sample `sample`'s grid indices, one per stratum, from the stream (seed, rollout, sample): a run repeats and
    resumes bit for bit."""
    u = stream_rng(seed, rollout_id, sample, _TIMESTEP_SALT).random(count)
    return torch.from_numpy(stratified_indices(num_steps, count, fraction, u)).long()


def awm_pairs(
    args: argparse.Namespace,
    samples: list[Sample],
    result: GenerateResult,
    advantages: torch.Tensor,
    *,
    rollout_id: int,
) -> TrainPairs:
    """The clean-latent pairs at the stratified timesteps, plus `step_index` (the grid index of `t`) and
    `old_log_prob` (NaN until the trainer's recompute pass writes windows 1..; window 0 uses its own value)."""
    batch = result.final_latents.shape[0]
    num_steps, steps = result.sigmas.shape[0] - 1, args.awm_train_timesteps
    index = torch.cat(
        [
            draw_stratified_indices(
                num_steps, steps, args.awm_timestep_fraction, seed=args.rollout_seed, rollout_id=rollout_id, sample=b
            )
            for b in range(batch)
        ]
    )
    pairs = clean_latent_pairs(result, advantages, index, steps)
    pairs["step_index"] = index
    pairs["old_log_prob"] = torch.full((batch * steps,), float("nan"))
    return pairs


SPEC = RolloutSpec(build_request=awm_request, convert=awm_pairs, pairs_per_sample=awm_pairs_count)
