"""--max-restarts through the driver: in rollout 1 of the golden nft run (tests/e2e/test_golden.py) a rollout engine
dies during the generation, then (restarted) a reward worker during the scoring, then (restarted again) a trainer rank
during the training. The run restarts after each from rollout 0's checkpoint, finishes by itself, and its metric
series equals the uninterrupted run's recorded fixture (bit for bit on the machine that recorded it). And, as a user
would, through the CLI with `--max-restarts 1`: a trainer rank's process killed (SIGKILL) twice, the second time once
the budget is spent, ends the run with the line naming the rank, the spent budget and the checkpoint to resume from
(this file's background job `budget`)."""

from __future__ import annotations

import inspect
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

import train_diffusion
from miles.arguments.parser import parse_args
from miles.backends.fsdp_utils.checkpoint import read_latest
from miles.ray.engine_group import RolloutEngineGroup
from miles.ray.reward_workers import RewardWorkerPool
from miles.ray.train_group import RayTrainGroup
from miles.utils.tracking import RESTART_KEY, current_records, read_metrics
from tests.e2e.test_golden import COMMON, FIXTURE, RUNS, UNRECORDED, differences, machine

pytestmark = pytest.mark.e2e
FLAGS = [*COMMON, *RUNS["nft"], "--rm-num-workers", "1", "--save-interval", "1", "--max-restarts", "3"]
KILLS = ("rollout engine 0", "reward worker 0", "actor rank 1")  # in this order, all in rollout 1


def run_flags(tmp, name: str, *extra: str) -> list[str]:
    return [*FLAGS, "--output-dir", str(tmp / name), "--save", str(tmp / f"{name}_ckpt"), *extra]


def series(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(UNRECORDED)} for r in records if RESTART_KEY not in r]


def kill_once(at: int, victim, done: set, name: str):
    """A wrapper of a group method whose first call in rollout `at` kills `victim(group)` before it runs."""

    def wrap(real):
        def method(self, *args, **kwargs):
            rollout_id = inspect.signature(real).bind(self, *args, **kwargs).arguments.get("rollout_id")
            if name not in done and rollout_id == at:
                done.add(name)
                ray.kill(victim(self))  # the process dies: OOM killer, a lost node, a GPU fault
            return real(self, *args, **kwargs)

        return method

    return wrap


@pytest.fixture(scope="module")
def restarted(ray_cluster, tmp_path_factory):
    tmp, done = tmp_path_factory.mktemp("restarted"), set()
    engine = kill_once(1, lambda group: group.engines[0], done, KILLS[0])
    worker = kill_once(1, lambda pool: pool.workers[0], done, KILLS[1])
    trainer = kill_once(1, lambda group: group.actors[1], done, KILLS[2])
    handler = CaptureHandler()
    logging.getLogger("miles.ray.restarts").addHandler(handler)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(RayTrainGroup, "train", trainer(RayTrainGroup.train))
            patch.setattr(RolloutEngineGroup, "generate", engine(RolloutEngineGroup.generate))
            patch.setattr(RolloutEngineGroup, "submit", engine(RolloutEngineGroup.submit))
            patch.setattr(RewardWorkerPool, "score", worker(RewardWorkerPool.score))
            summary = train_diffusion.run(parse_args(run_flags(tmp, "run")))
    finally:
        logging.getLogger("miles.ray.restarts").removeHandler(handler)
    records = read_metrics(tmp / "run" / "metrics.jsonl")
    return {"records": records, "log": handler.lines, "done": done, "summary": summary, "ckpt": tmp / "run_ckpt"}


class CaptureHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_run_restarts_after_each_death_and_finishes_by_itself(restarted):
    assert restarted["done"] == set(KILLS)
    restarts = [r for r in restarted["records"] if RESTART_KEY in r]
    assert [(r[RESTART_KEY], r["rollout_id"], r["restart/failed_rollout"]) for r in restarts] == [
        (1, 1, 1),
        (2, 1, 1),
        (3, 1, 1),
    ]
    assert all(r["restart/lost_rollouts"] == 1 for r in restarts)  # the rollout in flight, never saved
    assert read_latest(str(restarted["ckpt"])) == 1
    assert [r["rollout_id"] for r in restarted["summary"]["rollouts"]] == [0, 1]


def test_each_restart_is_logged_with_the_dead_actor_its_node_and_the_rollout(restarted):
    failed = [line for line in restarted["log"] if "failed in rollout" in line]
    assert len(failed) == 3, restarted["log"]
    for count, (line, who) in enumerate(zip(failed, KILLS), start=1):
        assert line.startswith(f"restart {count} of --max-restarts 3: {who} on ")
        assert "failed in rollout 1: " in line and "unknown node" not in line
    resumed = [line for line in restarted["log"] if "resuming at rollout" in line]
    assert len(resumed) == 3 and all(" redone (not saved): rollouts 1" in line for line in resumed)
    assert resumed[0].startswith(f"restart 1: resuming at rollout 1 from {restarted['ckpt']}; ")


def test_the_restarted_series_equals_the_uninterrupted_one(restarted):
    fixture = json.loads(FIXTURE.read_text())
    got, expected = series(current_records(restarted["records"])), fixture["series"]["nft"]
    assert len(got) == len(expected)
    exact = fixture["machine"] == machine()
    for record, recorded in zip(got, expected):
        assert not differences(record, recorded, exact), (exact, differences(record, recorded, exact))


def test_a_rank_whose_node_never_comes_back_restarts_the_run_at_a_smaller_dp_size(ray_cluster, tmp_path):
    """--restart-min-dp-size: actor rank 1 dies in rollout 1 and its resources never come back (the wait times out,
    as on a cluster that lost the node for good); the run goes on at dp 1 from rollout 0's dp-2 checkpoint, resharded,
    and its series is still the uninterrupted dp-2 run's (the golden fixture)."""
    import miles.ray.restarts as restarts_module

    def lost_for_good(target, timeout_s, poll_s=1.0):
        raise TimeoutError(f"the cluster still lacks 0.5 CPU after {timeout_s:.0f}s (--restart-timeout)")

    done: set = set()
    handler = CaptureHandler()
    logging.getLogger("miles.ray.restarts").addHandler(handler)
    try:
        with pytest.MonkeyPatch.context() as patch:
            trainer = kill_once(1, lambda group: group.actors[1], done, "actor rank 1")
            patch.setattr(RayTrainGroup, "train", trainer(RayTrainGroup.train))
            patch.setattr(restarts_module, "wait_for_resources", lost_for_good)
            train_diffusion.run(parse_args(run_flags(tmp_path, "shrunk", "--restart-min-dp-size", "1")))
    finally:
        logging.getLogger("miles.ray.restarts").removeHandler(handler)
    records = read_metrics(tmp_path / "shrunk" / "metrics.jsonl")
    [restart] = [r for r in records if RESTART_KEY in r]
    assert (restart["rollout_id"], restart["restart/dp_size"]) == (1, 1) and done == {"actor rank 1"}
    assert any("going on at --dp-size 1 instead of 2 (--restart-min-dp-size 1)" in line for line in handler.lines)
    placement = json.loads((tmp_path / "shrunk" / "placement.json").read_text())
    assert len(placement["actor"]) == 1  # the attempt that finished ran one rank
    fixture = json.loads(FIXTURE.read_text())
    got, expected = series(current_records(records)), fixture["series"]["nft"]
    assert len(got) == len(expected)
    for record, recorded in zip(got, expected):  # dp 1 against dp 2: the rounding of the layout, not bit for bit
        assert not differences(record, recorded, exact=False), differences(record, recorded, exact=False)


BUDGET_JOB = ("tests/e2e/test_restarts.py", "budget")


def actor_pids(out: Path) -> list[int]:
    """The actor ranks' process ids in the run's placement.json ([] before it is written, or while it is)."""
    try:
        return [entry["pid"] for entry in json.loads((out / "placement.json").read_text())["actor"]]
    except (OSError, ValueError, KeyError):
        return []


def wait_until(condition, driver: subprocess.Popen, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if driver.poll() is not None or time.monotonic() > deadline:
            driver.kill()
            raise RuntimeError(f"no {what} (driver code {driver.poll()}):\n{driver.communicate()[1][-4000:]}")
        time.sleep(0.05)


def run_budget(root: Path) -> dict:
    """A driver with --max-restarts 1 whose actor rank 1 is killed once rollout 0 is saved and recorded, then again
    as soon as the restarted attempt has placed its ranks (so in rollout 1 both times, rollout 0 the latest save)."""
    out, ckpt = root / "run", root / "ckpt"
    flags = [*COMMON, *RUNS["nft"], "--num-rollout", "4", "--save-interval", "1", "--max-restarts", "1"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray, not a test session's
    command = [sys.executable, "train_diffusion.py", *flags, "--output-dir", str(out), "--save", str(ckpt)]
    root_dir = Path(__file__).resolve().parents[2]
    driver = subprocess.Popen(command, cwd=root_dir, env=env, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    recorded = lambda key: metrics.exists() and key in metrics.read_text()  # noqa: E731
    wait_until(lambda: recorded("perf/generate_total_s") and actor_pids(out), driver, "rollout 0's record")
    first = actor_pids(out)[1]
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: recorded(RESTART_KEY) and actor_pids(out)[1] != first, driver, "restarted ranks")
    os.kill(actor_pids(out)[1], signal.SIGKILL)
    stderr = driver.communicate(timeout=300)[1]
    return {"returncode": driver.returncode, "stderr": stderr, "ckpt": str(ckpt)}


@pytest.mark.background(*BUDGET_JOB)
def test_a_second_lost_rank_names_the_rank_the_spent_budget_and_the_checkpoint():
    from tests.background import job_folder

    run = json.loads((job_folder(*BUDGET_JOB) / "budget.json").read_text())
    assert run["returncode"] == 1, run["stderr"][-4000:]
    assert "restart 1 of --max-restarts 1: actor rank 1 on " in run["stderr"]
    # the note under the actor's error in the traceback (the log has the same line after its prefix)
    notes = [line for line in run["stderr"].splitlines() if line.startswith("actor rank 1 on ")]
    assert len(notes) == 1, run["stderr"][-4000:]
    assert notes[0].endswith(
        " lost in rollout 1: restart budget (1) spent (--max-restarts 1, 1 restart(s) done); the latest checkpoint is "
        f"rollout 0: rerun the command with --load {run['ckpt']} to resume from it"
    ), notes[0]
    assert "miles.utils.failures.ActorDied: actor rank 1 died during " in run["stderr"]
    assert read_latest(run["ckpt"]) == 0


if __name__ == "__main__":  # the background job (tests/background.py): `budget`, a driver process of its own
    folder = Path(sys.argv[2])
    (folder / "budget.json").write_text(json.dumps(run_budget(folder)))
