"""Flags of the RL side: sampling and step strategy, rewards and advantages, Flow-GRPO, LoRA and EMA."""

from __future__ import annotations

import argparse

from miles.utils.hook_paths import add_rollout_step_arguments, validate_rollout_step_args


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
    group.add_argument("--diffusion-sde-type", choices=("sde", "cps", "ode"), default="sde", help="Step kernel.")
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


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("policy_loss (Flow-GRPO)")
    group.add_argument("--diffusion-clip-range", type=float, default=1e-4, help="PPO clip ε of the ratio.")
    group.add_argument("--diffusion-kl-beta", type=float, default=0.0, help="KL weight β against the reference.")
    group.add_argument("--ref-mode", choices=("none", "lora_base", "ema"), default="none", help="The KL reference.")


def add_nft_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("nft (DiffusionNFT)")
    group.add_argument("--diffusion-nft-beta", type=float, default=1.0, help="Mixing β of the implicit policies.")
    group.add_argument(
        "--diffusion-nft-timestep-fraction", type=float, default=0.6, help="Share of sampling steps trained per sample."
    )
    group.add_argument(
        "--diffusion-nft-disable-adaptive-weight", action="store_true", help="w = 1 instead of the x̂₀-error weight."
    )
    group.add_argument(
        "--diffusion-nft-guidance-scale", type=float, default=1.0, help="CFG of the training forwards (1: CFG-free)."
    )
    group.add_argument("--diffusion-nft-kl-beta", type=float, default=0.0, help="Weight of mean((v − v_ref)²).")
    group.add_argument(
        "--diffusion-nft-old-decay-rate", type=float, default=0.001, help="d = min(rate·(s − flat), max)."
    )
    group.add_argument("--diffusion-nft-old-decay-max", type=float, default=0.5, help="Cap of the old-policy decay d.")
    group.add_argument(
        "--diffusion-nft-old-decay-flat-steps", type=int, default=0, help="d = 0 for this many optimizer steps."
    )


def add_dmd2_arguments(parser: argparse.ArgumentParser) -> None:
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
        "--dmd2-timestep-shift",
        type=float,
        default=None,
        help="Shift of the timestep draw and generator grid (default: the model's scheduler shift; 1-step: try 1).",
    )


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
    add_policy_arguments,
    add_nft_arguments,
    add_dmd2_arguments,
    add_lora_arguments,
    add_ema_arguments,
    add_rollout_step_arguments,
)


def validate_rl_args(args: argparse.Namespace, error) -> None:
    """Rules of the RL flags; `error(message)` raises the parser's error type."""
    if args.ref_mode == "lora_base" and not args.use_lora:
        error("--ref-mode lora_base needs --use-lora (the reference is the LoRA base)")
    if args.ref_mode == "ema" and not args.use_ema:
        error("--ref-mode ema needs --use-ema")
    if args.ema_rollout_policy == "ema" and not args.use_ema:
        error("--ema-rollout-policy ema needs --use-ema")
    if args.loss_type == "policy_loss" and args.diffusion_kl_beta > 0 and args.ref_mode == "none":
        error("--diffusion-kl-beta > 0 needs a reference: --ref-mode lora_base or ema")
    if args.loss_type == "nft":
        if args.diffusion_nft_kl_beta > 0 and args.ref_mode == "none":
            error("--diffusion-nft-kl-beta > 0 needs a reference: --ref-mode lora_base or ema")
        if args.diffusion_nft_guidance_scale > 1 and args.diffusion_guidance_scale <= 1:
            error("--diffusion-nft-guidance-scale > 1 needs --diffusion-guidance-scale > 1 (negative embeddings)")
        if not 0 < args.diffusion_nft_timestep_fraction <= 1:
            error("--diffusion-nft-timestep-fraction must be in (0, 1]")
        if args.diffusion_nft_beta <= 0:
            error("--diffusion-nft-beta must be > 0")
    if args.loss_type == "dmd2":
        _validate_dmd2(args, error)
    if args.rollout_num_engines < 1:
        error("--rollout-num-engines must be ≥ 1")
    if args.rm_num_workers < 0:
        error("--rm-num-workers must be ≥ 0")
    if args.loss_type == "policy_loss" and args.diffusion_sde_type == "ode":
        error("--loss-type policy_loss needs stochastic steps: --diffusion-sde-type sde or cps")
    if args.diffusion_shared_initial_noise and args.loss_type in ("nft", "dmd2"):
        error(
            f"--diffusion-shared-initial-noise is for SDE rollouts (policy_loss, custom_loss); --loss-type "
            f"{args.loss_type} samples {'deterministic ODE' if args.loss_type == 'nft' else 'generator'} trajectories"
        )
    validate_rollout_step_args(args, error)
    if args.save_debug_rollout_data and args.load_debug_rollout_data:
        error("--save-debug-rollout-data and --load-debug-rollout-data exclude each other")
    if args.loss_type in ("policy_loss", "nft", "dmd2") and args.train_only:
        error(f"--train-only skips the rollout engine, which --loss-type {args.loss_type} needs")
    try:
        from miles.utils.reward_spec import reward_spec_from_args

        if args.loss_type in ("policy_loss", "nft"):
            reward_spec_from_args(args)
    except ValueError as exc:
        error(str(exc))


def _validate_dmd2(args: argparse.Namespace, error) -> None:
    """dmd2's ranges; fills the critic's steps per rollout from the update ratio unless given."""
    if not 1 <= args.dmd2_generator_steps <= 4:
        error(f"--dmd2-generator-steps must be in 1..4, got {args.dmd2_generator_steps}")
    if args.dmd2_critic_updates_per_step < 1:
        error(f"--dmd2-critic-updates-per-step must be ≥ 1, got {args.dmd2_critic_updates_per_step}")
    if not 0 <= args.dmd2_t_min < args.dmd2_t_max <= 1:
        error(f"--dmd2-t-min / --dmd2-t-max must satisfy 0 ≤ min < max ≤ 1, got {args.dmd2_t_min}, {args.dmd2_t_max}")
    if args.dmd2_timestep_shift is not None and args.dmd2_timestep_shift <= 0:
        error(f"--dmd2-timestep-shift must be > 0, got {args.dmd2_timestep_shift}")
    if args.dmd2_real_guidance_scale < 1:
        error(f"--dmd2-real-guidance-scale must be ≥ 1 (1: no CFG), got {args.dmd2_real_guidance_scale}")
    if args.diffusion_guidance_scale > 1:
        error(
            f"--diffusion-guidance-scale {args.diffusion_guidance_scale} does not apply to --loss-type dmd2: the generator"
            " samples CFG-free; the teacher's CFG is --dmd2-real-guidance-scale"
        )
    if args.critic_micro_batch_size is not None and args.critic_micro_batch_size < 1:
        error(f"--critic-micro-batch-size must be ≥ 1, got {args.critic_micro_batch_size}")
    if args.critic_num_steps_per_rollout is None:
        args.critic_num_steps_per_rollout = args.dmd2_critic_updates_per_step * args.num_steps_per_rollout
    elif args.critic_num_steps_per_rollout < 1:
        error(f"--critic-num-steps-per-rollout must be ≥ 1, got {args.critic_num_steps_per_rollout}")
