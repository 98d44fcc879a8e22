"""Media files of a rollout or an eval: image grids for images; for video, one mp4 per sample (H.264, with AAC
audio when the family has sound; encoded by PyAV, which ships its own FFmpeg) and a contact sheet PNG of frames.
"""

from __future__ import annotations

import logging
import math
import os
from fractions import Fraction
from typing import Any, Final

import numpy as np

from miles.arguments.records import RolloutFlags
from miles.rollout.image_grid import save_image_grid

logger = logging.getLogger(__name__)

VIDEO_CODEC: Final = "libx264"  # Final (a literal): PyAV types its stream by the codec name
VIDEO_PIXEL_FORMAT = "yuv420p"  # what browsers and players decode; it halves chroma, so sizes must be even
VIDEO_CRF = "18"  # x264's "visually lossless" end; tiny test videos stay close to their frames
AUDIO_CODEC: Final = "aac"
AUDIO_LAYOUTS = {1: "mono", 2: "stereo"}
CONTACT_SHEET_FRAMES = 4


def _check_fps(fps: Any) -> Fraction:
    try:
        value = float(fps)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"fps must be a positive finite number of frames per second, got {fps!r}")
    return Fraction(value).limit_denominator(1001)  # 24000/1001 (NTSC 23.976) stays exact


def _check_frames(frames: Any, what: str) -> np.ndarray:
    array = np.asarray(frames)
    if array.ndim != 4 or array.shape[-1] != 3 or array.shape[0] < 1 or array.dtype != np.uint8:
        raise ValueError(
            f"{what} must be uint8 frames (F >= 1, H, W, 3) channels-last, got shape {array.shape} dtype {array.dtype}"
        )
    return array


def _check_audio(audio: Any, sample_rate: Any) -> np.ndarray:
    array = np.asarray(audio, dtype=np.float32)
    if array.ndim != 2 or array.shape[0] not in AUDIO_LAYOUTS or array.shape[1] < 1:
        raise ValueError(f"audio must be (channels 1 or 2, samples >= 1) float in [-1, 1], got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError("audio holds NaN or inf samples")
    if not isinstance(sample_rate, (int, np.integer)) or sample_rate <= 0:
        raise ValueError(f"audio needs a positive integer sample_rate in Hz, got {sample_rate!r}")
    return np.ascontiguousarray(np.clip(array, -1.0, 1.0))


def pad_to_even(frames: np.ndarray) -> np.ndarray:
    """Frames (F, H, W, 3) with an odd H or W grown by one edge-replicated row / column (yuv420p needs even sizes)."""
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if not pad_h and not pad_w:
        return frames
    return np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")


def write_mp4(path: str, frames: Any, fps: float, audio: Any = None, sample_rate: int | None = None) -> str:
    """Write `frames` (F, H, W, 3) uint8 at `fps` as an H.264 yuv420p mp4 (odd sizes padded, see `pad_to_even`);
    `audio` (channels, samples) float in [-1, 1] at `sample_rate` Hz is muxed as AAC, as given (not trimmed)."""
    import av  # local: PyAV costs ~0.25 s per process and only video runs write mp4s

    frames = pad_to_even(_check_frames(frames, "write_mp4 frames"))
    rate = _check_fps(fps)
    audio = None if audio is None else _check_audio(audio, sample_rate)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with av.open(path, mode="w") as container:
        video = container.add_stream(VIDEO_CODEC, rate=rate, options={"crf": VIDEO_CRF})
        video.width, video.height, video.pix_fmt = frames.shape[2], frames.shape[1], VIDEO_PIXEL_FORMAT
        video.codec_context.time_base = 1 / rate
        sound: av.AudioStream | None = None
        audio_rate = 0
        if audio is not None:
            assert sample_rate is not None  # _check_audio took it
            audio_rate = int(sample_rate)
            sound = container.add_stream(AUDIO_CODEC, rate=audio_rate)
            sound.layout = AUDIO_LAYOUTS[audio.shape[0]]
        for index, frame in enumerate(frames):
            picture = av.VideoFrame.from_ndarray(frame, format="rgb24")
            picture.pts = index
            container.mux(video.encode(picture))
        container.mux(video.encode())
        if sound is not None:  # one planar frame; the encoder cuts it into AAC's 1024-sample frames
            wave = av.AudioFrame.from_ndarray(audio, format="fltp", layout=AUDIO_LAYOUTS[audio.shape[0]])
            wave.sample_rate, wave.pts = audio_rate, 0
            container.mux(sound.encode(wave))
            container.mux(sound.encode())
    return path


def contact_frame_indices(num_frames: int, per_sample: int = CONTACT_SHEET_FRAMES) -> list[int]:
    """`per_sample` evenly spaced frame indices, first and last included (all frames when there are fewer)."""
    if num_frames < 1 or per_sample < 1:
        raise ValueError(f"contact sheet needs num_frames >= 1 and per_sample >= 1, got {num_frames}, {per_sample}")
    return sorted({round(i) for i in np.linspace(0, num_frames - 1, min(per_sample, num_frames))})


def contact_sheet(
    videos: Any, path: str, per_sample: int = CONTACT_SHEET_FRAMES, sources: np.ndarray | None = None
) -> str:
    """One PNG of `videos` (B, F, H, W, 3) uint8: a row per sample, `per_sample` evenly spaced frames across it
    (after the sample's source image (B, H, W, 3) when given)."""
    array = np.asarray(videos)
    if array.ndim != 5 or array.shape[0] < 1:
        raise ValueError(f"contact_sheet expects videos (B >= 1, F, H, W, 3), got shape {array.shape}")
    _check_frames(array[0], "contact_sheet videos")
    picks = contact_frame_indices(array.shape[1], per_sample)
    tiles = array[:, picks]
    if sources is not None:  # image-to-video: each row starts with the sample's source image
        tiles = np.concatenate([np.asarray(sources)[: len(array), None], tiles], axis=1)
    columns = tiles.shape[1]
    tiles = tiles.reshape(-1, *array.shape[2:])
    return save_image_grid(tiles, path, columns=columns, max_images=len(tiles))


def first_sources(samples: list[Any]) -> np.ndarray | None:
    """Each sample's first source image stacked (B, H, W, 3), or None when the samples are text-only."""
    if not samples or samples[0].source_images is None:
        return None
    return np.stack([np.asarray(s.source_images[0]) for s in samples])


def beside_sources(images: np.ndarray, sources: np.ndarray, group: int) -> np.ndarray:
    """Tiles (N + N / group, H, W, 3): each run of `group` images (one prompt's samples) after its source image;
    `sources` (N, H, W, 3) holds each image's source (the group shares one)."""
    if sources.shape != images.shape:
        raise ValueError(f"source images {sources.shape} and results {images.shape} must have one shape to be shown")
    tiles = []
    for start in range(0, len(images), group):
        tiles.append(sources[start])
        tiles.extend(images[start : start + group])
    return np.stack(tiles)


def save_media(
    output_dir: str,
    name: str,
    images: np.ndarray,
    *,
    fps: float | None = None,
    audio: Any = None,
    sample_rate: int | None = None,
    columns: int | None = None,
    max_samples: int = 64,
    sources: np.ndarray | None = None,
) -> list[str]:
    """Save a batch under the run's `output_dir` as `name` (`rollout_0000003`, `eval_0000003`); returns the paths.

    Images (B, H, W, 3): the grid `images/{name}.png` (at most 64, `columns` wide); with `sources` (B, H, W, 3),
    each sample's first source image (editing, image-to-video), a row per prompt starts with its source. Video (B, F, H, W, 3) at
    `fps`: the first `max_samples` samples as `media/{name}/sample_{k}.mp4` (with their `audio` (B, channels,
    samples) muxed when given) and their contact sheet `images/{name}.png`, where trackers pick up image grids.
    """
    grid_path = os.path.join(output_dir, "images", f"{name}.png")
    array = np.asarray(images)
    if array.ndim == 4 and sources is not None:  # editing: each row a prompt's source, then its `columns` results
        group = columns or 1
        tiles = beside_sources(array, np.asarray(sources), group)
        return [save_image_grid(tiles, grid_path, columns=group + 1, max_images=(group + 1) * max(1, 64 // group))]
    if array.ndim == 4:
        return [save_image_grid(array, grid_path, columns=columns, max_images=64)]
    if array.ndim != 5:
        raise ValueError(f"media to save must be images (B, H, W, 3) or frames (B, F, H, W, 3), got {array.shape}")
    if fps is None:
        raise ValueError(f"video media {name} {array.shape} has no fps; the engine result must carry one")
    count = min(max_samples, array.shape[0])
    if audio is not None:
        audio = np.asarray(audio.cpu() if hasattr(audio, "cpu") else audio, dtype=np.float32)
    paths = [
        write_mp4(
            os.path.join(output_dir, "media", name, f"sample_{k}.mp4"),
            array[k],
            fps,
            audio=None if audio is None else audio[k],
            sample_rate=sample_rate,
        )
        for k in range(count)
    ]
    paths.append(contact_sheet(array[:count], grid_path, sources=None if sources is None else sources[:count]))
    logger.info("wrote %d mp4 sample(s) and a contact sheet for %s", count, name)
    return paths


def save_rollout_media(flags: RolloutFlags, rollout_id: int, result: Any, samples: list[Any]) -> None:
    """Every --image-grid-interval rollouts: the image grid of the rollout's `result`, or for video the first
    --media-max-samples samples as mp4s (audio muxed when there is sound) and their contact sheet (`save_media`)."""
    if not flags.image_grid_interval or rollout_id % flags.image_grid_interval or result.images is None:
        return
    save_media(
        flags.output_dir,
        f"rollout_{rollout_id:07d}",
        result.images,
        fps=result.fps,
        audio=result.audio,
        sample_rate=result.sample_rate,
        columns=flags.n_samples_per_prompt,
        max_samples=flags.media_max_samples,
        sources=first_sources(samples),
    )
