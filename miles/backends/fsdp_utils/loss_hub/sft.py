"""sft_loss: flow-matching supervision on (clean latent, prompt embedding) pairs (ALGORITHMS.md)."""

from __future__ import annotations

from functools import lru_cache

import torch

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
from miles.utils.seeding import stream_generator
from miles.utils.types import TrainPairs


@lru_cache(maxsize=8)
def _sigma_table(shift: float) -> torch.Tensor:
    return training_sigmas(shift=shift)


def microbatch_generator(ctx: DiffusionLossContext, microbatch_id: int, salt: int = 0) -> torch.Generator:
    """Noise seeded by (seed, rollout, rank, micro-batch): identical in every pass over the same micro-batch."""
    return stream_generator(ctx.args.seed, ctx.rollout_id, ctx.dp_rank, microbatch_id, salt)


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
    generator = microbatch_generator(ctx, microbatch_id)
    u = sample_timestep_density(
        args.sft_timestep_sampling,
        x0.shape[0],
        logit_mean=args.sft_logit_mean,
        logit_std=args.sft_logit_std,
        mode_scale=args.sft_mode_scale,
        generator=generator,
    )
    sigmas = sigmas_from_u(u, _sigma_table(float(ctx.family.scheduler_shift)))
    noise = torch.randn(x0.shape, generator=generator, dtype=torch.float32)
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
