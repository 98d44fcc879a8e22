"""direct_align: Direct-Align (SRPO): known noise ε injected into the policy's clean sample x₀ at σ, one step of Δσ
with gradient, x̂₀ recovered analytically from the known ε, the reward ascended on x̂₀; with control words, SRPO's
relative reward (1 + k)·R(x̂₀, c⁺) − R(x̂₀, c⁻) (docs/user-guide/reward-gradients.md)."""

from __future__ import annotations

import argparse

from miles.algorithms.base import (
    REWARD_GRADIENT_PANELS,
    REWARD_GRADIENT_PROGRESS,
    SHARED_DESTS,
    Algorithm,
    always,
    reward_gradient_rules,
)
from miles.utils.ranges import AT_LEAST_0, POSITIVE, UNIT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("direct_align (Direct-Align, SRPO)")
    group.add_argument("--direct-align-sigma-min", type=float, default=0.75, help="Lowest injected σ_hi.")
    group.add_argument("--direct-align-sigma-max", type=float, default=0.96, help="Highest injected σ_hi (< 1).")
    group.add_argument(
        "--direct-align-delta-sigma", type=float, default=0.02, help="Δσ = σ_hi − σ_lo of the one differentiated step."
    )
    group.add_argument(
        "--direct-align-branch",
        choices=("denoise", "inversion"),
        default="denoise",
        help="denoise: from σ_hi down to σ_lo (the reward ascended); inversion: from σ_lo up (a penalty).",
    )
    group.add_argument(
        "--direct-align-control-words",
        nargs=2,
        metavar=("POSITIVE", "NEGATIVE"),
        default=None,
        help="SRPO's relative reward: each sample scored with metadata control_word = POSITIVE and NEGATIVE "
        "(unset: the plain reward).",
    )
    group.add_argument(
        "--direct-align-k", type=float, default=0.1, help="k of the relative reward (1 + k)·R(c⁺) − R(c⁻)."
    )


def validate(args: argparse.Namespace) -> list[str]:
    errors = reward_gradient_rules(args)
    low, high, delta = args.direct_align_sigma_min, args.direct_align_sigma_max, args.direct_align_delta_sigma
    if not low <= high < 1:
        errors.append(f"--direct-align-sigma-min {low} <= --direct-align-sigma-max {high} < 1 must hold")
    if delta >= low:
        errors.append(f"--direct-align-delta-sigma {delta} must be below --direct-align-sigma-min {low} (σ_lo > 0)")
    return errors


ALGORITHM = Algorithm(
    name="direct_align",
    async_rollout=True,  # its rollout side's stale_batch says why a batch one update old is right
    differentiable_reward=always,
    samples_sde=False,
    shapes_eval_interval=20,
    add_arguments=add_arguments,
    flag_ranges={
        "direct_align_sigma_min": UNIT,
        "direct_align_sigma_max": UNIT,
        "direct_align_delta_sigma": POSITIVE,
        "direct_align_k": AT_LEAST_0,
    },
    reads=SHARED_DESTS,
    validate=validate,
    progress_keys=REWARD_GRADIENT_PROGRESS,
    plot_panels=REWARD_GRADIENT_PANELS,
    identifying_metrics=("train/direct_align_sigma_mean",),
)
