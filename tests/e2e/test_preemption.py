"""Preemption with real signals to a `python train_diffusion.py` process: SIGTERM stops after a rollout, saves it and
exits with EXIT_PREEMPTED; a second signal exits at once with EXIT_FORCED and the last complete checkpoint still
resumes; the pieces of the interrupted runs plus the resumed run give an uninterrupted run's series bit for bit.
Runs 1 and 2 (the signalled drivers) are this file's background job `signals`, started with the session
(tests/background.py); run 3 and the reference run are in process, in the session's Ray cluster."""

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
NUM_ROLLOUT = 4
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


JOB = ("tests/e2e/test_preemption.py", "signals")  # runs 1 and 2 (their own drivers), from the session's start
NAMES = ("ckpt", "stopped", "forced", "resumed", "reference")


def run_stopped(folders: dict[str, Path]) -> dict:
    """Run 1: one SIGTERM as soon as rollout 0 is recorded: it lands in rollout 1's generation, whose batch is then
    dropped (on a machine slow enough to miss that, in rollout 1's training, which runs to its end); no
    --save-interval, so the checkpoint is the signal's own save."""
    out, ckpt = folders["stopped"], folders["ckpt"]
    driver = start_driver(out, "--save", str(ckpt), "--use-tensorboard")
    wait_for(lambda: rollout_records(out), driver, "rollout 0's record in metrics.jsonl")
    driver.send_signal(signal.SIGTERM)
    stderr = finish(driver)
    lines = STOP_LINE.findall(stderr)
    return {
        "returncode": driver.returncode,
        "stderr": stderr,
        "lines": lines,
        "last": int(lines[0][0]) if lines else None,
    }


def run_forced(folders: dict[str, Path]) -> dict:
    """Run 2: resumes from run 1's checkpoint; one SIGTERM once its first rollout is recorded (so the stop saves
    that rollout), and a second as soon as that save has created its folder (so it lands inside the save)."""
    out, ckpt = folders["forced"], folders["ckpt"]
    before = read_latest(str(ckpt))
    driver = start_driver(out, "--save", str(ckpt), "--load", str(ckpt))
    wait_for(lambda: rollout_records(out), driver, "the resumed run's first rollout record")
    driver.send_signal(signal.SIGTERM)
    save_started = lambda: any(int(p.name[len("iter_") :]) > before for p in ckpt.glob("iter_*"))  # noqa: E731
    wait_for(save_started, driver, "the stop signal's save to start")
    driver.send_signal(signal.SIGTERM)
    stderr = finish(driver)
    return {"returncode": driver.returncode, "stderr": stderr, "before": before}


@pytest.fixture(scope="module")
def folders() -> dict[str, Path]:
    from tests.background import job_folder

    root = job_folder(*JOB)
    return {name: root / name for name in NAMES}


@pytest.fixture(scope="module")
def stopped(folders):
    return json.loads((folders["ckpt"].parent / "stopped.json").read_text())


@pytest.mark.background(*JOB)
def test_sigterm_stops_after_a_rollout_saves_it_and_exits_with_exit_preempted(stopped, folders):
    assert stopped["returncode"] == EXIT_PREEMPTED, stopped["stderr"][-4000:]
    assert len(stopped["lines"]) == 1, stopped["stderr"][-4000:]
    last, checkpoint, load, code = stopped["last"], *stopped["lines"][0][1:]
    assert last < NUM_ROLLOUT - 2  # stopped early, with room for run 2
    assert checkpoint == os.path.join(str(folders["ckpt"]), f"iter_{last:07d}") and load == str(folders["ckpt"])
    assert int(code) == EXIT_PREEMPTED
    assert read_latest(str(folders["ckpt"])) == last
    assert os.path.isfile(os.path.join(checkpoint_dir(str(folders["ckpt"]), last, "actor"), META_FILE))
    # the metrics end with the last completed rollout: nothing of an abandoned one
    records = read_metrics(folders["stopped"] / "metrics.jsonl")
    assert {r["rollout_id"] for r in records} == set(range(last + 1))
    # TensorBoard closed: its event file holds every scalar of metrics.jsonl
    expected = {(tag, x) for r in records for tag, _, x, _ in scalar_points(r)}
    scalars, _ = read_tensorboard(str(folders["stopped"] / "tensorboard"))
    assert {(tag, step) for tag, steps in scalars.items() for step in steps} == expected


@pytest.fixture(scope="module")
def forced(stopped, folders):
    return json.loads((folders["ckpt"].parent / "forced.json").read_text())


@pytest.mark.background(*JOB)
def test_a_second_signal_exits_at_once_and_the_last_complete_checkpoint_stays_the_latest(forced, folders):
    assert forced["returncode"] == EXIT_FORCED, forced["stderr"][-4000:]
    assert "SIGTERM again (after SIGTERM): exiting at once with code 143" in forced["stderr"]
    assert not STOP_LINE.search(forced["stderr"])  # no cleanup, no stop line: it ended inside the save
    recorded = {r["rollout_id"] for r in read_metrics(folders["forced"] / "metrics.jsonl")}
    assert min(recorded) == forced["before"] + 1  # it resumed where run 1 stopped
    latest = read_latest(str(folders["ckpt"]))
    assert latest in (forced["before"], max(recorded))  # run 1's, or run 2's if its save beat the second signal
    assert os.path.isfile(os.path.join(checkpoint_dir(str(folders["ckpt"]), latest, "actor"), META_FILE))


@pytest.fixture(scope="module")
def resumed(forced, folders, ray_cluster):
    """Run 3, in-process: resumes from whatever the latest pointer names after run 2, to the end."""
    latest, ckpt = read_latest(str(folders["ckpt"])), str(folders["ckpt"])
    train_diffusion.run(parse_args([*FLAGS, "--output-dir", str(folders["resumed"]), "--load", ckpt, "--save", ckpt]))
    return latest


def by_rollout(out: Path) -> dict[int, list[dict]]:
    grouped: dict[int, list[dict]] = {}
    for record in series(out / "metrics.jsonl"):
        grouped.setdefault(record["rollout_id"], []).append(record)
    return grouped


@pytest.mark.background(*JOB)
def test_the_interrupted_runs_and_the_resumed_run_give_the_uninterrupted_series(stopped, forced, resumed, folders):
    train_diffusion.run(parse_args([*FLAGS, "--output-dir", str(folders["reference"])]))
    reference = by_rollout(folders["reference"])
    assert sorted(reference) == list(range(NUM_ROLLOUT))
    runs = {name: by_rollout(folders[name]) for name in ("stopped", "forced", "resumed")}
    assert sorted(runs["stopped"]) == list(range(stopped["last"] + 1))
    assert sorted(runs["resumed"]) == list(range(resumed + 1, NUM_ROLLOUT))  # from the pointer run 2 left
    for name, rollouts in runs.items():  # every rollout each run recorded, bit for bit (timings aside)
        for rollout_id, records in rollouts.items():
            assert records == reference[rollout_id], json.dumps({name: records, "reference": reference[rollout_id]})


if __name__ == "__main__":  # the background job (tests/background.py): runs 1 and 2, each a driver process of its own
    root = Path(sys.argv[2])
    job = {name: root / name for name in NAMES}
    (root / "stopped.json").write_text(json.dumps(run_stopped(job)))
    (root / "forced.json").write_text(json.dumps(run_forced(job)))
