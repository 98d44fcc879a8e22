"""What a reward that can be back-propagated provides (`DifferentiableReward`, the `differentiable` attribute of its
reward function), and the learned shapes rewards' declarations. On the models floor, so that the trainer's
reward-gradient losses (loss_hub) and the rollout side's reward functions (rm_hub) read the same record
(docs/user-guide/rewards.md, "Differentiable rewards")."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from miles.models.shapes_reward.net import IMAGE, LATENT, LATENT_CHECKPOINT, score_images, score_latents


@dataclass(frozen=True)
class DifferentiableReward:
    """What a reward that can be back-propagated provides, as the `differentiable` attribute of its function.

    `inputs`: IMAGE, pixels (B, 3, H, W) in [0, 1]; or LATENT, the normalised latents of `latent_checkpoint`.
    `score(args, inputs, metadatas)`: (B,) tensor on the inputs' device, differentiable in the inputs, the same
    values (to float rounding) as the reward function `rm(args, samples)` gives the samples those inputs decode to
    or come from (`metadatas`: the samples' prompt metadata).
    """

    inputs: str
    score: Callable[[argparse.Namespace, torch.Tensor, Sequence[dict[str, Any]]], torch.Tensor]
    latent_checkpoint: str | None = None


def differentiable_of(fn: Callable[..., Any]) -> DifferentiableReward | None:
    """The reward function's `DifferentiableReward`, or None for a reward known by its values only."""
    found = getattr(fn, "differentiable", None)
    return found if isinstance(found, DifferentiableReward) else None


def differentiable_images(args: argparse.Namespace, pixels: torch.Tensor, metadatas: Sequence[dict]) -> torch.Tensor:
    """`shapes_learned`'s declared scorer: `score_images` with the weights of --shapes-learned-dir."""
    return score_images(pixels, metadatas, args.shapes_learned_dir)


def differentiable_latents(args: argparse.Namespace, latents: torch.Tensor, metadatas: Sequence[dict]) -> torch.Tensor:
    """`shapes_learned_latent`'s declared scorer: `score_latents` with the weights of --shapes-learned-dir."""
    return score_latents(latents, metadatas, args.shapes_learned_dir)


# the built-in differentiable rewards by --rm-type name (miles.arguments.reward_spec.DIFFERENTIABLE_REWARDS lists the
# same names and inputs; a test keeps them equal)
BUILTIN_DIFFERENTIABLE: dict[str, DifferentiableReward] = {
    "shapes_learned": DifferentiableReward(IMAGE, differentiable_images),
    "shapes_learned_latent": DifferentiableReward(LATENT, differentiable_latents, LATENT_CHECKPOINT),
}
