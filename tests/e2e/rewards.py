"""Rewards the tiny random-VAE model can move (used by the e2e learning tests)."""

import numpy as np


async def brightness(args, samples):
    """Mean pixel value of the decoded image in [0, 1] (of every frame, for a video family's sample)."""
    return [
        float(np.asarray(s.image if s.frames is None else s.frames, dtype=np.float32).mean() / 255.0) for s in samples
    ]
