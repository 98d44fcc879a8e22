"""Preemption with real signals to a `python train_diffusion.py` process: SIGTERM stops after a rollout, saves it and
exits with EXIT_PREEMPTED; a second signal exits at once with EXIT_FORCED and the last complete checkpoint still
resumes; the pieces of the interrupted runs plus the resumed run give an uninterrupted run's series bit for bit."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import train_diffusion
from miles.backends.fsdp_utils.checkpoint import META_FILE, checkpoint_dir, read_latest
from miles.utils.arguments import parse_args
from miles.utils.stop_signals import EXIT_FORCED, EXIT_PREEMPTED
from miles.utils.tracking import read_metrics, scalar_points
from tests.e2e.test_golden import COMMON, RUNS, series

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "fast", "utils"))
from tracker_readers import read_tensorboard  # noqa: E402

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
NUM_ROLLOUT = 5
FLAGS = [*COMMON, *RUNS["nft"], "--num-rollout", str(NUM_ROLLOUT)]  # nft saves EMA and old-policy shadows too
STOP_LINE = re.compile(r"stopped on SIGTERM after rollout (\d+)(?: \(rollout \d+ generated, not trained\))?: "
                       r"checkpoint (\S+); resume with --load (\S+); exit code (\d+)$", re.M)  # fmt: skip


def rollout_records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [r for r in read_metrics(path) if "perf/generate_total_s" in r] if path.exists() else []


def start_driver(out: Path, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray, not the test session's
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    command = [sys.executable, str(ROOT / "train_diffusion.py"), *FLAGS, "--output-dir", str(out), *extra]
    return subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)


def wait_for(condition, driver: subprocess.Popen, what: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if driver.poll() is not None:
            pytest.fail(f"the driver ended (code {driver.returncode}) before {what}:\n{driver.stderr.read()[-4000:]}")
        if time.monotonic() > deadline:
            driver.kill()
            pytest.fail(f"no {what} within {timeout}s")
        time.sleep(0.005)


def finish(driver: subprocess.Popen) -> str:
    try:
        return driver.communicate(timeout=120)[1]
    except subprocess.TimeoutExpired:
        driver.kill()
        raise


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("preempt")
    return {name: tmp / name for name in ("ckpt", "stopped", "forced", "resumed", "reference")}


@pytest.fixture(scope="module")
def stopped(folders):
    """Run 1: one SIGTERM once rollout 0 is recorded, timed to land in rollout 1's training (its generation took
    `generate` s of the ~`generate + train` of rollout 0), which then runs to its end; no --save-interval, so the
    checkpoint is the signal's own save."""
    out, ckpt = folders["stopped"], folders["ckpt"]
    driver = start_driver(out, "--save", str(ckpt), "--use-tensorboard")
    wait_for(lambda: rollout_records(out), driver, "rollout 0's record in metrics.jsonl")
    first = rollout_records(out)[0]
    time.sleep(first["perf/generate_total_s"] + 0.25 * first["perf/train_s"])
    driver.send_signal(signal.SIGTERM)
    return {"stderr": finish(driver), "driver": driver}


def test_sigterm_finishes_the_rollout_saves_it_and_exits_with_exit_preempted(stopped, folders):
    assert stopped["driver"].returncode == EXIT_PREEMPTED, stopped["stderr"][-4000:]
    lines = STOP_LINE.findall(stopped["stderr"])
    assert len(lines) == 1, stopped["stderr"][-4000:]
    rollout, checkpoint, load, code = lines[0]
    last = int(rollout)
    assert last < NUM_ROLLOUT - 1  # stopped early
    assert checkpoint == os.path.join(str(folders["ckpt"]), f"iter_{last:07d}") and load == str(folders["ckpt"])
    assert int(code) == EXIT_PREEMPTED
    assert read_latest(str(folders["ckpt"])) == last
    assert os.path.isfile(os.path.join(checkpoint_dir(str(folders["ckpt"]), last, "actor"), META_FILE))
    # the metrics end with the last completed rollout: nothing of an abandoned or later one
    records = read_metrics(folders["stopped"] / "metrics.jsonl")
    assert {r["rollout_id"] for r in records} == set(range(last + 1))
    # TensorBoard closed: its event file holds every scalar of metrics.jsonl
    expected = {(tag, x): value for r in records for tag, _, x, value in scalar_points(r)}
    scalars, _ = read_tensorboard(str(folders["stopped"] / "tensorboard"))
    assert {(tag, step) for tag, steps in scalars.items() for step in steps} == set(expected)


@pytest.fixture(scope="module")
def forced(stopped, folders):
    """Run 2: resumes from run 1's checkpoint; once its first rollout is recorded, one SIGTERM, and a second as soon
    as the save that the first started has created its folder (so it lands inside that save)."""
    out, ckpt = folders["forced"], folders["ckpt"]
    before = read_latest(str(ckpt))
    driver = start_driver(out, "--save", str(ckpt), "--load", str(ckpt))
    wait_for(lambda: rollout_records(out), driver, "the resumed run's first rollout record")
    driver.send_signal(signal.SIGTERM)
    started_save = lambda: any(int(p.name[5:]) > before for p in ckpt.glob("iter_*"))  # noqa: E731
    wait_for(started_save, driver, "the stop signal's save to start")
    driver.send_signal(signal.SIGTERM)
    stderr = finish(driver)
    return {"driver": driver, "stderr": stderr, "before": before, "first": rollout_records(out)[0]["rollout_id"]}


def test_a_second_signal_exits_at_once_and_the_last_complete_checkpoint_stays_the_latest(forced, folders):
    assert forced["first"] == forced["before"] + 1  # run 2 resumed from run 1's checkpoint
    assert forced["driver"].returncode == EXIT_FORCED, forced["stderr"][-4000:]
    assert "SIGTERM again (after SIGTERM): exiting at once with code 143" in forced["stderr"]
    assert not STOP_LINE.search(forced["stderr"])  # no cleanup, no stop line: it ended inside the save
    latest = read_latest(str(folders["ckpt"]))
    assert os.path.isfile(os.path.join(checkpoint_dir(str(folders["ckpt"]), latest, "actor"), META_FILE))


@pytest.fixture(scope="module")
def resumed(forced, folders, ray_cluster):
    """Run 3, in-process: resumes from whatever the latest pointer names after run 2, to the end."""
    latest = read_latest(str(folders["ckpt"]))
    ckpt = str(folders["ckpt"])
    train_diffusion.run(parse_args([*FLAGS, "--output-dir", str(folders["resumed"]), "--load", ckpt, "--save", ckpt]))
    return latest


def test_the_interrupted_runs_and_the_resumed_run_give_the_uninterrupted_series(stopped, forced, resumed, folders):
    train_diffusion.run(parse_args([*FLAGS, "--output-dir", str(folders["reference"])]))
    reference = series(folders["reference"] / "metrics.jsonl")
    first_stop = int(STOP_LINE.findall(stopped["stderr"])[0][0])  # run 1's checkpoint, where run 2 resumed
    pieces = [
        (series(folders["stopped"] / "metrics.jsonl"), range(0, first_stop + 1)),
        (series(folders["forced"] / "metrics.jsonl"), range(first_stop + 1, resumed + 1)),
        (series(folders["resumed"] / "metrics.jsonl"), range(resumed + 1, NUM_ROLLOUT)),
    ]
    joined = [record for records, rollouts in pieces for record in records if record["rollout_id"] in rollouts]
    assert [r["rollout_id"] for r in reference] == [r["rollout_id"] for r in joined]
    for got, want in zip(joined, reference):
        assert got == want, json.dumps({"got": got, "want": want})[:4000]
