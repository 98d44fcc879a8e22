"""Held-out evaluation on the shapes world: deterministic samples of a prompt set, scored by the shapes reward.

`evaluate_shapes` works with any engine that has `generate(GenerateRequest) -> GenerateResult` (an in-process
`DiffusionEngine` or the Ray `RolloutEngineGroup`); `shapes_eval_metrics` is the aggregation on its own.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import numpy as np

from miles.rollout.engine import GenerateRequest, GenerateResult
from miles.rollout.rm_hub.shapes import ShapeScore, shapes_reward
from miles.utils.seeding import stream_seed

logger = logging.getLogger(__name__)

METRIC_PREFIX = "eval/shapes"
# An attribute counts as correct as in `ShapeScore.all_correct`: color share > 0.5, mean shape likeness >= 0.5 (with
# three classes a likeness >= 0.5 is the likeliest; all_correct asks that of every object), exact count, position
# ramp >= 0.5 (the centroid leads toward the named side by at least half the ramp).
ATTRIBUTE_CORRECT = {
    "color": lambda score: score.color > 0.5,
    "shape": lambda score: score.shape >= 0.5,
    "count": lambda score: score.count == 1.0,
    "position": lambda score: score.position >= 0.5,
}


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


def evaluate_shapes(
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
) -> tuple[dict[str, float], np.ndarray]:
    """Sample every record's prompt `num_samples_per_prompt` times and score it: the deterministic ODE kernel, or
    `sde_type="renoise"` for a DMD2 few-step generator (its fresh noise is drawn from the same fixed seeds).

    `records` are {"prompt", "metadata"} dicts (`miles.data.shapes.shapes_prompts`, e.g. its "eval" split). Sample k
    of record i starts from the noise of `eval_seed(seed, i, k)`, so repeated evals give identical images. Returns
    the metrics of `shapes_eval_metrics` and the images (N, H, W, 3) uint8, record-major (record i, then sample k).
    """
    if not records:
        raise ValueError("evaluate_shapes needs at least one record")
    if num_samples_per_prompt < 1 or batch_size < 1:
        raise ValueError(
            f"num_samples_per_prompt ({num_samples_per_prompt}) and batch_size ({batch_size}) must be >= 1"
        )
    prompts = [r["prompt"] for r in records for _ in range(num_samples_per_prompt)]
    metadatas = [r["metadata"] for r in records for _ in range(num_samples_per_prompt)]
    seeds = [eval_seed(seed, i, k) for i in range(len(records)) for k in range(num_samples_per_prompt)]
    images = []
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
        )
        result = engine.generate(request)
        if result.images is None:
            raise ValueError("the engine returned no images; evaluate_shapes needs decoded samples (decode=True)")
        images.append(result.images)
    images_array = np.concatenate(images)
    metrics = shapes_eval_metrics(shapes_reward(list(images_array), metadatas))
    logger.info(
        "shapes eval: %d samples, %d %s steps, cfg %.2f: accuracy %.3f",
        len(prompts),
        num_steps,
        sde_type,
        guidance_scale,
        metrics[f"{METRIC_PREFIX}_accuracy"],
    )
    return metrics, images_array
