"""policy_loss (Flow-GRPO): clipped ratio of SDE-step log-probs, optional KL to a reference (ALGORITHMS.md). Its
prepare, step kernel and KL are the shared policy step's (`loss_hub/policy.py`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from miles.backends.fsdp_utils.loss_hub.policy import policy_step, with_reference_kl
from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext, PreparedBatch, WindowMetrics
from miles.diffusion.policy import clipped_policy_loss
from miles.utils.types import TrainPairs


def policy_formula(
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
    """Sum over pairs of the clipped policy loss of the SDE step's log-prob, plus kl_beta·KL to `ref` when the
    prepare named it; in the recompute pass (`write_old_log_prob`) it stores the old log-probs and returns None."""
    args = ctx.args
    step = policy_step(ctx, batch, new_pred)
    log_prob = step.log_prob
    assert log_prob is not None  # policy_step is an SDE step: it has a log-prob
    if write_old_log_prob:
        batch["old_log_prob"].copy_(log_prob.detach().to(batch["old_log_prob"].device))
        return None
    old = log_prob.detach() if old_log_prob_from_new else batch["old_log_prob"].to(log_prob.device)
    loss, _ = clipped_policy_loss(
        log_prob,
        old,
        batch["advantage"].to(log_prob.device),
        clip_range=args.diffusion_clip_range,
        adv_clip_max=args.diffusion_adv_clip_max,
    )
    with torch.no_grad():
        delta = log_prob - old
        metrics.add("train/ratio_mean", torch.exp(delta))
        metrics.add("train/clipfrac", ((torch.exp(delta) - 1.0).abs() > args.diffusion_clip_range).float())
        metrics.add("train/approx_kl", 0.5 * delta**2)
        if optim_step_idx == 0:  # only window 0 runs before any update of this train call
            diff = (log_prob - batch["rollout_log_prob"].to(log_prob.device)).abs()
            metrics.add("train/log_prob_abs_diff", diff)
    metrics.add("train/policy_loss", loss)
    loss = with_reference_kl(ctx, batch, step, frozen_preds, metrics, loss)
    metrics.add("train/loss", loss)
    return loss.sum()
