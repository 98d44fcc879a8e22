"""flow_dppo (Flow-DPPO), train side: the unclipped −A·r of the SDE step's log-prob ratio, masked per transition by a
trust region on the exact Gaussian KL to the rollout's step mean μ_old (ALGORITHMS.md "Flow-DPPO and DanceGRPO").

The mask, as the two peer implementations write it (UniRL `unirl/algorithms/flowdppo.py` `_flowdppo_kl_adv_loss`,
verl-omni `FlowDPPOLoss.compute_loss`, which agree): KL = mean over dims of (μ_θ − μ_old)²/(2s²), s = std_t·√(−dt)
the step's true std; a transition is dropped when KL >= δ and (r > 1 and A > 0, or r < 1 and A < 0; read here from the sign of log r), i.e. outside the
trust region and moving further from the rollout policy; a high-KL transition whose gradient pulls r back to 1 is
kept. Both zero the dropped ones with `torch.where` (an overflowed r cannot make inf·0) and average over every
transition, dropped ones included. Differences here: the advantage is clamped to ±--diffusion-adv-clip-max as in
every miles loss (neither peer clamps it for Flow-DPPO); μ_old and the old log-prob are the engine's record (UniRL
replays μ_old with the trainer before the update; --diffusion-recompute-old-log-prob does that here, for both); and
their `add_kl_coefficient=False` option (KL without the 1/(2s²)) is not offered.
"""

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
from miles.diffusion.dppo import gaussian_mean_kl, kl_masked_policy_loss
from miles.utils.types import TrainPairs


def dppo_formula(
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
    """Sum over pairs of the KL-masked −A·r, plus the optional KL to `ref`; in the recompute pass
    (`write_old_log_prob`) it stores μ_old and the old log-prob and returns None."""
    args = ctx.args
    step = policy_step(ctx, batch, new_pred)
    if write_old_log_prob:
        store_old_step(batch, step)
        return None
    log_prob = step.log_prob
    assert log_prob is not None  # policy_step is an SDE step: it has a log-prob
    old_mean = old_mean_of(batch, step, old_log_prob_from_new)
    old_log_prob = log_prob.detach() if old_log_prob_from_new else batch["old_log_prob"].to(log_prob.device)
    kl = gaussian_mean_kl(step.mean.detach(), old_mean, step.step_std)
    loss, ratio, keep = kl_masked_policy_loss(
        log_prob,
        old_log_prob,
        kl,
        batch["advantage"].to(log_prob.device),
        kl_threshold=args.flow_dppo_kl_threshold,
        adv_clip_max=args.diffusion_adv_clip_max,
    )
    with torch.no_grad():
        metrics.add("train/ratio_mean", ratio)
        metrics.add("train/approx_kl", 0.5 * (log_prob - old_log_prob) ** 2)
        metrics.add("train/kl_old", kl)
        metrics.add("train/masked_fraction", (~keep).float())
    record_rollout_parity(batch, step, metrics, optim_step_idx)
    metrics.add("train/policy_loss", loss)
    loss = with_reference_kl(ctx, batch, step, frozen_preds, metrics, loss)
    metrics.add("train/loss", loss)
    return loss.sum()
