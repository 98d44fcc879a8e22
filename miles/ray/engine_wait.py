"""Waiting for the rollout engines' answers: each engine's deadline (`Allowance`), restarted by its progress reports
where the allowance says so, the reports shown to the driver (`on_progress`) and logged while the wait is long, and a
late engine named with its last report."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError

from miles.arguments.engine import RolloutTimeout
from miles.rollout.micro_batches import EngineProgress
from miles.utils.failures import EngineError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Allowance:
    """How long one engine may take to answer: `first_s` from the start of the wait, then, when `after_report` is
    given, that many seconds from each new progress report (None: the first deadline holds). `source` names the flag
    that set it, for the error."""

    first_s: float
    source: str
    after_report: Callable[[EngineProgress], float] | None = None

    @staticmethod
    def fixed(seconds: float, source: str) -> Allowance:
        return Allowance(seconds, source)

    @staticmethod
    def resetting(seconds: float, source: str) -> Allowance:
        """`seconds` without a report: an engine still finishing an earlier call (a generation) keeps its turn."""
        return Allowance(seconds, source, lambda _report: seconds)

    @staticmethod
    def generate(timeout: RolloutTimeout, samples: int) -> Allowance:
        """--rollout-timeout for an engine given `samples`: per step (the first stretch, prompt encoding and the first
        step, as for one micro-batch of all of them), or one total."""
        if timeout.total_s is not None:
            return Allowance.fixed(timeout.total_s, timeout.describe())
        return Allowance(
            timeout.step_limit(samples), timeout.describe(), lambda report: timeout.step_limit(report.samples)
        )


class EngineWait:
    """One wait for an answer of each of several engines (`run`), polling their `progress` every `poll_s` seconds."""

    def __init__(
        self,
        engines: list[Any],
        what: str,
        allowances: dict[int, Allowance],
        *,
        poll_s: float = 1.0,
        log_every_s: float = 30.0,
        on_progress: Callable[[str], None] | None = None,
    ) -> None:
        self.engines, self.what, self.allowances = engines, what, allowances
        self.poll_s, self.log_every_s, self.on_progress = poll_s, log_every_s, on_progress
        self.started = time.monotonic()
        self.deadline = {index: self.started + a.first_s for index, a in allowances.items()}
        self.reports: dict[int, EngineProgress] = {}  # the last report seen of each engine
        self.heard: dict[int, float] = {}  # when that report was first seen (monotonic)

    def run(self, refs: dict[int, ray.ObjectRef], answer: Callable[[int, ray.ObjectRef], Any]) -> dict[int, Any]:
        """`answer(index, ref)` of every engine's ref, taken as they finish. A dead engine (`answer` raises
        `EngineError`) or one past its deadline raises at once, naming it (and its allowance and last report); another
        failure (raised by a live engine) is raised once every engine before it has answered, so the lowest failing
        engine is the one named, whichever finished first."""
        try:
            return self._run(dict(refs), answer)
        finally:
            if self.reports and self.on_progress is not None:
                self.on_progress("")  # the wait is over: the display goes back to what it showed before

    def _run(self, pending: dict[int, ray.ObjectRef], answer: Callable[[int, ray.ObjectRef], Any]) -> dict[int, Any]:
        out, failures = {}, {}
        next_poll, next_log = self.started + self.poll_s, self.started + self.log_every_s
        while pending:
            now = time.monotonic()
            wake = min(next_poll, *(self.deadline[i] for i in pending))
            ready, _ = ray.wait(list(pending.values()), num_returns=1, timeout=max(wake - now, 0.0))
            for index in sorted(i for i, ref in pending.items() if ref in ready):
                try:
                    out[index] = answer(index, pending.pop(index))
                except EngineError:
                    raise
                except Exception as exc:  # noqa: BLE001 - re-raised below, in engine order
                    failures[index] = exc
            if failures and min(failures) < min(pending, default=len(self.engines)):
                raise failures[min(failures)]
            now = time.monotonic()
            if pending and now >= next_poll:
                self._poll(pending, now)
                next_poll = now + self.poll_s
                if now >= next_log:
                    logger.info("%s: waited %.0fs; %s", self.what, now - self.started, self._status(pending, now))
                    next_log = now + self.log_every_s
            for index in pending:
                if time.monotonic() > self.deadline[index]:
                    raise EngineError(self._late(index, len(self.engines)), index)
        return out

    def _poll(self, pending: dict[int, Any], now: float) -> None:
        """Read each pending engine's progress; a new report restarts its deadline where its allowance says so."""
        if self.on_progress is None and all(self.allowances[i].after_report is None for i in pending):
            return  # nothing would read the reports (start-up: an engine answers nothing before its __init__ ends)
        asked = {index: self.engines[index].progress.remote() for index in pending}
        answered, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=self.poll_s)
        for index, ref in asked.items():
            if ref not in answered:  # a stuck engine says nothing
                continue
            try:
                report = ray.get(ref)
            except RayActorError:  # a dead engine's own call fails next
                continue
            previous = self.reports.get(index)
            if previous is None or report.ticks != previous.ticks:
                self.reports[index], self.heard[index] = report, now
                after = self.allowances[index].after_report
                if previous is not None and after is not None:
                    self.deadline[index] = now + after(report)
        if self.on_progress is not None and self.reports:
            done = sum(r.steps_done for r in self.reports.values())
            total = sum(r.steps_total for r in self.reports.values())
            self.on_progress(f"{self.what.split(' ')[0]} {done}/{total} steps" if total else self.what)

    def _status(self, pending: dict[int, Any], now: float) -> str:
        parts = []
        for index in pending:
            report = self.reports.get(index)
            if report is None:
                parts.append(f"engine {index}: no report yet")
            else:
                parts.append(f"engine {index}: {report.describe()}, last report {now - self.heard[index]:.0f}s ago")
        return "; ".join(parts)

    def _late(self, index: int, num_engines: int) -> str:
        now, allowance = time.monotonic(), self.allowances[index]
        report = self.reports.get(index)
        if report is None or allowance.after_report is None:
            seen = "" if report is None else f" (last report: {report.describe()})"
            return (
                f"rollout engine {index} of {num_engines} did not answer {self.what} within "
                f"{now - self.started:.1f}s{seen}; {allowance.source} sets the deadline"
            )
        return (
            f"rollout engine {index} of {num_engines} made no progress for {now - self.heard[index]:.1f}s during "
            f"{self.what} (last report: {report.describe()}; {allowance.after_report(report):g}s allowed by "
            f"{allowance.source}): it is stuck or far slower than the flag expects"
        )
