"""The prompt cache fill at start-up: the manager asks for the prompts the run's rollouts draw (and the eval prompts),
the engines that share a cache key split them, and every engine frees its text encoders only when the set is whole."""

from __future__ import annotations

import ray

from miles.arguments.engine import EngineTimeouts
from miles.arguments.parser import default_args
from miles.arguments.records import RolloutFlags
from miles.ray.engine_group import RolloutEngineGroup
from miles.ray.rollout_manager import RolloutManager
from miles.rollout.data_source import PromptDataSource
from miles.rollout.prompt_cache import PromptCacheConfig

TIMEOUT = 60


class _Remote:
    """An actor method's `.remote`, answered at once through the object store."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        return ray.put(self.fn(*args))


class FakeEngine:
    def __init__(self, key: str) -> None:
        self.filled: list[tuple[list[str], list[str]]] = []
        self.released = False
        self.prompt_cache_key = _Remote(lambda: key)
        self.fill_prompt_cache = _Remote(self._fill)
        self.release_text_encoders = _Remote(self._release)

    def _fill(self, prompts, negatives):
        self.filled.append((list(prompts), list(negatives)))
        return {"found": 1, "encoded": len(prompts) + len(negatives) - 1}

    def _release(self):
        self.released = True
        return True


def group_of(engines) -> RolloutEngineGroup:
    group = RolloutEngineGroup.__new__(RolloutEngineGroup)
    group.engines, group.failed = engines, False
    group.timeouts = EngineTimeouts(startup_s=TIMEOUT, sync_s=TIMEOUT)
    group.on_progress, group.poll_s, group.log_every_s = None, 1.0, 30.0
    return group


def test_engines_sharing_a_key_split_the_distinct_prompts_and_free_their_encoders_once_all_are_in(ray_cluster):
    engines = [FakeEngine("a"), FakeEngine("a"), FakeEngine("b")]  # two alike, one on another device / thread count
    prompts = ["p0", "p1", "p0", "p2", "p3", "p4", "p1"]
    totals = group_of(engines).fill_prompt_cache(prompts, ["neg"], release=False)

    distinct = ["p0", "p1", "p2", "p3", "p4"]
    (first, neg_first), (second, neg_second) = engines[0].filled[0], engines[1].filled[0]
    assert first + second == distinct and first and second  # disjoint contiguous slices of the key's set
    assert (neg_first, neg_second) == (["neg"], [])  # the negative once per key
    assert engines[2].filled == [(distinct, ["neg"])]  # alone with its key: everything
    assert totals == {"found": 3, "encoded": 5 + 1 + 5 + 1 - 3}
    assert not any(e.released for e in engines)

    group_of(engines).fill_prompt_cache(prompts, ["neg"], release=True)
    assert all(e.released for e in engines)


class RecordingEngines:
    def __init__(self) -> None:
        self.calls = []

    def fill_prompt_cache(self, prompts, negatives, release):
        self.calls.append((prompts, negatives, release))
        return {"found": 0, "encoded": len(set(prompts)) + len(negatives)}


def manager_of(records, hooks=None) -> RolloutManager:
    manager = RolloutManager.__new__(RolloutManager)
    manager.flags = RolloutFlags.from_args(default_args(num_rollout=3, negative_prompt="neg"))
    manager.records, manager.hooks, manager.engines = records, hooks or {}, RecordingEngines()
    manager.source = PromptDataSource(len(records), 2, seed=5, shuffle=True)
    manager.prompt_cache = PromptCacheConfig("unused", "f")
    return manager


def test_the_manager_fills_what_the_rollouts_draw_and_keeps_the_encoders_when_prompts_may_come_from_elsewhere():
    records = [{"prompt": f"prompt {i}"} for i in range(20)]
    manager = manager_of(records)
    manager.fill_prompt_cache(["eval a", "eval b"], start_rollout_id=1)
    drawn = sorted({i for rollout_id in (1, 2) for i in manager.source.indices(rollout_id)})
    assert manager.engines.calls == [([f"prompt {i}" for i in drawn] + ["eval a", "eval b"], ["neg"], True)]

    for hooks, eval_prompts in (({"data_source_path": print}, []), ({"dynamic_sampling_filter_path": print}, []),
                                ({}, None)):  # fmt: skip
        manager = manager_of(records, hooks)
        manager.fill_prompt_cache(eval_prompts)
        assert manager.engines.calls[0][2] is False  # filled, encoders kept

    manager = manager_of([{"prompt": "edit it", "source_images": ["a.png"]}])
    manager.fill_prompt_cache([])
    assert manager.engines.calls == []  # cached at first use, with the images
