"""What the reward-gradient losses (refl, draft, direct_align) share on the train side: the differentiable rewards of
--rm-type loaded in the trainer, a clean latent scored with gradient (decoded by the family's VAE for an image
reward), the prepare of a recorded step's input with CFG as the engine sampled, and the objective with its
reference-velocity penalty (docs/user-guide/reward-gradients.md). A neutral module: no algorithm's own."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from miles.arguments.reward_spec import CUSTOM, differentiable_reward_problems, reward_spec_from_args
from miles.backends.fsdp_utils.loss_hub.types import (
    DiffusionLossContext,
    PreparedBatch,
    WindowMetrics,
    conditioning_from_pairs,
    frozen_prediction,
)
from miles.diffusion.reward_grad import reward_objective, velocity_penalty
from miles.models.shapes_reward.differentiable import (
    BUILTIN_DIFFERENTIABLE,
    DifferentiableReward,
    differentiable_of,
)
from miles.models.shapes_reward.net import IMAGE
from miles.utils.json_column import decode_json_column
from miles.utils.misc import load_function
from miles.utils.types import TrainPairs

REF_NETWORK = "ref"
METADATA = "reward_metadata"  # the JSON column of each pair's prompt metadata (rollout_hub.pairs writes it)


@dataclass(frozen=True)
class TrainReward:
    """One weighted term of the trained reward."""

    name: str
    weight: float
    reward: DifferentiableReward


def differentiable_rewards(args: argparse.Namespace) -> list[TrainReward]:
    """The weighted rewards of --rm-type as the trainer scores them (zero-weight ones are only logged by the rollout
    side); one that cannot be back-propagated is an error naming it (the start-up refused it already)."""
    problems = differentiable_reward_problems(args, reward_spec_from_args(args))
    if problems:
        raise ValueError("; ".join(problems))
    terms = []
    for name, weight in reward_spec_from_args(args):
        if weight == 0:
            continue
        found = (
            differentiable_of(load_function(args.custom_rm_path)) if name == CUSTOM else BUILTIN_DIFFERENTIABLE[name]
        )
        assert found is not None  # differentiable_reward_problems checked it
        terms.append(TrainReward(name, weight, found))
    return terms


def decoded_pixels(ctx: DiffusionLossContext, x0: torch.Tensor) -> torch.Tensor:
    """The family's VAE decode of normalised latents, differentiable, on the trainer's device (loaded there once)."""
    vae = ctx.family.cached_vae()
    if vae.device != ctx.device:
        ctx.family.load_vae(ctx.device)
    return ctx.family.decode_latents(x0).pixels


def score_x0(ctx: DiffusionLossContext, x0: torch.Tensor, metadatas: list[dict[str, Any]]) -> torch.Tensor:
    """(B,) Σ_k w_k·R_k of the clean latents `x0`, differentiable in them: an image reward scores their decode, a
    latent reward the latents themselves."""
    total: torch.Tensor | None = None
    pixels: torch.Tensor | None = None
    for term in differentiable_rewards(ctx.args):
        if term.reward.inputs == IMAGE:
            pixels = decoded_pixels(ctx, x0) if pixels is None else pixels
            inputs = pixels
        else:
            inputs = x0
        value = term.weight * term.reward.score(ctx.args, inputs, metadatas).float().to(x0.device)
        total = value if total is None else total + value
    if total is None:
        raise ValueError(f"--loss-type {ctx.args.loss_type}: --rm-type {ctx.args.rm_type} has no weighted reward")
    return total


def pair_metadatas(batch: TrainPairs, copies: int = 1) -> list[dict[str, Any]]:
    """Each pair's prompt metadata, each repeated `copies` times in a row (the rows of a pair's copies)."""
    if METADATA not in batch:
        raise KeyError(
            f"reward-gradient pairs need the {METADATA!r} column (the rollout side writes it): {sorted(batch)}"
        )
    return [m for m in decode_json_column(batch[METADATA]) for _ in range(copies)]


def uses_reference(args: argparse.Namespace) -> bool:
    return args.reward_grad_kl_beta > 0 and args.ref_mode != "none"


def prepare_reward_batch(
    ctx: DiffusionLossContext,
    batch: TrainPairs,
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    *,
    copies: int = 1,
    unroll_sigmas: torch.Tensor | None = None,
    extras: dict[str, Any] | None = None,
) -> PreparedBatch:
    """The forward on `latents` at `sigmas` (`copies` rows per pair, pair-major) with the pairs' conditioning and CFG
    exactly as the engine sampled, the reference named when the penalty needs it."""
    args = ctx.args
    guided = args.diffusion_guidance_scale > 1.0
    embeds = conditioning_from_pairs(batch, ctx.device)
    negative = conditioning_from_pairs(batch, ctx.device, prefix="negative_") if guided else None
    if copies > 1:
        embeds = embeds.repeat_interleave(copies)
        negative = None if negative is None else negative.repeat_interleave(copies)
    return PreparedBatch(
        latents=latents.to(ctx.device),
        sigmas=sigmas.to(ctx.device),
        embeds=embeds,
        negative=negative,
        guidance_scale=args.diffusion_guidance_scale,
        frozen_networks=(REF_NETWORK,) if uses_reference(args) else (),
        extras=extras or {},
        unroll_sigmas=unroll_sigmas,
    )


def reward_loss(
    ctx: DiffusionLossContext,
    reward: torch.Tensor,
    new_pred: torch.Tensor,
    frozen_preds: Mapping[str, torch.Tensor],
    metrics: WindowMetrics,
    *,
    copies: int = 1,
) -> torch.Tensor:
    """Σ over pairs of λ·φ(R) (+ β·mean((v_θ − v_ref)²)), each pair's terms the mean over its `copies` rows."""
    args = ctx.args
    per_row = args.reward_grad_scale * reward_objective(reward, args.reward_grad_hinge)
    metrics.add("train/reward_mean", reward)
    metrics.add("train/reward_loss", per_row)
    if uses_reference(args):
        v_ref = frozen_prediction(frozen_preds, REF_NETWORK, f"--reward-grad-kl-beta of --loss-type {args.loss_type}")
        penalty = velocity_penalty(new_pred, v_ref)
        metrics.add("train/velocity_penalty", penalty)
        per_row = per_row + args.reward_grad_kl_beta * penalty
    per_pair = per_row.reshape(-1, copies).mean(dim=1)
    metrics.add("train/loss", per_pair)
    return per_pair.sum()
