"""Flags of held-out evaluation: which prompts, how often, how they are sampled."""

from __future__ import annotations

import argparse

from miles.models.builtin import makes_video


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("evaluation")
    group.add_argument(
        "--eval-interval",
        type=int,
        default=None,
        help="Evaluate every N rollouts, before training and at the end "
        "(default: 20 for policy_loss / nft / dmd2 on builtin:shapes with an image family, otherwise off; 0: off). "
        "dmd2 runs evaluate the generator with its --dmd2-generator-steps.",
    )
    group.add_argument(
        "--eval-prompt-data",
        default="builtin:shapes",
        help="Held-out shapes prompts: builtin:shapes (its eval split) or a JSONL with shapes metadata.",
    )
    group.add_argument(
        "--eval-num-prompts",
        type=int,
        default=500,
        help="Prompts taken from builtin:shapes' eval split (500: an accuracy near 0.5 is known to ±2.2 points, "
        "one binomial std; 100 prompts leave ±5, too coarse for the 4-8 points 40 nft rollouts gain).",
    )
    group.add_argument("--n-samples-per-eval-prompt", type=int, default=1, help="Samples per eval prompt.")
    group.add_argument(
        "--diffusion-eval-num-steps",
        type=int,
        default=20,
        help="ODE steps of eval sampling (dmd2: the generator's --dmd2-generator-steps instead).",
    )
    group.add_argument("--eval-seed", type=int, default=0, help="Seeds the eval noise: the same images every time.")
    group.add_argument("--eval-only", action="store_true", help="Evaluate the model (or --load checkpoint) and exit.")


def validate_eval_args(args: argparse.Namespace, error) -> None:
    if args.eval_interval is not None and args.eval_interval < 0:
        error("--eval-interval must be ≥ 0 (0: no evaluation)")
    if args.eval_only and args.train_only:
        error("--eval-only samples with the rollout engine; it cannot be combined with --train-only")
    for dest in ("eval_num_prompts", "n_samples_per_eval_prompt"):
        if getattr(args, dest) < 1:
            error(f"--{dest.replace('_', '-')} must be ≥ 1")
    shapes_rl = args.loss_type in ("policy_loss", "nft", "dmd2") and args.prompt_data == "builtin:shapes"
    shapes_rl = shapes_rl and not makes_video(args.hf_checkpoint, args.model_family)  # the shapes eval scores images
    if args.eval_interval is None and shapes_rl and not args.debug_rollout_only:
        args.eval_interval = 20
    if args.eval_interval == 0:
        args.eval_interval = None


def eval_enabled(args: argparse.Namespace) -> bool:
    return args.eval_only or args.eval_interval is not None
