"""nft (DiffusionNFT): implicit positive/negative policy loss on re-noised clean latents against the `old` policy,
optional KL to a reference, and the old-policy decay read from the flags (ALGORITHMS.md, nft)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

import torch

from miles.backends.fsdp_utils.loss_hub.noise import pair_generators, pair_noise
from miles.backends.fsdp_utils.loss_hub.types import (
    DiffusionLossContext,
    PreparedBatch,
    WindowMetrics,
    conditioning_from_pairs,
    frozen_prediction,
)
from miles.diffusion.nft import advantage_to_r, nft_loss
from miles.diffusion.schedule import add_noise
from miles.diffusion.shadow import old_policy_decay, velocity_kl
from miles.utils.types import TrainPairs

OLD_NETWORK = "old"
REF_NETWORK = "ref"


def nft_old_decay(args: argparse.Namespace, step: int) -> float:
    """Decay d of θ_old ← d·θ_old + (1 − d)·θ after a rollout's training, `step` = optimizer steps done so far."""
    return old_policy_decay(
        step,
        rate=args.diffusion_nft_old_decay_rate,
        max_decay=args.diffusion_nft_old_decay_max,
        flat_steps=args.diffusion_nft_old_decay_flat_steps,
    )


def decay_old_policy(ctx: DiffusionLossContext, *, global_step: int) -> dict[str, float]:
    """The per-rollout step: θ_old ← d·θ_old + (1 − d)·θ with d from the schedule, once training is done."""
    return {OLD_NETWORK: nft_old_decay(ctx.args, global_step)}


def prepare_nft_batch(
    ctx: DiffusionLossContext,
    batch: TrainPairs,
    *,
    microbatch_id: int,
    optim_step_idx: int,
    pad_to_len: int | None = None,
) -> PreparedBatch:
    """x_t = (1 − t)·x₀ + t·ε with fresh ε seeded per pair (`pair_generators`); the trunk runs `old` on the same inputs
    (`frozen_preds["old"]`), and `ref` too when the KL term is on (`frozen_preds["ref"]`)."""
    args = ctx.args
    x0, t = batch["x0"].float(), batch["t"].float()
    noise = pair_noise(pair_generators(ctx, batch, optim_step_idx), x0.shape)
    x0, noise, t = x0.to(ctx.device), noise.to(ctx.device), t.to(ctx.device)
    guidance = float(args.diffusion_nft_guidance_scale)
    negative = None
    if guidance > 1.0:
        if not any(key.startswith("negative_cond/") for key in batch):
            raise ValueError(
                "--diffusion-nft-guidance-scale > 1 needs negative prompt embeddings in the train pairs: "
                "sample the rollout with --diffusion-guidance-scale > 1, or train CFG-free (scale 1.0)"
            )
        negative = conditioning_from_pairs(batch, ctx.device, prefix="negative_")
    return PreparedBatch(
        latents=add_noise(x0, noise, t),
        sigmas=t,
        embeds=conditioning_from_pairs(batch, ctx.device),
        negative=negative,
        guidance_scale=guidance,
        frozen_networks=(OLD_NETWORK, REF_NETWORK) if args.diffusion_nft_kl_beta > 0 else (OLD_NETWORK,),
        extras={"x0": x0, "noise": noise, "t": t},
    )


def nft_formula(
    ctx: DiffusionLossContext,
    batch: TrainPairs,
    prepared: PreparedBatch,
    *,
    new_pred: torch.Tensor,
    frozen_preds: Mapping[str, torch.Tensor],
    metrics: WindowMetrics,
    **kwargs,
) -> torch.Tensor:
    """Sum over pairs of the NFT loss (v_θ = `new_pred`, v_old = `frozen_preds["old"]`), plus
    kl_beta·mean((v_θ − v_ref)²) with v_ref = `frozen_preds["ref"]`."""
    v_old = frozen_prediction(frozen_preds, OLD_NETWORK, "nft's policy loss")
    args = ctx.args
    clip = args.diffusion_adv_clip_max
    r = advantage_to_r(batch["advantage"].to(new_pred.device), clip)
    loss, parts = nft_loss(
        new_pred,
        v_old,
        prepared.extras["x0"],
        prepared.latents,
        prepared.sigmas,
        r,
        beta=args.diffusion_nft_beta,
        adv_clip_max=clip,
        adaptive_weight=not args.diffusion_nft_disable_adaptive_weight,
    )
    n = loss.shape[0]
    # nft_loss reports micro-batch means; n copies of a mean sum to the per-pair sum, so window means stay per pair
    metrics.add("train/nft_policy_loss", loss)
    metrics.add("train/nft_positive_loss", parts["positive_loss"].expand(n))
    metrics.add("train/nft_negative_loss", parts["negative_loss"].expand(n))
    metrics.add("train/nft_old_deviate", parts["old_deviate"].expand(n))
    metrics.add("train/r_mean", r)
    if args.diffusion_nft_kl_beta > 0:
        kl = velocity_kl(new_pred, frozen_prediction(frozen_preds, REF_NETWORK, "--diffusion-nft-kl-beta > 0"))
        metrics.add("train/kl", kl)
        loss = loss + args.diffusion_nft_kl_beta * kl
    metrics.add("train/loss", loss)
    return loss.sum()
