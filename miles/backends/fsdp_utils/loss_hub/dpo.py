"""dpo (Diffusion-DPO in flow form): the preference loss on the flow-matching errors of each pair's chosen and rejected
latent against the `dpo_ref` shadow, and its refresh every --dpo-ref-update-interval optimizer steps
(ALGORITHMS.md, "DPO in flow form")."""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

import torch

from miles.algorithms.dpo import REFERENCE
from miles.backends.fsdp_utils.loss_hub.noise import pair_generators, pair_noise
from miles.backends.fsdp_utils.loss_hub.types import (
    DiffusionLossContext,
    PreparedBatch,
    WindowMetrics,
    conditioning_from_pairs,
    frozen_prediction,
)
from miles.diffusion.dpo import dpo_logits, dpo_loss, flow_error
from miles.diffusion.schedule import add_noise, sample_timestep_density, sigmas_from_u, training_sigmas
from miles.utils.simulation import real_tensors
from miles.utils.types import TrainPairs

REF_NETWORK = REFERENCE.name
PAIR_WEIGHT = "weight"  # 1 for a pair that trains, 0 for a dropped group's: the trunk's denominator (LossHooks)


@lru_cache(maxsize=8)
def _sigma_table(shift: float) -> torch.Tensor:
    with real_tensors():  # cached: never a planner's fake tensor
        return training_sigmas(shift=shift)


def refresh_due(global_step: int, *, interval: int, steps_per_rollout: int) -> bool:
    """Whether the optimizer-step count crossed a multiple of `interval` during the rollout just trained (it ended at
    `global_step` after up to `steps_per_rollout` steps); interval 0 never refreshes."""
    if interval <= 0 or global_step <= 0:
        return False
    return global_step // interval > max(global_step - steps_per_rollout, 0) // interval


def refresh_reference(ctx: DiffusionLossContext, *, global_step: int) -> dict[str, float]:
    """The per-rollout step: θ_ref ← θ (decay 0) when a refresh is due, else nothing (offline: never, by default)."""
    args = ctx.args
    due = refresh_due(global_step, interval=args.dpo_ref_update_interval, steps_per_rollout=args.num_steps_per_rollout)
    return {REF_NETWORK: 0.0} if due else {}


def prepare_dpo_batch(
    ctx: DiffusionLossContext,
    batch: TrainPairs,
    *,
    microbatch_id: int,
    optim_step_idx: int,
    pad_to_len: int | None = None,
) -> PreparedBatch:
    """Each pair's chosen and rejected latent noised with ONE ε and ONE σ (logit-normal u, mean 0, std 1, looked up
    on the scheduler's training table), seeded by ids; the rows interleave (w₀, l₀, w₁, l₁, ...) so that one forward
    of the policy and one of `dpo_ref` score both."""
    x0_w, x0_l = batch["x0_w"].float(), batch["x0_l"].float()
    generators = pair_generators(ctx, batch, optim_step_idx)
    u = torch.cat([sample_timestep_density("logit_normal", 1, generator=g) for g in generators])
    sigmas = sigmas_from_u(u, _sigma_table(float(ctx.family.scheduler_shift)))
    noise = pair_noise(generators, x0_w.shape)
    x0 = torch.stack([x0_w, x0_l], dim=1).flatten(0, 1).to(ctx.device)  # (2P, ...) interleaved
    noise = noise.repeat_interleave(2, dim=0).to(ctx.device)
    sigmas = sigmas.repeat_interleave(2).to(ctx.device)
    return PreparedBatch(
        latents=add_noise(x0, noise, sigmas),
        sigmas=sigmas,
        embeds=conditioning_from_pairs(batch, ctx.device).repeat_interleave(2),
        frozen_networks=(REF_NETWORK,),
        extras={"x0": x0, "noise": noise, "weight": batch[PAIR_WEIGHT].float().to(ctx.device)},
    )


def dpo_formula(
    ctx: DiffusionLossContext,
    batch: TrainPairs,
    prepared: PreparedBatch,
    *,
    new_pred: torch.Tensor,
    frozen_preds: Mapping[str, torch.Tensor],
    metrics: WindowMetrics,
    **kwargs,
) -> torch.Tensor:
    """Sum over pairs of weight·(−log σ(z)), z from the flow errors of v_θ (`new_pred`) and v_ref
    (`frozen_preds["dpo_ref"]`) on the interleaved rows. The trunk divides by the window's weight (the entry's
    `pair_weight`), so the step is the mean over the pairs that train, however many dropped groups ride along;
    `train/loss` is that mean too (over the kept pairs), and `train/dpo_pair_weight` the kept share."""
    v_ref = frozen_prediction(frozen_preds, REF_NETWORK, "dpo's preference loss")
    x0, noise, weight = prepared.extras["x0"], prepared.extras["noise"], prepared.extras["weight"]
    err = flow_error(new_pred, x0, noise).view(-1, 2)
    with torch.no_grad():
        ref_err = flow_error(v_ref, x0, noise).view(-1, 2)
    z = dpo_logits(err[:, 0], err[:, 1], ref_err[:, 0], ref_err[:, 1], beta=ctx.args.dpo_beta)
    loss = weight * dpo_loss(z)
    kept = weight > 0
    metrics.add("train/loss", loss[kept])  # the mean the step follows (weights are 0/1)
    metrics.add("train/dpo_pair_weight", weight)
    metrics.add("train/dpo_implicit_acc", (z[kept] > 0).float())  # among trained pairs (possibly none here)
    metrics.add("train/dpo_z", z[kept])
    metrics.add("train/dpo_err_w", err[kept, 0])
    metrics.add("train/dpo_err_l", err[kept, 1])
    metrics.add("train/dpo_ref_err_w", ref_err[kept, 0])
    metrics.add("train/dpo_ref_err_l", ref_err[kept, 1])
    metrics.add("train/sigma_mean", prepared.sigmas[::2])
    if "reward_gap" in batch:
        metrics.add("train/dpo_reward_gap", batch["reward_gap"].float()[kept.cpu()])
    return loss.sum()
