"""--max-restarts through the driver: in rollout 1 of the golden nft run (tests/e2e/test_golden.py) a rollout engine
dies during the generation, then (restarted) a reward worker during the scoring, then (restarted again) a trainer rank
during the training. The run restarts after each from rollout 0's checkpoint, finishes by itself, and its metric
series equals the uninterrupted run's recorded fixture (bit for bit on the machine that recorded it)."""

from __future__ import annotations

import inspect
import json
import logging

import pytest
import ray

import train_diffusion
from miles.backends.fsdp_utils.checkpoint import read_latest
from miles.ray.engine_group import RolloutEngineGroup
from miles.ray.reward_workers import RewardWorkerPool
from miles.ray.train_group import RayTrainGroup
from miles.utils.arguments import parse_args
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
