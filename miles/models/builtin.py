"""Named built-in checkpoints: `builtin:tiny-shapes` (shipped, pretrained) and `builtin:tiny-sd3` (random, cached)."""

from __future__ import annotations

import fcntl
import logging
import os

logger = logging.getLogger(__name__)

BUILTIN_TINY = "builtin:tiny-sd3"  # random weights, built on first use (tests, plumbing)
BUILTIN_SHAPES_MODEL = "builtin:tiny-shapes"  # pretrained on the shapes world, shipped in the package (§9)
SHIPPED_SHAPES_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "tiny_shapes_sd3"
)


def cache_dir() -> str:
    return os.environ.get("MILES_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "miles"))


def resolve_checkpoint(path: str | None) -> str | None:
    """Map a builtin name to a pipeline folder, building it under a file lock the first time; other paths pass."""
    if path == BUILTIN_SHAPES_MODEL:
        if not os.path.isfile(os.path.join(SHIPPED_SHAPES_DIR, "model_index.json")):
            raise FileNotFoundError(
                f"--hf-checkpoint {BUILTIN_SHAPES_MODEL}: the shipped folder {SHIPPED_SHAPES_DIR} is missing; "
                "reinstall miles or rebuild it with scripts/pretrain_tiny_shapes.py"
            )
        return SHIPPED_SHAPES_DIR
    if path is not None and path.startswith("builtin:") and path != BUILTIN_TINY:
        raise ValueError(f"unknown built-in checkpoint {path!r}; known: {BUILTIN_SHAPES_MODEL}, {BUILTIN_TINY}")
    if path != BUILTIN_TINY:
        return path
    from miles.models.tiny import save_tiny_sd3_pipeline

    target = os.path.join(cache_dir(), "tiny-sd3-seed0")
    os.makedirs(cache_dir(), exist_ok=True)
    with open(target + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(target, "model_index.json")):
            logger.info("building the tiny SD3 pipeline into %s", target)
            tmp = target + ".tmp"
            save_tiny_sd3_pipeline(tmp, seed=0)
            os.replace(tmp, target)
    return target
