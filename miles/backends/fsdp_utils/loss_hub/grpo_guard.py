"""grpo_guard (GRPO-Guard), train side: the shared policy step (`loss_hub/policy.py`: prepare, kernel, μ_old, KL), the
normalised ratio r̂ against the rollout's step mean μ_old, the clipped loss reweighted by 1/(−dt) (ALGORITHMS.md
"GRPO-Guard")."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from miles.backends.fsdp_utils.loss_hub.policy import (
    old_mean_of,
    policy_step,
    record_rollout_parity,
    store_old_step,
    with_reference_kl,
)
from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext, PreparedBatch, WindowMetrics
from miles.diffusion.guard import clip_decision, guard_policy_loss, normalized_log_ratio
from miles.utils.types import TrainPairs


def guard_formula(
    ctx: DiffusionLossContext,
    batch: TrainPairs,
    prepared: PreparedBatch,
    *,
    new_pred: torch.Tensor,
    frozen_preds: Mapping[str, torch.Tensor],
    metrics: WindowMetrics,
    optim_step_idx: int,
    write_old_log_prob: bool = False,
    old_log_prob_from_new: bool = False,
    **kwargs,
) -> torch.Tensor | None:
    """Sum over pairs of w·max(−A·r̂, −A·clip(r̂, 1 ± c)), log r̂ = mean(z·(μ_θ − μ_old)), plus the optional KL to
    `ref`; in the recompute pass (`write_old_log_prob`) it stores μ_old and the old log-prob and returns None."""
    args = ctx.args
    step = policy_step(ctx, batch, new_pred)
    if write_old_log_prob:
        store_old_step(batch, step)
        return None
    device = step.mean.device
    old_mean = old_mean_of(batch, step, old_log_prob_from_new)
    log_ratio = normalized_log_ratio(step.mean, old_mean, batch["next_latents"].to(device), step.step_std)
    loss, ratio = guard_policy_loss(
        log_ratio,
        batch["advantage"].to(device),
        (batch["sigma_next"] - batch["sigma"]).to(device),
        clip_range=args.grpo_guard_clip_range,
        adv_clip_max=args.diffusion_adv_clip_max,
        step_reweight=not args.grpo_guard_no_step_reweight,
    )
    with torch.no_grad():
        metrics.add("train/ratio_mean", ratio)
        below, above = clip_decision(log_ratio, args.grpo_guard_clip_range)  # exact, not on the float32 r̂
        metrics.add("train/clipfrac", (below | above).float())
        metrics.add("train/approx_kl", 0.5 * log_ratio**2)
    record_rollout_parity(batch, step, metrics, optim_step_idx)
    metrics.add("train/guard_policy_loss", loss)
    loss = with_reference_kl(ctx, batch, step, frozen_preds, metrics, loss)
    metrics.add("train/loss", loss)
    return loss.sum()
