"""A reward for the reward-server merging tests: brightness, slow enough per call (0.3 s) that concurrent requests
queue behind a batch being scored, refusing any sample whose prompt is "poison"."""

import time

import numpy as np

CALL_S = 0.3


async def slow_brightness(args, samples):
    time.sleep(CALL_S)  # per call, not per sample: merging requests saves it
    for sample in samples:
        if sample.prompt == "poison":
            raise ValueError("refusing the poison prompt")
    return [float(np.asarray(s.image, dtype=np.float32).mean() / 255.0) for s in samples]
