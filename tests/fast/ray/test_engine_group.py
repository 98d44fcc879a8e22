"""The rollout engine group's own work: the prompt cache fill at start-up, where the engines that share a cache key
split the distinct prompts and every engine frees its text encoders only when the set is whole; each engine's Ray
options."""

from __future__ import annotations

import ray

from miles.arguments.engine import EngineTimeouts
from miles.ray.engine_group import RolloutEngineGroup, engine_options

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

    def _fill(self, prompts, negatives, resolution, guided):
        assert (resolution, guided) == (64, True)  # the run's: each engine sizes its fill's micro-batches by them
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
    totals = group_of(engines).fill_prompt_cache(prompts, ["neg"], False, 64, True)

    distinct = ["p0", "p1", "p2", "p3", "p4"]
    (first, neg_first), (second, neg_second) = engines[0].filled[0], engines[1].filled[0]
    assert first + second == distinct and first and second  # disjoint contiguous slices of the key's set
    assert (neg_first, neg_second) == (["neg"], [])  # the negative once per key
    assert engines[2].filled == [(distinct, ["neg"])]  # alone with its key: everything
    assert totals == {"found": 3, "encoded": 5 + 1 + 5 + 1 - 3}
    assert not any(e.released for e in engines)

    group_of(engines).fill_prompt_cache(prompts, ["neg"], True, 64, True)
    assert all(e.released for e in engines)


def test_an_engine_without_colocation_asks_for_its_own_shares():
    assert engine_options(3, 0.5, 0.0) == {"num_cpus": 0.5, "num_gpus": 0.0}
    assert engine_options(0, 1.0, 1.0) == {"num_cpus": 1.0, "num_gpus": 1.0}
