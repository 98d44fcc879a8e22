"""`Media`: what a family's decoder returns for a batch: images, or video frames with optional audio."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from miles.utils.simulation import simulating


@dataclass(frozen=True, eq=False)
class Media:
    """Decoded samples, batch-first, float in [0, 1].

    `pixels`: images (B, 3, H, W), or video frames (B, F, 3, H, W) played at `fps`. `audio`: a waveform
    (B, channels, samples) in [-1, 1] at `sample_rate` Hz, or None.
    """

    pixels: torch.Tensor
    fps: float | None = None
    audio: torch.Tensor | None = None
    sample_rate: int | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.pixels.shape)
        if self.pixels.ndim not in (4, 5) or shape[-3] != 3:
            raise ValueError(f"Media pixels must be (B, 3, H, W) images or (B, F, 3, H, W) frames, got {shape}")
        if self.is_video and (self.fps is None or self.fps <= 0):
            raise ValueError(f"video Media needs a positive fps, got {self.fps}")
        if self.audio is not None:
            if self.audio.ndim != 3 or self.audio.shape[0] != shape[0]:
                raise ValueError(
                    f"Media audio must be (B={shape[0]}, channels, samples), got {tuple(self.audio.shape)}"
                )
            if self.sample_rate is None or self.sample_rate <= 0:
                raise ValueError(f"Media audio needs a positive sample_rate, got {self.sample_rate}")

    @property
    def batch_size(self) -> int:
        return self.pixels.shape[0]

    @property
    def is_video(self) -> bool:
        return self.pixels.ndim == 5

    @property
    def images(self) -> torch.Tensor:
        """The images (B, 3, H, W); an error for video (image rewards and grids take images only)."""
        if self.is_video:
            raise ValueError(f"this Media is video {tuple(self.pixels.shape)}, not images")
        return self.pixels

    def pixels_uint8(self) -> np.ndarray:
        """Pixels channels-last as uint8, rounded as diffusers' image processor does: (B, H, W, 3) images or
        (B, F, H, W, 3) frames. Under the planner's simulation (fake pixels) zeros of that shape that take no memory
        (a read-only broadcast of one zero)."""
        channels_last = self.pixels.movedim(-3, -1)
        if simulating():
            return np.broadcast_to(np.zeros((), dtype=np.uint8), tuple(channels_last.shape))
        return (channels_last.float().cpu().numpy() * 255).round().astype(np.uint8)
