"""policy_loss (Flow-GRPO): clipped ratio of SDE-step log-probs, optional KL to a reference (ALGORITHMS.md)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from miles.backends.fsdp_utils.loss_hub.types import (
    DiffusionLossContext,
    PreparedBatch,
    WindowMetrics,
    conditioning_from_pairs,
)
from miles.diffusion.grpo import clipped_policy_loss
from miles.diffusion.sde import get_sde_kernel, kl_to_reference
from miles.utils.types import TrainPairs

REF_NETWORK = "ref"


def uses_reference(args) -> bool:
    return args.diffusion_kl_beta > 0 and args.ref_mode != "none"


def prepare_policy_batch(
    ctx: DiffusionLossContext,
    batch: TrainPairs,
    *,
    microbatch_id: int,
    optim_step_idx: int,
    pad_to_len: int | None = None,
) -> PreparedBatch:
    """The recorded transition's input latents and conditioning, with CFG exactly as the engine sampled."""
    args = ctx.args
    guided = args.diffusion_guidance_scale > 1.0
    return PreparedBatch(
        latents=batch["latents"].to(ctx.device),
        sigmas=batch["sigma"].to(ctx.device),
        embeds=conditioning_from_pairs(batch, ctx.device),
        negative=conditioning_from_pairs(batch, ctx.device, prefix="negative_") if guided else None,
        guidance_scale=args.diffusion_guidance_scale,
        frozen_networks=(REF_NETWORK,) if uses_reference(args) else (),
    )


def policy_step(ctx: DiffusionLossContext, batch: TrainPairs, velocity: torch.Tensor):
    """The --diffusion-sde-type kernel scoring the recorded transition x -> x' of `batch` under `velocity`."""
    kernel = get_sde_kernel(ctx.args.diffusion_sde_type)
    return kernel(
        batch["latents"].to(ctx.device),
        velocity,
        batch["sigma"].to(ctx.device),
        batch["sigma_next"].to(ctx.device),
        noise_level=ctx.args.diffusion_noise_level,
        sigma_max=float(batch["sigma_max"][0]),  # one grid per rollout
        prev_sample=batch["next_latents"].to(ctx.device),
    )


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
    if REF_NETWORK in frozen_preds:
        with torch.no_grad():
            ref_mean = policy_step(ctx, batch, frozen_preds[REF_NETWORK]).mean
        kl = kl_to_reference(step.mean, ref_mean, step.std_t)
        metrics.add("train/kl", kl)
        loss = loss + args.diffusion_kl_beta * kl
    metrics.add("train/loss", loss)
    return loss.sum()
