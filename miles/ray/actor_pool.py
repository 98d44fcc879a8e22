"""Actor processes kept between runs of one driver process (a test session, a sweep): a run's trainer ranks and
engines go back to an `ActorPool` at shutdown and a later run with the same resource shape takes them, skipping a
new Python process and its imports (~5 s of CPU each: torch, diffusers, transformers). Idle actors keep their
resources until a new actor needs them (`make_room`)."""

from __future__ import annotations

import contextlib
import contextvars
import gc
import logging
import os
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
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
        type(self).__init__(self, *args, **kwargs)
        return True


class ActorPool:
    """Idle actors by key (what they were started with: role kind, count, resource shares), each holding its
    resources. `take` hands out the newest match; `make_room` ends the oldest idle ones until the cluster has what a
    new actor needs; `evict_idle` ends them all."""

    def __init__(self) -> None:
        self._idle: dict[Hashable, list[_Idle]] = {}
        self._session = _ray_session()
        self._puts = 0
        # takes that found an idle item (a trainer group, an engine) or did not; idle items ended to make room
        self.stats = {"reused": 0, "missed": 0, "ended_for_room": 0}

    def take(self, key: tuple) -> Any | None:
        """The newest idle item started with `key`, or None."""
        if self._session != _ray_session():  # Ray restarted: the idle actors died with the old cluster
            self._idle.clear()
            self._session = _ray_session()
        items = self._idle.get(key)
        self.stats["reused" if items else "missed"] += 1
        return items.pop().item if items else None

    def put(self, key: tuple, item: Any, end: Callable[[], None], resources: dict[str, float] | None = None) -> None:
        """Keep `item` (holding `resources`, e.g. {"CPU": 1.0}) for the next `take(key)`; `end()` kills it."""
        self._puts += 1
        self._idle.setdefault(key, []).append(_Idle(item, end, dict(resources or {}), self._puts))

    def make_room(self, need: dict[str, float]) -> None:
        """End idle items, oldest first, until what the cluster has free plus what they held covers `need`."""
        free = ray.available_resources() if ray.is_initialized() else {}
        short = {k: v - free.get(k, 0.0) for k, v in need.items() if v - free.get(k, 0.0) > 1e-9}
        while short and len(self):
            key, oldest = min(((k, items[0]) for k, items in self._idle.items() if items), key=lambda e: e[1].stamp)
            self._idle[key].pop(0)
            _end(oldest)
            self.stats["ended_for_room"] += 1
            short = {k: v - oldest.resources.get(k, 0.0) for k, v in short.items()}
            short = {k: v for k, v in short.items() if v > 1e-9}

    def __len__(self) -> int:
        """Idle items held."""
        return sum(len(items) for items in self._idle.values())

    def evict_idle(self) -> None:
        for items in self._idle.values():
            for idle in items:
                _end(idle)
        self._idle.clear()


@dataclass
class _Idle:
    item: Any
    end: Callable[[], None]  # kills the item's actors (and removes their placement group)
    resources: dict[str, float]  # what it holds while idle
    stamp: int  # put order: the oldest is ended first


def _end(idle: _Idle) -> None:
    try:
        idle.end()
    except Exception as exc:  # an actor that died idle: nothing left to end
        logger.warning("ending an idle pooled actor failed: %s", exc)


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
        pool.evict_idle()
