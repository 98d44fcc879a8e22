"""The actor pool: what it hands out and ends, and the process settings a released actor puts back."""

from __future__ import annotations

import os

import ray
import torch

from miles.ray.actor_pool import ActorPool, ReusableActor, current_pool, reusing_actors


def test_take_hands_out_the_newest_match_and_a_miss_ends_nothing():
    pool, ended = ActorPool(), []
    pool.put(("trainer", 2), "dp2-a", lambda: ended.append("dp2-a"))
    pool.put(("trainer", 2), "dp2-b", lambda: ended.append("dp2-b"))
    pool.put(("engine", 0.5), "engine", lambda: ended.append("engine"))
    assert pool.take(("trainer", 2)) == "dp2-b"
    assert pool.take(("trainer", 4)) is None
    assert ended == [] and len(pool) == 2
    assert pool.take(("engine", 0.5)) == "engine" and pool.take(("engine", 0.5)) is None
    assert len(pool) == 1


def test_make_room_ends_the_oldest_idle_items_until_the_need_is_covered(monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 0.5})
    pool, ended = ActorPool(), []
    for name, cpus in (("old", 0.5), ("middle", 1.0), ("new", 0.5)):
        pool.put((name,), name, lambda name=name: ended.append(name), resources={"CPU": cpus})
    pool.make_room({"CPU": 0.5})  # free already
    assert ended == []
    pool.make_room({"CPU": 1.5})  # 0.5 free + the oldest's 0.5 is not enough: the next oldest goes too
    assert ended == ["old", "middle"] and pool.take(("new",)) == "new"
    pool.put(("gpu",), "gpu", lambda: ended.append("gpu"), resources={"CPU": 0.01, "GPU": 1.0})
    pool.make_room({"CPU": 0.5, "GPU": 0.0})  # a GPU-less need leaves a GPU holder alone
    assert ended == ["old", "middle"] and len(pool) == 1


def test_evict_idle_ends_everything_even_when_one_end_fails():
    pool, ended = ActorPool(), []

    def dead() -> None:
        raise RuntimeError("actor died while idle")

    pool.put(("engine", 0.5), "dead", dead)
    pool.put(("trainer", 1), "rank", lambda: ended.append("rank"))
    pool.evict_idle()
    assert ended == ["rank"] and len(pool) == 0


def test_reusing_actors_scopes_the_pool_and_ends_its_idle_actors():
    ended, outer = [], current_pool()  # the suite's session pool when a Ray fixture ran before
    with reusing_actors() as pool:
        assert current_pool() is pool and pool is not outer
        pool.put(("engine", 0.5), "engine", lambda: ended.append("engine"))
    assert current_pool() is outer and ended == ["engine"]


class Worker(ReusableActor):
    def __init__(self, value: int) -> None:
        self._remember_process_baseline()
        self.value = value
        self.released_resources = []

    def _release_resources(self) -> None:
        self.released_resources.append("closed")


def test_release_puts_back_the_process_settings_a_run_changed(monkeypatch):
    monkeypatch.setattr(ReusableActor, "_process_baseline", None)
    monkeypatch.delenv("MILES_POOL_PROBE", raising=False)
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    worker = Worker(1)
    resources = worker.released_resources
    try:
        os.environ["MILES_POOL_PROBE"] = "set by the run"
        torch.set_num_threads(threads + 1)
        torch.use_deterministic_algorithms(True)
        assert worker.release()
        assert resources == ["closed"] and worker.__dict__ == {}
        assert "MILES_POOL_PROBE" not in os.environ
        assert torch.get_num_threads() == threads
        assert torch.are_deterministic_algorithms_enabled() == deterministic
        assert worker.reuse(2) and worker.value == 2 and worker.released_resources == []
    finally:
        os.environ.pop("MILES_POOL_PROBE", None)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
