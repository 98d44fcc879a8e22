"""Reward workers (`--rm-num-workers`): Ray actors that each score a contiguous chunk of the batch.

With zero workers the pool scores in-process; either way `score` returns what `compute_rewards` returns, in order.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
from collections.abc import Coroutine
from typing import Any

from miles.utils import import_gc

# ruff: noqa: E402 - the imports below come after the collector's pause
# a Ray worker imports this module to start a reward worker: its imports run without the collector until
# RewardWorker.__init__ resumes it (docs/user-guide/performance.md, "Imports without the garbage collector")
import_gc.pause_in_ray_worker()

import ray

from miles.rollout.rm_hub import RewardError, compute_rewards
from miles.rollout.rm_hub.vlm_judge import unparsable_problem
from miles.utils.failures import gather, where
from miles.utils.misc import split_contiguous
from miles.utils.stop_signals import defer_first_sigterm
from miles.utils.types import Sample

logger = logging.getLogger(__name__)

RewardResult = tuple[list[float], dict[str, list[float]]]


def _run_sync(coroutine: Coroutine[Any, Any, RewardResult]) -> RewardResult:
    """Run a coroutine to completion, also from code that already runs inside an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as executor:
        return executor.submit(asyncio.run, coroutine).result()


class RewardWorker:
    """One reward process; models a reward loads (CLIP) stay cached in it between calls."""

    def __init__(self, args: argparse.Namespace, spec: list[tuple[str, float]]) -> None:
        import_gc.resume()  # this module's imports are done (the pause at its top)
        defer_first_sigterm()  # a scheduler's signal to the whole job: live on while the driver saves
        self.args, self.spec = args, spec

    async def ready(self) -> bool:
        return True

    async def score(self, samples: list[Sample]) -> tuple[list[float], dict[str, list[float]], list[dict[str, Any]]]:
        """compute_rewards plus, per sample, the `extra` entries the rewards added or replaced (the driver's
        samples are other objects, so these are copied back there)."""
        before = [dict(sample.extra) for sample in samples]
        totals, per_reward = await compute_rewards(self.args, samples, self.spec)
        added = [
            {key: value for key, value in sample.extra.items() if key not in old or old[key] is not value}
            for sample, old in zip(samples, before)
        ]
        return totals, per_reward, added


REWARD_WORKER_CPUS = 0.25  # each worker's logical CPU share


class RewardWorkerPool:
    """`num_workers` Ray actors with fractional CPUs; `score(samples)` splits the batch into contiguous chunks."""

    def __init__(
        self,
        args: argparse.Namespace,
        spec: list[tuple[str, float]],
        num_workers: int,
        num_cpus_per_worker: float = REWARD_WORKER_CPUS,
        timeout_s: float = 1800.0,
        wait: bool = True,
    ) -> None:
        """Start the workers; with `wait=False` they start in the background until `wait_ready`."""
        if num_workers < 0:
            raise ValueError(f"--rm-num-workers must be >= 0 (0 scores in the driver), got {num_workers}")
        self.args, self.spec, self.timeout_s = args, spec, timeout_s
        self.workers: list[Any] = []
        self._starting: list[Any] = []
        if num_workers == 0:
            return
        remote_cls = ray.remote(RewardWorker)
        self.workers = [remote_cls.options(num_cpus=num_cpus_per_worker).remote(args, spec) for _ in range(num_workers)]
        self._starting = [worker.ready.remote() for worker in self.workers]
        self._cpus_per_worker = num_cpus_per_worker
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait (within the timeout) until every worker has started; a no-op once they have (or with none)."""
        if not self._starting:
            return
        try:
            ray.get(self._starting, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            num_workers, cpus = len(self.workers), self._cpus_per_worker
            self.shutdown()
            raise TimeoutError(
                f"{num_workers} reward workers (--rm-num-workers) with {cpus} CPUs each did not start "
                f"within {self.timeout_s}s; does the Ray cluster have {num_workers * cpus} free CPUs?"
            ) from None
        self._starting = []

    def score(self, samples: list[Sample], rollout_id: int | None = None) -> RewardResult:
        """(weighted totals, raw values per reward) for `samples` in order; a worker's RewardError is re-raised, a
        dead worker is named with `rollout_id`; a VLM judge that gave too few scores fails here (`unparsable_problem`:
        its workers each saw only their chunk)."""
        result = self._score(samples, rollout_id)
        problem = unparsable_problem(self.args, samples)
        if problem is not None:
            raise RewardError(f"reward 'vlm_judge': {problem} [{where('score', rollout_id)}]")
        return result

    def _score(self, samples: list[Sample], rollout_id: int | None) -> RewardResult:
        if not self.workers:
            try:
                return _run_sync(compute_rewards(self.args, samples, self.spec))
            except RewardError as exc:
                raise RewardError(f"{exc} [{where('score', rollout_id)}]") from exc
        chunks = [(a, b) for a, b in split_contiguous(len(samples), len(self.workers)) if b > a]
        refs = [worker.score.remote(samples[a:b]) for worker, (a, b) in zip(self.workers, chunks)]
        try:  # a dead worker raises ActorDied naming it, the phase and the rollout
            results = gather(refs, role="reward worker", phase="score", rollout_id=rollout_id, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"reward workers did not score {len(samples)} samples within {self.timeout_s}s"
            ) from None
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, RewardError):
                raise RewardError(f"{exc.cause} [{where('score', rollout_id)}]") from None
            raise
        totals: list[float] = []
        per_reward: dict[str, list[float]] = {name: [] for name, _ in self.spec}
        for (start, _), (chunk_totals, chunk_rewards, added) in zip(chunks, results):
            totals.extend(chunk_totals)
            for name, values in chunk_rewards.items():
                per_reward[name].extend(values)
            for sample, entries in zip(samples[start:], added):
                sample.extra.update(entries)
        return totals, per_reward

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
