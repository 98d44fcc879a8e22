"""policy_loss: Flow-GRPO, the PPO-style clipped policy gradient on SDE transitions with an optional KL."""

from __future__ import annotations

import argparse

from miles.algorithms.base import COMMON_PANELS, EVAL_PANELS, Algorithm, FirstWindowMetrics, reference_rule
from miles.utils.ranges import AT_LEAST_0, POSITIVE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("policy_loss (Flow-GRPO)")
    group.add_argument("--diffusion-clip-range", type=float, default=1e-4, help="PPO clip ε of the ratio.")
    group.add_argument(
        "--diffusion-kl-beta", type=float, default=0.0, help="KL weight β against the reference (--ref-mode)."
    )


def validate(args: argparse.Namespace) -> list[str]:
    errors = reference_rule(args)
    if args.diffusion_sde_type == "ode":
        errors.append(f"--loss-type {ALGORITHM.name} needs stochastic steps: --diffusion-sde-type sde or cps")
    return errors


ALGORITHM = Algorithm(
    name="policy_loss",
    group_advantages=True,
    async_rollout=True,
    log_prob_ratio=True,
    first_window_metrics=FirstWindowMetrics(),
    shapes_eval_interval=20,
    add_arguments=add_arguments,
    flag_ranges={"diffusion_clip_range": POSITIVE, "diffusion_kl_beta": AT_LEAST_0},
    reads=("ref_mode",),  # its KL term's reference
    validate=validate,
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
    identifying_metrics=("train/ratio_mean", "train/clipfrac"),
)
