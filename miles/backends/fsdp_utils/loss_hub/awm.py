"""awm (advantage-weighted matching, arXiv 2509.25050): the clipped policy gradient whose log-prob is the weighted
flow-matching error of re-noised clean samples, + β·KL to the reference + β_ema·KL to the EMA anchor (ALGORITHMS.md).

Against the authors' code (scxue/advantage_weighted_matching, scripts/train_sd3_awm.py, `time_type
discrete_wo_init`, `loss_type exp_first`, on-policy):
- logp_old: window 0 takes its own detached log-prob (ratio exactly 1), windows 1.. the trainer's recompute pass
  with the pre-update weights on the same timesteps and noise (the seed's `write_old_log_prob` contract; the
  declaration turns --diffusion-recompute-old-log-prob on). The authors' loop does the same: its first
  gradient-accumulation round reuses its own value, the others get a no-grad pre-pass. Their recipe takes one
  optimizer step per rollout, where the ratio is always 1 and the clip never acts.
- Timesteps: the same strata of the grid indices [1, int(0.9·N)) (floors of an even split, one index per stratum),
  but drawn per sample from a seeded stream where the authors draw one set per micro-batch from the global RNG.
- ε: drawn per micro-batch from the (seed, rollout, rank, micro-batch) stream, identical in the recompute and the
  training pass; the authors draw it once per rollout and keep it.
- The KL terms use their `Uniform` weighting, mean((v_θ − v)²); ℓ and logp are computed in float64 as theirs.
- The EMA anchor moves once per rollout after training, d = min(0.3, 0.001·step) (`linear`), as theirs; v_ref is
  the --ref-mode reference (the LoRA base in their recipe).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from miles.algorithms.awm import EMA_ANCHOR
from miles.backends.fsdp_utils.loss_hub.noise import pair_generators, pair_noise
from miles.backends.fsdp_utils.loss_hub.types import (
    DiffusionLossContext,
    PreparedBatch,
    WindowMetrics,
    conditioning_from_pairs,
    frozen_prediction,
)
from miles.diffusion.awm import awm_log_prob, scaled_advantage
from miles.diffusion.policy import clipped_policy_loss
from miles.diffusion.schedule import add_noise
from miles.diffusion.shadow import old_policy_decay, velocity_kl
from miles.utils.types import TrainPairs

REF_NETWORK = "ref"
EMA_NETWORK = EMA_ANCHOR.name


def decay_ema_anchor(ctx: DiffusionLossContext, *, global_step: int) -> dict[str, float]:
    """The per-rollout step: θ_ema ← d·θ_ema + (1 − d)·θ, d = min(--awm-ema-decay-max, rate·step)."""
    args = ctx.args
    decay = old_policy_decay(global_step, rate=args.awm_ema_decay_rate, max_decay=args.awm_ema_decay_max)
    return {EMA_NETWORK: decay}


def frozen_networks(args) -> tuple[str, ...]:
    """The networks whose predictions the loss reads: `ref` for the KL term, the EMA anchor for its KL term."""
    return (REF_NETWORK,) * (args.awm_kl_beta > 0) + (EMA_NETWORK,) * (args.awm_ema_kl_beta > 0)


def prepare_awm_batch(
    ctx: DiffusionLossContext,
    batch: TrainPairs,
    *,
    microbatch_id: int,
    optim_step_idx: int,
    pad_to_len: int | None = None,
) -> PreparedBatch:
    """x_σ = (1 − σ)·x₀ + σ·ε with fresh ε seeded by ids (the same in the recompute and the training pass), CFG as
    the engine sampled."""
    args = ctx.args
    x0, sigma = batch["x0"].float(), batch["t"].float()
    noise = pair_noise(pair_generators(ctx, batch, optim_step_idx), x0.shape)
    x0, noise, sigma = x0.to(ctx.device), noise.to(ctx.device), sigma.to(ctx.device)
    guided = args.diffusion_guidance_scale > 1.0
    return PreparedBatch(
        latents=add_noise(x0, noise, sigma),
        sigmas=sigma,
        embeds=conditioning_from_pairs(batch, ctx.device),
        negative=conditioning_from_pairs(batch, ctx.device, prefix="negative_") if guided else None,
        guidance_scale=args.diffusion_guidance_scale,
        frozen_networks=frozen_networks(args),
        extras={"x0": x0, "noise": noise},
    )


def awm_formula(
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
    """Sum over pairs of max(−A'·ratio, −A'·clip(ratio, 1 − c, 1 + c)) + β·mean((v_θ − v_ref)²) +
    β_ema·mean((v_θ − v_ema)²), ratio = exp(logp_θ − sg(logp_old)); in the recompute pass (`write_old_log_prob`) it
    stores logp_old and returns None."""
    args = ctx.args
    log_prob = awm_log_prob(
        new_pred,
        prepared.extras["x0"],
        prepared.extras["noise"],
        prepared.sigmas,
        weighting=args.awm_weighting,
        power=args.awm_ghuber_power,
    ).float()
    if write_old_log_prob:
        batch["old_log_prob"].copy_(log_prob.detach().to(batch["old_log_prob"].device))
        return None
    old = log_prob.detach() if old_log_prob_from_new else batch["old_log_prob"].to(log_prob.device)
    advantage = scaled_advantage(batch["advantage"].to(log_prob.device), args.diffusion_adv_clip_max)
    loss, _ = clipped_policy_loss(log_prob, old, advantage, clip_range=args.awm_clip_range, adv_clip_max=1.0)
    with torch.no_grad():
        delta = log_prob - old
        metrics.add("train/awm_ratio_mean", torch.exp(delta))
        metrics.add("train/awm_clipfrac", ((torch.exp(delta) - 1.0).abs() > args.awm_clip_range).float())
        metrics.add("train/awm_approx_kl", 0.5 * delta**2)
        metrics.add("train/awm_log_prob", log_prob)
        metrics.add("train/sigma_mean", prepared.sigmas)
    metrics.add("train/policy_loss", loss)
    if args.awm_kl_beta > 0:
        kl = velocity_kl(new_pred, frozen_prediction(frozen_preds, REF_NETWORK, "--awm-kl-beta > 0"))
        metrics.add("train/kl", kl)
        loss = loss + args.awm_kl_beta * kl
    if args.awm_ema_kl_beta > 0:
        ema_kl = velocity_kl(new_pred, frozen_prediction(frozen_preds, EMA_NETWORK, "--awm-ema-kl-beta > 0"))
        metrics.add("train/ema_kl", ema_kl)
        loss = loss + args.awm_ema_kl_beta * ema_kl
    metrics.add("train/loss", loss)
    return loss.sum()
