"""Held-out evaluation during training: fixed-seed samples of the eval prompts on the rollout engines (ODE, or
the k-step generator of a dmd2 run)."""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from miles.data.shapes import BUILTIN_SHAPES, ShapeScene, shapes_prompts
from miles.rollout.data_source import read_jsonl_records
from miles.rollout.evaluation import evaluate_shapes
from miles.rollout.media_files import save_media
from miles.rollout.rollout_hub import DatasetSpec, rollout_spec_of
from miles.utils.hook_paths import load_path_flags
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
    """The eval sampler of the run's rollout entry (`rollout_spec_of`) on the eval prompts, or --eval-function-path."""

    def __init__(self, args: argparse.Namespace) -> None:
        spec = rollout_spec_of(args)
        if isinstance(spec, DatasetSpec):
            raise ValueError(
                f"the held-out eval samples with the rollout engines, and --loss-type {args.loss_type} trains on "
                "dataset pairs here with none started: pass --eval-interval 0"
            )
        self.args, self.sampler = args, spec.eval_sampler
        self.custom = load_path_flags(args).get("eval_function_path")
        self.records = load_eval_records(args) if self.custom is None else []

    def evaluate(self, engine: Any, rollout_id: int) -> dict[str, float]:
        args, started = self.args, time.perf_counter()
        if self.custom is not None:
            metrics = {k: float(v) for k, v in dict(self.custom(args, engine, rollout_id)).items()}
            metrics["perf/eval_s"] = time.perf_counter() - started
            metrics[EVAL_AXIS] = rollout_id
            return metrics
        sampler = self.sampler(args)
        metrics, samples = evaluate_shapes(
            engine,
            self.records,
            num_samples_per_prompt=args.n_samples_per_eval_prompt,
            guidance_scale=args.diffusion_guidance_scale,
            seed=args.eval_seed,
            resolution=args.resolution,
            negative_prompt=args.negative_prompt,
            **sampler,
        )
        save_media(
            args.output_dir,
            f"eval_{rollout_id:07d}",
            samples.images,
            fps=samples.fps,
            audio=samples.audio,
            sample_rate=samples.sample_rate,
            max_samples=args.media_max_samples,
        )
        metrics["perf/eval_s"] = time.perf_counter() - started
        metrics[EVAL_AXIS] = rollout_id  # the x of this eval in plots and trackers: 0 is the baseline
        return metrics
