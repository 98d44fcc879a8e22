"""refl, train side: one forward with gradient at the rollout's x_j (σ_j), x̂₀ = x_j − σ_j·v_θ, the differentiable
reward ascended on x̂₀ (ALGORITHMS.md, ReFL; docs/user-guide/reward-gradients.md)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from miles.backends.fsdp_utils.loss_hub.reward_grad import (
    pair_metadatas,
    prepare_reward_batch,
    reward_loss,
    score_x0,
)
from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext, PreparedBatch, WindowMetrics
from miles.diffusion.reward_grad import one_step_x0
from miles.diffusion.schedule import expand_like
from miles.utils.types import TrainPairs


def prepare_refl_batch(
    ctx: DiffusionLossContext,
    batch: TrainPairs,
    *,
    microbatch_id: int,
    optim_step_idx: int,
    pad_to_len: int | None = None,
) -> PreparedBatch:
    """The recorded step's input x_j at σ_j, CFG as the engine sampled."""
    return prepare_reward_batch(ctx, batch, batch["latents"], batch["sigma"])


def refl_formula(
    ctx: DiffusionLossContext,
    batch: TrainPairs,
    prepared: PreparedBatch,
    *,
    new_pred: torch.Tensor,
    frozen_preds: Mapping[str, torch.Tensor],
    metrics: WindowMetrics,
    optim_step_idx: int,
    **kwargs,
) -> torch.Tensor:
    """Σ over pairs of λ·φ(R(x̂₀)) (+ the velocity penalty). Before the first update the trainer's Euler step from
    x_j must reproduce the engine's x_{j+1} (`train/euler_step_abs_diff`, the first-step parity)."""
    x, sigma = prepared.latents, prepared.sigmas
    reward = score_x0(ctx, one_step_x0(x, new_pred, sigma), pair_metadatas(batch))
    metrics.add("train/refl_sigma_mean", sigma)
    if optim_step_idx == 0:
        with torch.no_grad():
            dt = expand_like(batch["sigma_next"].to(x.device) - sigma, x)
            euler = x.float() + new_pred.detach().float() * dt
            diff = (euler - batch["next_latents"].to(x.device).float()).flatten(1).abs().mean(dim=1)
            metrics.add("train/euler_step_abs_diff", diff)
    return reward_loss(ctx, reward, new_pred, frozen_preds, metrics)
