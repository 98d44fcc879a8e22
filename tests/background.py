"""Long whole-run checks that run in a child process from the start of the session, while the rest of the suite runs.

A test marked `@pytest.mark.background(SCRIPT, JOB)` gets its numbers from `python SCRIPT JOB OUT_DIR`, started
once per session as soon as collection selects the test (the jobs one after another, on one thread), and waits for
it in the `background_job` fixture. The fast tier keeps about one of this machine's two cores busy (its ranks wait on
each other and on Ray), so the learning standards' ~5 minutes of runs mostly fill the other core instead of adding to
the suite's wall time. The job's results are the same numbers as in process: its runs are seeded and their thread
counts fixed (`--cpu-phase-threads auto` counts the node's cores, not how busy they are).

A job is a plain script: it writes what its tests check under OUT_DIR and exits 0; anything else fails its tests
with the end of its log. Jobs that outlive the session (an interrupted run) get SIGTERM, then SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CURRENT: Jobs | None = None  # the session's jobs (tests/conftest.py sets it once collection asked for one)


def job_folder(script: str, name: str, timeout: float = 1500.0) -> Path:
    """The folder of the session's job `name` of `script` (relative to the repository) once it exited 0; waits up
    to `timeout` s. A test that reads it carries `@pytest.mark.background(script, name)`, which starts the job."""
    if CURRENT is None:
        raise RuntimeError(
            f"no background jobs in this session: mark the test @pytest.mark.background({script!r}, {name!r})"
        )
    return CURRENT.result(str(ROOT / script), name, timeout)


@dataclass
class Job:
    script: str
    name: str
    out: Path
    started: float | None = None
    ended: float | None = None
    returncode: int | None = None
    process: subprocess.Popen | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def log(self) -> Path:
        return self.out / "job.log"

    def run(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray, not the session's
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        self.started = time.monotonic()
        try:
            with open(self.log, "w") as log:
                self.process = subprocess.Popen(
                    [sys.executable, self.script, self.name, str(self.out)],
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its Ray processes end with it, not with a signal to pytest's group
                )
                self.returncode = self.process.wait()
        finally:
            self.ended = time.monotonic()
            self.done.set()

    def stop(self, grace: float = 30.0) -> None:
        """End a job still running (the session ended first): SIGTERM to its process group, SIGKILL after `grace`."""
        if self.process is None or self.process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


class Jobs:
    """The session's background jobs, keyed by (script, name), run in the order they were asked for."""

    def __init__(self) -> None:
        self.jobs: dict[tuple[str, str], Job] = {}
        self.root = Path(tempfile.mkdtemp(prefix="miles-background-"))
        self.thread: threading.Thread | None = None

    def start(self, wanted: list[tuple[str, str]]) -> None:
        for script, name in wanted:
            if (script, name) not in self.jobs:
                out = self.root / f"{Path(script).stem}-{name}"
                out.mkdir(parents=True)
                self.jobs[(script, name)] = Job(script, name, out)
        pending = [job for job in self.jobs.values() if job.started is None]
        if pending:
            self.thread = threading.Thread(target=lambda: [job.run() for job in pending], daemon=True)
            self.thread.start()

    def result(self, script: str, name: str, timeout: float) -> Path:
        """The job's folder once it has exited 0 (waiting up to `timeout` s); raises naming its log otherwise."""
        job = self.jobs.get((script, name))
        if job is None:
            raise RuntimeError(f"background job {name} of {script} was never started (the marker's test not selected?)")
        if not job.done.wait(timeout):
            raise TimeoutError(f"background job {name} of {script} still running after {timeout:.0f} s; log {job.log}")
        if job.returncode != 0:
            tail = job.log.read_text()[-4000:] if job.log.exists() else ""
            raise RuntimeError(f"background job {name} of {script} exited with {job.returncode}:\n{tail}")
        return job.out

    def stop(self, grace: float = 30.0) -> None:
        for job in self.jobs.values():
            job.stop(grace)

    def summary(self) -> list[str]:
        lines = []
        for job in self.jobs.values():
            if job.started is not None and job.ended is not None:
                lines.append(
                    f"{Path(job.script).name} {job.name}: {job.ended - job.started:.0f} s, exit {job.returncode}"
                )
        return lines
