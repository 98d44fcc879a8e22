"""tests/background.py: a job runs its script with (name, folder), its folder comes back once it exits 0, and a job
that fails, hangs or was never asked for fails its test with a message naming it (and the end of its log)."""

from __future__ import annotations

import shutil

import pytest

from tests.background import Jobs

SCRIPT = """
import pathlib, sys, time
name, out = sys.argv[1], pathlib.Path(sys.argv[2])
if name == "ok":
    (out / "result.txt").write_text("done")
elif name == "slow":
    time.sleep(30)
else:
    print("something broke in", name)
    sys.exit(3)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return str(path)


def test_jobs_run_in_order_and_report_their_folder_or_their_failure(script):
    jobs = Jobs()
    try:
        jobs.start([(script, "ok"), (script, "broken")])
        assert (jobs.result(script, "ok", timeout=60) / "result.txt").read_text() == "done"
        with pytest.raises(RuntimeError, match=r"(?s)broken of .*exited with 3.*something broke in broken"):
            jobs.result(script, "broken", timeout=60)
        with pytest.raises(RuntimeError, match="never started"):
            jobs.result(script, "other", timeout=1)
        assert [line.split(":")[0] for line in jobs.summary()] == ["job.py ok", "job.py broken"]
    finally:
        jobs.stop()
        shutil.rmtree(jobs.root)


def test_a_job_still_running_times_out_and_is_stopped_with_the_session(script):
    jobs = Jobs()
    jobs.start([(script, "slow")])
    with pytest.raises(TimeoutError, match="slow of .* still running after 1 s"):
        jobs.result(script, "slow", timeout=1)
    jobs.stop(grace=5.0)
    job = jobs.jobs[(script, "slow")]
    assert job.done.wait(10) and job.returncode not in (0, None)
    shutil.rmtree(jobs.root)
