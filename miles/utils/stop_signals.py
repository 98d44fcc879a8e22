"""SIGTERM / SIGINT to the driver (a preempted job): the first signal stops the run at its next safe point, a second
exits at once; and the exit codes a scheduler reads."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType, TracebackType

logger = logging.getLogger(__name__)

EXIT_PREEMPTED = 75  # EX_TEMPFAIL (sysexits.h), for either signal: stopped cleanly; rerun with --load to resume
EXIT_FORCED = 143  # 128 + SIGTERM, for either signal: a second signal ended the run at once, nothing more saved
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """The driver's SIGTERM / SIGINT handlers while a run is under way (installed on entering, the previous ones put
    back on leaving; only the main thread can install them, elsewhere this is inert).

    First signal: recorded (`requested`); the driver finishes the phase under way and stops at its next safe point.
    The handler raises nothing: an exception thrown into the main thread while Ray's C++ code waits in `ray.get`
    comes out as a SystemError from Ray's internals, not as itself. Second signal: logs one line and
    `os._exit(EXIT_FORCED)`; no cleanup runs (Ray's processes end with the driver), and checkpoints stay safe
    because a save only becomes the latest once it is complete.
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None  # the first signal's name once one arrived
        self.abandoned: str | None = None  # what the driver gave up after the signal (a generated, untrained batch)
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            logger.error(
                "%s again (after %s): exiting at once with code %d; the latest checkpoint pointer still names the last "
                "complete save",
                name,
                self.signal_name,
                EXIT_FORCED,
            )
            for handler in logging.getLogger().handlers:
                handler.flush()
            sys.stderr.flush()
            os._exit(EXIT_FORCED)
        self.signal_name = name
        logger.warning(
            "%s: finishing the phase under way, then saving the last completed rollout and stopping; send it again "
            "to exit at once",
            name,
        )


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
