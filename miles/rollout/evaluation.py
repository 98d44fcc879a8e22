"""Held-out evaluation: deterministic samples of a prompt set, scored by the shapes reward (images, or videos frame by
frame: `evaluate_shapes`), the moving-shapes reward (clips: `evaluate_moving_shapes`) or by the OCR reward (images of
prompts with quoted text: `evaluate_ocr`).

Both work with any engine that has `generate(GenerateRequest) -> GenerateResult` (an in-process `DiffusionEngine` or
the Ray `RolloutEngineGroup`); `shapes_eval_metrics` and `ocr_eval_metrics` are the aggregations on their own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from miles.data.source_images import load_source_images
from miles.rollout.engine_api import GenerateRequest, GenerateResult
from miles.rollout.rm_hub.edit import PSNR_CAP_DB, keep_mask, masked_psnr
from miles.rollout.rm_hub.moving_shapes import MovingShapeScore, moving_shapes_reward
from miles.rollout.rm_hub.ocr import OcrScore, load_ocr_engine, ocr_scores
from miles.rollout.rm_hub.shapes import ShapeScore, shapes_reward
from miles.utils.seeding import stream_seed

logger = logging.getLogger(__name__)

METRIC_PREFIX = "eval/shapes"
OCR_METRIC_PREFIX = "eval/ocr"
MOVING_METRIC_PREFIX = "eval/moving_shapes"
# An attribute counts as correct as in `ShapeScore.all_correct`: color share > 0.5, mean shape likeness >= 0.5 (with
# three classes a likeness >= 0.5 is the likeliest; all_correct asks that of every object), exact count, position
# ramp >= 0.5 (the centroid leads toward the named side by at least half the ramp).
ATTRIBUTE_CORRECT = {
    "color": lambda score: score.color > 0.5,
    "shape": lambda score: score.shape >= 0.5,
    "count": lambda score: score.count == 1.0,
    "position": lambda score: score.position >= 0.5,
}


@dataclass(frozen=True)
class EvalSamples:
    """The eval's decoded samples, record-major: `images` (N, H, W, 3) uint8, or for a video family frames
    (N, F, H, W, 3) at `fps` with `audio` (N, channels, samples) at `sample_rate` when it has sound."""

    images: np.ndarray
    fps: float | None = None
    audio: torch.Tensor | None = None
    sample_rate: int | None = None
    sources: np.ndarray | None = None  # (N, H, W, 3) each sample's first source image (editing, image-to-video)


class GenerateEngine(Protocol):
    def generate(self, request: GenerateRequest) -> GenerateResult: ...


def eval_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The noise seed of sample `sample_index` of prompt `prompt_index`: fixed by (seed, indices), batch-independent."""
    return stream_seed(seed, prompt_index, sample_index)


def shapes_eval_metrics(scores: list[ShapeScore]) -> dict[str, float]:
    """`eval/shapes_accuracy` (all-correct rate), per-attribute accuracies (`ATTRIBUTE_CORRECT`), mean reward."""
    if not scores:
        raise ValueError("shapes_eval_metrics needs at least one score")
    metrics = {f"{METRIC_PREFIX}_accuracy": float(np.mean([s.all_correct for s in scores]))}
    for name, correct in ATTRIBUTE_CORRECT.items():
        metrics[f"{METRIC_PREFIX}_{name}_accuracy"] = float(np.mean([correct(s) for s in scores]))
    metrics[f"{METRIC_PREFIX}_reward_mean"] = float(np.mean([s.reward for s in scores]))
    return metrics


def frame_averaged_score(scores: list[ShapeScore]) -> ShapeScore:
    """One video's score from its frames' scores: each attribute and the reward averaged over frames, the object
    count rounded from its mean, and all_correct only when every frame is all correct."""
    return ShapeScore(
        color=float(np.mean([s.color for s in scores])),
        shape=float(np.mean([s.shape for s in scores])),
        count=float(np.mean([s.count for s in scores])),
        position=float(np.mean([s.position for s in scores])),
        num_objects=round(float(np.mean([s.num_objects for s in scores]))),
        all_correct=all(s.all_correct for s in scores),
        reward=float(np.mean([s.reward for s in scores])),
    )


def score_shapes_media(images: np.ndarray, metadatas: list[dict[str, Any]]) -> list[ShapeScore]:
    """Shapes scores of images (N, H, W, 3), or of videos (N, F, H, W, 3) frame by frame (`frame_averaged_score`)."""
    if images.ndim == 4:
        return shapes_reward(list(images), metadatas)
    frames = images.shape[1]
    flat = shapes_reward(list(images.reshape(-1, *images.shape[2:])), [m for m in metadatas for _ in range(frames)])
    return [frame_averaged_score(flat[i * frames : (i + 1) * frames]) for i in range(len(images))]


def eval_source_images(
    records: list[dict[str, Any]], num_samples_per_prompt: int, resolution: int | None
) -> list[list[np.ndarray]] | None:
    """Each sample's source images (record-major, as the prompts), loaded at `resolution`; None when no record
    carries any (text-only prompts)."""
    if all(r.get("source_images") is None for r in records):
        return None
    if resolution is None:  # editing / image-to-video prompts
        raise ValueError("the eval's prompts carry source images: pass the run's resolution to load them at")
    loaded = [load_source_images(r.get("source_images"), resolution) or [] for r in records]
    return [images for images in loaded for _ in range(num_samples_per_prompt)]


def generate_eval_samples(
    engine: GenerateEngine,
    records: list[dict[str, Any]],
    *,
    num_samples_per_prompt: int = 1,
    num_steps: int,
    guidance_scale: float,
    seed: int = 0,
    resolution: int | None = None,
    batch_size: int = 64,
    negative_prompt: str = "",
    sde_type: str = "ode",
    shift: float | None = None,
) -> EvalSamples:
    """Sample every record's prompt `num_samples_per_prompt` times: the deterministic ODE kernel, or
    `sde_type="renoise"` for a DMD2 few-step generator (its fresh noise is drawn from the same fixed seeds).

    Sample k of record i starts from the noise of `eval_seed(seed, i, k)`, so repeated evals give identical images.
    Returns the samples (`EvalSamples`), record-major (record i, then sample k).
    """
    if not records:
        raise ValueError("the held-out eval needs at least one record")
    if num_samples_per_prompt < 1 or batch_size < 1:
        raise ValueError(
            f"num_samples_per_prompt ({num_samples_per_prompt}) and batch_size ({batch_size}) must be >= 1"
        )
    prompts = [r["prompt"] for r in records for _ in range(num_samples_per_prompt)]
    seeds = [eval_seed(seed, i, k) for i in range(len(records)) for k in range(num_samples_per_prompt)]
    sources = eval_source_images(records, num_samples_per_prompt, resolution)
    images: list[np.ndarray] = []
    audio: list[torch.Tensor] = []
    fps: float | None = None
    sample_rate: int | None = None
    for start in range(0, len(prompts), batch_size):
        request = GenerateRequest(
            prompts=prompts[start : start + batch_size],
            seeds=seeds[start : start + batch_size],
            num_steps=num_steps,
            guidance_scale=guidance_scale,
            negative_prompt=negative_prompt,
            sde_type=sde_type,
            noise_level=0.0,
            trained_steps=[],
            resolution=resolution,
            shift=shift,
            source_images=None if sources is None else sources[start : start + batch_size],
        )
        result = engine.generate(request)
        if result.images is None:
            raise ValueError("the engine returned no images; the held-out eval needs decoded samples (decode=True)")
        images.append(result.images)
        audio += [] if result.audio is None else [result.audio]
        fps, sample_rate = result.fps, result.sample_rate  # the last batch's
    return EvalSamples(
        np.concatenate(images),
        fps=fps,
        audio=torch.cat(audio) if audio else None,
        sample_rate=sample_rate if audio else None,
        sources=None if sources is None else np.stack([images[0] for images in sources]),
    )


def edit_eval_metrics(samples: EvalSamples, metadatas: list[dict[str, Any]]) -> dict[str, float]:
    """`eval/edit_preservation_mean` of an editing eval's images against their first source images (`sources`),
    outside each sample's `edit_box`."""
    if samples.sources is None:
        raise ValueError("the edit eval's preservation needs the samples' source images (EvalSamples.sources)")
    height, width = samples.images.shape[1:3]
    scores = [
        min(masked_psnr(image, source, keep_mask(height, width, meta.get("edit_box"))), PSNR_CAP_DB) / PSNR_CAP_DB
        for image, source, meta in zip(samples.images, samples.sources, metadatas)
    ]
    return {"eval/edit_preservation_mean": float(np.mean(scores))}


def evaluate_shapes(
    engine: GenerateEngine, records: list[dict[str, Any]], *, num_samples_per_prompt: int = 1, **sampling: Any
) -> tuple[dict[str, float], EvalSamples]:
    """`generate_eval_samples` scored by the shapes reward: the metrics of `shapes_eval_metrics` and the samples.

    `records` are {"prompt", "metadata"} dicts (`miles.data.shapes.shapes_prompts`, e.g. its "eval" split). A video
    family's samples are scored frame by frame (`score_shapes_media`).
    """
    samples = generate_eval_samples(engine, records, num_samples_per_prompt=num_samples_per_prompt, **sampling)
    metadatas = [r["metadata"] for r in records for _ in range(num_samples_per_prompt)]
    metrics = shapes_eval_metrics(score_shapes_media(samples.images, metadatas))
    if samples.images.ndim == 4 and samples.sources is not None:
        metrics |= edit_eval_metrics(samples, metadatas)
    logger.info(
        "shapes eval: %d samples, %d %s steps, cfg %.2f: accuracy %.3f",
        len(metadatas),
        sampling["num_steps"],
        sampling.get("sde_type", "ode"),
        sampling["guidance_scale"],
        metrics[f"{METRIC_PREFIX}_accuracy"],
    )
    return metrics, samples


def moving_shapes_eval_metrics(scores: list[MovingShapeScore]) -> dict[str, float]:
    """`eval/moving_shapes_accuracy` (all-correct rate), per-attribute accuracies (colour share > 0.5, shape likeness
    >= 0.5, direction ramp >= 0.5: each half of `all_correct`) and the mean reward."""
    if not scores:
        raise ValueError("moving_shapes_eval_metrics needs at least one score")
    p = MOVING_METRIC_PREFIX
    return {
        f"{p}_accuracy": float(np.mean([s.all_correct for s in scores])),
        f"{p}_color_accuracy": float(np.mean([s.color > 0.5 for s in scores])),
        f"{p}_shape_accuracy": float(np.mean([s.shape >= 0.5 for s in scores])),
        f"{p}_direction_accuracy": float(np.mean([s.direction >= 0.5 for s in scores])),
        f"{p}_reward_mean": float(np.mean([s.reward for s in scores])),
    }


def evaluate_moving_shapes(
    engine: GenerateEngine, records: list[dict[str, Any]], *, num_samples_per_prompt: int = 1, **sampling: Any
) -> tuple[dict[str, float], EvalSamples]:
    """`generate_eval_samples` of builtin:moving-shapes prompts (a video family's clips) scored by the
    moving_shapes reward: the metrics of `moving_shapes_eval_metrics` and the samples."""
    samples = generate_eval_samples(engine, records, num_samples_per_prompt=num_samples_per_prompt, **sampling)
    if samples.images.ndim != 5:
        raise ValueError("the moving-shapes eval scores clips; this model makes images (use a video family)")
    metadatas = [r["metadata"] for r in records for _ in range(num_samples_per_prompt)]
    metrics = moving_shapes_eval_metrics(moving_shapes_reward(list(samples.images), metadatas))
    logger.info(
        "moving-shapes eval: %d clips, %d %s steps, cfg %.2f: accuracy %.3f",
        len(metadatas),
        sampling["num_steps"],
        sampling.get("sde_type", "ode"),
        sampling["guidance_scale"],
        metrics[f"{MOVING_METRIC_PREFIX}_accuracy"],
    )
    return metrics, samples


def ocr_eval_metrics(scores: list[OcrScore]) -> dict[str, float]:
    """`eval/ocr_accuracy` (the rate of samples whose target text is read in full: reward 1) and `eval/ocr_reward_mean`."""
    if not scores:
        raise ValueError("ocr_eval_metrics needs at least one score")
    return {
        f"{OCR_METRIC_PREFIX}_accuracy": float(np.mean([s.correct for s in scores])),
        f"{OCR_METRIC_PREFIX}_reward_mean": float(np.mean([s.reward for s in scores])),
    }


def evaluate_ocr(
    engine: GenerateEngine,
    records: list[dict[str, Any]],
    *,
    num_samples_per_prompt: int = 1,
    ocr_num_threads: int = 1,
    **sampling: Any,
) -> tuple[dict[str, float], EvalSamples]:
    """`generate_eval_samples` of prompts with quoted text (`miles.data.ocr`), scored by the OCR reward: the metrics
    of `ocr_eval_metrics` and the samples. Images only (a video family's eval is the shapes one)."""
    samples = generate_eval_samples(engine, records, num_samples_per_prompt=num_samples_per_prompt, **sampling)
    if samples.images.ndim != 4:
        raise ValueError("the OCR eval scores images; a video family's samples have frames (use a shapes eval)")
    prompts = [r["prompt"] for r in records for _ in range(num_samples_per_prompt)]
    metrics = ocr_eval_metrics(ocr_scores(load_ocr_engine(ocr_num_threads), list(samples.images), prompts))
    logger.info(
        "ocr eval: %d samples, %d %s steps, cfg %.2f: accuracy %.3f",
        len(prompts),
        sampling["num_steps"],
        sampling.get("sde_type", "ode"),
        sampling["guidance_scale"],
        metrics[f"{OCR_METRIC_PREFIX}_accuracy"],
    )
    return metrics, samples
