"""Reward-server processes for tests: started on a free loopback port, always killed."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
FAKE_SERVERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_reward_servers.py")


@contextlib.contextmanager
def server_process(
    argv: Sequence[str], env: dict[str, str] | None = None, timeout: float = 60.0
) -> Iterator[tuple[subprocess.Popen, str]]:
    """(process, http://127.0.0.1:PORT) of `python *argv READY_FILE-flag`: argv must end with the flag that takes
    the ready file (`--ready-file` or the fake servers' positional)."""
    with tempfile.TemporaryDirectory() as tmp:
        ready, log = os.path.join(tmp, "port"), open(os.path.join(tmp, "log"), "w+")
        process = subprocess.Popen(
            [sys.executable, *argv, ready],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + timeout
            while not os.path.exists(ready):
                if process.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"server {argv} did not start (exit {process.poll()}): {log.read()[-2000:]}")
                time.sleep(0.05)
            with open(ready) as f:
                yield process, f"http://127.0.0.1:{int(f.read())}"
        finally:
            process.kill()
            process.wait(timeout=30)
            log.close()


def reward_server(*flags: str, env: dict[str, str] | None = None):
    """`python -m miles.reward_server FLAGS --port 0` (see server_process)."""
    return server_process(["-m", "miles.reward_server", *flags, "--port", "0", "--ready-file"], env=env)


def fake_servers():
    return server_process([FAKE_SERVERS])
