"""sft_loss: flow-matching supervised fine-tuning on (prompt, image) dataset pairs."""

from __future__ import annotations

import argparse
from typing import Any

from miles.algorithms.base import COMMON_PANELS, Algorithm
from miles.utils.ranges import AT_LEAST_0, FINITE, POSITIVE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sft_loss (flow-matching SFT)")
    group.add_argument(
        "--sft-timestep-sampling",
        choices=("logit_normal", "uniform", "mode"),
        default="logit_normal",
        help="Density of u for σ lookup.",
    )
    group.add_argument("--sft-logit-mean", type=float, default=0.0)
    group.add_argument("--sft-logit-std", type=float, default=1.0)
    group.add_argument("--sft-mode-scale", type=float, default=1.29)
    group.add_argument(
        "--sft-loss-weighting", choices=("none", "sigma_sqrt", "cosmap"), default="none", help="w(σ) of the loss."
    )


def derive(args: argparse.Namespace) -> dict[str, Any]:
    return {"n_samples_per_prompt": 1}  # SFT trains each dataset pair once: there are no sample groups


ALGORITHM = Algorithm(
    name="sft_loss",
    scores_rewards=False,
    samples_sde=False,
    uses_engines=False,
    accepts_train_only=True,
    add_arguments=add_arguments,
    flag_ranges={"sft_logit_mean": FINITE, "sft_logit_std": POSITIVE, "sft_mode_scale": AT_LEAST_0},
    derive=derive,
    progress_keys=(("loss", "train/loss", ".4f"), ("lr", "train/lr", ".1e")),
    plot_panels=(("flow-matching loss", ("train/loss",)), ("learning rate", ("train/lr",)), *COMMON_PANELS),
)
