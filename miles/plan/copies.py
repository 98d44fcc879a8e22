"""Forked copies of a simulated trainer rank right after its start-up, so that a re-plan that changes only the
micro-batch runs its window from that state instead of simulating the start-up again (a real-size start-up is a
third of a re-plan: the sharded load, `fully_shard`, the shadows and the optimizer on fake tensors).

The start-up does not read the micro-batch (the train loop reads it from the role's settings in each window), so
the state a copy holds is the one a new start-up would build; every other flag must be the same (`StartedRank.fits`).
A copy is a process forked inside the rank's simulation (its fake process group, fake mode and tracker entered); each
request forks it once more, so every window starts from the same state, and the plan comes back through a pipe."""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

# the flags a copy's window may change: the trainer's micro-batch and its roles' own (not the engines')
_WINDOW_ONLY = "micro_batch_size"
_ENGINE_ONLY = "rollout_micro_batch_size"

_COPIES: list[StartedRank] | None = None  # while `started_ranks` is entered: the copies made so far
_OWNER: int | None = None  # the process that entered it (a rank simulated in a forked child keeps no copy)


class StartedRank:
    """A forked copy of one trainer rank after its start-up, waiting for windows to run (`window`)."""

    def __init__(self, role: str, rank: int, args: argparse.Namespace, run: Callable[[dict[str, Any]], Any]) -> None:
        self.role, self.rank, self.args = role, rank, argparse.Namespace(**vars(args))
        context = multiprocessing.get_context("fork")
        self._conn, child = context.Pipe(duplex=True)
        self._process = context.Process(target=_serve, args=(child, run), daemon=True)
        self._process.start()
        child.close()

    def fits(self, role: str, rank: int, args: argparse.Namespace) -> dict[str, Any] | None:
        """The micro-batch values to run `args`' window of `role` rank `rank` from this copy, or None when another
        flag differs (or the copy is of another rank)."""
        if (role, rank) != (self.role, self.rank):
            return None
        mine, theirs = vars(self.args), vars(args)
        if mine.keys() != theirs.keys():
            return None
        changed = {key: theirs[key] for key in theirs if theirs[key] != mine[key]}
        if any(not key.endswith(_WINDOW_ONLY) or key.endswith(_ENGINE_ONLY) for key in changed):
            return None
        return changed

    def window(self, changed: dict[str, Any]) -> Any:
        """What the copy's `run` returns for the window with `changed` flags (its exception re-raised)."""
        self._conn.send(changed)
        result = self._conn.recv()
        if isinstance(result, BaseException):
            raise result
        return result

    def close(self) -> None:
        with contextlib.suppress(OSError, EOFError):
            self._conn.send(None)
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.terminate()
        self._conn.close()


def _serve(conn: Any, run: Callable[[dict[str, Any]], Any]) -> None:
    """The copy: for each request, a child forked from the start-up state runs it and sends what it returns."""
    while True:
        try:
            changed = conn.recv()
        except EOFError:
            break
        if changed is None:
            break
        pid = os.fork()
        if pid == 0:
            try:
                result = run(changed)
            except BaseException as exc:  # noqa: BLE001 - handed to the parent, which raises it
                result = RuntimeError(f"re-planning a window from the start-up copy: {type(exc).__name__}: {exc}")
            conn.send(result)
            os._exit(0)
        os.waitpid(pid, 0)
    conn.close()
    os._exit(0)


@contextlib.contextmanager
def started_ranks() -> Iterator[None]:
    """Copies of simulated ranks after their start-up may be kept (`keep_copy`) and used (`find_copy`) inside; all
    are ended on exit."""
    global _COPIES, _OWNER
    outer, _COPIES, _OWNER = (_COPIES, _OWNER), [], os.getpid()
    try:
        yield
    finally:
        copies = _COPIES
        _COPIES, _OWNER = outer
        for copy in copies:
            copy.close()


def find_copy(role: str, rank: int, args: argparse.Namespace) -> tuple[StartedRank, dict[str, Any]] | None:
    """A kept copy that can run this rank's window under `args`, and the flags that change; None if there is none."""
    for copy in _COPIES or []:
        changed = copy.fits(role, rank, args)
        if changed is not None:
            return copy, changed
    return None


def keep_copy(role: str, rank: int, args: argparse.Namespace, run: Callable[[dict[str, Any]], Any]) -> None:
    """Fork a copy of the calling simulation now (right after its start-up), when copies are kept, none of this
    rank under these flags exists, and no other thread runs (a fork copies the locks other threads hold)."""
    if _COPIES is None or _OWNER != os.getpid() or threading.active_count() != 1:
        return
    if find_copy(role, rank, args) is not None:
        return
    _COPIES.append(StartedRank(role, rank, args, run))
