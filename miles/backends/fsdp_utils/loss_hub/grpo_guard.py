"""grpo_guard (GRPO-Guard), train side: Flow-GRPO's prepare and step kernel, the normalised ratio r̂ against the
rollout's step mean μ_old, the clipped loss reweighted by 1/(−dt) (ALGORITHMS.md "GRPO-Guard"). The μ_old helpers
here serve every loss that takes the rollout's step means (Flow-DPPO too)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from miles.backends.fsdp_utils.loss_hub.flow_grpo import REF_NETWORK, policy_step
from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext, PreparedBatch, WindowMetrics
from miles.diffusion.guard import guard_policy_loss, normalized_log_ratio
from miles.diffusion.sde import StepResult, kl_to_reference
from miles.utils.types import TrainPairs

OLD_MEAN = "old_mean"  # μ_old of the ratio: the rollout's, or the recompute pass's (--diffusion-recompute-old-log-prob)
ROLLOUT_MEAN = "rollout_mean"  # the engine's, kept for the train/rollout parity metric


def old_mean_of(batch: TrainPairs, step: StepResult, old_log_prob_from_new: bool) -> torch.Tensor:
    """μ_old of each pair: the current step mean, detached, in a window that runs before any update of a recompute
    run (the ratio is then exactly 1); else the `old_mean` column."""
    if old_log_prob_from_new:
        return step.mean.detach()
    if OLD_MEAN not in batch:
        raise KeyError(
            f"the train pairs have no {OLD_MEAN!r} column (the rollout's step means μ_old): its rollout side must ask "
            "the engine for them (GenerateRequest.record_means) and store them"
        )
    return batch[OLD_MEAN].to(step.mean.device)


def store_old_step(batch: TrainPairs, step: StepResult) -> None:
    """The recompute pass: the current policy's step mean and log-prob become the pairs' old ones."""
    batch[OLD_MEAN].copy_(step.mean.detach().to(batch[OLD_MEAN].device))
    batch["old_log_prob"].copy_(step.log_prob.detach().to(batch["old_log_prob"].device))


def record_rollout_parity(batch: TrainPairs, step: StepResult, metrics: WindowMetrics, optim_step_idx: int) -> None:
    """Before any update of this train call (window 0): how far the trainer's step is from the engine's record."""
    if optim_step_idx != 0:
        return
    with torch.no_grad():
        log_prob = step.log_prob
        metrics.add("train/log_prob_abs_diff", (log_prob - batch["rollout_log_prob"].to(log_prob.device)).abs())
        diff = (step.mean - batch[ROLLOUT_MEAN].to(step.mean.device)).abs()
        metrics.add("train/mean_abs_diff", diff.reshape(diff.shape[0], -1).max(dim=1).values)


def with_reference_kl(
    ctx: DiffusionLossContext,
    batch: TrainPairs,
    step: StepResult,
    frozen_preds: Mapping[str, torch.Tensor],
    metrics: WindowMetrics,
    loss: torch.Tensor,
) -> torch.Tensor:
    """loss + --diffusion-kl-beta · Flow-GRPO's KL to `ref`, when the prepare named it."""
    if REF_NETWORK not in frozen_preds:
        return loss
    with torch.no_grad():
        ref_mean = policy_step(ctx, batch, frozen_preds[REF_NETWORK]).mean
    kl = kl_to_reference(step.mean, ref_mean, step.std_t)
    metrics.add("train/kl", kl)
    return loss + ctx.args.diffusion_kl_beta * kl


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
        metrics.add("train/clipfrac", ((ratio - 1.0).abs() > args.grpo_guard_clip_range).float())
        metrics.add("train/approx_kl", 0.5 * log_ratio**2)
    record_rollout_parity(batch, step, metrics, optim_step_idx)
    metrics.add("train/guard_policy_loss", loss)
    loss = with_reference_kl(ctx, batch, step, frozen_preds, metrics, loss)
    metrics.add("train/loss", loss)
    return loss.sum()
