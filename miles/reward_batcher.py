"""The reward server's scoring loop: concurrent /score requests merged into one batch per `compute_rewards` call.

Requests that arrive while a batch is scored (or within a short wait window) queue up; the next batch takes whole
requests in arrival order up to `max_batch_size` samples (a larger request goes alone) and hands each its own slice
of the results. A merged batch that fails is scored again one request at a time, so an error reaches only the
request that caused it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger(__name__)

ScoreFn = Callable[[list[Any]], Sequence[Any]]  # items -> one result per item, in order


@dataclass
class BatchStats:
    """What the loop did since the server started (the `batching` entry of GET /health)."""

    batches: int = 0  # compute_rewards calls on merged batches (re-scoring after an error not counted)
    requests: int = 0  # requests answered (with results or an error)
    samples: int = 0
    largest_batch_requests: int = 0
    largest_batch_samples: int = 0
    split_after_error: int = 0  # merged batches that failed and were re-scored request by request


@dataclass
class _Pending:
    items: list[Any]
    future: asyncio.Future


class RequestBatcher:
    """`await submit(items)` -> the results of `items`, scored by `score_fn` in `executor` (one thread: a loaded
    reward model is not shared between threads) together with the requests queued beside them."""

    def __init__(
        self, score_fn: ScoreFn, *, max_batch_size: int, wait_s: float, executor: concurrent.futures.Executor
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"--server-max-batch-size must be >= 1 (1: each request alone), got {max_batch_size}")
        if wait_s < 0:
            raise ValueError(f"--server-batch-wait-ms must be >= 0, got {wait_s * 1000:g}")
        self.score_fn, self.max_batch_size, self.wait_s, self.executor = score_fn, max_batch_size, wait_s, executor
        self.stats = BatchStats()
        self._queue: deque[_Pending] = deque()
        self._arrived: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None

    def describe(self) -> dict[str, Any]:
        return {"max_batch_size": self.max_batch_size, "wait_ms": self.wait_s * 1000, **asdict(self.stats)}

    async def submit(self, items: list[Any]) -> list[Any]:
        """The results of `items` in order; the exception their batch raised when scored alone."""
        if self._loop_task is None or self._loop_task.done():  # started in the server's event loop, on first use
            self._arrived = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        pending = _Pending(list(items), asyncio.get_running_loop().create_future())
        self._queue.append(pending)
        assert self._arrived is not None  # made above, with the loop task
        self._arrived.set()
        return await pending.future

    async def _run(self) -> None:
        assert self._arrived is not None  # submit() makes it before it starts this task
        while True:
            await self._arrived.wait()
            if self.wait_s > 0 and self._queued_samples() < self.max_batch_size:
                await asyncio.sleep(self.wait_s)  # let the requests sent together arrive
            batch = self._take()
            if not self._queue:
                self._arrived.clear()
            await self._score(batch)

    def _queued_samples(self) -> int:
        return sum(len(p.items) for p in self._queue)

    def _take(self) -> list[_Pending]:
        """Whole requests from the front while they fit in max_batch_size samples (always at least one)."""
        batch = [self._queue.popleft()]
        size = len(batch[0].items)
        while self._queue and size + len(self._queue[0].items) <= self.max_batch_size:
            size += len(self._queue[0].items)
            batch.append(self._queue.popleft())
        return batch

    async def _score(self, batch: list[_Pending]) -> None:
        items = [item for pending in batch for item in pending.items]
        self.stats.batches += 1
        self.stats.largest_batch_requests = max(self.stats.largest_batch_requests, len(batch))
        self.stats.largest_batch_samples = max(self.stats.largest_batch_samples, len(items))
        try:
            results = await self._call(items)
        except Exception as exc:
            if len(batch) == 1:
                self._answer(batch[0], error=exc)
                return
            self.stats.split_after_error += 1
            logger.info("a merged batch of %d requests failed (%s); scoring them one by one", len(batch), exc)
            for pending in batch:
                try:
                    self._answer(pending, results=await self._call(pending.items))
                except Exception as alone:
                    self._answer(pending, error=alone)
            return
        start = 0
        for pending in batch:
            self._answer(pending, results=results[start : start + len(pending.items)])
            start += len(pending.items)

    async def _call(self, items: list[Any]) -> list[Any]:
        results = list(await asyncio.get_running_loop().run_in_executor(self.executor, self.score_fn, items))
        if len(results) != len(items):
            raise RuntimeError(f"the scoring function returned {len(results)} results for {len(items)} samples")
        return results

    def _answer(self, pending: _Pending, *, results: list[Any] | None = None, error: Exception | None = None) -> None:
        self.stats.requests += 1
        self.stats.samples += len(pending.items)
        if pending.future.done():  # the client went away
            return
        if error is not None:
            pending.future.set_exception(error)
        else:
            pending.future.set_result(results)
