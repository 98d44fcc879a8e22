"""Held-out evaluation during training: fixed-seed samples of the eval prompts on the rollout engines (ODE, or
the k-step generator of a dmd2 run)."""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

from miles.data.shapes import BUILTIN_SHAPES, ShapeScene, shapes_prompts
from miles.rollout.data_source import read_jsonl_records
from miles.rollout.evaluation import evaluate_shapes
from miles.rollout.image_grid import save_image_grid
from miles.utils.tracking import EVAL_AXIS

logger = logging.getLogger(__name__)


def load_eval_records(args: argparse.Namespace) -> list[dict[str, Any]]:
    """builtin:shapes -> its eval split (disjoint seeds from training); a JSONL must carry shapes metadata."""
    if args.eval_prompt_data == BUILTIN_SHAPES:
        return shapes_prompts(args.eval_num_prompts, seed=args.eval_seed, split="eval")
    records = read_jsonl_records(args.eval_prompt_data, input_key=args.input_key, metadata_key=args.metadata_key)
    for line, record in enumerate(records, start=1):
        try:
            ShapeScene.from_metadata(record["metadata"])
        except (ValueError, TypeError) as exc:
            raise ValueError(f"--eval-prompt-data {args.eval_prompt_data} record {line}: {exc}") from exc
    return records


class Evaluator:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.records = load_eval_records(args)

    def evaluate(self, engine: Any, rollout_id: int) -> dict[str, float]:
        args, started = self.args, time.perf_counter()
        if args.loss_type == "dmd2":  # the few-step generator, sampled exactly as its rollouts are (CFG-free)
            sampler = {"sde_type": "renoise", "num_steps": args.dmd2_generator_steps, "shift": args.dmd2_timestep_shift}
        else:
            sampler = {"sde_type": "ode", "num_steps": args.diffusion_eval_num_steps}
        metrics, images = evaluate_shapes(
            engine,
            self.records,
            num_samples_per_prompt=args.n_samples_per_eval_prompt,
            guidance_scale=args.diffusion_guidance_scale,
            seed=args.eval_seed,
            resolution=args.resolution,
            negative_prompt=args.negative_prompt,
            **sampler,
        )
        save_image_grid(images, os.path.join(args.output_dir, "images", f"eval_{rollout_id:07d}.png"), max_images=64)
        metrics["perf/eval_s"] = time.perf_counter() - started
        metrics[EVAL_AXIS] = rollout_id  # the x of this eval in plots and trackers: 0 is the baseline
        return metrics
