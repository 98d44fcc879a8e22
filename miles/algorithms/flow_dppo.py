"""flow_dppo: Flow-DPPO, the unclipped policy ratio objective with a trust region on the exact Gaussian KL of each
SDE transition: a transition outside it that the update would move further from the rollout policy is dropped."""

from __future__ import annotations

import argparse

from miles.algorithms.base import COMMON_PANELS, EVAL_PANELS, Algorithm, FirstWindowMetrics, reference_rule
from miles.utils.ranges import POSITIVE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("flow_dppo (Flow-DPPO)")
    group.add_argument(
        "--flow-dppo-kl-threshold",
        type=float,
        default=1e-5,
        help="Trust region δ: a transition with Gaussian KL mean((μ_θ − μ_old)²)/(2s²) >= δ whose update moves "
        "further from the rollout policy is masked out.",
    )


def validate(args: argparse.Namespace) -> list[str]:
    errors = reference_rule(args)
    if args.diffusion_sde_type not in ("sde", "dance"):
        errors.append(
            f"--loss-type {ALGORITHM.name} needs a Gaussian step log-prob for its ratio: --diffusion-sde-type sde "
            f"or dance (not {args.diffusion_sde_type}: cps drops the 1/(2s²) of its log-prob, ode has none)"
        )
    return errors


ALGORITHM = Algorithm(
    name="flow_dppo",
    group_advantages=True,
    async_rollout=True,
    log_prob_ratio=True,
    first_window_metrics=FirstWindowMetrics(),
    shapes_eval_interval=20,
    add_arguments=add_arguments,
    flag_ranges={"flow_dppo_kl_threshold": POSITIVE},
    reads=("diffusion_kl_beta", "ref_mode"),  # policy_loss's KL weight and its reference (reference_rule)
    validate=validate,
    progress_keys=(
        ("reward", "rollout/reward_mean", ".3f"),
        ("kl_old", "train/kl_old", ".2e"),
        ("masked", "train/masked_fraction", ".3f"),
        ("grad", "train/grad_norm", ".3f"),
    ),
    plot_panels=(
        ("rollout reward", ("rollout/reward_mean",)),
        *EVAL_PANELS,
        ("KL to the rollout policy", ("train/kl_old", "train/approx_kl")),
        ("masked fraction", ("train/masked_fraction",)),
        *COMMON_PANELS,
    ),
    identifying_metrics=("train/masked_fraction",),
)
