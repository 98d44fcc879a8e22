"""The garbage collector paused during imports (`miles.utils.import_gc`): in a Ray worker from the top of an actor
class's module to the actor's `__init__`, in the driver during its start-up, and never left off."""

from __future__ import annotations

import ast
import gc
import importlib.util
import sys
import time
from pathlib import Path

import pytest

from miles.ray.reward_workers import RewardWorker
from miles.utils import import_gc

ACTOR_MODULES = ["miles.ray.train_group", "miles.ray.engine_group", "miles.ray.reward_workers"]


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
    monkeypatch.setattr(import_gc, "in_ray_worker", lambda: True)
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


def test_every_miles_actor_resumes_the_collector_first_thing(collector_restored, monkeypatch):
    from miles.backends.fsdp_utils.actor import FSDPTrainRayActor
    from miles.ray.train_group import TrainRankActor

    seen = []  # whether the collector was on when the trunk's own __init__ began
    monkeypatch.setattr(FSDPTrainRayActor, "__init__", lambda self, *args: seen.append(gc.isenabled()))
    monkeypatch.setattr(import_gc, "in_ray_worker", lambda: True)
    for make in (lambda: TrainRankActor(1, 0, "actor"), lambda: RewardWorker(None, [])):
        assert import_gc.pause_in_ray_worker() and not gc.isenabled()
        make()
        assert gc.isenabled()
    assert seen == [True]  # EngineActor, and the order: tests/fast/rollout/test_engine.py


@pytest.mark.parametrize("module", ACTOR_MODULES)
def test_each_actor_module_pauses_the_collector_before_its_heavy_imports(module):
    """A Ray worker imports the module of the actor class it starts: only the standard library and import_gc may
    come before the pause, every other import after it."""
    body = ast.parse(Path(importlib.util.find_spec(module).origin).read_text()).body
    pause = next(
        i
        for i, node in enumerate(body)
        if isinstance(node, ast.Expr) and ast.unparse(node.value) == "import_gc.pause_in_ray_worker()"
    )
    before = [
        alias.name if isinstance(node, ast.Import) else node.module
        for node in body[:pause]
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in (node.names if isinstance(node, ast.Import) else [None])
    ]
    allowed = set(sys.stdlib_module_names) | {"__future__", "miles.utils"}
    assert before and all(name.split(".")[0] in allowed or name in allowed for name in before), before
    assert any(isinstance(node, (ast.Import, ast.ImportFrom)) for node in body[pause:])


def test_built_in_families_import_with_the_collector_off(collector_restored, monkeypatch):
    import miles.models.family_registry as registry

    seen = []
    monkeypatch.delitem(registry.TRAIN_PIPELINE_CONFIGS, "flux", raising=False)
    monkeypatch.setattr(registry, "import_module", lambda name: seen.append((name, gc.isenabled())))
    registry.family_class("flux")
    assert seen == [(registry.BUILTIN_FAMILIES["flux"][0], False)] and gc.isenabled()
