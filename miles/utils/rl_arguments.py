"""Shared flags of the RL side: sampling and step strategy, rewards and advantages, the KL reference, LoRA and EMA;
and their rules (each algorithm's own flags and rules are in its declaration, miles/algorithms/)."""

from __future__ import annotations

import argparse

from miles.algorithms import Algorithm
from miles.utils.hook_paths import add_rollout_step_arguments, rollout_step_rules
from miles.utils.reward_spec import reward_spec_from_args


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (rollout engine)")
    group.add_argument("--rollout-num-engines", type=int, default=1, help="Rollout engine actors.")
    group.add_argument("--rollout-cpus-per-engine", type=float, default=0.5, help="CPU share of an engine on CPU.")
    group.add_argument("--rollout-gpus-per-engine", type=float, default=1.0, help="GPUs per engine on CUDA.")
    group.add_argument(
        "--async-rollout",
        action="store_true",
        help="Generate rollout k+1 while rollout k trains, with the weights before update k: staleness at most one "
        "update, recorded as rollout/staleness. policy_loss (without --diffusion-recompute-old-log-prob), nft and "
        "dmd2 only (docs/user-guide/performance.md).",
    )
    group.add_argument(
        "--diffusion-sde-type",
        choices=("sde", "cps", "dance", "ode"),
        default="sde",
        help="Step kernel (dance: DanceGRPO's, Flow-GRPO's mean with a constant std_t = the noise level).",
    )
    group.add_argument("--diffusion-noise-level", type=float, default=0.7, help="SDE noise level a.")
    group.add_argument(
        "--diffusion-shared-initial-noise",
        action="store_true",
        help="A prompt's samples start from one latent; they differ by their SDE noise only (policy_loss).",
    )
    group.add_argument(
        "--diffusion-num-sde-steps",
        type=int,
        default=3,
        help="Trained steps: one contiguous window of K (0: all but the last); ignored with a strategy path.",
    )
    group.add_argument(
        "--diffusion-sde-window-range", default=None, help="a,b: the window starts in [a, b-K] (default 0,N-1)."
    )
    group.add_argument(
        "--diffusion-step-strategy-path", default=None, help="fn(args, rollout_id, num_steps) -> trained steps."
    )
    group.add_argument("--debug-rollout-only", action="store_true", help="Generate and score; never train.")
    group.add_argument("--save-debug-rollout-data", default=None, help="Save each rollout's train data: DIR.")
    group.add_argument(
        "--load-debug-rollout-data", default=None, help="Replay rollouts saved by --save-debug-rollout-data: DIR."
    )
    group.add_argument(
        "--image-grid-interval",
        type=int,
        default=1,
        help="Save an image grid (video: mp4s and a contact sheet) every N rollouts.",
    )
    group.add_argument(
        "--media-max-samples",
        type=int,
        default=4,
        help="Video: samples of a rollout or eval saved as media/NAME/sample_K.mp4 (and contact sheet rows).",
    )


def add_reward_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("rewards and advantages")
    group.add_argument(
        "--rm-type",
        default=None,
        help="Reward or weighted list name:w,... (default shapes, temporal_consistency for a video family; custom "
        "with --custom-rm-path).",
    )
    group.add_argument("--custom-rm-path", default=None, help="Batched [async] def rm(args, samples) -> list[float].")
    group.add_argument("--rm-num-workers", type=int, default=0, help="Reward worker actors (0: in the driver).")
    group.add_argument(
        "--generate-chunk-size",
        type=int,
        default=0,
        help="Generate each rollout N samples at a time and score each chunk while the next generates (0: the whole "
        "batch, then scoring). Worth it when rewards are slow; the engines' batch is N (results then agree with an "
        "unchunked run to float rounding, not bit for bit).",
    )
    group.add_argument("--clip-model-path", default=None, help="Local CLIP folder for clip_score.")
    group.add_argument("--pickscore-model-path", default=None, help="Local PickScore folder for pickscore.")
    group.add_argument("--globalize-reward-std", action="store_true", help="Normalise by the batch-wide reward std.")
    group.add_argument(
        "--disable-grpo-std-normalization", action="store_true", help="Advantages are reward minus group mean."
    )
    group.add_argument("--diffusion-adv-clip-max", type=float, default=5.0, help="Clamp advantages to ± this.")
    group.add_argument(
        "--custom-reward-post-process-path", default=None, help="fn(args, samples, rewards) -> advantages."
    )


def add_reference_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KL reference (read by every algorithm with a KL term)")
    group.add_argument("--ref-mode", choices=("none", "lora_base", "ema"), default="none", help="The KL reference.")


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA")
    group.add_argument("--use-lora", action="store_true", help="Train LoRA adapters instead of full weights.")
    group.add_argument("--lora-rank", type=int, default=8)
    group.add_argument("--lora-alpha", type=float, default=None, help="Default: the rank.")
    group.add_argument("--lora-target-modules", default=None, help="Comma list; default per model family.")
    group.add_argument(
        "--lora-init-weights",
        choices=("true", "false", "gaussian"),
        default="true",
        help="peft init: true (B = 0, starts at the base model), gaussian, false (random A and B).",
    )


def add_ema_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("EMA")
    group.add_argument("--use-ema", action="store_true", help="Keep an EMA of the trained weights.")
    group.add_argument("--ema-decay", type=float, default=0.995)
    group.add_argument(
        "--ema-warmup", choices=("none", "power"), default="power", help="power: decay min(d, (1+s)/(10+s))."
    )
    group.add_argument("--ema-update-interval", type=int, default=1, help="Update every N optimizer steps.")
    group.add_argument(
        "--ema-rollout-policy", choices=("live", "ema"), default="live", help="Which weights the engines sample."
    )


RL_ARGUMENT_GROUPS = (
    add_sampling_arguments,
    add_reward_arguments,
    add_reference_arguments,
    add_lora_arguments,
    add_ema_arguments,
    add_rollout_step_arguments,
)


def rl_rules(args: argparse.Namespace, algorithm: Algorithm) -> list[str]:
    """The shared rules of the RL flags (an algorithm's own are in its declaration)."""
    errors = []
    if args.ref_mode == "lora_base" and not args.use_lora:
        errors.append("--ref-mode lora_base needs --use-lora (the reference is the LoRA base)")
    if args.ref_mode == "ema" and not args.use_ema:
        errors.append("--ref-mode ema needs --use-ema")
    if args.ema_rollout_policy == "ema" and not args.use_ema:
        errors.append("--ema-rollout-policy ema needs --use-ema")
    if args.diffusion_shared_initial_noise and not algorithm.samples_sde:
        errors.append(
            f"--diffusion-shared-initial-noise is for SDE rollouts; --loss-type {algorithm.name} samples no SDE "
            "trajectories"
        )
    errors += rollout_step_rules(args, algorithm)
    if args.save_debug_rollout_data and args.load_debug_rollout_data:
        errors.append("--save-debug-rollout-data and --load-debug-rollout-data exclude each other")
    if algorithm.scores_rewards and not args.train_only:
        try:
            reward_spec_from_args(args)
        except ValueError as exc:
            errors.append(str(exc))
    return errors
