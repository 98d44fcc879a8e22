"""Python's cyclic garbage collector paused while a process imports torch, diffusers, transformers and peft: their
hundreds of thousands of long-lived objects are scanned again and again as they pile up, and none is garbage (the
start-up CPU it saves: docs/user-guide/performance.md, "Imports without the garbage collector").

- `paused()`: the collector off inside a `with` block (the driver's start-up in `train_diffusion.run`).
- `pause_in_ray_worker()`: called at the top of each module that holds a Ray actor class (`miles.ray.train_group`,
  `engine_group`, `reward_workers`), before its imports: a Ray worker imports that module to start the actor. Outside
  a Ray worker it does nothing. The actor's `__init__` calls `resume()` first thing, once those imports are done; a
  worker that imports such a module for anything else gets its collector back after `PAUSE_LIMIT_S` at the latest.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
from collections.abc import Iterator

PAUSE_LIMIT_S = 60.0
_timer: threading.Timer | None = None
_lock = threading.Lock()


def in_ray_worker() -> bool:
    ray_worker = sys.modules.get("ray._private.worker")  # a Ray worker imported Ray before any of its tasks' code
    if ray_worker is None:
        return False
    worker = getattr(ray_worker, "global_worker", None)
    return getattr(worker, "mode", None) == getattr(ray_worker, "WORKER_MODE", object())


def pause_in_ray_worker() -> bool:
    """Turn the collector off in a Ray worker process until `resume()` or `PAUSE_LIMIT_S`; True when it did."""
    global _timer
    if not in_ray_worker() or not gc.isenabled():
        return False
    with _lock:
        gc.disable()
        _timer = threading.Timer(PAUSE_LIMIT_S, resume)
        _timer.daemon = True
        _timer.start()
    return True


def resume() -> None:
    """The collector back on, if `pause_in_ray_worker` turned it off (a no-op otherwise)."""
    global _timer
    with _lock:
        if _timer is None:
            return
        _timer.cancel()
        _timer = None
        gc.enable()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The collector off inside the block, then back as it was."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
