"""dmd2: distribution-matching distillation of a few-step generator (the actor) from a frozen teacher, with a critic
(the fake score) trained before each generator update."""

from __future__ import annotations

from miles.algorithms.base import COMMON_PANELS, EVAL_PANELS, TEACHER, Algorithm, Role

CRITIC = Role("critic", frozen_networks=(TEACHER,), defaults={"checkpoint": "teacher_load"})

ALGORITHM = Algorithm(
    name="dmd2",
    roles=(CRITIC, Role("actor")),
    scores_rewards=False,
    samples_sde=False,
    guidance_scale=1.0,  # the generator samples CFG-free; the teacher's CFG is --dmd2-real-guidance-scale
    progress_keys=(
        ("dmd", "train/dmd_loss", ".4f"),
        ("critic", "train/critic_loss", ".4f"),
        ("reward", "rollout/reward_mean", ".3f"),
    ),
    plot_panels=(
        *EVAL_PANELS,
        ("generator DMD loss", ("train/dmd_loss",)),
        ("critic loss", ("critic/train/critic_loss",)),
        ("rollout reward", ("rollout/reward_mean",)),
        *COMMON_PANELS,
    ),
    identifying_metrics=("train/dmd_loss", "train/critic_loss"),
)
