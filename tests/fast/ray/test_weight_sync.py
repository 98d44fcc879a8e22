"""The driver's side of the weight sync. A sync that fails because one of its members died names the dead one: a
trainer rank killed mid-sync makes rank 0's collective break ("Connection closed by peer") about when Ray reports the
death, and the dead rank (or engine), not rank 0, is the loss the driver reports and restarts from (`WeightSyncLink`).
A forced shared transport that some engine cannot map is refused naming the flag; the bucket size by device."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from miles.arguments.engine import EngineTimeouts
from miles.ray.engine_group import RolloutEngineGroup
from miles.ray.train_group import RayTrainGroup
from miles.ray.weight_sync import WeightSyncLink, bucket_bytes, check_placement
from miles.utils.failures import ActorDied, EngineError
from tests.fast.ray.sync_members import SyncMember

TIMEOUT = 60.0


def sync_of(trainer: list[tuple], engines: list[tuple]) -> tuple[WeightSyncLink, RayTrainGroup, list]:
    """A sync link between stand-in trainer ranks and engines, each given (what it does, after how long)."""
    import ray

    member = ray.remote(num_cpus=0.01, max_concurrency=2)(SyncMember)
    group = RayTrainGroup.__new__(RayTrainGroup)
    group.role, group.timeout, group.failed = "actor", TIMEOUT, False
    group.actors = [member.remote(*does) for does in trainer]
    engine_group = RolloutEngineGroup.__new__(RolloutEngineGroup)
    engine_group.engines = [member.remote(*does) for does in engines]
    engine_group.failed, engine_group.timeouts = False, EngineTimeouts(startup_s=TIMEOUT, sync_s=TIMEOUT)
    engine_group.on_progress, engine_group.poll_s, engine_group.log_every_s = None, 1.0, 30.0
    link = WeightSyncLink.__new__(WeightSyncLink)
    link.engines, link.actor_group, link.kind = engine_group, group, "shm"
    return link, group, group.actors + engine_group.engines


def test_a_trainer_rank_killed_mid_sync_is_named_not_rank_0_whose_collective_broke(ray_cluster, tmp_path):
    import ray

    # rank 1 dies; rank 0's barrier breaks before Ray reports the death; the engine waits for rank 0's buckets
    flag = str(tmp_path / "broken")
    link, group, members = sync_of([("break", 0.0, flag), ("die", 0.3, flag)], [("hang",)])
    try:
        with pytest.raises(
            ActorDied, match=r"^actor rank 1 died during weight sync \(version 4\) of rollout 2: "
        ) as info:
            link.push(group, 4, rollout_id=2)
        assert (info.value.role, info.value.rank, info.value.rollout_id) == ("actor rank", 1, 2)
        assert info.value.__notes__ == [
            "actor rank 0 failed after it: ConnectionError: [gloo/transport/tcp/pair.cc:534] Connection closed by "
            "peer [127.0.0.1]:41000"
        ]
        assert group.failed and link.engines.failed  # the engine waits in the broken group: not for a pool
    finally:
        for actor in members:
            ray.kill(actor)


def test_an_engine_killed_mid_sync_is_named_not_rank_0_whose_send_broke(ray_cluster, tmp_path):
    import ray

    flag = str(tmp_path / "broken")
    link, group, members = sync_of([("break", 0.0, flag)], [("hang",), ("die", 0.3, flag)])
    try:
        with pytest.raises(EngineError, match=r"^rollout engine 1 of 2 died during weight sync \(version 3\)") as info:
            link.push(group, 3, rollout_id=1)
        assert info.value.index == 1 and link.engines.failed
        assert info.value.__notes__[0].startswith("actor rank 0 failed after it: ConnectionError: ")
    finally:
        for actor in members:
            ray.kill(actor)


def test_a_member_s_own_error_with_every_peer_alive_is_raised_naming_it(ray_cluster):
    import ray

    link, group, members = sync_of([("break", 0.5)], [("answer",)])
    try:
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            link.push(group, 5, rollout_id=3)
        assert "raised by actor rank 0 during weight sync (version 5) of rollout 3" in info.value.__notes__
    finally:
        for actor in members:
            ray.kill(actor)


def test_a_forced_shared_transport_that_some_engine_cannot_map_is_refused_naming_the_flag():
    rank0 = {"node_id": "n0", "gpus": ["0"]}
    check_placement("shm", rank0, [{"node_id": "n0", "gpus": []}])
    check_placement("gloo", rank0, [{"node_id": "n1", "gpus": []}])
    with pytest.raises(
        ValueError, match=r"--weight-sync-transport shm needs every engine on the node .* engines \[1\]"
    ):
        check_placement("shm", rank0, [{"node_id": "n0", "gpus": []}, {"node_id": "n1", "gpus": []}])
    with pytest.raises(ValueError, match=r"cuda_ipc needs every engine on the GPU"):
        check_placement("cuda_ipc", rank0, [{"node_id": "n0", "gpus": ["1"]}])


def test_the_bucket_size_follows_the_flag_or_the_runs_device():
    assert bucket_bytes(SimpleNamespace(weight_sync_bucket_mb=8, device="cpu")) == 8 << 20
    assert bucket_bytes(SimpleNamespace(weight_sync_bucket_mb=None, device="cpu")) == 64 << 20
    assert bucket_bytes(SimpleNamespace(weight_sync_bucket_mb=None, device="cuda")) == 512 << 20


def test_a_trainer_rank_lost_before_the_sync_connects_is_named(ray_cluster):
    """The sync's first connect asks every rank where it runs (as the start-up's placement record does): a rank that
    died before is named with its role and rank, the restartable error, not Ray's bare ActorDiedError."""
    import ray

    link, group, members = sync_of([("answer",), ("answer",)], [("answer",)])
    link.args = SimpleNamespace(weight_sync_transport="auto")  # read after the ranks' places
    try:
        ray.kill(group.actors[1])
        with pytest.raises(ActorDied) as raised:
            link.connect(group)
        assert (raised.value.role, raised.value.rank) == ("actor rank", 1) and group.failed
        assert "start-up (placement)" in str(raised.value)
    finally:
        for member in members:
            ray.kill(member)
