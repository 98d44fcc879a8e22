"""Held-out evaluation during training: fixed-seed samples of the eval prompts on the rollout engines (ODE, or
the k-step generator of a dmd2 run)."""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from typing import Any

from miles.arguments.hook_paths import load_path_flags
from miles.arguments.records import FlagRecord
from miles.data.moving_shapes import BUILTIN_MOVING_SHAPES, moving_shapes_items
from miles.data.ocr import BUILTIN_OCR, ocr_prompts, unquoted_prompts
from miles.data.shapes import BUILTIN_SHAPES, ShapeScene, shapes_prompts
from miles.data.shapes_edit import BUILTIN_SHAPES_EDIT, shapes_edit_items
from miles.rollout.data_source import read_prompt_file, wants_source_images
from miles.rollout.eval_rewards import EvalRewards, eval_reward_samples
from miles.rollout.evaluation import evaluate_moving_shapes, evaluate_ocr, evaluate_shapes
from miles.rollout.media_files import save_media
from miles.rollout.rollout_hub import DatasetSpec, rollout_spec_of
from miles.utils.tracking import EVAL_AXIS

logger = logging.getLogger(__name__)


SHAPES_EVAL, OCR_EVAL, MOVING_SHAPES_EVAL = "shapes", "ocr", "moving_shapes"


def load_eval_records(args: argparse.Namespace, source_images: bool = False) -> tuple[str, list[dict[str, Any]]]:
    """(which eval, its records). builtin:shapes (builtin:shapes-edit, builtin:moving-shapes) -> its eval split
    (disjoint seeds from training); builtin:ocr -> the
    first --eval-num-prompts of its eval split (words disjoint from training). A file is an OCR eval when no record
    has shapes metadata (every prompt then needs quoted text), else a shapes eval (every record needs it)."""
    data = args.eval_prompt_data
    if data == BUILTIN_SHAPES_EDIT:  # metadata: the target scene, scored as a shapes eval (and the preservation)
        return SHAPES_EVAL, shapes_edit_items(args.eval_num_prompts, seed=args.eval_seed, split="eval")
    if data == BUILTIN_MOVING_SHAPES:  # clips scored by the moving_shapes reward
        items = moving_shapes_items(args.eval_num_prompts, seed=args.eval_seed, split="eval", clips=False)
        return MOVING_SHAPES_EVAL, items
    if data == BUILTIN_SHAPES:
        return SHAPES_EVAL, shapes_prompts(args.eval_num_prompts, seed=args.eval_seed, split="eval")
    if data == BUILTIN_OCR:
        return OCR_EVAL, ocr_prompts(split="eval")[: args.eval_num_prompts]
    records = read_prompt_file(data, args, flag="--eval-prompt-data", source_images=source_images)
    if not any(record["metadata"] for record in records):
        unquoted = unquoted_prompts(records)
        if unquoted:
            raise ValueError(
                f"--eval-prompt-data {data} record {unquoted[0]}: {records[unquoted[0] - 1]['prompt']!r} has neither "
                'shapes metadata nor a target text in double quotes (an OCR eval prompt: a sign that says "OPEN")'
            )
        return OCR_EVAL, records
    for line, record in enumerate(records, start=1):
        try:
            ShapeScene.from_metadata(record["metadata"])
        except (ValueError, TypeError) as exc:
            raise ValueError(f"--eval-prompt-data {data} record {line}: {exc}") from exc
    return SHAPES_EVAL, records


@dataclass(frozen=True)
class EvalFlags(FlagRecord):
    """The flags the evaluator reads itself (the prompts' flags are read where the prompts load, the sampler's by
    the rollout entry's sampler, which gets the whole namespace)."""

    loss_type: str
    n_samples_per_eval_prompt: int
    diffusion_guidance_scale: float | None  # None only before the computed defaults (the algorithm's scale)
    eval_seed: int
    resolution: int | None
    negative_prompt: str
    ocr_num_threads: int
    output_dir: str
    media_max_samples: int
    gold_rm_type: str | None  # the proxy-gold monitor's gold (miles.rollout.eval_rewards)


class Evaluator:
    """The eval sampler of the run's rollout entry (`rollout_spec_of`) on the eval prompts, or --eval-function-path."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.flags = EvalFlags.from_args(args)
        spec = rollout_spec_of(args)
        if isinstance(spec, DatasetSpec):
            raise ValueError(
                f"the held-out eval samples with the rollout engines, and --loss-type {self.flags.loss_type} trains "
                "on dataset pairs here with none started: pass --eval-interval 0"
            )
        self.args, self.sampler = args, spec.eval_sampler
        self.custom = load_path_flags(args).get("eval_function_path")
        sources = wants_source_images(args)
        self.kind: str | None
        self.records: list[dict[str, Any]]
        self.kind, self.records = load_eval_records(args, sources) if self.custom is None else (None, [])
        gold = self.flags.gold_rm_type
        self.rewards = EvalRewards(args, gold) if gold else None  # --eval-function-path is refused with a gold

    def prompts(self) -> list[str] | None:
        """The eval prompts, or None when --eval-function-path samples prompts of its own."""
        return None if self.custom is not None else [record["prompt"] for record in self.records]

    def evaluate(self, engine: Any, rollout_id: int) -> dict[str, float]:
        args, flags, started = self.args, self.flags, time.perf_counter()
        if self.custom is not None:
            metrics = {k: float(v) for k, v in dict(self.custom(args, engine, rollout_id)).items()}
            metrics["perf/eval_s"] = time.perf_counter() - started
            metrics[EVAL_AXIS] = rollout_id
            return metrics
        sampling = dict(
            num_samples_per_prompt=flags.n_samples_per_eval_prompt,
            guidance_scale=flags.diffusion_guidance_scale,
            seed=flags.eval_seed,
            resolution=flags.resolution,
            negative_prompt=flags.negative_prompt,
            **self.sampler(args),
        )
        if self.kind == OCR_EVAL:
            metrics, samples = evaluate_ocr(engine, self.records, ocr_num_threads=flags.ocr_num_threads, **sampling)
        elif self.kind == MOVING_SHAPES_EVAL:
            metrics, samples = evaluate_moving_shapes(engine, self.records, **sampling)
        else:
            metrics, samples = evaluate_shapes(engine, self.records, **sampling)
        if self.rewards is not None:  # the proxy and the gold on the same samples
            scored = eval_reward_samples(
                self.records, samples, flags.n_samples_per_eval_prompt, flags.eval_seed, flags.resolution
            )
            metrics |= self.rewards.metrics(scored)
        save_media(
            flags.output_dir,
            f"eval_{rollout_id:07d}",
            samples.images,
            fps=samples.fps,
            audio=samples.audio,
            sample_rate=samples.sample_rate,
            max_samples=flags.media_max_samples,
            columns=flags.n_samples_per_eval_prompt if samples.sources is not None else None,
            sources=samples.sources,
        )
        metrics["perf/eval_s"] = time.perf_counter() - started
        metrics[EVAL_AXIS] = rollout_id  # the x of this eval in plots and trackers: 0 is the baseline
        return metrics
