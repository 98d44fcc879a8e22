"""nft: DiffusionNFT, negative-aware fine-tuning on clean ODE samples with an old policy that samples them."""

from __future__ import annotations

import argparse

from miles.algorithms.base import COMMON_PANELS, EVAL_PANELS, OLD_POLICY, Algorithm, Role
from miles.utils.ranges import AT_LEAST_0, POSITIVE, UNIT, UNIT_OPEN_LOW


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("nft (DiffusionNFT)")
    group.add_argument("--diffusion-nft-beta", type=float, default=1.0, help="Mixing β of the implicit policies.")
    group.add_argument(
        "--diffusion-nft-timestep-fraction", type=float, default=0.6, help="Share of sampling steps trained per sample."
    )
    group.add_argument(
        "--diffusion-nft-disable-adaptive-weight", action="store_true", help="w = 1 instead of the x̂₀-error weight."
    )
    group.add_argument(
        "--diffusion-nft-guidance-scale", type=float, default=1.0, help="CFG of the training forwards (1: CFG-free)."
    )
    group.add_argument("--diffusion-nft-kl-beta", type=float, default=0.0, help="Weight of mean((v − v_ref)²).")
    group.add_argument(
        "--diffusion-nft-old-decay-rate", type=float, default=0.001, help="d = min(rate·(s − flat), max)."
    )
    group.add_argument("--diffusion-nft-old-decay-max", type=float, default=0.5, help="Cap of the old-policy decay d.")
    group.add_argument(
        "--diffusion-nft-old-decay-flat-steps", type=int, default=0, help="d = 0 for this many optimizer steps."
    )


def validate(args: argparse.Namespace) -> list[str]:
    errors = []
    if args.diffusion_nft_kl_beta > 0 and args.ref_mode == "none":
        errors.append("--diffusion-nft-kl-beta > 0 needs a reference: --ref-mode lora_base or ema")
    if args.diffusion_nft_guidance_scale > 1 and args.diffusion_guidance_scale <= 1:
        errors.append("--diffusion-nft-guidance-scale > 1 needs --diffusion-guidance-scale > 1 (negative embeddings)")
    return errors


ALGORITHM = Algorithm(
    name="nft",
    group_advantages=True,
    async_rollout=True,
    roles=(Role("actor", frozen_networks=(OLD_POLICY,)),),
    samples_sde=False,
    guidance_scale=1.0,  # DiffusionNFT samples CFG-free
    guidance_flags=("diffusion_nft_guidance_scale",),
    shapes_eval_interval=20,
    add_arguments=add_arguments,
    flag_ranges={
        "diffusion_nft_beta": POSITIVE,
        "diffusion_nft_timestep_fraction": UNIT_OPEN_LOW,
        "diffusion_nft_guidance_scale": AT_LEAST_0,
        "diffusion_nft_kl_beta": AT_LEAST_0,
        "diffusion_nft_old_decay_rate": AT_LEAST_0,
        "diffusion_nft_old_decay_max": UNIT,
        "diffusion_nft_old_decay_flat_steps": AT_LEAST_0,
    },
    reads=("ref_mode",),  # --diffusion-nft-kl-beta's reference
    validate=validate,
    progress_keys=(
        ("reward", "rollout/reward_mean", ".3f"),
        ("loss", "train/loss", ".4f"),
        ("kl", "train/kl", ".2e"),
        ("grad", "train/grad_norm", ".3f"),
    ),
    plot_panels=(
        ("rollout reward", ("rollout/reward_mean",)),
        *EVAL_PANELS,
        ("NFT loss", ("train/loss", "train/nft_positive_loss", "train/nft_negative_loss")),
        ("KL / old-policy deviation", ("train/kl", "train/nft_old_deviate")),
        *COMMON_PANELS,
    ),
    identifying_metrics=("train/nft_policy_loss",),
)
