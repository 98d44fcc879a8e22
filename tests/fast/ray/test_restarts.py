"""--max-restarts' parts without Ray actors: naming the dead actor and its node, the flags a restart resumes with,
the wait for the cluster's resources, the records a restart supersedes, and the driver's attempt loop."""

from __future__ import annotations

import pytest

from miles.arguments.parser import parse_args
from miles.backends.fsdp_utils.checkpoint import LATEST_FILE
from miles.ray import restarts as restarts_module
from miles.ray.restarts import Restarts, describe, needed_resources, resume_args, resume_hint, wait_for_resources
from miles.utils.failures import ActorDied, EngineError
from miles.utils.tracking import RESTART_KEY, current_records

PLACEMENT = {
    "actor": [{"ip": "10.0.0.1"}, {"ip": "10.0.0.2"}],
    "engines": [{"ip": "10.0.0.3"}],
    "reward_workers": [{"ip": "10.0.0.4"}],
}


def args_for(*flags: str):
    return parse_args(["--hf-checkpoint", "builtin:tiny-shapes", "--loss-type", "nft", *flags])


def write_latest(folder: str, rollout_id: int) -> None:  # the pointer alone: what `read_latest` reads
    with open(f"{folder}/{LATEST_FILE}", "w") as f:
        f.write(str(rollout_id))


def died(role: str, rank: int) -> ActorDied:
    return ActorDied(role, rank, "train", 3, RuntimeError("gone"))


@pytest.mark.parametrize(
    "exc,who,node",
    [
        (died("actor rank", 1), "actor rank 1", "10.0.0.2"),
        (died("reward worker", 0), "reward worker 0", "10.0.0.4"),
        (
            EngineError("rollout engine 0 of 1 died during generate of rollout 3: gone", 0),
            "rollout engine 0",
            "10.0.0.3",
        ),
        (died("critic rank", 0), "critic rank 0", "unknown node"),  # not in the placement (it died at start-up)
    ],
)
def test_the_failure_names_the_dead_actor_and_its_node(exc, who, node):
    failure = describe(exc, PLACEMENT)
    assert (failure.who, failure.node) == (who, node)
    assert failure.message == str(exc)


def test_a_restart_resumes_every_role_from_its_save_folder(tmp_path):
    args = parse_args(
        ["--hf-checkpoint", "builtin:tiny-shapes", "--loss-type", "dmd2", "--teacher-load", "builtin:tiny-shapes"]
        + ["--save", str(tmp_path / "a"), "--critic-save", str(tmp_path / "b"), "--max-restarts", "1"]
    )
    assert resume_args(args) == (args, None)  # nothing saved yet: the next attempt starts as the run did
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_latest(str(tmp_path / "a"), 4)
    assert resume_args(args) == (args, None)  # the critic's folder has no checkpoint: the roles would disagree
    write_latest(str(tmp_path / "b"), 4)
    resumed, saved = resume_args(args)
    assert saved == 4 and (resumed.load, resumed.critic_load) == (str(tmp_path / "a"), str(tmp_path / "b"))
    assert args.load is None and args.critic_load is None  # the run's own flags stay as given
    assert resume_hint(args) == (
        f"the latest checkpoint is rollout 4: rerun the command with --critic-load {tmp_path / 'b'} --load "
        f"{tmp_path / 'a'} to resume from it"
    )


def test_the_wait_returns_once_the_cluster_holds_the_resources_again(monkeypatch):
    totals = iter([{"CPU": 2.0}, {"CPU": 3.0}, {"CPU": 4.0, "GPU": 1.0}])
    monkeypatch.setattr(restarts_module.ray, "cluster_resources", lambda: next(totals))
    assert wait_for_resources({"CPU": 4.0, "GPU": 1.0}, timeout_s=10, poll_s=0.0) >= 0.0
    monkeypatch.setattr(restarts_module.ray, "cluster_resources", lambda: {"CPU": 1.0})
    with pytest.raises(TimeoutError, match=r"still lacks 3 CPU, 1 GPU after 0s \(--restart-timeout\)"):
        wait_for_resources({"CPU": 4.0, "GPU": 1.0}, timeout_s=0.0, poll_s=0.0)


def test_needed_resources_count_every_actor():
    args = args_for(
        "--dp-size", "2", "--cpus-per-rank", "0.5", "--rm-num-workers", "2",
        "--rollout-num-engines", "3", "--rollout-cpus-per-engine", "0.75", "--device", "cpu",
    )  # fmt: skip
    assert needed_resources(args) == {"CPU": pytest.approx(2 * 0.5 + 3 * 0.75 + 2 * 0.25), "GPU": 0.0}


def test_a_restart_record_supersedes_the_records_of_the_rollouts_it_redoes():
    records = [
        {"rollout_id": 0, "step": 1},
        {"rollout_id": 1, "step": 2},
        {"rollout_id": 1, RESTART_KEY: 1},
        {"rollout_id": 1, "step": 2, "again": True},
        {"rollout_id": 0, RESTART_KEY: 2},  # nothing was saved: everything is redone
        {"rollout_id": 0, "step": 1, "again": True},
    ]
    assert current_records(records) == [records[2], records[4], records[5]]


class FakeGroups:
    def __init__(self) -> None:
        self.placement, self.shut = PLACEMENT, False

    def shutdown_steps(self):
        return [("shutdown", lambda: setattr(self, "shut", True))]


def test_recover_tears_down_points_at_the_checkpoint_and_trims_the_summary(tmp_path, monkeypatch):
    monkeypatch.setattr(restarts_module.ray, "cluster_resources", lambda: {"CPU": 64.0})
    args = args_for("--save", str(tmp_path), "--max-restarts", "1")
    tmp_path.mkdir(exist_ok=True)
    write_latest(str(tmp_path), 1)
    restarts, groups = Restarts(args), FakeGroups()
    restarts.groups = groups
    restarts.start_attempt(0)
    summary = {"rollouts": [{"rollout_id": i, "_actor_losses": [float(i)]} for i in range(3)], "losses": [0, 1, 2]}
    assert restarts.can_restart(died("actor rank", 1)) and not restarts.can_restart(RuntimeError("a bug"))
    record = restarts.recover(died("actor rank", 1), summary)
    assert groups.shut and restarts.groups is None and restarts.args.load == str(tmp_path)
    assert record == {"rollout_id": 2, RESTART_KEY: 1, "restart/lost_rollouts": 2, "restart/failed_rollout": 3,
                      "restart/wait_s": record["restart/wait_s"], "restart/dp_size": 2}  # fmt: skip
    assert [r["rollout_id"] for r in summary["rollouts"]] == [0, 1] and summary["losses"] == [0.0, 1.0]
    assert not restarts.can_restart(died("actor rank", 1))  # --max-restarts 1 used up


def test_recover_raises_the_actor_error_when_the_resources_never_come_back(tmp_path, monkeypatch):
    totals = iter([{"CPU": 64.0}])
    monkeypatch.setattr(restarts_module.ray, "cluster_resources", lambda: next(totals, {"CPU": 0.0}))
    restarts = Restarts(args_for("--save", str(tmp_path), "--max-restarts", "1", "--restart-timeout", "0.01"))
    error = died("actor rank", 0)
    with pytest.raises(ActorDied) as info:
        restarts.recover(error, {})
    assert info.value is error and "not restarted: the cluster still lacks" in info.value.__notes__[0]


def test_the_driver_restarts_at_most_max_restarts_times(tmp_path, monkeypatch):
    monkeypatch.setattr(restarts_module.ray, "cluster_resources", lambda: {"CPU": 64.0})
    attempts, starts, logged = [], [], []
    restarts = Restarts(args_for("--save", str(tmp_path), "--max-restarts", "2"))

    def failing_attempt(started):
        attempts.append(restarts.count)
        starts.append(started)
        raise died("actor rank", len(attempts))

    writer = type("Writer", (), {"log": lambda self, record: logged.append(record)})()
    stop = type("Stop", (), {"requested": False})()
    with pytest.raises(ActorDied, match="actor rank 3 died") as info:
        restarts.attempts(failing_attempt, writer, {}, stop, 0.0)
    assert attempts == [0, 1, 2] and [r[RESTART_KEY] for r in logged] == [1, 2]
    assert starts[0] == 0.0 and 0.0 < starts[1] <= starts[2]  # a restarted attempt's start-up counts from its restart
    assert info.value.__notes__ == [
        "actor rank 3 on unknown node lost in rollout 0: restart budget (2) spent (--max-restarts 2, 2 restart(s) "
        f"done); no checkpoint in {tmp_path} yet: rerun the command to start over"
    ]


def test_a_stop_signal_ends_the_restarts_with_the_first_loss(tmp_path, monkeypatch):
    monkeypatch.setattr(restarts_module.ray, "cluster_resources", lambda: {"CPU": 64.0})
    restarts = Restarts(args_for("--save", str(tmp_path), "--max-restarts", "2"))
    stop = type("Stop", (), {"requested": True})()
    writer = type("Writer", (), {"log": lambda self, record: pytest.fail("no restart after a stop signal")})()

    def attempt(started):
        raise died("actor rank", 0)

    with pytest.raises(ActorDied) as info:
        restarts.attempts(attempt, writer, {}, stop, 0.0)
    assert "not restarted after a stop signal" in info.value.__notes__[0] and restarts.count == 0


def test_the_last_loss_names_the_lost_rank_the_spent_budget_and_the_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(restarts_module.ray, "cluster_resources", lambda: {"CPU": 64.0})
    restarts = Restarts(args_for("--save", str(tmp_path), "--max-restarts", "1"))
    restarts.count, restarts.groups = 1, type("Groups", (), {"placement": PLACEMENT})()
    restarts.start_attempt(3)  # the restarted attempt resumed at rollout 3 and completed it
    write_latest(str(tmp_path), 3)
    error = died("actor rank", 1)
    line = restarts.give_up(error, {"rollouts": [{"rollout_id": 2}, {"rollout_id": 3}]})
    assert line == (
        "actor rank 1 on 10.0.0.2 lost in rollout 4: restart budget (1) spent (--max-restarts 1, 1 restart(s) done); "
        f"the latest checkpoint is rollout 3: rerun the command with --load {tmp_path} to resume from it"
    )
    assert error.__notes__ == [line]
    without = Restarts(args_for("--max-restarts", "0"))
    assert without.give_up(died("reward worker", 0), {}) == (
        "reward worker 0 on unknown node lost in rollout 0: not restarted (--max-restarts 0); nothing to resume from "
        "(no --save)"
    )


def test_a_node_lost_for_good_restarts_smaller_with_restart_min_dp_size(tmp_path, monkeypatch):
    """dp 8 at 0.5 CPUs a rank (4 CPUs, + 0.5 for the engine): the cluster keeps 3 CPUs after the loss. dp 7, 6 and 5
    do not divide the global batch of 64 (8 prompts x 8 samples, 1 window); dp 4 does and fits (2.5 CPUs)."""
    cluster = {"CPU": 4.5}  # at the start; after the loss, 3 CPUs for good
    monkeypatch.setattr(restarts_module.ray, "cluster_resources", lambda: dict(cluster))
    flags = ("--save", str(tmp_path), "--max-restarts", "2", "--restart-timeout", "0.01", "--dp-size", "8")
    restarts = Restarts(args_for(*flags, "--restart-min-dp-size", "2"))
    floor = Restarts(args_for(*flags, "--restart-min-dp-size", "5"))
    cluster["CPU"] = 3.0
    record = restarts.recover(died("actor rank", 5), {})
    assert restarts.args.dp_size == restarts.given.dp_size == 4 and record["restart/dp_size"] == 4
    assert restarts.target == {"CPU": 2.5, "GPU": 0.0}  # what the next restart waits for
    with pytest.raises(ActorDied) as info:
        floor.recover(died("actor rank", 5), {})
    assert info.value.__notes__[0].endswith(
        "after 0s (--restart-timeout); no --dp-size from --restart-min-dp-size 5 to 7 fits it"
    )
    assert floor.given.dp_size == 8
