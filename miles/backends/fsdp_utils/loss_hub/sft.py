"""sft_loss: flow-matching supervision on (clean latent, prompt embedding) pairs (ALGORITHMS.md)."""

from __future__ import annotations

from functools import lru_cache

import torch

from miles.backends.fsdp_utils.loss_hub.noise import pair_generators, pair_noise
from miles.backends.fsdp_utils.loss_hub.types import (
    DiffusionLossContext,
    PreparedBatch,
    WindowMetrics,
    conditioning_from_pairs,
)
from miles.diffusion.schedule import (
    add_noise,
    flow_matching_loss,
    sample_timestep_density,
    sigmas_from_u,
    training_sigmas,
)
from miles.utils.simulation import real_tensors
from miles.utils.types import TrainPairs


@lru_cache(maxsize=8)
def _sigma_table(shift: float) -> torch.Tensor:
    with real_tensors():  # cached: never a planner's fake tensor
        return training_sigmas(shift=shift)


def prepare_sft_batch(
    ctx: DiffusionLossContext,
    batch: TrainPairs,
    *,
    microbatch_id: int,
    optim_step_idx: int,
    pad_to_len: int | None = None,
) -> PreparedBatch:
    args = ctx.args
    x0 = batch["x0"].float()
    generators = pair_generators(ctx, batch, optim_step_idx)
    density = {"logit_mean": args.sft_logit_mean, "logit_std": args.sft_logit_std, "mode_scale": args.sft_mode_scale}
    u = torch.cat([sample_timestep_density(args.sft_timestep_sampling, 1, generator=g, **density) for g in generators])
    sigmas = sigmas_from_u(u, _sigma_table(float(ctx.family.scheduler_shift)))
    noise = pair_noise(generators, x0.shape)
    x0, noise, sigmas = x0.to(ctx.device), noise.to(ctx.device), sigmas.to(ctx.device)
    embeds = conditioning_from_pairs(batch, ctx.device)
    return PreparedBatch(
        latents=add_noise(x0, noise, sigmas),
        sigmas=sigmas,
        embeds=embeds,
        extras={"x0": x0, "noise": noise},
    )


def sft_formula(
    ctx: DiffusionLossContext,
    batch: TrainPairs,
    prepared: PreparedBatch,
    *,
    new_pred: torch.Tensor,
    metrics: WindowMetrics,
    **kwargs,
) -> torch.Tensor:
    """Sum over pairs of the weighted flow-matching loss of v_θ against ε − x₀."""
    per_sample = flow_matching_loss(
        new_pred,
        prepared.extras["x0"],
        prepared.extras["noise"],
        prepared.sigmas,
        weighting=ctx.args.sft_loss_weighting,
    )
    metrics.add("train/loss", per_sample)
    metrics.add("train/sigma_mean", prepared.sigmas)
    return per_sample.sum()
