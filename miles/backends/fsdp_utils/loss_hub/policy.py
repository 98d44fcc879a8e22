"""The policy step, shared by every loss on recorded SDE transitions (Flow-GRPO, GRPO-Guard, Flow-DPPO and a
custom_loss built on them): the prepare that replays a transition's inputs, the --diffusion-sde-type kernel scoring
it (`policy_step`), the optional KL to the `ref` network, and the rollout's step mean μ_old of the ratio-on-means
losses (its column, the recompute pass's store, the train/rollout parity metrics)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from miles.backends.fsdp_utils.loss_hub.types import (
    DiffusionLossContext,
    PreparedBatch,
    WindowMetrics,
    conditioning_from_pairs,
)
from miles.diffusion.sde import StepResult, get_sde_kernel, kl_to_reference
from miles.utils.types import TrainPairs

REF_NETWORK = "ref"
OLD_MEAN = "old_mean"  # μ_old of the ratio: the rollout's, or the recompute pass's (--diffusion-recompute-old-log-prob)
ROLLOUT_MEAN = "rollout_mean"  # the engine's, kept for the train/rollout parity metric


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


def policy_step(ctx: DiffusionLossContext, batch: TrainPairs, velocity: torch.Tensor) -> StepResult:
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
    assert step.log_prob is not None  # policy_step is an SDE step: it has a log-prob
    batch["old_log_prob"].copy_(step.log_prob.detach().to(batch["old_log_prob"].device))


def record_rollout_parity(batch: TrainPairs, step: StepResult, metrics: WindowMetrics, optim_step_idx: int) -> None:
    """Before any update of this train call (window 0): how far the trainer's step is from the engine's record."""
    if optim_step_idx != 0:
        return
    with torch.no_grad():
        log_prob = step.log_prob
        assert log_prob is not None  # policy_step is an SDE step: it has a log-prob
        metrics.add("train/log_prob_abs_diff", (log_prob - batch["rollout_log_prob"].to(log_prob.device)).abs())
        diff = (step.mean - batch[ROLLOUT_MEAN].to(step.mean.device)).abs()
        metrics.add("train/mean_abs_diff", diff.reshape(diff.shape[0], -1).max(dim=1).values)
