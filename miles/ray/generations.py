"""Where each rollout's batch comes from: generated when the driver asks, or with --async-rollout one rollout ahead,
and the staleness of an ahead batch against the trainer's weights."""

from __future__ import annotations

import argparse
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class Generations:
    """Each rollout's batch with its rollout metrics and generation seconds: generated when asked for, or with
    --async-rollout one rollout ahead on a worker thread, so that batch k+1 generates while batch k trains.

    Ahead, batch k+1 is asked of the engines right after batch k is in, before k trains: an engine runs its calls
    in order, so k+1 samples with the weights the engines hold then (those before update k), and the sync after
    update k reaches them after it. Staleness is at most one update; `staleness_metrics` records and checks it.
    """

    def __init__(self, args: argparse.Namespace, rollout_manager: Any) -> None:
        self.args, self.rollout_manager = args, rollout_manager
        self.ahead: dict[int, Future] = {}  # rollout id -> future of its generation
        self.executor = None
        if args.async_rollout:
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-rollout")

    def _generate(self, rollout_id: int) -> tuple[list, dict, float]:
        started = time.perf_counter()
        data = self.rollout_manager.generate(rollout_id)
        return data, self.rollout_manager.metrics(rollout_id), time.perf_counter() - started

    def get(self, rollout_id: int) -> tuple[list, dict, float]:
        """(one box per dp rank, the rollout's metrics, seconds its generation took); ahead, starts the next one, and
        the metrics end with the batch's staleness and the seconds waited for it (`staleness_metrics`)."""
        if self.executor is None:
            return self._generate(rollout_id)
        asked = time.perf_counter()
        future = self.ahead.pop(rollout_id, None) or self.executor.submit(self._generate, rollout_id)
        data, metrics, generate_s = future.result()
        waited = time.perf_counter() - asked
        if rollout_id + 1 < self.args.num_rollout:
            self.ahead[rollout_id + 1] = self.executor.submit(self._generate, rollout_id + 1)
        staleness = staleness_metrics(self.args, self.rollout_manager, rollout_id, metrics, waited)
        return data, {**metrics, **staleness}, generate_s

    def close(self) -> None:
        """Drop a generation not yet started; one under way ends with the engines (shut down after this)."""
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
        self.ahead.clear()


def staleness_metrics(
    args: argparse.Namespace, rollout_manager: Any, rollout_id: int, rollout_metrics: dict, wait_s: float
) -> dict:
    """--async-rollout: the trainer's weights version (the last one synced: its weights now) against the batch's,
    and the seconds the driver waited for the batch; a batch more than one update behind is an error."""
    if not args.async_rollout or "rollout/weights_version" not in rollout_metrics:
        return {}
    trainer = rollout_manager.weights_version
    staleness = trainer - rollout_metrics["rollout/weights_version"]
    if not 0 <= staleness <= 1:
        raise RuntimeError(
            f"rollout {rollout_id} was generated with weights version {rollout_metrics['rollout/weights_version']} "
            f"but the trainer holds version {trainer}: --async-rollout allows one update of staleness"
        )
    return {"rollout/staleness": staleness, "rollout/trainer_weights_version": trainer, "perf/generate_wait_s": wait_s}
