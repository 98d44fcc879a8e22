"""Flags of the RL side: sampling and step strategy, rewards and advantages, Flow-GRPO, LoRA and EMA."""

from __future__ import annotations

import argparse


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (rollout engine)")
    group.add_argument("--rollout-num-engines", type=int, default=1, help="Rollout engine actors.")
    group.add_argument("--rollout-cpus-per-engine", type=float, default=0.5, help="CPU share of an engine on CPU.")
    group.add_argument("--rollout-gpus-per-engine", type=float, default=1.0, help="GPUs per engine on CUDA.")
    group.add_argument("--diffusion-sde-type", choices=("sde", "cps", "ode"), default="sde", help="Step kernel.")
    group.add_argument("--diffusion-noise-level", type=float, default=0.7, help="SDE noise level a.")
    group.add_argument(
        "--diffusion-num-sde-steps", type=int, default=None, help="Trained steps as one contiguous window of K."
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
    group.add_argument("--image-grid-interval", type=int, default=1, help="Save an image grid every N rollouts.")


def add_reward_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("rewards and advantages")
    group.add_argument(
        "--rm-type",
        default=None,
        help="Reward or weighted list name:w,... (default shapes; custom with --custom-rm-path).",
    )
    group.add_argument("--custom-rm-path", default=None, help="Batched [async] def rm(args, samples) -> list[float].")
    group.add_argument("--rm-num-workers", type=int, default=0, help="Reward worker actors (0: in the driver).")
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
    group.add_argument(
        "--custom-expand-samples-to-train-pairs-path", default=None, help="fn(args, result, advantages) -> pairs."
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
    add_lora_arguments,
    add_ema_arguments,
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
    if args.rollout_num_engines < 1:
        error("--rollout-num-engines must be ≥ 1")
    if args.rm_num_workers < 0:
        error("--rm-num-workers must be ≥ 0")
    if args.loss_type == "policy_loss" and args.diffusion_sde_type == "ode":
        error("--loss-type policy_loss needs stochastic steps: --diffusion-sde-type sde or cps")
    if args.save_debug_rollout_data and args.load_debug_rollout_data:
        error("--save-debug-rollout-data and --load-debug-rollout-data exclude each other")
    if args.loss_type in ("policy_loss", "nft", "dmd2") and args.train_only:
        error(f"--train-only skips the rollout engine, which --loss-type {args.loss_type} needs")
    try:
        from miles.rollout.rm_hub import reward_spec_from_args

        if args.loss_type in ("policy_loss", "nft"):
            reward_spec_from_args(args)
    except ValueError as exc:
        error(str(exc))
