"""Programmatic video rewards over `sample.frames` (F, H, W, 3) uint8: `temporal_consistency` (how little frames
change from one to the next) and `motion_direction` (how far the brightness centroid travels to the right)."""

from __future__ import annotations

import argparse
import logging

import numpy as np

from miles.rollout.rm_hub.media import sample_frames
from miles.utils.types import Sample

logger = logging.getLogger(__name__)

# ITU-R BT.601 luma weights, as PIL's convert("L")
LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float64)


def frame_consistency(frames: np.ndarray) -> float:
    """1 − mean over consecutive pairs of mean |frame[t+1] − frame[t]| / 255, in [0, 1]: 1 for a still video
    (and for one frame), 0 when every pixel flips between black and white each frame."""
    if len(frames) < 2:
        return 1.0
    steps = np.abs(np.diff(frames.astype(np.int16), axis=0))
    return 1.0 - float(steps.mean()) / 255.0


def centroid_x(frames: np.ndarray) -> np.ndarray:
    """Per frame, the luma-weighted mean column in image widths, in (0, 1) (pixel centres at (x + 0.5) / W);
    0.5 for an all-black frame."""
    luma = frames.astype(np.float64) @ LUMA  # (F, H, W)
    columns = luma.sum(axis=1)  # (F, W)
    total = columns.sum(axis=1)
    positions = (np.arange(frames.shape[2]) + 0.5) / frames.shape[2]
    weighted = columns @ positions
    return np.where(total > 0, weighted / np.where(total > 0, total, 1.0), 0.5)


def rightward_motion(frames: np.ndarray) -> float:
    """Sum of the frame-to-frame shifts of the brightness centroid = its travel from the first frame to the last,
    in image widths, in (−1, 1): positive for bright content moving right (so negative for a dark object moving
    right on a bright background), 0 for one frame."""
    xs = centroid_x(frames)
    return float(xs[-1] - xs[0])


async def temporal_consistency(args: argparse.Namespace, samples: list[Sample]) -> list[float]:
    """`frame_consistency` of each sample's frames: higher for smooth, flicker-free video."""
    return [frame_consistency(sample_frames(sample)) for sample in samples]


async def motion_direction(args: argparse.Namespace, samples: list[Sample]) -> list[float]:
    """`rightward_motion` of each sample's frames: higher when bright content moves right over the clip."""
    return [rightward_motion(sample_frames(sample)) for sample in samples]
