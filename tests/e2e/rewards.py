"""Rewards the tiny random-VAE model can move (used by the e2e learning tests), two of them declared differentiable
for the reward-gradient losses."""

import numpy as np

from miles.models.shapes_reward.differentiable import DifferentiableReward
from miles.models.shapes_reward.net import IMAGE, LATENT


async def brightness(args, samples):
    """Mean pixel value of the decoded image in [0, 1] (of every frame, for a video family's sample)."""
    return [
        float(np.asarray(s.image if s.frames is None else s.frames, dtype=np.float32).mean() / 255.0) for s in samples
    ]


def _pixel_mean(args, pixels, metadatas):
    return pixels.flatten(1).mean(dim=1)


async def differentiable_brightness(args, samples):
    """`brightness`, declared differentiable for an image family: the trainer's score is the mean of the decoded
    pixels in [0, 1], the value `brightness` gives the same image before its rounding to uint8."""
    return await brightness(args, samples)


def _latent_mean(args, latents, metadatas):
    return latents.flatten(1).mean(dim=1)


async def latent_mean(args, samples):
    """A latent reward for any family, video included: the trainer's score is the mean of the final latents. A test
    stand-in: samples carry frames, not latents, so the value the rollout logs is the frames' `brightness`, another
    function (a real latent reward encodes the frames, as `shapes_learned_latent` does); the reward-gradient losses
    train on the trainer's score only."""
    return await brightness(args, samples)


differentiable_brightness.differentiable = DifferentiableReward(IMAGE, _pixel_mean)
latent_mean.differentiable = DifferentiableReward(LATENT, _latent_mean)
