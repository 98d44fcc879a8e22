"""draft: DRaFT-K, the reward back-propagated through the last K steps of the ODE sampler (the first N − K are the
rollout's, without gradient; each differentiated step's activations checkpointed), and DRaFT-LV (K = 1 with n
re-noised copies of the sample, `--draft-lv-copies`) (docs/user-guide/reward-gradients.md)."""

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
from miles.utils.ranges import AT_LEAST_0, AT_LEAST_1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("draft (DRaFT-K, DRaFT-LV)")
    group.add_argument(
        "--draft-k", type=int, default=1, help="K: the last K sampling steps are differentiated (K = N: full DRaFT)."
    )
    group.add_argument(
        "--draft-lv-copies",
        type=int,
        default=0,
        help="n > 0: DRaFT-LV, the reward also of n re-noised copies of the sample at the last step (needs --draft-k 1).",
    )


def validate(args: argparse.Namespace) -> list[str]:
    errors = reward_gradient_rules(args)
    if args.draft_k > args.diffusion_num_steps:
        errors.append(f"--draft-k {args.draft_k} must be <= --diffusion-num-steps {args.diffusion_num_steps}")
    if args.draft_lv_copies > 0 and args.draft_k != 1:
        errors.append(f"--draft-lv-copies {args.draft_lv_copies} (DRaFT-LV) needs --draft-k 1, got {args.draft_k}")
    return errors


ALGORITHM = Algorithm(
    name="draft",
    differentiable_reward=always,
    samples_sde=False,
    shapes_eval_interval=20,
    add_arguments=add_arguments,
    flag_ranges={"draft_k": AT_LEAST_1, "draft_lv_copies": AT_LEAST_0},
    reads=SHARED_DESTS,
    validate=validate,
    progress_keys=REWARD_GRADIENT_PROGRESS,
    plot_panels=REWARD_GRADIENT_PANELS,
    identifying_metrics=("train/draft_final_abs_diff",),
)
