"""The C heap of a CPU actor (ARCHITECTURE §4, colocated phases): keep memory freed in one rollout for the next.

glibc hands allocations above its mmap threshold (dynamic, 128 KiB at first) straight to the kernel and returns
them on free, and trims the top of the heap once more than the trim threshold lies free there. A rollout on CPU
allocates and frees the same few hundred MB of activations at every denoising step and every micro-batch, so each
rollout faults all of those pages in again: on the tiny model ~100k-350k minor faults and 0.2-0.6 s of kernel time
per 64-sample generation (1.27 s without them). `keep_freed_memory` raises both thresholds once per actor process,
so freed blocks stay in the heap and are reused. Only glibc (Linux) has these knobs; a user's own `MALLOC_*`
environment settings win.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit: bigger blocks still come from (and go back to) mmap
TRIM_THRESHOLD = 1 << 30  # up to 1 GiB free at the top of the heap stays with the process
# A trainer rank's: FSDP2 gathers each block's parameters (4-24 MB each at 1024 wide) and frees them at every reshard;
# kept in the heap they left it fragmented around the activations, and a LoRA nft step of a 461M-parameter model at
# dp 2 peaked at 4.5-5.2x the rank's share of the weights instead of 2.4x (docs/user-guide/memory.md)
TRAINER_MMAP_THRESHOLD = 4 << 20
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "LD_PRELOAD")


def keep_freed_memory(mmap_threshold: int = MMAP_THRESHOLD) -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True when set. False (nothing changed) off Linux,
    without glibc's `mallopt`, or when the environment already tunes the allocator (`MALLOC_*`, or another
    allocator preloaded). Blocks of `mmap_threshold` bytes or more still come from (and go back to) the kernel."""
    given = [name for name in USER_SETTINGS if os.environ.get(name)]
    if not sys.platform.startswith("linux") or given:
        if given:
            logger.debug("heap thresholds left as set by %s", ", ".join(given))
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
