"""refl: ReFL, reward feedback learning: the policy's ODE sample to a step j drawn from the last M without gradient
(the rollout), one step with gradient to x̂₀ = x_j − σ_j·v_θ, the differentiable reward ascended on x̂₀
(docs/user-guide/reward-gradients.md)."""

from __future__ import annotations

import argparse

from miles.algorithms.base import (
    REWARD_GRADIENT_PANELS,
    REWARD_GRADIENT_PROGRESS,
    SHARED_RANGES,
    Algorithm,
    add_reward_gradient_arguments,
    always,
    reward_gradient_rules,
)
from miles.utils.ranges import AT_LEAST_1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_reward_gradient_arguments(parser)  # the shared flags, added once: draft and direct_align read them
    group = parser.add_argument_group("refl (ReFL)")
    group.add_argument(
        "--refl-last-steps",
        type=int,
        default=3,
        help="M: the differentiated step j is drawn per rollout from the last M of --diffusion-num-steps.",
    )


def validate(args: argparse.Namespace) -> list[str]:
    errors = reward_gradient_rules(args)
    if args.refl_last_steps > args.diffusion_num_steps:
        errors.append(
            f"--refl-last-steps {args.refl_last_steps} must be <= --diffusion-num-steps {args.diffusion_num_steps}"
        )
    return errors


ALGORITHM = Algorithm(
    name="refl",
    differentiable_reward=always,
    samples_sde=False,
    shapes_eval_interval=20,
    add_arguments=add_arguments,
    flag_ranges={**SHARED_RANGES, "refl_last_steps": AT_LEAST_1},
    reads=("ref_mode",),
    validate=validate,
    progress_keys=REWARD_GRADIENT_PROGRESS,
    plot_panels=REWARD_GRADIENT_PANELS,
    identifying_metrics=("train/refl_sigma_mean",),
)
