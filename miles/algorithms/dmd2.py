"""dmd2: distribution-matching distillation of a few-step generator (the actor) from a frozen teacher, with a critic
(the fake score) trained before each generator update."""

from __future__ import annotations

import argparse
from typing import Any

from miles.algorithms.base import COMMON_PANELS, EVAL_PANELS, TEACHER, Algorithm, Computed, Role
from miles.utils.ranges import AT_LEAST_0, AT_LEAST_1, FINITE, POSITIVE, UNIT, Range


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dmd2 (distribution-matching distillation)")
    group.add_argument(
        "--dmd2-generator-steps", type=int, default=1, help="k: generator sampling steps (1-4), renoise kernel."
    )
    group.add_argument(
        "--dmd2-real-guidance-scale", type=float, default=4.5, help="CFG scale of the teacher's real score."
    )
    group.add_argument(
        "--dmd2-critic-updates-per-step",
        type=int,
        default=5,
        help="Critic updates per generator update: critic steps = this x --num-steps-per-rollout.",
    )
    group.add_argument("--dmd2-t-min", type=float, default=0.02, help="Lower clamp of the critic/DMD timestep.")
    group.add_argument("--dmd2-t-max", type=float, default=0.98, help="Upper clamp of the critic/DMD timestep.")
    group.add_argument(
        "--dmd2-reward-weight",
        type=float,
        default=0.0,
        help="λ: reward-guided distillation, + λ·φ(R(x_θ)) on the generator's output with a differentiable --rm-type "
        "(0: plain dmd2).",
    )
    group.add_argument(
        "--dmd2-reward-hinge",
        type=float,
        default=None,
        help="c of the reward term's φ(R) = ReLU(c − R) (DMDR: 0.7); unset: φ(R) = −R.",
    )
    group.add_argument(
        "--dmd2-timestep-shift",
        type=float,
        default=None,
        help="Shift of the timestep draw and generator grid (default: the model's scheduler shift; 1-step: try 1).",
    )


def validate(args: argparse.Namespace) -> list[str]:
    errors = []
    if args.dmd2_t_min >= args.dmd2_t_max:  # each within [0, 1] is its range
        errors.append(
            f"--dmd2-t-min / --dmd2-t-max must satisfy 0 ≤ min < max ≤ 1, got {args.dmd2_t_min}, {args.dmd2_t_max}"
        )
    if args.diffusion_guidance_scale > 1:
        errors.append(
            f"--diffusion-guidance-scale {args.diffusion_guidance_scale} does not apply to --loss-type dmd2: the "
            "generator samples CFG-free; the teacher's CFG is --dmd2-real-guidance-scale"
        )
    return errors


def derive(args: argparse.Namespace) -> dict[str, Any]:
    """--teacher-load unset: the model itself (--hf-checkpoint). DMD2 distills a many-step model into a few-step
    generator that starts from it, the critic starting from it too: the authors' setup."""
    return {} if args.teacher_load else {"teacher_load": args.hf_checkpoint}


def default_notes(args: argparse.Namespace) -> list[str]:
    if args.teacher_load:
        return []
    return [
        f"--loss-type dmd2: --teacher-load is --hf-checkpoint {args.hf_checkpoint}: it distills the model into a "
        f"{args.dmd2_generator_steps}-step generator of itself (pass --teacher-load DIR for another teacher)"
    ]


def reward_guided(args: argparse.Namespace) -> bool:
    """--dmd2-reward-weight > 0: the generator's output is scored with gradient by the differentiable reward."""
    return bool(args.dmd2_reward_weight > 0)


def critic_steps(args: argparse.Namespace) -> int:
    steps: int = args.dmd2_critic_updates_per_step * args.num_steps_per_rollout
    return steps


CRITIC = Role(
    "critic",
    frozen_networks=(TEACHER,),
    defaults={
        "checkpoint": "teacher_load",
        "num_steps_per_rollout": Computed(critic_steps, "--dmd2-critic-updates-per-step x --num-steps-per-rollout"),
    },
)

ALGORITHM = Algorithm(
    name="dmd2",
    async_rollout=True,
    roles=(CRITIC, Role("actor")),
    scores_rewards=False,
    differentiable_reward=reward_guided,
    samples_sde=False,
    guidance_scale=1.0,  # the generator samples CFG-free; the teacher's CFG is --dmd2-real-guidance-scale
    guidance_flags=("dmd2_real_guidance_scale",),
    shapes_eval_interval=20,
    add_arguments=add_arguments,
    flag_ranges={
        "dmd2_generator_steps": Range(1, 4),
        "dmd2_real_guidance_scale": AT_LEAST_1,
        "dmd2_critic_updates_per_step": AT_LEAST_1,
        "dmd2_t_min": UNIT,
        "dmd2_t_max": UNIT,
        "dmd2_timestep_shift": POSITIVE,
        "dmd2_reward_weight": AT_LEAST_0,
        "dmd2_reward_hinge": FINITE,
    },
    validate=validate,
    derive=derive,
    default_notes=default_notes,
    progress_keys=(
        ("dmd", "train/dmd_loss", ".4f"),
        ("critic", "train/critic_loss", ".4f"),
        ("reward", "rollout/reward_mean", ".3f"),
    ),
    plot_panels=(
        *EVAL_PANELS,
        ("generator DMD loss", ("train/dmd_loss",)),
        ("generator reward (--dmd2-reward-weight)", ("train/dmd2_reward_mean",)),
        ("critic loss", ("critic/train/critic_loss",)),
        ("rollout reward", ("rollout/reward_mean",)),
        *COMMON_PANELS,
    ),
    identifying_metrics=("train/dmd_loss", "train/critic_loss"),
)
