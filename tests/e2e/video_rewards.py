"""A smooth programmatic video reward (the proof that --custom-rm-path works for video: it reads the frames)."""

import numpy as np


async def brightening(args, samples):
    """How much the clip brightens over time: the mean pixel value of its last frame minus its first, in [-1, 1].

    Each sample's `image` holds its frames (F, H, W, 3) uint8; an image would be a wiring error, not a clip."""
    rewards = []
    for sample in samples:
        frames = np.asarray(sample.image, dtype=np.float32) / 255.0
        if frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"brightening scores video frames (F, H, W, 3), got an array of shape {frames.shape}")
        rewards.append(float(frames[-1].mean() - frames[0].mean()))
    return rewards
