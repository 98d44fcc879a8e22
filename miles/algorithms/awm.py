"""awm: advantage-weighted matching (arXiv 2509.25050), a policy gradient whose log-prob is the weighted
flow-matching error of the policy's own clean samples, with KL terms to the frozen reference and to an EMA anchor."""

from __future__ import annotations

import argparse
from typing import Any

from miles.algorithms.base import COMMON_PANELS, EVAL_PANELS, Algorithm, FirstWindowMetrics, FrozenNetwork, Role
from miles.utils.ranges import AT_LEAST_0, AT_LEAST_1, POSITIVE, UNIT, UNIT_OPEN_LOW

# the EMA anchor v_ema: a copy of the trained weights that only the per-rollout step moves (d = min(max, rate·step))
EMA_ANCHOR = FrozenNetwork("ema_anchor", "shadow")
SAMPLERS = ("ode", "sde")
WEIGHTINGS = ("ghuber", "l", "sigma", "sigma2")  # miles.diffusion.awm.AWM_WEIGHTINGS (no torch imported here)
AUTHORS_KL_BETA = 1e-3  # their KL to the LoRA base (--use-lora --ref-mode lora_base)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("awm (advantage-weighted matching)")
    group.add_argument(
        "--awm-sampler",
        choices=SAMPLERS,
        default="ode",
        help="Rollout sampler: ode (deterministic), or sde (the --diffusion-sde-type kernel on the steps "
        "--diffusion-num-sde-steps picks).",
    )
    group.add_argument("--awm-train-timesteps", type=int, default=6, help="Trained timesteps per sample (strata).")
    group.add_argument(
        "--awm-timestep-fraction",
        type=float,
        default=0.9,
        help="Timesteps are drawn one per stratum of the grid indices [1, int(fraction·--diffusion-num-steps)).",
    )
    group.add_argument(
        "--awm-weighting",
        choices=WEIGHTINGS,
        default="ghuber",
        help="logp = −w(ℓ, σ): ghuber (σ/p)·((ℓ+1e-10)^p − 1e-10^p), l ℓ, sigma σ·ℓ, sigma2 σ²·ℓ.",
    )
    group.add_argument("--awm-ghuber-power", type=float, default=0.25, help="Power p of the ghuber weighting.")
    group.add_argument("--awm-clip-range", type=float, default=1.0, help="PPO clip c of the ratio.")
    group.add_argument(
        "--awm-kl-beta",
        type=float,
        default=None,
        help=f"β of mean((v − v_ref)²), v_ref the --ref-mode reference (default: the authors' {AUTHORS_KL_BETA:g} "
        "with a reference, 0 without one).",
    )
    group.add_argument(
        "--awm-ema-kl-beta", type=float, default=1.0, help="β_ema of mean((v − v_ema)²), v_ema the EMA anchor."
    )
    group.add_argument(
        "--awm-ema-decay-rate", type=float, default=0.001, help="EMA anchor decay d = min(max, rate·step)."
    )
    group.add_argument("--awm-ema-decay-max", type=float, default=0.3, help="Cap of the EMA anchor decay d.")


def validate(args: argparse.Namespace) -> list[str]:
    errors = []
    if args.awm_kl_beta > 0 and args.ref_mode == "none":
        errors.append(
            f"--awm-kl-beta {args.awm_kl_beta} needs the frozen reference v_ref: --ref-mode lora_base (with "
            "--use-lora; the authors' base model) or ema, or --awm-kl-beta 0"
        )
    if args.awm_sampler == "sde" and args.diffusion_sde_type == "ode":
        errors.append("--awm-sampler sde needs a stochastic kernel: --diffusion-sde-type sde or cps")
    top = int(args.awm_timestep_fraction * args.diffusion_num_steps)
    if args.awm_train_timesteps > top - 1:
        errors.append(
            f"--awm-train-timesteps {args.awm_train_timesteps} strata do not fit in the grid indices [1, {top}) of "
            f"--diffusion-num-steps {args.diffusion_num_steps} x --awm-timestep-fraction {args.awm_timestep_fraction}"
            f": at most {max(top - 1, 0)}"
        )
    return errors


def derive(args: argparse.Namespace) -> dict[str, Any]:
    """The old log-prob of windows 1.. is always the trainer's recompute pass (the rollout records none; window 0
    takes its own detached value), as in the authors' on-policy loop. --awm-kl-beta unset: the authors' β when the
    run has a reference, else 0 (the KL to the EMA anchor still holds the policy near its recent past)."""
    derived: dict[str, Any] = {"diffusion_recompute_old_log_prob": True}
    if args.awm_kl_beta is None:
        derived["awm_kl_beta"] = AUTHORS_KL_BETA if args.ref_mode != "none" else 0.0
    return derived


def default_notes(args: argparse.Namespace) -> list[str]:
    if args.awm_kl_beta is not None:
        return []
    if args.ref_mode != "none":
        return [
            f"--loss-type awm: --awm-kl-beta {AUTHORS_KL_BETA:g} (the authors'), to the --ref-mode {args.ref_mode} reference"
        ]
    return [
        "--loss-type awm: no --ref-mode reference, so --awm-kl-beta is 0 (no KL to v_ref; the KL to the EMA anchor, "
        f"--awm-ema-kl-beta {args.awm_ema_kl_beta:g}, stays); the authors' is --awm-kl-beta {AUTHORS_KL_BETA:g} to "
        "the LoRA base: --use-lora --ref-mode lora_base"
    ]


ALGORITHM = Algorithm(
    name="awm",
    group_advantages=True,
    roles=(Role("actor", frozen_networks=(EMA_ANCHOR,)),),
    log_prob_ratio=True,
    first_window_metrics=FirstWindowMetrics(ratio="train/awm_ratio_mean", log_prob_abs_diff=None),
    samples_sde=False,
    # and --awm-sampler sde samples with the SDE kernel on the steps the step strategy picks
    reads=(
        "ref_mode",  # --awm-kl-beta's reference
        *("diffusion_sde_type", "diffusion_noise_level", "diffusion_num_sde_steps", "diffusion_sde_window_range"),
    ),
    guidance_scale=1.0,  # the authors' SD3.5-M recipe samples and trains CFG-free
    globalize_reward_std=True,  # the authors' advantage: per-prompt mean, batch std
    shapes_eval_interval=20,
    add_arguments=add_arguments,
    flag_ranges={
        "awm_train_timesteps": AT_LEAST_1,
        "awm_timestep_fraction": UNIT_OPEN_LOW,
        "awm_ghuber_power": POSITIVE,
        "awm_clip_range": POSITIVE,
        "awm_kl_beta": AT_LEAST_0,
        "awm_ema_kl_beta": AT_LEAST_0,
        "awm_ema_decay_rate": AT_LEAST_0,
        "awm_ema_decay_max": UNIT,
    },
    validate=validate,
    derive=derive,
    default_notes=default_notes,
    progress_keys=(
        ("reward", "rollout/reward_mean", ".3f"),
        ("loss", "train/loss", ".4f"),
        ("kl", "train/kl", ".2e"),
        ("ema_kl", "train/ema_kl", ".2e"),
        ("grad", "train/grad_norm", ".3f"),
    ),
    plot_panels=(
        ("rollout reward", ("rollout/reward_mean",)),
        *EVAL_PANELS,
        ("AWM loss", ("train/loss", "train/policy_loss")),
        ("KL to reference / EMA anchor", ("train/kl", "train/ema_kl")),
        ("ratio / clip fraction", ("train/awm_ratio_mean", "train/awm_clipfrac")),
        *COMMON_PANELS,
    ),
    identifying_metrics=("train/awm_log_prob",),
)
