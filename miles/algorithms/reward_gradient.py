"""What the reward-gradient losses (refl, draft, direct_align) share in their declarations: the flags of the reward
objective (its scale, hinge and reference-velocity penalty; refl's parser group adds them, the others list them in
`reads`), the rule of the penalty's reference, the progress keys and plot panels (docs/user-guide/reward-gradients.md).
A neutral module: no algorithm's own."""

from __future__ import annotations

import argparse

from miles.algorithms.base import COMMON_PANELS, EVAL_PANELS, PlotPanel, ProgressKey
from miles.utils.ranges import AT_LEAST_0, FINITE, POSITIVE

# the dests of add_reward_gradient_arguments (and the penalty's reference), for the `reads` of the algorithms that
# do not add them
SHARED_DESTS = ("reward_grad_scale", "reward_grad_hinge", "reward_grad_kl_beta", "ref_mode")
SHARED_RANGES = {"reward_grad_scale": POSITIVE, "reward_grad_hinge": FINITE, "reward_grad_kl_beta": AT_LEAST_0}
REWARD_GRADIENT_PROGRESS: tuple[ProgressKey, ...] = (
    ("reward", "rollout/reward_mean", ".3f"),
    ("train reward", "train/reward_mean", ".3f"),
    ("grad", "train/grad_norm", ".3f"),
)
REWARD_GRADIENT_PANELS: tuple[PlotPanel, ...] = (
    ("rollout reward", ("rollout/reward_mean",)),
    *EVAL_PANELS,
    ("reward of the differentiated sample", ("train/reward_mean",)),
    ("reward-gradient loss", ("train/loss", "train/reward_loss", "train/velocity_penalty")),
    *COMMON_PANELS,
)


def add_reward_gradient_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("reward gradients (refl, draft, direct_align)")
    group.add_argument("--reward-grad-scale", type=float, default=1.0, help="λ: the loss is λ·mean φ(R) per sample.")
    group.add_argument(
        "--reward-grad-hinge",
        type=float,
        default=None,
        help="c: φ(R) = ReLU(c − R), no gradient once R ≥ c (ReFL's hinge); unset: φ(R) = −R.",
    )
    group.add_argument(
        "--reward-grad-kl-beta",
        type=float,
        default=0.0,
        help="β of the reference-velocity penalty β·mean((v_θ − v_ref)²) at the differentiated input (needs "
        "--ref-mode lora_base or ema).",
    )


def reward_gradient_rules(args: argparse.Namespace) -> list[str]:
    """What every reward-gradient loss needs: a reference for its penalty."""
    if args.reward_grad_kl_beta > 0 and args.ref_mode == "none":
        return [
            f"--reward-grad-kl-beta > 0 (--loss-type {args.loss_type}) needs a reference: --ref-mode lora_base or ema"
        ]
    return []
