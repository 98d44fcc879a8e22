"""Flags of held-out evaluation: which prompts, how often, how they are sampled."""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

from miles.algorithms import BUILTIN_ALGORITHMS, Algorithm
from miles.arguments.reward_spec import REWARD_PACKAGES
from miles.models.builtin import makes_video

BUILTIN_SHAPES = "builtin:shapes"
BUILTIN_SHAPES_EDIT = "builtin:shapes-edit"  # miles.data.shapes_edit's (this module stays free of the data modules)
BUILTIN_MOVING_SHAPES = "builtin:moving-shapes"  # miles.data.moving_shapes'
BUILTIN_OCR = "builtin:ocr"  # miles.data.ocr's
BUILTIN_PROMPT_SETS = (BUILTIN_SHAPES, BUILTIN_SHAPES_EDIT, BUILTIN_MOVING_SHAPES, BUILTIN_OCR)
SHAPES_EVALUATED = " / ".join(a.name for a in BUILTIN_ALGORITHMS if a.shapes_eval_interval)


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("evaluation")
    group.add_argument(
        "--eval-interval",
        type=int,
        default=None,
        help="Evaluate every N rollouts, before training and at the end "
        f"(default: the algorithm's on builtin:shapes with an image family, 20 for {SHAPES_EVALUATED}, otherwise off; "
        "0: off). "
        "dmd2 runs evaluate the generator with its --dmd2-generator-steps.",
    )
    group.add_argument(
        "--eval-prompt-data",
        default="builtin:shapes",
        help="Held-out prompts: builtin:shapes, builtin:shapes-edit or builtin:moving-shapes (each the default when "
        "training on it) or builtin:ocr "
        "(their eval splits), a JSONL with shapes metadata (and source images for an editing family), or a "
        "JSONL / .txt of prompts with quoted text (scored by OCR: eval/ocr_accuracy).",
    )
    group.add_argument(
        "--eval-num-prompts",
        type=int,
        default=500,
        help="Prompts taken from builtin:shapes' eval split (builtin:ocr: at most its 96; 500: an accuracy near 0.5 is known to ±2.2 points, "
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
    group.add_argument(
        "--no-eval-before-train",
        action="store_true",
        help="Skip the baseline eval before the first rollout (also the one a resumed run repeats); the evals every "
        "--eval-interval rollouts and at the end still run.",
    )


def eval_rules(args: argparse.Namespace) -> list[str]:
    errors = []
    if args.eval_only and args.train_only:
        errors.append("--eval-only samples with the rollout engine; it cannot be combined with --train-only")
    if args.eval_only and args.no_eval_before_train:
        errors.append("--eval-only is the eval before training; it cannot be combined with --no-eval-before-train")
    for flag, data in (("--prompt-data", args.prompt_data), ("--eval-prompt-data", args.eval_prompt_data)):
        if data and data.startswith("builtin:") and data not in BUILTIN_PROMPT_SETS:
            errors.append(
                f"{flag} {data}: no such built-in prompt set; the built-in ones: {', '.join(BUILTIN_PROMPT_SETS)}"
            )
    module, install = REWARD_PACKAGES["ocr"]
    evaluates = args.eval_only or bool(args.eval_interval)
    if evaluates and args.eval_prompt_data == BUILTIN_OCR and not args.eval_function_path:
        if importlib.util.find_spec(module) is None:  # refused here, not at the first eval
            errors.append(
                f"--eval-prompt-data {BUILTIN_OCR} is scored by OCR, which needs the {module} package: {install}"
            )
    return errors


def eval_defaults(args: argparse.Namespace, algorithm: Algorithm) -> dict[str, Any]:
    """--eval-interval unset: the algorithm's own on builtin:shapes (or builtin:shapes-edit) prompts with an image
    family and on builtin:moving-shapes prompts with a video family (off for debug rollouts and otherwise); 0 means
    off. Training on builtin:shapes-edit or builtin:moving-shapes evaluates on its eval split unless
    --eval-prompt-data names other prompts."""
    interval = args.eval_interval
    worlds = (BUILTIN_SHAPES, BUILTIN_SHAPES_EDIT)
    shapes = args.prompt_data in worlds and not makes_video(args.hf_checkpoint, args.model_family)  # images
    moving = args.prompt_data == BUILTIN_MOVING_SHAPES and makes_video(args.hf_checkpoint, args.model_family)
    if interval is None and (shapes or moving) and not args.debug_rollout_only:
        interval = algorithm.shapes_eval_interval
    derived: dict[str, Any] = {"eval_interval": None if interval == 0 else interval}
    if args.prompt_data == BUILTIN_SHAPES_EDIT and args.eval_prompt_data == BUILTIN_SHAPES:
        derived["eval_prompt_data"] = BUILTIN_SHAPES_EDIT  # editing triples are evaluated on the edit world's split
    if args.prompt_data == BUILTIN_MOVING_SHAPES and args.eval_prompt_data == BUILTIN_SHAPES:
        derived["eval_prompt_data"] = BUILTIN_MOVING_SHAPES  # clips are evaluated on the video world's split
    return derived


def eval_enabled(args: argparse.Namespace) -> bool:
    return args.eval_only or args.eval_interval is not None
