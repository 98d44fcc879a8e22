"""One owner per save folder: a second holder is refused naming the folder and the pid; the lock dies with its
process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from miles.utils.locks import LOCK_FILE, FolderLock, FolderLockedError, FolderLocks

HOLD = textwrap.dedent(
    """
    import sys, time
    from miles.utils.locks import FolderLock
    FolderLock(sys.argv[1], "--save")
    print("locked", flush=True)
    time.sleep(120)
    """
)


@pytest.fixture
def holder(tmp_path):
    """Another process holding `tmp_path/ckpt` (killed with SIGKILL at the end, like a crashed run)."""
    folder = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout.readline().strip() == "locked"
    yield folder, process
    process.kill()
    process.wait(timeout=10)


def test_a_second_owner_is_refused_naming_folder_and_pid(holder):
    folder, process = holder
    with pytest.raises(FolderLockedError, match=rf"--save {folder} is in use by another run \(pid {process.pid} "):
        FolderLock(str(folder), "--save")


def test_the_lock_dies_with_its_process(holder):
    folder, process = holder
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)
    lock = FolderLock(str(folder), "--save")  # no stale lock from the crashed run
    with open(folder / LOCK_FILE) as f:
        assert f.read().strip() == str(os.getpid())
    lock.release()


def test_a_run_takes_each_folder_once_and_releases_all(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    locks = FolderLocks([("--save", a), ("--critic-save", b), ("--critic-save", a)])  # a shared folder: one lock
    assert len(locks.locks) == 2
    with pytest.raises(FolderLockedError, match=f"--critic-save {b} is in use"):
        FolderLocks([("--save", str(tmp_path / "c")), ("--critic-save", b)])
    FolderLock(str(tmp_path / "c"), "--save").release()  # the failed run let go of what it had taken
    locks.release()
    FolderLocks([("--save", a), ("--critic-save", b)]).release()
