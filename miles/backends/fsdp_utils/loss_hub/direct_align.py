"""direct_align, train side: the rollout's known initial noise ε injected into its clean sample x₀ at σ_hi (drawn per
pair in [--direct-align-sigma-min, --direct-align-sigma-max]), one forward with gradient, x̂₀ recovered analytically
after one step of Δσ (denoising, or inversion), the reward (or SRPO's relative reward) ascended on x̂₀
(ALGORITHMS.md, Direct-Align; docs/user-guide/reward-gradients.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from miles.backends.fsdp_utils.loss_hub.noise import pair_generators
from miles.backends.fsdp_utils.loss_hub.reward_grad import (
    pair_metadatas,
    prepare_reward_batch,
    reward_loss,
    score_x0,
)
from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext, PreparedBatch, WindowMetrics
from miles.diffusion.reward_grad import direct_align_input, direct_align_x0, relative_reward
from miles.utils.types import TrainPairs

_SIGMA_SALT = 0x44414C4E  # keeps the per-pair σ draw apart from other per-pair streams


def draw_sigma_hi(ctx: DiffusionLossContext, batch: TrainPairs, optim_step_idx: int) -> torch.Tensor:
    """(B,) σ_hi uniform in [--direct-align-sigma-min, --direct-align-sigma-max], one per pair row (same in every pass
    over its window, at any dp size or micro-batch size)."""
    low, high = float(ctx.args.direct_align_sigma_min), float(ctx.args.direct_align_sigma_max)
    u = torch.cat([torch.rand(1, generator=g) for g in pair_generators(ctx, batch, optim_step_idx, salt=_SIGMA_SALT)])
    return low + (high - low) * u


def prepare_direct_align_batch(
    ctx: DiffusionLossContext,
    batch: TrainPairs,
    *,
    microbatch_id: int,
    optim_step_idx: int,
    pad_to_len: int | None = None,
) -> PreparedBatch:
    """x = (1 − σ)·x₀ + σ·ε at σ_hi (denoising) or σ_lo = σ_hi − Δσ (inversion), ε the rollout's initial noise."""
    x0, noise = batch["final_latents"].float(), batch["latents"].float()
    sigma_hi = draw_sigma_hi(ctx, batch, optim_step_idx)
    sigma_lo = sigma_hi - float(ctx.args.direct_align_delta_sigma)
    x, sigma = direct_align_input(x0, noise, sigma_hi, sigma_lo, ctx.args.direct_align_branch)
    extras = {"x0": x0, "noise": noise, "sigma_hi": sigma_hi, "sigma_lo": sigma_lo}
    return prepare_reward_batch(ctx, batch, x, sigma, extras={k: v.to(ctx.device) for k, v in extras.items()})


def augmented(metadatas: list[dict[str, Any]], word: str) -> list[dict[str, Any]]:
    """Each metadata with its `control_word` (what a text-conditioned differentiable reward reads with `prompt`)."""
    return [{**m, "control_word": word} for m in metadatas]


def direct_align_formula(
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
    """Σ over pairs of λ·φ(r) (+ the velocity penalty): r = R(x̂₀), or with --direct-align-control-words
    (1 + k)·R(x̂₀, c⁺) − R(x̂₀, c⁻)."""
    args, extras = ctx.args, prepared.extras
    x0_hat = direct_align_x0(
        prepared.latents, new_pred, extras["noise"], extras["sigma_hi"], extras["sigma_lo"], args.direct_align_branch
    )
    metadatas = pair_metadatas(batch)
    if args.direct_align_control_words:
        positive, negative = args.direct_align_control_words
        r_pos = score_x0(ctx, x0_hat, augmented(metadatas, positive))
        r_neg = score_x0(ctx, x0_hat, augmented(metadatas, negative))
        reward = relative_reward(r_pos, r_neg, float(args.direct_align_k))
    else:
        reward = score_x0(ctx, x0_hat, metadatas)
    with torch.no_grad():
        metrics.add("train/direct_align_sigma_mean", extras["sigma_hi"])
        metrics.add("train/direct_align_x0_abs_diff", (x0_hat.detach() - extras["x0"]).flatten(1).abs().mean(dim=1))
    return reward_loss(ctx, reward, new_pred, frozen_preds, metrics)
