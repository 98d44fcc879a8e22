"""Reward-hacking monitors (docs/user-guide/rewards.md, "Monitors"): statistics of each rollout's decoded samples
(`monitor/*` metrics), and the console warning when one drifts from the run's first rollout or diversity collapses.

They read the rollout and feed nothing back: no metric, reward or advantage changes when they run.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)

PREFIX = "monitor/"
THUMBNAIL = 64  # the pixel diversity compares images block-averaged to at most this many pixels a side
LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float64)  # Rec. 601 weights of R, G, B


def image_statistics(images: np.ndarray) -> dict[str, np.ndarray]:
    """Per sample of a (B, H, W, 3) or (B, F, H, W, 3) uint8 batch: `brightness`, the mean Rec. 601 luma
    (0.299 R + 0.587 G + 0.114 B) / 255, and `saturation`, the mean HSV saturation (max − min) / max over pixels
    (0 where max is 0); both in [0, 1]. One sample at a time, so a batch of large images costs one image of floats."""
    brightness, saturation = np.empty(len(images)), np.empty(len(images))
    for i, image in enumerate(images):
        pixels = np.asarray(image, dtype=np.float64).reshape(-1, 3) / 255.0
        high, low = pixels.max(axis=1), pixels.min(axis=1)
        brightness[i] = float((pixels @ LUMA).mean())
        saturation[i] = float(np.where(high > 0, (high - low) / np.where(high > 0, high, 1.0), 0.0).mean())
    return {"brightness": brightness, "saturation": saturation}


def latent_norms(latents: np.ndarray) -> np.ndarray:
    """Per sample, the RMS of its final latent x̂₀: sqrt(mean(x²)) over every latent element."""
    flat = np.asarray(latents, dtype=np.float64).reshape(len(latents), -1)
    return np.sqrt((flat**2).mean(axis=1))


def thumbnail(image: np.ndarray) -> np.ndarray:
    """A 1-D float64 feature in [0, 1] of one (H, W, 3) image or (F, H, W, 3) video: each frame block-averaged by
    the smallest integer factor that brings its longer side to at most THUMBNAIL pixels (rows and columns past the
    last whole block dropped)."""
    array = np.asarray(image)
    height, width = array.shape[-3], array.shape[-2]
    factor = max(1, math.ceil(max(height, width) / THUMBNAIL))
    rows, cols = height // factor, width // factor
    cropped = array[..., : rows * factor, : cols * factor, :].astype(np.float64) / 255.0
    return cropped.reshape(*array.shape[:-3], rows, factor, cols, factor, 3).mean(axis=(-4, -2)).reshape(-1)


def rms_distances(features: np.ndarray) -> np.ndarray:
    """(n, n) RMS distances ||a − b|| / sqrt(D) between the rows of an (n, D) array."""
    squares = (features**2).sum(axis=1)
    gram = features @ features.T
    return np.sqrt(np.maximum(squares[:, None] + squares[None, :] - 2.0 * gram, 0.0) / features.shape[1])


def cosine_distances(features: np.ndarray) -> np.ndarray:
    """(n, n) 1 − cos between the rows of an (n, D) array (rows of norm 0 count as orthogonal to everything)."""
    norms = np.linalg.norm(features, axis=1, keepdims=True)
    unit = features / np.where(norms > 0, norms, 1.0)
    return 1.0 - unit @ unit.T


def group_diversity(features: np.ndarray, groups: Sequence[Sequence[int]], metric: str = "rms") -> float | None:
    """Mean over prompt groups of ≥ 2 samples of the mean distance over the group's pairs i < j (`rms` or `cosine`);
    None when no group has two samples."""
    distances = rms_distances if metric == "rms" else cosine_distances
    means = []
    for rows in groups:
        if len(rows) < 2:
            continue
        matrix = distances(np.asarray(features, dtype=np.float64)[list(rows)])
        upper = np.triu_indices(len(rows), k=1)
        means.append(float(matrix[upper].mean()))
    return sum(means) / len(means) if means else None


def reward_correlations(per_reward: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Pearson correlation over the batch of each pair of rewards, `a__b` in spec order; a pair where either reward
    is constant over the batch has no correlation and is left out."""
    names = list(per_reward)
    out = {}
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            a, b = (np.asarray(per_reward[n], dtype=np.float64) for n in (first, second))
            a, b = a - a.mean(), b - b.mean()
            scale = math.sqrt(float((a**2).sum()) * float((b**2).sum()))
            if scale > 0:
                out[f"{first}__{second}"] = float((a * b).sum() / scale)
    return out


def monitor_metrics(
    images: np.ndarray | None,
    final_latents: np.ndarray,
    groups: Sequence[Sequence[int]],
    per_reward: Mapping[str, Sequence[float]],
    clip_embeddings: np.ndarray | None = None,
) -> dict[str, float]:
    """The `monitor/*` metrics of one rollout: mean and std over the batch of each sample's brightness, saturation
    (decoded media) and x̂₀ RMS norm; the pixel diversity within prompt groups (and the CLIP one, 1 − cos of the
    image embeddings, when a CLIP reward kept them); each pair's reward correlation when several rewards are weighted.
    `groups`: the batch rows of each prompt group."""
    per_sample = {"norm": latent_norms(final_latents)}
    if images is not None:
        per_sample.update(image_statistics(images))
    metrics = {}
    for name in ("brightness", "saturation", "norm"):
        if name in per_sample:
            metrics[f"{PREFIX}x0_{name}_mean"] = float(per_sample[name].mean())
            metrics[f"{PREFIX}x0_{name}_std"] = float(per_sample[name].std())
    diversities = {}
    if images is not None:
        diversities["pixel"] = group_diversity(np.stack([thumbnail(image) for image in images]), groups)
    if clip_embeddings is not None:
        diversities["clip"] = group_diversity(clip_embeddings, groups, metric="cosine")
    metrics.update({f"{PREFIX}diversity_{k}": v for k, v in diversities.items() if v is not None})
    if len(per_reward) > 1:
        metrics.update({f"{PREFIX}reward_corr/{k}": v for k, v in reward_correlations(per_reward).items()})
    return metrics


@dataclass(frozen=True)
class Watch:
    """A condition the console warns about: `key` moved past `threshold` (the `flag`'s value) from its first value;
    `kind`: `absolute` |v − v₀| > t, `relative` |v − v₀| > t·|v₀|, or `collapse` v < t·v₀."""

    key: str
    kind: str
    flag: str
    threshold: float

    def holds(self, value: float, first: float) -> bool:
        if self.kind == "absolute":
            return abs(value - first) > self.threshold
        if self.kind == "relative":
            return abs(value - first) > self.threshold * abs(first)
        return value < self.threshold * first

    def describe(self, value: float, first: float) -> str:
        if self.kind == "collapse":
            return f"fell to {value:.4g}, below {self.flag} {self.threshold:g} x its first value {first:.4g}"
        bound = f"{self.threshold:g}" + (f" x |{first:.4g}|" if self.kind == "relative" else "")
        return f"drifted to {value:.4g} from its first value {first:.4g} (|change| {abs(value - first):.4g} > {self.flag} {bound})"


def watches(image_drift: float, norm_drift: float, diversity_collapse: float) -> list[Watch]:
    """The conditions of the three threshold flags; a threshold of 0 watches nothing."""
    specs = [
        (f"{PREFIX}x0_brightness_mean", "absolute", "--monitor-image-drift", image_drift),
        (f"{PREFIX}x0_saturation_mean", "absolute", "--monitor-image-drift", image_drift),
        (f"{PREFIX}x0_norm_mean", "relative", "--monitor-norm-drift", norm_drift),
        (f"{PREFIX}diversity_pixel", "collapse", "--monitor-diversity-collapse", diversity_collapse),
        (f"{PREFIX}diversity_clip", "collapse", "--monitor-diversity-collapse", diversity_collapse),
    ]
    return [Watch(*spec) for spec in specs if spec[3] > 0]


@dataclass
class DriftWatch:
    """Each watched metric against its first logged value (the first rollout this process ran): `check` returns the
    conditions that hold and logs one warning per condition per run, the first time it holds; `held` keeps each
    rollout's (flag, what held) for `--monitor-action` until `pop_held` takes them."""

    conditions: list[Watch]
    first: dict[str, tuple[int, float]] = field(default_factory=dict)  # key -> (rollout id, value)
    warned: set[str] = field(default_factory=set)
    held: dict[int, list[tuple[str, str]]] = field(default_factory=dict)

    def pop_held(self, rollout_id: int) -> list[tuple[str, str]]:
        """The conditions that held at rollout `rollout_id`, each (its flag, the metric and its values), once."""
        return self.held.pop(rollout_id, [])

    def check(self, rollout_id: int, metrics: dict[str, float]) -> list[str]:
        holding = []
        for watch in self.conditions:
            if watch.key not in metrics:
                continue
            value = metrics[watch.key]
            first_rollout, first = self.first.setdefault(watch.key, (rollout_id, value))
            if not watch.holds(value, first):
                continue
            holding.append(watch.key)
            self.held.setdefault(rollout_id, []).append((watch.flag, f"{watch.key} {watch.describe(value, first)}"))
            if watch.key not in self.warned:
                self.warned.add(watch.key)
                logger.warning(
                    "rollout %d: %s %s (first value at rollout %d); the policy may be hacking the reward "
                    "(docs/user-guide/rewards.md, Monitors). Warned once per run: monitor/alerts counts it every rollout",
                    rollout_id,
                    watch.key,
                    watch.describe(value, first),
                    first_rollout,
                )
        return holding
