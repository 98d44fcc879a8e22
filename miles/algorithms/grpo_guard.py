"""grpo_guard: GRPO-Guard, Flow-GRPO's clipped objective on the normalised ratio r̂ (mean 1, the same scale at every
step) with the per-step gradient reweighting 1/(−dt)."""

from __future__ import annotations

import argparse

from miles.algorithms.base import (
    COMMON_PANELS,
    EVAL_PANELS,
    Algorithm,
    FirstWindowMetrics,
    reference_rule,
    stochastic_steps_rule,
)
from miles.utils.ranges import POSITIVE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("grpo_guard (GRPO-Guard)")
    group.add_argument(
        "--grpo-guard-clip-range",
        type=float,
        default=2e-6,
        help="Clip c of the normalised ratio r̂ (its log is smaller than Flow-GRPO's by the step std s).",
    )
    group.add_argument(
        "--grpo-guard-no-step-reweight",
        action="store_true",
        help="Drop the per-step weight 1/(−dt) of the loss (on by default: it gives every step the same gradient "
        "scale; it acts like a larger lr, 1/|dt| times, most on the finest steps).",
    )


def validate(args: argparse.Namespace) -> list[str]:
    return stochastic_steps_rule(ALGORITHM.name, args) + reference_rule(args)


ALGORITHM = Algorithm(
    name="grpo_guard",
    group_advantages=True,
    async_rollout=True,
    log_prob_ratio=True,
    first_window_metrics=FirstWindowMetrics(),
    shapes_eval_interval=20,
    add_arguments=add_arguments,
    flag_ranges={"grpo_guard_clip_range": POSITIVE},
    exclusive_flags=("grpo_guard_no_step_reweight",),
    reads=("diffusion_kl_beta", "ref_mode"),  # policy_loss's KL weight and its reference (reference_rule)
    validate=validate,
    progress_keys=(
        ("reward", "rollout/reward_mean", ".3f"),
        ("ratio", "train/ratio_mean", ".6f"),
        ("clip", "train/clipfrac", ".3f"),
        ("grad", "train/grad_norm", ".3f"),
    ),
    plot_panels=(
        ("rollout reward", ("rollout/reward_mean",)),
        *EVAL_PANELS,
        ("normalised ratio / clip fraction", ("train/ratio_mean", "train/clipfrac")),
        ("KL", ("train/kl", "train/approx_kl")),
        *COMMON_PANELS,
    ),
    identifying_metrics=("train/guard_policy_loss",),
)
