"""nft (DiffusionNFT), rollout side: deterministic ODE samples, one train pair per (sample, drawn grid timestep).

The fresh noise ε of a pair is not stored: `loss_hub.nft.prepare_nft_batch` draws it from ids.
"""

from __future__ import annotations

import argparse

import torch

from miles.rollout.engine_api import GenerateRequest, GenerateResult
from miles.rollout.requests import ode_request
from miles.rollout.rollout_hub.pairs import clean_latent_pairs
from miles.rollout.rollout_hub.spec import RolloutSpec
from miles.utils.seeding import stream_rng
from miles.utils.types import Sample, TrainPairs

# Keeps the per-sample timestep streams apart from other seeded streams of the same (seed, rollout).
_TIMESTEP_SALT = 0x4E4654
STALE_NFT_BATCH = (
    "off-policy by construction: the loss noises the clean samples afresh and needs only their rewards, no "
    "log-prob of the policy that sampled them; samples from the previous weights are ordinary training data"
)


def nft_pairs_per_sample(num_steps: int, timestep_fraction: float) -> int:
    """How many distinct grid timesteps each sample trains on: max(1, round(fraction·num_steps))."""
    if not 0.0 < timestep_fraction <= 1.0:
        raise ValueError(f"--diffusion-nft-timestep-fraction must lie in (0, 1], got {timestep_fraction}")
    return max(1, round(timestep_fraction * num_steps))


def nft_pairs_count(args: argparse.Namespace, request: GenerateRequest) -> int:
    return nft_pairs_per_sample(args.diffusion_num_steps, args.diffusion_nft_timestep_fraction)


def draw_timestep_indices(num_steps: int, count: int, *, seed: int, rollout_id: int, sample: int) -> torch.Tensor:
    """`count` distinct indices into the grid's nonzero sigmas (0 .. num_steps−1), shuffled per sample."""
    rng = stream_rng(seed, rollout_id, sample, _TIMESTEP_SALT)
    return torch.from_numpy(rng.permutation(num_steps)[:count].copy()).long()


def nft_pairs(
    args: argparse.Namespace,
    samples: list[Sample],
    result: GenerateResult,
    advantages: torch.Tensor,
    *,
    rollout_id: int,
) -> TrainPairs:
    """`clean_latent_pairs` with K = `nft_pairs_per_sample` of --diffusion-nft-timestep-fraction distinct grid
    timesteps per sample (a σ of `result.sigmas[:-1]`, never 0), drawn from (--rollout-seed, rollout id, sample).

    `result` is the engine's deterministic (ODE) sampling; `advantages` (B,) one per sample.
    """
    batch = result.final_latents.shape[0]
    num_steps = result.sigmas.shape[0] - 1  # σ = 0 is the clean end: nothing to denoise there
    steps = nft_pairs_per_sample(num_steps, args.diffusion_nft_timestep_fraction)
    draws = [
        draw_timestep_indices(num_steps, steps, seed=args.rollout_seed, rollout_id=rollout_id, sample=b)
        for b in range(batch)
    ]
    return clean_latent_pairs(result, advantages, torch.cat(draws), steps)


SPEC = RolloutSpec(
    build_request=ode_request, convert=nft_pairs, pairs_per_sample=nft_pairs_count, stale_batch=STALE_NFT_BATCH
)
