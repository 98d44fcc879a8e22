"""Reward registry (`--rm-type`, `--custom-rm-path`), weighted reward specs, and `compute_rewards`, which runs every
reward of a spec on a batch and turns a bad result (raise, NaN/inf, wrong count) into a `RewardError` naming the sample.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import logging
import math
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from miles.arguments.reward_spec import (  # noqa: F401  (re-exported)
    CUSTOM,
    VIDEO_REWARDS,
    parse_reward_spec,
    remote_url,
    reward_spec_from_args,
    valid_reward_names,
)
from miles.rollout.rm_hub.clip import clip_score, pickscore
from miles.rollout.rm_hub.edit import edit_preservation
from miles.rollout.rm_hub.jpeg import jpeg_compressibility, jpeg_incompressibility, sample_pil_image
from miles.rollout.rm_hub.learned_shapes import (  # noqa: F401  (differentiable_of re-exported)
    DifferentiableReward,
    differentiable_of,
    shapes_learned_latent_rm,
    shapes_learned_rm,
)
from miles.rollout.rm_hub.media import IMAGE, VIDEO, media_mismatch, sample_frames
from miles.rollout.rm_hub.moving_shapes import MovingShapeScore, moving_shapes_reward
from miles.rollout.rm_hub.ocr import OCR_EXTRA_KEY, ocr_rm
from miles.rollout.rm_hub.remote import RemoteRewardError, server_rewards
from miles.rollout.rm_hub.shapes import ShapeScore, shapes_reward
from miles.rollout.rm_hub.video import motion_direction, temporal_consistency
from miles.rollout.rm_hub.vlm_judge import unparsable_metrics, vlm_judge
from miles.utils.misc import load_function
from miles.utils.types import Sample

logger = logging.getLogger(__name__)

RewardFn = Callable[[argparse.Namespace, list[Sample]], Any]
SHAPES_EXTRA_KEY = "shapes"
MOVING_SHAPES_EXTRA_KEY = "moving_shapes"


class RewardError(RuntimeError):
    """A reward raised or returned an unusable result; the message names the reward and the sample."""


def _stored(samples: list[Sample], scores: list, key: str) -> list:
    """`scores`, each also stored in its sample's `extra[key]` (every field) for metrics."""
    for sample, score in zip(samples, scores):
        sample.extra[key] = asdict(score)
    return scores


def _scored_shapes(samples: list[Sample]) -> list[ShapeScore]:
    images, metadatas = [sample_pil_image(s) for s in samples], [s.metadata for s in samples]
    return _stored(samples, shapes_reward(images, metadatas), SHAPES_EXTRA_KEY)


async def shapes_rm(args: argparse.Namespace, samples: list[Sample]) -> list[float]:
    """Mean of the color/shape/count/position scores (see `rm_hub/shapes.py`); every `ShapeScore` field, including
    `all_correct`, is also stored in `sample.extra["shapes"]` for metrics."""
    return [score.reward for score in _scored_shapes(samples)]


async def shapes_strict_rm(args: argparse.Namespace, samples: list[Sample]) -> list[float]:
    """1 when every attribute is right (the shapes reward's `all_correct`: GenEval's strict "correct", what
    `eval/shapes_accuracy` counts), else 0: no partial credit. Stores the `ShapeScore` in `sample.extra["shapes"]`
    as `shapes_rm` does (the same values when both run)."""
    return [float(score.all_correct) for score in _scored_shapes(samples)]


def _scored_clips(samples: list[Sample]) -> list[MovingShapeScore]:
    clips, metadatas = [sample_frames(s) for s in samples], [s.metadata for s in samples]
    return _stored(samples, moving_shapes_reward(clips, metadatas), MOVING_SHAPES_EXTRA_KEY)


async def moving_shapes_rm(args: argparse.Namespace, samples: list[Sample]) -> list[float]:
    """Mean of the colour/shape/direction scores of each clip (see `rm_hub/moving_shapes.py`); every
    `MovingShapeScore` field, including `all_correct`, is also stored in `sample.extra["moving_shapes"]` for metrics."""
    return [score.reward for score in _scored_clips(samples)]


async def moving_shapes_strict_rm(args: argparse.Namespace, samples: list[Sample]) -> list[float]:
    """1 when the clip's colour, shape and direction are all right (the moving_shapes reward's `all_correct`, what
    `eval/moving_shapes_accuracy` counts), else 0. Stores the score as `moving_shapes_rm` does."""
    return [float(score.all_correct) for score in _scored_clips(samples)]


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "shapes": shapes_rm,
    "jpeg_compressibility": jpeg_compressibility,
    "jpeg_incompressibility": jpeg_incompressibility,
    "clip_score": clip_score,
    "pickscore": pickscore,
    "ocr": ocr_rm,
    "temporal_consistency": temporal_consistency,
    "motion_direction": motion_direction,
    "vlm_judge": vlm_judge,
    "edit_preservation": edit_preservation,
    "moving_shapes": moving_shapes_rm,
    "shapes_strict": shapes_strict_rm,
    "moving_shapes_strict": moving_shapes_strict_rm,
    "shapes_learned": shapes_learned_rm,
    "shapes_learned_latent": shapes_learned_latent_rm,
}
# The media each built-in scores (custom rewards read what they like): image rewards read sample.image, video
# rewards sample.frames; the start-up refuses a mismatch with the family (`reward_media_problems`), and
# compute_rewards with the samples (a custom rollout's) before calling the reward.
REWARD_MEDIA: dict[str, str] = {name: VIDEO if name in VIDEO_REWARDS else IMAGE for name in REWARD_FUNCTIONS}
REWARD_MEDIA.pop("vlm_judge")  # judges an image or a video's key frames


def get_reward_function(
    name: str | None, custom_path: str | None = None, args: argparse.Namespace | None = None
) -> RewardFn:
    """The reward called `name`; `custom` (the default when `custom_path` is given) loads `--custom-rm-path`;
    `remote<K>` is the reward server of the K-th `--rm-url` (needs `args`)."""
    url = remote_url(args, name) if args is not None and name else None
    if url is not None:
        return server_rewards(url)
    if name is None:
        name = CUSTOM if custom_path else "shapes"
    if name == CUSTOM:
        if not custom_path:
            raise ValueError(
                "--rm-type names 'custom' but --custom-rm-path is not set (path/to/file.py:fn or pkg.mod.fn)"
            )
        return load_function(custom_path)
    if name not in REWARD_FUNCTIONS:
        raise ValueError(f"unknown reward {name!r} in --rm-type; valid rewards: {valid_reward_names()}")
    return REWARD_FUNCTIONS[name]


def _describe(sample: Sample) -> str:
    prompt = sample.prompt if len(sample.prompt) <= 80 else sample.prompt[:77] + "..."
    return f"sample index={sample.index} prompt={prompt!r}"


async def _call(fn: RewardFn, args: argparse.Namespace, samples: list[Sample]) -> Any:
    result = fn(args, samples)
    return await result if inspect.isawaitable(result) else result


async def _locate_failure(fn: RewardFn, args: argparse.Namespace, samples: list[Sample]) -> str:
    """Which sample a batched reward chokes on: score them one by one (error path only) until one raises."""
    if len(samples) > 1:
        for sample in samples:
            try:
                await _call(fn, args, [sample])
            except Exception:
                return _describe(sample)
    if len(samples) == 1:
        return _describe(samples[0])
    return f"the batch of {len(samples)} samples (indices {samples[0].index}..{samples[-1].index}; each alone passes)"


async def _score_one(name: str, fn: RewardFn, args: argparse.Namespace, samples: list[Sample]) -> list[float]:
    try:
        result = await _call(fn, args, samples)
    except RemoteRewardError as exc:  # names the URL; re-sending sample by sample would only repeat it
        raise RewardError(f"reward {name!r}: {exc}") from exc
    except Exception as exc:
        where = await _locate_failure(fn, args, samples)
        raise RewardError(f"reward {name!r} raised on {where}: {type(exc).__name__}: {exc}") from exc
    try:
        values = list(result)
    except TypeError:
        raise RewardError(
            f"reward {name!r} returned {type(result).__name__}, expected one float per sample "
            f"({len(samples)} samples from {_describe(samples[0])})"
        ) from None
    if len(values) != len(samples):
        culprit = samples[len(values)] if len(values) < len(samples) else samples[-1]
        what = "has no value" if len(values) < len(samples) else "is the last sample; extra values follow it"
        raise RewardError(
            f"reward {name!r} returned {len(values)} values for {len(samples)} samples: {_describe(culprit)} {what}"
        )
    scores = []
    for sample, value in zip(samples, values):
        try:
            score = float(value)
        except (TypeError, ValueError):
            raise RewardError(f"reward {name!r} returned a non-number {value!r} for {_describe(sample)}") from None
        if not math.isfinite(score):
            raise RewardError(f"reward {name!r} returned {score} for {_describe(sample)}")
        scores.append(score)
    return scores


async def compute_rewards(
    args: argparse.Namespace, samples: list[Sample], spec: list[tuple[str, float]]
) -> tuple[list[float], dict[str, list[float]]]:
    """Every reward of `spec` on the batch: (weighted totals per sample, raw values per reward name)."""
    custom_path = args.custom_rm_path
    functions = [get_reward_function(name, custom_path, args) for name, _ in spec]
    if not samples:
        return [], {name: [] for name, _ in spec}
    for name, _ in spec:
        problem = (
            media_mismatch(name, REWARD_MEDIA[name], samples, list(VIDEO_REWARDS)) if name in REWARD_MEDIA else None
        )
        if problem:
            raise RewardError(problem)
    outcomes = await asyncio.gather(
        *(_score_one(name, fn, args, samples) for (name, _), fn in zip(spec, functions)), return_exceptions=True
    )
    per_reward: dict[str, list[float]] = {}
    for (name, _), outcome in zip(spec, outcomes):
        if isinstance(outcome, BaseException):
            raise outcome
        per_reward[name] = outcome
    totals = [sum(weight * per_reward[name][i] for name, weight in spec) for i in range(len(samples))]
    return totals, per_reward


def reward_metrics(
    totals: list[float], per_reward: dict[str, list[float]], samples: list[Sample] | None = None
) -> dict[str, float]:
    """`rollout/reward_mean`, `rollout/reward_<name>_mean`, `rollout/shapes_<field>_mean` from the samples'
    `extra["shapes"]` (all_correct as a rate), `rollout/moving_shapes_<field>_mean` from `extra["moving_shapes"]`, and `rollout/ocr_correct_mean` (target text found) from `extra["ocr"]`."""
    metrics: dict[str, float] = {}
    if totals:
        metrics["rollout/reward_mean"] = sum(totals) / len(totals)
    for name, values in per_reward.items():
        if values:
            metrics[f"rollout/reward_{name}_mean"] = sum(values) / len(values)
    infos = [s.extra[SHAPES_EXTRA_KEY] for s in samples or [] if SHAPES_EXTRA_KEY in s.extra]
    for field in ("color", "shape", "count", "position", "num_objects", "all_correct"):
        if infos:
            metrics[f"rollout/shapes_{field}_mean"] = sum(float(info[field]) for info in infos) / len(infos)
    moving = [s.extra[MOVING_SHAPES_EXTRA_KEY] for s in samples or [] if MOVING_SHAPES_EXTRA_KEY in s.extra]
    for field in ("color", "shape", "direction", "all_correct"):
        if moving:
            metrics[f"rollout/moving_shapes_{field}_mean"] = sum(float(info[field]) for info in moving) / len(moving)
    ocr = [s.extra[OCR_EXTRA_KEY] for s in samples or [] if OCR_EXTRA_KEY in s.extra]
    if ocr:
        metrics["rollout/ocr_correct_mean"] = sum(float(info["correct"]) for info in ocr) / len(ocr)
    metrics.update(unparsable_metrics(samples or []))
    return metrics
