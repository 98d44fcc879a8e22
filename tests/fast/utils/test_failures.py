"""Failures name the actor: a dead rank names role, rank, phase and rollout; cleanup runs every step and keeps the
error that stopped the run in front."""

from __future__ import annotations

import os
import sys
import time

import pytest

from miles.utils.failures import ActorDied, gather, run_cleanup


def test_cleanup_runs_every_step_and_keeps_the_first_error_in_front():
    ran = []

    def failing(name):
        def step():
            ran.append(name)
            raise RuntimeError(f"{name} broke")

        return step

    with pytest.raises(ValueError, match="the run's own error") as info:
        try:
            raise ValueError("the run's own error")
        finally:
            run_cleanup([("groups", failing("groups")), ("writer", lambda: ran.append("writer")),
                         ("ray", failing("ray"))])  # fmt: skip
    assert ran == ["groups", "writer", "ray"]
    assert info.value.__notes__ == [
        "cleanup: groups also failed: RuntimeError: groups broke",
        "cleanup: ray also failed: RuntimeError: ray broke",
    ]


def test_cleanup_failure_is_raised_when_nothing_else_went_wrong():
    ran = []
    with pytest.raises(RuntimeError, match="first"):
        run_cleanup([("a", lambda: (_ for _ in ()).throw(RuntimeError("first"))), ("b", lambda: ran.append("b"))])
    assert ran == ["b"] and sys.exc_info()[1] is None


class Rank:
    def work(self) -> int:
        return 7

    def fail(self) -> None:
        raise KeyError("inside the actor")

    def collective(self, die: bool) -> None:
        if die:  # killed in the collective: Ray reports the death a little after the peer's own error
            time.sleep(0.3)
            os._exit(1)
        raise ConnectionError("Connection closed by peer")


def test_a_dead_rank_is_named_with_role_phase_and_rollout_not_the_peer_that_failed_first(ray_cluster):
    import ray

    actors = [ray.remote(num_cpus=0.01)(Rank).remote() for _ in range(2)]
    assert gather([a.work.remote() for a in actors], role="actor rank", phase="train", timeout=60) == [7, 7]
    with pytest.raises(ActorDied, match=r"^actor rank 1 died during train of rollout 3: ") as info:
        gather([a.collective.remote(rank == 1) for rank, a in enumerate(actors)], role="actor rank", phase="train",
               rollout_id=3, timeout=60)  # fmt: skip
    assert (info.value.role, info.value.rank, info.value.phase, info.value.rollout_id) == ("actor rank", 1, "train", 3)
    assert info.value.__notes__ == ["actor rank 0 failed after it: ConnectionError: Connection closed by peer"]
    with pytest.raises(ray.exceptions.RayTaskError) as raised:
        gather([actors[0].fail.remote()], role="reward worker", phase="score", rollout_id=2, timeout=60)
    assert "raised by reward worker 0 during score of rollout 2" in raised.value.__notes__
    for actor in actors:
        ray.kill(actor)


def test_a_rank_ended_by_rays_memory_monitor_is_a_death_named_as_such(monkeypatch):
    """Ray's memory monitor ends a worker mid-task: that task raises OutOfMemoryError (only later calls raise
    RayActorError), and the rank is lost (restartable), not a bug inside it."""
    from ray.exceptions import OutOfMemoryError

    from miles.utils import failures

    class FakeRay:
        @staticmethod
        def wait(pending, num_returns, timeout):
            return pending[:1], pending[1:]

        @staticmethod
        def get(ref):
            if ref == "rank 1":
                raise OutOfMemoryError("1 worker(s) were killed due to the node running low on memory")
            return 7

    monkeypatch.setattr(failures, "ray", FakeRay)
    with pytest.raises(ActorDied, match=r"^actor rank 1 died during train of rollout 4: OutOfMemoryError: 1 worker"):
        gather(["rank 0", "rank 1"], role="actor rank", phase="train", rollout_id=4, timeout=5)


class Refuses:
    def __init__(self) -> None:
        raise ValueError("--lora-target-modules ['nope'] match no module")

    def work(self) -> int:
        return 7


def test_an_actor_whose_constructor_raised_fails_to_start_named_and_is_not_a_death_to_restart(ray_cluster):
    """Ray reports a constructor's error as the actor's death (`actor_init_failed`); it would raise again on any
    node, so it is `StartFailed` (not `ActorDied`, which --max-restarts restarts), led by the constructor's error."""
    import ray

    from miles.ray.restarts import RESTARTABLE
    from miles.utils.failures import StartFailed, start_failure

    actor = ray.remote(num_cpus=0.01)(Refuses).remote()
    with pytest.raises(StartFailed) as info:
        gather([actor.work.remote()], role="reward worker", phase="start", timeout=60)
    assert str(info.value) == (
        "reward worker 0 failed to start (its constructor raised; not restarted): "
        "ValueError: --lora-target-modules ['nope'] match no module"
    )
    assert isinstance(info.value.__cause__, ray.exceptions.RayActorError) and not isinstance(info.value, RESTARTABLE)
    assert start_failure(ray.exceptions.ActorDiedError(), "engine 0") is None  # a death of unknown cause: restartable
