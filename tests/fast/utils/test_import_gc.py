"""The garbage collector paused during imports (`miles.utils.import_gc`): in a Ray worker from `import miles` to the
actor's `__init__`, in the driver during its start-up, and never left off."""

from __future__ import annotations

import gc
import time

import pytest

from miles.ray.reward_workers import RewardWorker
from miles.utils import import_gc


@pytest.fixture
def collector_restored():
    """Whatever a test does to the collector, the next test finds it on."""
    yield
    import_gc.resume()
    gc.enable()


class GcProbe(RewardWorker):
    """A reward worker that notes whether the collector was off when its class had been imported."""

    def __init__(self, *args, **kwargs) -> None:
        self.off_at_init = not gc.isenabled()
        super().__init__(*args, **kwargs)

    async def collector(self) -> tuple[bool, bool]:
        return self.off_at_init, gc.isenabled()


def test_paused_turns_the_collector_off_inside_and_back_as_it_was(collector_restored):
    with import_gc.paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    with import_gc.paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # someone else's choice is kept
    with pytest.raises(ValueError), import_gc.paused():
        raise ValueError("an import failed")
    assert not gc.isenabled()


def test_outside_a_ray_worker_nothing_is_paused(collector_restored):
    assert not import_gc.pause_in_ray_worker()  # the pytest process is not a Ray worker
    assert gc.isenabled()
    gc.disable()
    import_gc.resume()  # resumes only its own pause
    assert not gc.isenabled()


def test_a_pause_nobody_resumes_ends_by_itself(collector_restored, monkeypatch):
    monkeypatch.setattr(import_gc, "_in_ray_worker", lambda: True)
    monkeypatch.setattr(import_gc, "PAUSE_LIMIT_S", 0.05)
    assert import_gc.pause_in_ray_worker()
    assert not gc.isenabled()
    deadline = time.monotonic() + 5
    while not gc.isenabled() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gc.isenabled()
    assert import_gc._timer is None


def test_a_ray_actor_imports_with_the_collector_off_and_runs_with_it_on(ray_cluster):
    import ray

    actor = ray.remote(num_cpus=0.01)(GcProbe).remote(None, [])
    off_at_init, on_after = ray.get(actor.collector.remote(), timeout=120)
    ray.kill(actor)
    assert off_at_init and on_after


def test_every_miles_actor_resumes_the_collector_in_its_init(collector_restored, monkeypatch):
    from miles.backends.fsdp_utils.actor import FSDPTrainRayActor

    calls = []
    monkeypatch.setattr(import_gc, "resume", lambda: calls.append("resume"))
    FSDPTrainRayActor(1, 0, "actor")
    RewardWorker(None, [])
    assert calls == ["resume", "resume"]  # EngineActor, and the order: tests/fast/rollout/test_engine.py


def test_built_in_families_import_with_the_collector_off(collector_restored, monkeypatch):
    import miles.models.base as base

    seen = []
    monkeypatch.delitem(base.TRAIN_PIPELINE_CONFIGS, "flux", raising=False)
    monkeypatch.setattr(base, "import_module", lambda name: seen.append((name, gc.isenabled())))
    base.family_class("flux")
    assert seen == [(base.BUILTIN_FAMILIES["flux"][0], False)] and gc.isenabled()
