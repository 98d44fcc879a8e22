"""The driver's stop signals, with real signals to this process: the first is recorded, the second exits at once with
EXIT_FORCED; Ray's start may not replace them; the stop line names what a stopped run left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from miles.utils.stop_signals import (
    EXIT_FORCED,
    EXIT_PREEMPTED,
    StopSignals,
    keeping_signal_handlers,
    stop_line,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_first_signal_is_recorded_and_the_previous_handlers_come_back(sig):
    seen = []
    previous = signal.signal(sig, lambda signum, frame: seen.append(signum))
    try:
        with StopSignals() as stop:
            assert not stop.requested
            os.kill(os.getpid(), sig)  # handled here, in the main thread, before kill returns to the next line
            assert stop.requested and stop.signal_name == signal.Signals(sig).name
        os.kill(os.getpid(), sig)  # after the block: the handler from before it
        assert seen == [sig]
    finally:
        signal.signal(sig, previous)


def test_a_second_signal_exits_at_once_with_exit_forced():
    script = textwrap.dedent(
        """
        import os, signal, time
        from miles.utils.stop_signals import StopSignals
        with StopSignals():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)  # not reached: the second signal ends the process
        raise SystemExit(0)
        """
    )
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_FORCED, done.stderr
    assert f"SIGINT again (after SIGTERM): exiting at once with code {EXIT_FORCED}" in done.stderr


def test_handlers_replaced_inside_the_block_are_put_back():
    mine = lambda signum, frame: None  # noqa: E731
    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with keeping_signal_handlers():
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(15))  # what ray.init does in a driver
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_stop_line_names_the_signal_the_rollout_and_the_checkpoint():
    stop = StopSignals()
    stop.signal_name, stop.abandoned = "SIGTERM", "rollout 4 generated, not trained"
    assert stop_line(stop, 3, ["/c/iter_0000003"], "/c") == (
        f"stopped on SIGTERM after rollout 3 (rollout 4 generated, not trained): checkpoint /c/iter_0000003; "
        f"resume with --load /c; exit code {EXIT_PREEMPTED}"
    )
    stop.abandoned = None
    assert stop_line(stop, 3, [], None) == (
        "stopped on SIGTERM after rollout 3: nothing saved (no --save: pass --save DIR to make a run resumable); "
        f"exit code {EXIT_PREEMPTED}"
    )
    assert stop_line(stop, -1, [], "/c") == (
        f"stopped on SIGTERM before rollout 0 completed: nothing trained in this run, nothing saved; exit code "
        f"{EXIT_PREEMPTED}"
    )
