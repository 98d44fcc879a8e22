"""A loss type added from outside miles: advantage-weighted flow matching (`awfm`), the worked example of
docs/user-guide/customization.md. Run it with

    python train_diffusion.py --algorithm-path examples/advantage_weighted_fm.py --loss-type awfm

The maths: on clean ODE samples x₀ with GRPO advantages A, re-noise x_t = (1 − t)·x₀ + t·ε and regress the velocity
onto ε − x₀, each pair weighted by max(A, 0)/c (c = --diffusion-adv-clip-max): samples better than their group
are imitated, the others ignored (a reward-filtered SFT, in the spirit of RAFT / reward-weighted regression).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from miles.algorithms import Algorithm, register_algorithm
from miles.backends.fsdp_utils.loss_hub import LOSS_HOOKS, LossHooks
from miles.backends.fsdp_utils.loss_hub.noise import pair_generators, pair_noise
from miles.backends.fsdp_utils.loss_hub.types import PreparedBatch, WindowMetrics, conditioning_from_pairs
from miles.diffusion.schedule import add_noise
from miles.rollout.rollout_hub import ROLLOUT_SPECS, RolloutSpec, nft_pairs, nft_pairs_count, ode_request

NAME = "awfm"


# ---- the maths: a pure function over tensors ----------------------------------------------------------------------
def advantage_weighted_fm_loss(
    v: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor, advantage: torch.Tensor, clip: float
) -> torch.Tensor:
    """Per pair: max(A, 0)/c · mean over dims of (v − (ε − x₀))², A clamped to [−c, c]."""
    weight = advantage.clamp(-clip, clip).clamp_min(0.0) / clip
    return weight * ((v.float() - (noise - x0)) ** 2).flatten(1).mean(dim=1)


# ---- the train side: prepare and formula, one LOSS_HOOKS entry ----------------------------------------------------
def prepare(ctx, batch, *, microbatch_id: int, optim_step_idx: int, pad_to_len=None) -> PreparedBatch:
    x0, t = batch["x0"].float(), batch["t"].float()
    noise = pair_noise(pair_generators(ctx, batch, optim_step_idx), x0.shape)
    x0, noise, t = x0.to(ctx.device), noise.to(ctx.device), t.to(ctx.device)
    return PreparedBatch(
        latents=add_noise(x0, noise, t),
        sigmas=t,
        embeds=conditioning_from_pairs(batch, ctx.device),
        extras={"x0": x0, "noise": noise},
    )


def formula(
    ctx,
    batch,
    prepared: PreparedBatch,
    *,
    new_pred: torch.Tensor,
    frozen_preds: Mapping[str, torch.Tensor],
    metrics: WindowMetrics,
    optim_step_idx: int,
    **kwargs,
) -> torch.Tensor:
    advantage = batch["advantage"].to(new_pred.device).float()
    loss = advantage_weighted_fm_loss(
        new_pred, prepared.extras["noise"], prepared.extras["x0"], advantage, ctx.args.diffusion_adv_clip_max
    )
    metrics.add("train/loss", loss)
    metrics.add("train/imitated_frac", (advantage > 0).float())
    return loss.sum()


# ---- the declaration: what the parser, the driver and the plots ask (ODE samples, rewards, the actor only) --------
register_algorithm(Algorithm(name=NAME, samples_sde=False, identifying_metrics=("train/imitated_frac",)))

LOSS_HOOKS[(NAME, "actor")] = LossHooks(prepare=prepare, formula=formula)

# ---- the rollout side: DiffusionNFT's ODE samples and clean-latent pairs, one ROLLOUT_SPECS entry ------------------
ROLLOUT_SPECS[NAME] = RolloutSpec(build_request=ode_request, convert=nft_pairs, pairs_per_sample=nft_pairs_count)
