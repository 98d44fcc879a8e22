"""A smooth programmatic video reward (the proof that --custom-rm-path works for video: it reads the frames)."""

import numpy as np


async def brightening(args, samples):
    """How much the clip brightens over time: the mean pixel value of its last frame minus its first, in [-1, 1].

    A video sample's `frames` hold its clip (F, H, W, 3) uint8 at `fps` (its `image` is None); an image would be a
    wiring error, not a clip."""
    rewards = []
    for sample in samples:
        if sample.frames is None or not sample.fps:
            raise ValueError(f"brightening scores video: sample {sample.index} has no frames (or no fps)")
        frames = np.asarray(sample.frames, dtype=np.float32) / 255.0
        if frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"brightening scores video frames (F, H, W, 3), got an array of shape {frames.shape}")
        rewards.append(float(frames[-1].mean() - frames[0].mean()))
    return rewards
