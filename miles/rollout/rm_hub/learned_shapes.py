"""The learned, differentiable shapes rewards as reward functions (`--rm-type shapes_learned`, `shapes_learned_latent`):
each sample's image scored by the networks of `miles.models.shapes_reward` (the latent variant on the image encoded
by the `builtin:tiny-shapes` VAE), in [0, 1]. The programmatic `shapes` reward stays the gold. Each function carries
its `DifferentiableReward` (what a reward-gradient algorithm back-propagates in the trainer) as its `differentiable`
attribute (docs/user-guide/rewards.md)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import torch

from miles.models.shapes_reward.differentiable import (  # noqa: F401  (re-exported: the rm_hub names)
    BUILTIN_DIFFERENTIABLE,
    DifferentiableReward,
    differentiable_images,
    differentiable_latents,
    differentiable_of,
)
from miles.models.shapes_reward.net import (  # noqa: F401  (re-exported for scripts/train_shapes_reward.py)
    ATTRIBUTES,
    IMAGE,
    IMAGE_SIZE,
    LATENT,
    LATENT_CHECKPOINT,
    WEIGHT_FILES,
    WEIGHTS_DIR,
    ShapesRewardNet,
    encode_images,
    load_net,
    scene_labels,
    score_images,
    score_latents,
    shapes_vae,
    shipped_metadata,
    split_logits,
    wanted_probabilities,
)
from miles.rollout.rm_hub.jpeg import sample_pil_image
from miles.utils.types import Sample


def _images(samples: list[Sample]) -> list[np.ndarray]:
    return [np.asarray(sample_pil_image(sample), dtype=np.float32) / 255.0 for sample in samples]


def _by_size(samples: list[Sample], score: Callable[[torch.Tensor, list[dict]], torch.Tensor]) -> list[float]:
    """`score` of the samples' images, one call per image size, in the samples' order."""
    arrays = _images(samples)
    scores: dict[int, float] = {}
    for size in {array.shape for array in arrays}:
        rows = [i for i, array in enumerate(arrays) if array.shape == size]
        pixels = torch.from_numpy(np.stack([arrays[i] for i in rows])).permute(0, 3, 1, 2)
        with torch.no_grad():
            values = score(pixels, [samples[i].metadata for i in rows])
        scores.update(zip(rows, values.tolist()))
    return [scores[i] for i in range(len(samples))]


async def shapes_learned_rm(args: argparse.Namespace, samples: list[Sample]) -> list[float]:
    """The image network's score of each sample's image against its shapes metadata (in [0, 1])."""
    return _by_size(samples, lambda pixels, metadatas: differentiable_images(args, pixels, metadatas))


async def shapes_learned_latent_rm(args: argparse.Namespace, samples: list[Sample]) -> list[float]:
    """The latent network's score of each sample's image encoded by the `builtin:tiny-shapes` VAE (posterior mode):
    samples carry decoded images; a reward-gradient algorithm scores the final latents directly (`score_latents`)."""
    return _by_size(samples, lambda pixels, metadatas: differentiable_latents(args, encode_images(pixels), metadatas))


shapes_learned_rm.differentiable = BUILTIN_DIFFERENTIABLE["shapes_learned"]  # type: ignore[attr-defined]
shapes_learned_latent_rm.differentiable = BUILTIN_DIFFERENTIABLE["shapes_learned_latent"]  # type: ignore[attr-defined]
