"""What a reward receives: each sample's media fields filled from an engine result (images, or frames with fps and
audio), and the check that a built-in reward gets the kind of media it scores."""

from __future__ import annotations

from typing import Any

import numpy as np

from miles.utils.types import Sample

IMAGE, VIDEO = "image", "video"


def attach_media(samples: list[Sample], result: Any) -> None:
    """Hand the result's decoded media to its samples, row by row: `image` (H, W, 3) uint8 for an image family;
    `frames` (F, H, W, 3) uint8, `fps`, and `audio` (channels, samples) float32 in [-1, 1] with `sample_rate` for
    a video family (audio only when it has sound)."""
    images = result.images
    if images is None:
        return
    if images.ndim == 4:
        for sample, image in zip(samples, images):
            sample.image = image
        return
    if images.ndim != 5:
        raise ValueError(f"engine result images must be (B, H, W, 3) or frames (B, F, H, W, 3), got {images.shape}")
    if result.fps is None:
        raise ValueError(f"engine result holds video frames {images.shape} but no fps")
    audio = None
    if result.audio is not None:
        raw = result.audio.detach().cpu() if hasattr(result.audio, "detach") else result.audio
        audio = np.asarray(raw, dtype=np.float32)
    for i, (sample, frames) in enumerate(zip(samples, images)):
        sample.frames, sample.fps = frames, float(result.fps)
        if audio is not None:
            sample.audio, sample.sample_rate = audio[i], int(result.sample_rate)


def media_kind(samples: list[Sample]) -> str:
    return VIDEO if any(sample.frames is not None for sample in samples) else IMAGE


def media_mismatch(name: str, kind: str, samples: list[Sample], video_rewards: list[str]) -> str | None:
    """Why reward `name`, which scores `kind` media, cannot score `samples`; None when it can."""
    got = media_kind(samples)
    if got == kind:
        return None
    if kind == IMAGE:
        return (
            f"reward {name!r} scores images (sample.image), but these samples are video (sample.frames, "
            f"(F, H, W, 3) uint8 at sample.fps); use a video reward ({', '.join(video_rewards)}) or a custom reward "
            "(--custom-rm-path) that reads sample.frames"
        )
    return (
        f"reward {name!r} scores video (sample.frames), but these samples are images (sample.image); it needs a "
        "video model family"
    )


def sample_frames(sample: Sample) -> np.ndarray:
    """The sample's frames (F, H, W, 3) as uint8; a sample without frames is an error."""
    if sample.frames is None:
        raise ValueError("sample has no video frames (sample.frames is None): is the model family a video family?")
    frames = np.asarray(sample.frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1 or frames.dtype != np.uint8:
        raise ValueError(f"sample.frames must be (F >= 1, H, W, 3) uint8, got shape {frames.shape} {frames.dtype}")
    return frames
