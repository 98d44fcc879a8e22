"""nft: DiffusionNFT, negative-aware fine-tuning on clean ODE samples with an old policy that samples them."""

from __future__ import annotations

from miles.algorithms.base import COMMON_PANELS, EVAL_PANELS, OLD_POLICY, Algorithm, Role

ALGORITHM = Algorithm(
    name="nft",
    roles=(Role("actor", frozen_networks=(OLD_POLICY,)),),
    samples_sde=False,
    guidance_scale=1.0,  # DiffusionNFT samples CFG-free
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
