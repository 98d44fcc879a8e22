"""--max-restarts: when an actor of the run dies (its process killed, its node lost) or a rollout engine stops
answering, the driver tears the groups down, waits for the cluster to hold the run's resources again, starts them
afresh and resumes from the latest checkpoint in the save folders: the path `--load` takes. At most N times.

What restarts: `ActorDied` (a trainer rank or a reward worker) and `EngineError` (an engine died or timed out).
What does not: an exception raised by code inside a live actor (a bug, a damaged checkpoint, a corrupted weight
sync), or by an actor's constructor (`StartFailed`: a flag the engine refuses, a model folder it cannot load), which
would fail again the same way.
"""

from __future__ import annotations

import argparse
import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import ray

from miles.algorithms import role_dest, role_flag, training_order
from miles.backends.fsdp_utils.checkpoint import read_latest
from miles.ray.checkpoint_folders import save_folders
from miles.ray.cluster import ClusterFlags, actor_cpus, actor_gpus
from miles.utils.failures import ActorDied, EngineError, run_cleanup
from miles.utils.stop_signals import StopSignals
from miles.utils.tracking import RESTART_KEY, Tracking

if TYPE_CHECKING:
    from miles.ray.groups import RunGroups

logger = logging.getLogger(__name__)

RESTARTABLE = (ActorDied, EngineError)
WAIT_LOG_S = 30.0  # how often the wait for resources says what it still misses
T = TypeVar("T")


@dataclass
class Failure:
    """What died: `who` reads like "actor rank 1", `node` is its IP (or "unknown node")."""

    who: str
    node: str
    message: str


def describe(exc: ActorDied | EngineError, placement: dict[str, list[dict[str, Any]]]) -> Failure:
    """The dead actor's role, rank and node, from the error and the run's placement (`RunGroups.placement`)."""
    if isinstance(exc, ActorDied):
        who, index = f"{exc.role} {exc.rank}", exc.rank
        key = "reward_workers" if exc.role == "reward worker" else exc.role.removesuffix(" rank")
    else:
        who, index, key = f"rollout engine {exc.index}", exc.index, "engines"
    entries = placement.get(key, [])
    node = entries[index]["ip"] if index < len(entries) else "unknown node"
    return Failure(who, node, str(exc).splitlines()[0])


def needed_resources(args: argparse.Namespace) -> dict[str, float]:
    """The CPUs and GPUs the run's actors ask Ray for (trainer ranks, engines, reward workers)."""
    flags = ClusterFlags.from_args(args)
    return {"CPU": actor_cpus(flags), "GPU": actor_gpus(flags)}


def missing_resources(target: dict[str, float]) -> dict[str, float]:
    """What the cluster's live nodes lack of `target` (empty: nothing)."""
    total = ray.cluster_resources()
    return {name: need - total.get(name, 0.0) for name, need in target.items() if total.get(name, 0.0) < need - 1e-9}


def wait_for_resources(target: dict[str, float], timeout_s: float, poll_s: float = 1.0) -> float:
    """Wait until the cluster holds `target` again (a lost node back, or a replacement); seconds waited. Raises
    TimeoutError naming what is missing after `timeout_s`."""
    started = last_log = time.monotonic()
    while missing := missing_resources(target):
        waited = time.monotonic() - started
        if waited >= timeout_s:
            raise TimeoutError(f"the cluster still lacks {fmt(missing)} after {timeout_s:.0f}s (--restart-timeout)")
        if time.monotonic() - last_log >= WAIT_LOG_S:
            logger.warning("restart: waiting for %s (%.0fs of --restart-timeout %.0f)", fmt(missing), waited, timeout_s)
            last_log = time.monotonic()
        time.sleep(poll_s)
    return time.monotonic() - started


def smaller_run(args: argparse.Namespace) -> tuple[argparse.Namespace | None, str]:
    """--restart-min-dp-size: the run's flags at the largest --dp-size from the floor up, below its own, whose actors
    the cluster holds now, that divides --global-batch-size and keeps --fsdp-shard-size, and (on CUDA) whose plan fits;
    None and why when there is none."""
    from miles.plan.startup import check_plan  # the planner's modules, only for a run that shrinks

    floor, total = args.restart_min_dp_size, ray.cluster_resources()
    if floor is None:
        return None, "--restart-min-dp-size not given"
    for dp in range(args.dp_size - 1, floor - 1, -1):
        smaller = copy.copy(args)
        smaller.dp_size = dp
        if args.global_batch_size % dp or (args.fsdp_shard_size and dp % args.fsdp_shard_size):
            continue
        if any(total.get(name, 0.0) < need - 1e-9 for name, need in needed_resources(smaller).items()):
            continue
        try:
            check_plan(smaller)  # on CUDA: fewer ranks hold more of the weights each
        except Exception as exc:  # noqa: BLE001 - a smaller run that does not fit is no way on: its reason is told
            return None, f"--dp-size {dp} fits the cluster but not the GPUs ({str(exc).splitlines()[0]})"
        return smaller, ""
    return None, f"no --dp-size from --restart-min-dp-size {floor} to {args.dp_size - 1} fits it"


def restart_target(args: argparse.Namespace) -> dict[str, float]:
    """What a restart waits for: the run's CPUs and GPUs, or as many as the cluster holds now if that is less."""
    total = ray.cluster_resources()
    return {name: min(need, total.get(name, 0.0)) for name, need in needed_resources(args).items()}


def fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in resources.items())


def resume_args(args: argparse.Namespace) -> tuple[argparse.Namespace, int | None]:
    """The run's flags with every role loading from its save folder, and the rollout they resume after; the flags
    as given (and None) when no save folder holds a checkpoint yet."""
    folders = save_folders(args, training_order(args))
    latest = [rollout for folder in folders.values() if (rollout := read_latest(folder)) is not None]
    if not folders or len(latest) < len(folders):
        return args, None
    resumed = copy.copy(args)
    for role, folder in folders.items():
        setattr(resumed, role_dest(role, "load"), folder)
    return resumed, min(latest)


def resume_hint(args: argparse.Namespace) -> str:
    """Where a rerun resumes: the latest checkpoint in the save folders (the `--load` flags to pass), or why there
    is none."""
    folders = save_folders(args, training_order(args))
    if not folders:
        return "nothing to resume from (no --save)"
    latest = [rollout for folder in folders.values() if (rollout := read_latest(folder)) is not None]
    if len(latest) < len(folders):
        return f"no checkpoint in {', '.join(dict.fromkeys(folders.values()))} yet: rerun the command to start over"
    flags = " ".join(f"{role_flag(role, 'load')} {folder}" for role, folder in folders.items())
    return f"the latest checkpoint is rollout {min(latest)}: rerun the command with {flags} to resume from it"


class Restarts:
    """The run's attempts: the restart budget, the current attempt's flags (`args`: `--load` at the save folders
    once it restarted) and groups (`groups`, a `RunGroups` the driver launches). The driver calls `start_attempt`
    once the groups started, `recover` when an attempt failed; `attempts` runs them in turn."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.given = args, args
        self.groups: RunGroups | None = None
        self.count, self.first_rollout = 0, 0
        self.target = restart_target(args)

    def attempts(
        self, attempt: Callable[[float], T], writer: Tracking, summary: dict, stop: StopSignals, started: float
    ) -> T:
        """`attempt(started)` (the groups started and trained); when an actor dies, again from the latest checkpoint
        while --max-restarts allows, `started` then the restart's time (its perf/startup_s counts from there)."""
        while True:
            try:
                return attempt(started)
            except RESTARTABLE as exc:
                if stop.requested or not self.can_restart(exc):
                    self.give_up(exc, summary, stop.requested)  # the lost actor, why, the checkpoint to resume
                    raise
                writer.log(self.recover(exc, summary))
                started = time.perf_counter()

    def can_restart(self, exc: BaseException) -> bool:
        return isinstance(exc, RESTARTABLE) and self.count < self.given.max_restarts

    def start_attempt(self, first_rollout: int) -> None:
        self.first_rollout = first_rollout

    def in_flight(self, summary: dict) -> int:
        """The rollout the current attempt was in: one past the last it completed."""
        completed = [r["rollout_id"] for r in summary.get("rollouts", []) if r["rollout_id"] >= self.first_rollout]
        return max(completed, default=self.first_rollout - 1) + 1

    def give_up(self, exc: ActorDied | EngineError, summary: dict, stopping: bool = False) -> str:
        """The run ends with `exc` (not restarted): one line, logged and added to `exc` as a note, naming the lost
        actor, why it is not restarted (the budget spent, a stop signal) and the checkpoint to resume from."""
        failure = describe(exc, self.groups.placement if self.groups is not None else {})
        budget = self.given.max_restarts
        if stopping:
            why = "not restarted after a stop signal"
        elif budget == 0:
            why = "not restarted (--max-restarts 0)"
        else:
            why = f"restart budget ({budget}) spent (--max-restarts {budget}, {self.count} restart(s) done)"
        where = f"{failure.who} on {failure.node} lost in rollout {self.in_flight(summary)}"
        line = f"{where}: {why}; {resume_hint(self.given)}"
        logger.error(line)
        exc.add_note(line)
        return line

    def recover(self, exc: ActorDied | EngineError, summary: dict) -> dict[str, Any]:
        """Tear the failed attempt's groups down, wait for the resources, point the next attempt at the latest
        checkpoint and drop the redone rollouts from `summary`; returns the restart's metrics record. Raises the
        original error when the wait times out."""
        failure = describe(exc, self.groups.placement if self.groups is not None else {})
        in_flight = self.in_flight(summary)
        self.count += 1
        logger.error(
            "restart %d of --max-restarts %d: %s on %s failed in rollout %d: %s",
            self.count, self.given.max_restarts, failure.who, failure.node, in_flight, failure.message,
        )  # fmt: skip
        if self.groups is not None:
            groups, self.groups = self.groups, None
            run_cleanup(groups.shutdown_steps())
        try:
            waited = wait_for_resources(self.target, self.given.restart_timeout)
        except TimeoutError as timeout:
            waited = self.shrink(exc, timeout)
        self.args, saved = resume_args(self.given)
        resume_at = 0 if saved is None else saved + 1
        lost = list(range(resume_at, in_flight + 1))
        logger.error(
            "restart %d: resuming at rollout %d from %s; redone (not saved): rollouts %s",
            self.count, resume_at, self.args.load if saved is not None else "the start (nothing saved yet)",
            ", ".join(map(str, lost)),
        )  # fmt: skip
        summary["rollouts"] = [r for r in summary.get("rollouts", []) if r["rollout_id"] < resume_at]
        summary["losses"] = [loss for r in summary["rollouts"] for loss in r["_actor_losses"]]
        return {"rollout_id": resume_at, RESTART_KEY: self.count, "restart/lost_rollouts": len(lost),
                "restart/failed_rollout": in_flight, "restart/wait_s": waited,
                "restart/dp_size": self.given.dp_size}  # fmt: skip

    def shrink(self, exc: ActorDied | EngineError, timeout: TimeoutError) -> float:
        """The resources did not come back: go on at a smaller --dp-size (`smaller_run`), or raise `exc` noting why
        not. Returns the seconds waited."""
        smaller, why = smaller_run(self.given)
        if smaller is None:
            exc.add_note(f"not restarted: {timeout}" + ("" if self.given.restart_min_dp_size is None else f"; {why}"))
            raise exc from None
        logger.error(
            "restart %d: %s; going on at --dp-size %d instead of %d (--restart-min-dp-size %d): the checkpoint loads "
            "resharded",
            self.count, timeout, smaller.dp_size, self.given.dp_size, self.given.restart_min_dp_size,
        )  # fmt: skip
        self.given, self.target = smaller, restart_target(smaller)
        return self.given.restart_timeout
