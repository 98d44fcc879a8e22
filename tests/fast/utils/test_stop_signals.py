"""The driver's stop signals, with real signals to this process: the first is recorded, a second lets the stop go on, a
third (or the end of --stop-grace-s) exits at once with EXIT_FORCED; Ray's start may not replace them; an actor lives
through a first SIGTERM; the stop line names what a stopped run left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from miles.utils.stop_signals import (
    EXIT_FORCED,
    EXIT_PREEMPTED,
    StopSignals,
    defer_first_sigterm,
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


def run_script(body: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    script = textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)


def test_a_second_signal_lets_the_stop_go_on_and_a_third_exits_at_once_with_exit_forced():
    done = run_script(
        """
        import os, signal, time
        from miles.utils.stop_signals import StopSignals
        with StopSignals() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)  # a scheduler's second signal, or one to the whole process group
            print("still saving", stop.signal_name, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # not reached: the third signal ends the process
        raise SystemExit(0)
        """
    )
    assert done.returncode == EXIT_FORCED, done.stderr
    assert done.stdout == "still saving SIGTERM\n"
    assert "SIGINT again (after SIGTERM): the stop goes on, the save under way finishes" in done.stderr
    assert f"SIGTERM a third time (after SIGTERM): exiting at once with code {EXIT_FORCED}" in done.stderr


def test_a_stop_that_outlasts_its_grace_period_exits_with_exit_forced():
    done = run_script(
        """
        import os, signal, time
        from miles.utils.stop_signals import StopSignals
        with StopSignals(grace_s=0.2):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # a save that never ends
        raise SystemExit(0)
        """
    )
    assert done.returncode == EXIT_FORCED, done.stderr
    assert (
        f"the stop on SIGTERM did not end within --stop-grace-s 0.2: exiting with code {EXIT_FORCED}; the latest "
        "checkpoint pointer still names the last complete save"
    ) in done.stderr


def test_a_stop_within_its_grace_period_ends_normally():
    done = run_script(
        """
        import os, signal, time
        from miles.utils.stop_signals import StopSignals
        with StopSignals(grace_s=0.1):
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.3)  # past the grace period, after the block: the watchdog is gone
        raise SystemExit(75)
        """
    )
    assert done.returncode == EXIT_PREEMPTED, done.stderr


class Deferring:
    def __init__(self) -> None:
        defer_first_sigterm()

    def pid(self) -> int:
        return os.getpid()


def test_an_actor_outlives_a_first_sigterm_and_ends_on_the_second(ray_cluster):
    import ray

    actor = ray.remote(num_cpus=0.01)(Deferring).remote()
    pid = ray.get(actor.pid.remote(), timeout=60)
    os.kill(pid, signal.SIGTERM)  # the whole job signalled: the driver still needs this actor for its save
    time.sleep(0.5)
    assert ray.get(actor.pid.remote(), timeout=60) == pid
    os.kill(pid, signal.SIGTERM)
    with pytest.raises(ray.exceptions.RayActorError):
        for _ in range(100):
            ray.get(actor.pid.remote(), timeout=60)
            time.sleep(0.1)


def test_defer_first_sigterm_does_nothing_outside_a_ray_worker():
    before = signal.getsignal(signal.SIGTERM)
    defer_first_sigterm()
    assert signal.getsignal(signal.SIGTERM) is before


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
