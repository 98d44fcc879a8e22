"""Named built-in checkpoints (`--hf-checkpoint builtin:tiny-sd3`), materialised once in a local cache."""

from __future__ import annotations

import fcntl
import logging
import os

logger = logging.getLogger(__name__)

BUILTIN_TINY = "builtin:tiny-sd3"


def cache_dir() -> str:
    return os.environ.get("MILES_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "miles"))


def resolve_checkpoint(path: str | None) -> str | None:
    """Map a builtin name to a pipeline folder, building it under a file lock the first time; other paths pass."""
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
