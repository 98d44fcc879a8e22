"""Preemption with real signals to the whole process group of a `python train_diffusion.py` process, as a terminal's
Ctrl-C and schedulers send them (Ray's processes and the actors included): SIGINT stops after a rollout, saves it and
exits with EXIT_PREEMPTED; two SIGTERMs, the second during the stop's save, let the save finish and exit with
EXIT_PREEMPTED too; the pieces of the interrupted runs plus the resumed run give an uninterrupted run's series bit
for bit. Runs 1 and 2 (the signalled drivers) and a check of the driver's handlers around Ray's start and shutdown
are this file's background job `signals`, started with the session (tests/background.py); run 3 and the reference
run are in process, in the session's Ray cluster."""

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
from miles.arguments.parser import parse_args
from miles.backends.fsdp_utils.checkpoint import META_FILE, checkpoint_dir, read_latest
from miles.utils.stop_signals import EXIT_PREEMPTED
from miles.utils.tracking import read_metrics, scalar_points
from tests.e2e.test_golden import COMMON, RUNS, series

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "fast", "utils"))
from tracker_readers import read_tensorboard  # noqa: E402

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
NUM_ROLLOUT = 4
FLAGS = [*COMMON, *RUNS["nft"], "--num-rollout", str(NUM_ROLLOUT)]  # nft saves EMA and old-policy shadows too
STOP_LINE = re.compile(r"stopped on (SIGTERM|SIGINT) after rollout (\d+)(?: \(rollout \d+ generated, not trained\))?: "
                       r"checkpoint (\S+); resume with --load (\S+); exit code (\d+)$", re.M)  # fmt: skip


def rollout_records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [r for r in read_metrics(path) if "perf/generate_total_s" in r] if path.exists() else []


def start_driver(out: Path, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray, not the test session's
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    command = [sys.executable, str(ROOT / "train_diffusion.py"), *FLAGS, "--output-dir", str(out), *extra]
    # its own process group, as a job's: the signals go to the whole group (os.killpg), as schedulers send them
    return subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)


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
NAMES = ("ckpt", "stopped", "twice", "resumed", "reference")


def run_stopped(folders: dict[str, Path]) -> dict:
    """Run 1: Ctrl-C (SIGINT to the whole process group) as soon as rollout 0 is recorded: it lands in rollout 1's
    generation, whose batch is then dropped (on a machine slow enough to miss that, in rollout 1's training, which
    runs to its end); no --save-interval, so the checkpoint is the signal's own save."""
    out, ckpt = folders["stopped"], folders["ckpt"]
    driver = start_driver(out, "--save", str(ckpt), "--use-tensorboard")
    wait_for(lambda: rollout_records(out), driver, "rollout 0's record in metrics.jsonl")
    os.killpg(driver.pid, signal.SIGINT)
    stderr = finish(driver)
    lines = STOP_LINE.findall(stderr)
    return {
        "returncode": driver.returncode,
        "stderr": stderr,
        "lines": lines,
        "last": int(lines[0][1]) if lines else None,
        "latest": read_latest(str(ckpt)),  # before run 2 moves the pointer
    }


def run_twice(folders: dict[str, Path]) -> dict:
    """Run 2: resumes from run 1's checkpoint; SIGTERM to the whole process group once its first rollout is recorded
    (so the stop saves that rollout), and again as soon as that save has created its folder (a scheduler's second
    signal, inside the save)."""
    out, ckpt = folders["twice"], folders["ckpt"]
    before = read_latest(str(ckpt))
    driver = start_driver(out, "--save", str(ckpt), "--load", str(ckpt))
    wait_for(lambda: rollout_records(out), driver, "the resumed run's first rollout record")
    os.killpg(driver.pid, signal.SIGTERM)
    save_started = lambda: any(int(p.name[len("iter_") :]) > before for p in ckpt.glob("iter_*"))  # noqa: E731
    wait_for(save_started, driver, "the stop signal's save to start")
    os.killpg(driver.pid, signal.SIGTERM)
    stderr = finish(driver)
    return {"returncode": driver.returncode, "stderr": stderr, "before": before, "lines": STOP_LINE.findall(stderr)}


def check_handlers() -> dict:
    """In this (job) process, the leader of its own process group: the driver's stop handlers across a local Ray's
    start and shutdown, with SIGTERM to the whole group in between (Ray's processes in sessions of their own)."""
    import psutil
    import ray

    from miles.ray.cluster import start_ray, stop_ray
    from miles.utils.stop_signals import StopSignals

    assert os.getpgrp() == os.getpid(), "run the job as its own process group (setsid), as tests/background.py does"
    with StopSignals() as stop:
        start_ray({"address": "local", "num_cpus": 1})
        ray_processes = psutil.Process().children(recursive=True)
        sessions = sorted({os.getsid(p.pid) for p in ray_processes})
        os.killpg(os.getpgrp(), signal.SIGTERM)
        time.sleep(1.0)
        alive = sum(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ray_processes)
        answered = ray.get(ray.put("still up"), timeout=60)
        stop_ray()
        os.kill(os.getpid(), signal.SIGTERM)  # after ray.shutdown, which resets the C-level handlers
        time.sleep(0.2)
        return {"own_session": os.getsid(0), "ray_sessions": sessions, "ray_processes": len(ray_processes),
                "alive": alive, "answered": answered, "signals": stop.count}  # fmt: skip


@pytest.fixture(scope="module")
def folders() -> dict[str, Path]:
    from tests.background import job_folder

    root = job_folder(*JOB)
    return {name: root / name for name in NAMES}


@pytest.fixture(scope="module")
def stopped(folders):
    return json.loads((folders["ckpt"].parent / "stopped.json").read_text())


@pytest.mark.background(*JOB)
def test_ctrl_c_to_the_process_group_stops_after_a_rollout_saves_it_and_exits_with_exit_preempted(stopped, folders):
    assert stopped["returncode"] == EXIT_PREEMPTED, stopped["stderr"][-4000:]
    assert len(stopped["lines"]) == 1, stopped["stderr"][-4000:]
    signal_name, _, checkpoint, load, code = stopped["lines"][0]
    last = stopped["last"]
    assert signal_name == "SIGINT"
    assert last < NUM_ROLLOUT - 2  # stopped early, with room for run 2
    assert checkpoint == os.path.join(str(folders["ckpt"]), f"iter_{last:07d}") and load == str(folders["ckpt"])
    assert int(code) == EXIT_PREEMPTED
    assert stopped["latest"] == last
    assert os.path.isfile(os.path.join(checkpoint_dir(str(folders["ckpt"]), last, "actor"), META_FILE))
    # the metrics end with the last completed rollout: nothing of an abandoned one
    records = read_metrics(folders["stopped"] / "metrics.jsonl")
    assert {r["rollout_id"] for r in records} == set(range(last + 1))
    # TensorBoard closed: its event file holds every scalar of metrics.jsonl
    expected = {(tag, x) for r in records for tag, _, x, _ in scalar_points(r)}
    scalars, _ = read_tensorboard(str(folders["stopped"] / "tensorboard"))
    assert {(tag, step) for tag, steps in scalars.items() for step in steps} == expected


@pytest.fixture(scope="module")
def twice(stopped, folders):
    return json.loads((folders["ckpt"].parent / "twice.json").read_text())


@pytest.mark.background(*JOB)
def test_a_second_sigterm_to_the_group_during_the_save_lets_it_finish_and_exits_with_exit_preempted(twice, folders):
    assert twice["returncode"] == EXIT_PREEMPTED, twice["stderr"][-4000:]
    assert "SIGTERM again (after SIGTERM): the stop goes on, the save under way finishes" in twice["stderr"]
    recorded = {r["rollout_id"] for r in read_metrics(folders["twice"] / "metrics.jsonl")}
    assert min(recorded) == twice["before"] + 1  # it resumed where run 1 stopped
    assert len(twice["lines"]) == 1, twice["stderr"][-4000:]
    signal_name, last, checkpoint, _, code = twice["lines"][0]
    assert (signal_name, int(last), int(code)) == ("SIGTERM", max(recorded), EXIT_PREEMPTED)
    assert read_latest(str(folders["ckpt"])) == max(recorded)  # the save the second signal landed in finished
    assert os.path.isfile(os.path.join(checkpoint_dir(str(folders["ckpt"]), max(recorded), "actor"), META_FILE))


@pytest.fixture(scope="module")
def handlers(folders):
    return json.loads((folders["ckpt"].parent / "handlers.json").read_text())


@pytest.mark.background(*JOB)
def test_ray_s_processes_outlive_a_sigterm_to_the_group_and_the_handlers_outlive_ray_shutdown(handlers):
    assert handlers["ray_processes"] >= 2  # the GCS and the raylet at least
    assert handlers["own_session"] not in handlers["ray_sessions"]
    assert handlers["alive"] == handlers["ray_processes"] and handlers["answered"] == "still up"
    assert handlers["signals"] == 2  # the group's SIGTERM and the one after ray.shutdown both reached the handler


@pytest.fixture(scope="module")
def resumed(twice, folders, ray_cluster):
    """Run 3, in-process: resumes from the latest pointer after run 2, to the end."""
    latest, ckpt = read_latest(str(folders["ckpt"])), str(folders["ckpt"])
    train_diffusion.run(parse_args([*FLAGS, "--output-dir", str(folders["resumed"]), "--load", ckpt, "--save", ckpt]))
    return latest


def by_rollout(out: Path) -> dict[int, list[dict]]:
    grouped: dict[int, list[dict]] = {}
    for record in series(out / "metrics.jsonl"):
        grouped.setdefault(record["rollout_id"], []).append(record)
    return grouped


@pytest.mark.background(*JOB)
def test_the_interrupted_runs_and_the_resumed_run_give_the_uninterrupted_series(stopped, twice, resumed, folders):
    train_diffusion.run(parse_args([*FLAGS, "--output-dir", str(folders["reference"])]))
    reference = by_rollout(folders["reference"])
    assert sorted(reference) == list(range(NUM_ROLLOUT))
    runs = {name: by_rollout(folders[name]) for name in ("stopped", "twice", "resumed")}
    assert sorted(runs["stopped"]) == list(range(stopped["last"] + 1))
    assert sorted(runs["resumed"]) == list(range(resumed + 1, NUM_ROLLOUT))  # from the pointer run 2 left
    for name, rollouts in runs.items():  # every rollout each run recorded, bit for bit (timings aside)
        for rollout_id, records in rollouts.items():
            assert records == reference[rollout_id], json.dumps({name: records, "reference": reference[rollout_id]})


if __name__ == "__main__":  # the background job (tests/background.py): runs 1 and 2 (driver processes), the handlers
    root = Path(sys.argv[2])
    job = {name: root / name for name in NAMES}
    (root / "stopped.json").write_text(json.dumps(run_stopped(job)))
    (root / "twice.json").write_text(json.dumps(run_twice(job)))
    (root / "handlers.json").write_text(json.dumps(check_handlers()))
