"""Naming what failed: the role, rank, rollout and phase of a dead or failing Ray actor; and a cleanup that runs every
step even when some fail, without hiding the error that stopped the run."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, OutOfMemoryError, RayActorError, RayTaskError

logger = logging.getLogger(__name__)

# what says an actor's process is gone: killed or lost (`RayActorError`), or ended by Ray's memory monitor while it ran
# the task waited for (`OutOfMemoryError`; its later calls raise `RayActorError`)
ACTOR_GONE = (RayActorError, OutOfMemoryError)
PEER_DEATH_WINDOW_S = 10.0  # after a rank's error, how long `gather` waits for its peers to reveal a dead rank


def where(phase: str, rollout_id: int | None) -> str:
    return phase if rollout_id is None else f"{phase} of rollout {rollout_id}"


class ActorDied(RuntimeError):
    """A Ray actor of the run died; the message names its role, rank, phase and rollout."""

    def __init__(self, role: str, rank: int, phase: str, rollout_id: int | None, cause: BaseException) -> None:
        self.role, self.rank, self.phase, self.rollout_id = role, rank, phase, rollout_id
        super().__init__(f"{role} {rank} died during {where(phase, rollout_id)}: {type(cause).__name__}: {cause}")


class StartFailed(RuntimeError):
    """An actor's constructor raised (a flag, a model folder, a hook): it would raise again on any node, so it is
    not a death `--max-restarts` restarts. The message names the actor and ends with the constructor's error."""


def start_failure(exc: BaseException, who: str) -> StartFailed | None:
    """`StartFailed` naming `who` when `exc` says an actor died in its constructor, else None (a death: a killed
    process, a lost node). Ray keeps only the text of the constructor's error: its last line (the exception and
    message) is the one given; the whole traceback stays in `exc`, which the caller chains."""
    if not (isinstance(exc, RayActorError) and exc.actor_init_failed):
        return None
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return StartFailed(f"{who} failed to start (its constructor raised; not restarted): {lines[-1]}")


class EngineError(RuntimeError):
    """A rollout engine died or did not answer in time (`miles.ray.engine_group`); `index` is the engine's."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index


def gather(
    refs: Sequence[Any],
    *,
    role: str,
    phase: str,
    rollout_id: int | None = None,
    timeout: float | None = None,
    ranks: Sequence[int] | None = None,
) -> list:
    """`ray.get` of one ref per rank, taken as they finish, so the failure reported is the first one that happened
    (a dead rank's ref fails at once while its peers wait in a collective for it).

    A dead actor raises `ActorDied`; an exception raised inside an actor is re-raised with a note naming the actor.
    `role` reads as a prefix of the rank: "actor rank", "reward worker". `ranks`: each ref's rank where the refs are
    not every rank in order (default: its position).
    """
    rank_of = dict(zip(refs, range(len(refs)) if ranks is None else ranks, strict=True))
    results: dict = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = list(refs)
    while pending:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            raise GetTimeoutError(
                f"{role}s {sorted(rank_of[r] for r in pending)} did not finish {where(phase, rollout_id)} "
                f"within {timeout}s"
            )
        for ref in ready:
            rank = rank_of[ref]
            try:
                results[ref] = ray.get(ref)
            except ACTOR_GONE as exc:
                raise start_failure(exc, f"{role} {rank}") or ActorDied(role, rank, phase, rollout_id, exc) from exc
            except RayTaskError as exc:
                dead = dead_peer(pending, rank_of)
                if dead is not None:  # the peer's death is the cause; this rank's error (a collective) followed it
                    died = ActorDied(role, dead[0], phase, rollout_id, dead[1])
                    died.add_note(f"{role} {rank} failed after it: {str(exc).strip().splitlines()[-1]}")
                    raise died from dead[1]
                exc.add_note(f"raised by {role} {rank} during {where(phase, rollout_id)}")
                raise
    return [results[ref] for ref in refs]


def dead_peer(pending: list, rank_of: dict, window_s: float = PEER_DEATH_WINDOW_S) -> tuple[Any, Exception] | None:
    """The first of the `pending` refs that fails within `window_s` because its actor died: (rank, error), else None.
    A rank killed in a collective makes its peers raise (gloo: "Connection closed by peer") about when Ray reports the
    death itself, so the peer's error may come first: the dead rank, not the peer, is the one to name."""
    deadline = time.monotonic() + window_s
    while pending and (left := deadline - time.monotonic()) > 0:
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in ready:
            try:
                ray.get(ref)
            except ACTOR_GONE as exc:
                return rank_of[ref], exc
            except Exception:  # noqa: BLE001 - another peer's own error: keep looking for a death
                continue
    return None


def run_cleanup(steps: Sequence[tuple[str, Callable[[], Any]]]) -> None:
    """Run every step in order, whatever the others do.

    Called from a `finally` block: while an exception is already propagating, each failed step is logged and added
    to it as a note (the error that stopped the run stays the one reported); otherwise the first failure is raised
    once every step has run.
    """
    in_flight = sys.exc_info()[1]
    first: BaseException | None = None
    for name, step in steps:
        try:
            step()
        except Exception as exc:
            logger.error("cleanup: %s failed: %s: %s", name, type(exc).__name__, exc)
            if in_flight is not None:
                in_flight.add_note(f"cleanup: {name} also failed: {type(exc).__name__}: {exc}")
            first = first or exc
    if first is not None and in_flight is None:
        raise first
