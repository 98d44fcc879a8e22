"""Actor processes kept between runs of one driver process (a test session, a sweep): a run's trainer ranks and
engines go back to an `ActorPool` at shutdown and the next run with the same resource shape takes them, skipping a
new Python process and its imports (~5 s of CPU each: torch, diffusers, transformers)."""

from __future__ import annotations

import contextlib
import contextvars
import gc
import logging
import os
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import ray
import torch

logger = logging.getLogger(__name__)

_CURRENT: contextvars.ContextVar[ActorPool | None] = contextvars.ContextVar("miles_actor_pool", default=None)


class ReusableActor:
    """Mixin of an actor class whose process a pool hands to the next run. `release` drops what the run held and
    puts back the process-wide settings a run changes (environment, torch threads and determinism), as a new process
    would have them; `reuse(*args, **kwargs)` then builds the instance again with the next run's arguments."""

    _process_baseline: dict[str, Any] | None = None  # the settings this process started with (set once, per class)

    def _remember_process_baseline(self) -> None:
        if ReusableActor._process_baseline is None:
            ReusableActor._process_baseline = {
                "environ": dict(os.environ),
                "threads": torch.get_num_threads(),
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                "cudnn": (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic),
            }

    def _release_resources(self) -> None:
        """What the run holds outside the instance's attributes (a process group, threads); subclasses extend."""

    def release(self) -> bool:
        self._release_resources()
        self.__dict__.clear()
        baseline = ReusableActor._process_baseline
        if baseline is not None:
            os.environ.clear()
            os.environ.update(baseline["environ"])
            torch.set_num_threads(baseline["threads"])
            torch.use_deterministic_algorithms(baseline["deterministic"])
            torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = baseline["cudnn"]
        gc.collect()
        return True

    def reuse(self, *args: Any, **kwargs: Any) -> bool:
        self.__init__(*args, **kwargs)
        return True


class ActorPool:
    """Idle actors by key (what the actors were started with: role kind, count, resource shares). `take` hands out
    a match or, on a miss, ends the idle actors of that kind (their resources go to the new ones); `evict_idle` ends
    every idle actor (a run calls it once it has taken what it needs, so the pool holds at most one run's actors)."""

    def __init__(self) -> None:
        self._idle: dict[Hashable, list[tuple[Any, Callable[[], None]]]] = {}
        self._session = _ray_session()

    def take(self, key: tuple) -> Any | None:
        """An idle item started with `key`, or None (then the idle items of kind `key[0]` are ended)."""
        if self._session != _ray_session():  # Ray restarted: the idle actors died with the old cluster
            self._idle.clear()
            self._session = _ray_session()
        items = self._idle.get(key)
        if items:
            item, _ = items.pop()
            return item
        for other in [k for k in self._idle if k[0] == key[0]]:
            self._end(other)
        return None

    def put(self, key: tuple, item: Any, end: Callable[[], None]) -> None:
        """Keep `item` for the next `take(key)`; `end()` kills it when it is evicted."""
        self._idle.setdefault(key, []).append((item, end))

    def __len__(self) -> int:
        """Idle items held."""
        return sum(len(items) for items in self._idle.values())

    def evict_idle(self) -> None:
        for key in list(self._idle):
            self._end(key)

    def _end(self, key: Hashable) -> None:
        for _, end in self._idle.pop(key, []):
            try:
                end()
            except Exception as exc:  # an actor that died idle: nothing left to end
                logger.warning("ending an idle pooled actor failed: %s", exc)

    close = evict_idle


def _ray_session() -> str | None:
    return ray.get_runtime_context().get_job_id() if ray.is_initialized() else None


def current_pool() -> ActorPool | None:
    """The pool of the enclosing `reusing_actors` block, or None (every run starts and kills its own actors)."""
    return _CURRENT.get()


@contextlib.contextmanager
def reusing_actors(pool: ActorPool | None = None) -> Iterator[ActorPool]:
    """Runs started inside the block reuse each other's actor processes; the idle ones end with the block."""
    pool = ActorPool() if pool is None else pool
    token = _CURRENT.set(pool)
    try:
        yield pool
    finally:
        _CURRENT.reset(token)
        pool.close()
