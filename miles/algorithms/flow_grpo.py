"""policy_loss: Flow-GRPO, the PPO-style clipped policy gradient on SDE transitions with an optional KL."""

from __future__ import annotations

from miles.algorithms.base import COMMON_PANELS, EVAL_PANELS, Algorithm

ALGORITHM = Algorithm(
    name="policy_loss",
    log_prob_ratio=True,
    progress_keys=(
        ("reward", "rollout/reward_mean", ".3f"),
        ("kl", "train/kl", ".2e"),
        ("approx_kl", "train/approx_kl", ".2e"),
        ("clip", "train/clipfrac", ".3f"),
        ("grad", "train/grad_norm", ".3f"),
    ),
    plot_panels=(
        ("rollout reward", ("rollout/reward_mean",)),
        *EVAL_PANELS,
        ("KL / clip fraction", ("train/kl", "train/approx_kl", "train/clipfrac")),
        *COMMON_PANELS,
    ),
    identifying_metrics=("train/clipfrac",),
)
