"""SIGTERM / SIGINT to the driver (a preempted job): the first signal stops the run at its next safe point (bounded by
--stop-grace-s), a second lets that stop go on, a third exits at once; the actors' deferral of a first SIGTERM; and
the exit codes a scheduler reads."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType, TracebackType
from typing import Any

from miles.utils.import_gc import in_ray_worker

logger = logging.getLogger(__name__)

EXIT_PREEMPTED = 75  # EX_TEMPFAIL (sysexits.h), for either signal: stopped cleanly; rerun with --load to resume
EXIT_FORCED = 143  # 128 + SIGTERM: a third signal, or a stop past --stop-grace-s, ended the run at once
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """The driver's SIGTERM / SIGINT handlers while a run is under way (installed on entering, the previous ones put
    back on leaving; only the main thread can install them, elsewhere this is inert).

    First signal: recorded (`requested`); the driver finishes the phase under way, saves and stops at its next safe
    point, within `grace_s` seconds (None: unbounded) or it exits with EXIT_FORCED. The handler raises nothing: an
    exception thrown into the main thread while Ray's C++ code waits in `ray.get` comes out as a SystemError from
    Ray's internals, not as itself. Second signal: logged, the stop goes on (schedulers and a signal to the whole
    process group send more than one; cutting the save short would lose it). Third: logs one line and
    `os._exit(EXIT_FORCED)`; no cleanup runs (Ray's processes end with the driver), and checkpoints stay safe because
    a save only becomes the latest once it is complete.
    """

    def __init__(self, grace_s: float | None = None) -> None:
        self.signal_name: str | None = None  # the first signal's name once one arrived
        self.abandoned: str | None = None  # what the driver gave up after the signal (a generated, untrained batch)
        self.grace_s, self.count = grace_s, 0
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}
        self._watchdog: threading.Timer | None = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        self.count += 1
        if self.count == 1:
            self.signal_name = name
            bound = "" if self.grace_s is None else f" (at most {self.grace_s:g}s, --stop-grace-s)"
            logger.warning(
                "%s: finishing the phase under way, then saving the last completed rollout and stopping%s; a third "
                "signal exits at once",
                name,
                bound,
            )
            if self.grace_s is not None:
                self._watchdog = threading.Timer(self.grace_s, self._expire)
                self._watchdog.daemon = True
                self._watchdog.start()
        elif self.count == 2:
            logger.warning(
                "%s again (after %s): the stop goes on, the save under way finishes (the latest checkpoint pointer "
                "moves only once it is complete); a third signal exits at once",
                name,
                self.signal_name,
            )
        else:
            exit_now(f"{name} a third time (after {self.signal_name}): exiting at once with code {EXIT_FORCED}")

    def _expire(self) -> None:
        grace = f"--stop-grace-s {self.grace_s:g}"
        exit_now(f"the stop on {self.signal_name} did not end within {grace}: exiting with code {EXIT_FORCED}")


def exit_now(reason: str) -> None:
    """Log `reason` and why the last checkpoint is safe, flush the log, and end the process with EXIT_FORCED."""
    logger.error("%s; the latest checkpoint pointer still names the last complete save", reason)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(EXIT_FORCED)


class DeferredSigterm:
    """An actor process's SIGTERM handler (`defer_first_sigterm`): the first is logged and ignored, the next go to
    `previous` (Ray's: the worker exits)."""

    def __init__(self, previous: object) -> None:
        self.previous, self.seen = previous, False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if not self.seen:
            self.seen = True
            logger.warning("SIGTERM: this actor keeps running until the driver ends it (the driver saves first)")
            return
        if callable(self.previous):
            self.previous(signum, frame)
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def defer_first_sigterm() -> None:
    """In a Ray actor's process (its main thread, e.g. its `__init__`; elsewhere nothing): a first SIGTERM is logged
    and ignored, so an actor signalled with the driver's whole job (a scheduler's preemption) lives on while the driver
    saves, then the driver ends it; a second SIGTERM exits as Ray's handler does. Once per process (a pooled actor is
    built again)."""
    if threading.current_thread() is not threading.main_thread() or not in_ray_worker():
        return
    previous = signal.getsignal(signal.SIGTERM)
    if not isinstance(previous, DeferredSigterm):
        signal.signal(signal.SIGTERM, DeferredSigterm(previous))


def ignore_late_signals() -> None:
    """Once a stopped run has ended (saved, Ray stopped): a signal that still comes changes nothing, so the process
    exits with EXIT_PREEMPTED rather than be killed by the signal's default action. Main thread only."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


@contextmanager
def keeping_signal_handlers() -> Iterator[None]:
    """Put the SIGTERM / SIGINT handlers back as they were before the block: `ray.init` replaces the driver's (with a
    Python handler that exits with code 15 and a C++ one that dumps a stack and aborts). Main thread only."""
    main = threading.current_thread() is threading.main_thread()
    before = {sig: signal.getsignal(sig) for sig in SIGNALS} if main else {}
    try:
        yield
    finally:
        for sig, handler in before.items():
            if handler is not None:  # None: set outside Python; nothing to put back
                signal.signal(sig, handler)


def stop_line(stop: StopSignals, completed: int, checkpoints: list[str], save_dir: str | None) -> str:
    """The one line a stopped run ends with: the signal, the last rollout completed (-1: none), what was given up,
    the checkpoint folders of `completed` (empty: none saved) and the exit code."""
    where = "before rollout 0 completed" if completed < 0 else f"after rollout {completed}"
    line = f"stopped on {stop.signal_name} {where}"
    if stop.abandoned is not None:
        line += f" ({stop.abandoned})"
    if checkpoints:
        line += f": checkpoint {', '.join(checkpoints)}"
        if save_dir:
            line += f"; resume with --load {save_dir}"
    elif completed >= 0 and not save_dir:
        line += ": nothing saved (no --save: pass --save DIR to make a run resumable)"
    else:
        line += ": nothing trained in this run, nothing saved"
    return f"{line}; exit code {EXIT_PREEMPTED}"
