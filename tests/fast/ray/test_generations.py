"""--async-rollout's staleness bound: the trainer's weights version against the batch's, at most one update apart."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from miles.ray.generations import Generations, staleness_metrics


def test_staleness_is_recorded_only_under_async_rollout_and_at_most_one_update():
    manager = SimpleNamespace(weights_version=5)
    batch = {"rollout/weights_version": 4}
    assert staleness_metrics(SimpleNamespace(async_rollout=False), manager, 7, batch, 0.5) == {}
    assert staleness_metrics(SimpleNamespace(async_rollout=True), manager, 7, batch, 0.5) == {
        "rollout/staleness": 1,
        "rollout/trainer_weights_version": 5,
        "perf/generate_wait_s": 0.5,
    }
    assert staleness_metrics(SimpleNamespace(async_rollout=True), manager, 7, {}, 0.5) == {}  # no version: nothing


def test_a_batch_more_than_one_update_behind_is_an_error():
    args, manager = SimpleNamespace(async_rollout=True), SimpleNamespace(weights_version=5)
    with pytest.raises(RuntimeError, match="generated with weights version 3 but the trainer holds version 5"):
        staleness_metrics(args, manager, 7, {"rollout/weights_version": 3}, 0.0)


def test_an_ahead_batch_comes_with_its_staleness_and_the_next_one_is_asked_for():
    class Manager:
        weights_version = 0

        def __init__(self):
            self.asked, self.version_of = [], {}

        def generate(self, rollout_id):
            self.asked.append(rollout_id)
            self.version_of[rollout_id] = self.weights_version  # the weights the engines sample with
            return [f"box {rollout_id}"]

        def metrics(self, rollout_id):
            return {"rollout/weights_version": self.version_of[rollout_id]}

    manager = Manager()
    generations = Generations(SimpleNamespace(async_rollout=True, num_rollout=2), manager)
    try:
        data, metrics, generate_s = generations.get(0)
        assert data == ["box 0"] and generate_s >= 0 and 1 in generations.ahead  # rollout 1 asked for
        generations.ahead[1].result()  # generated with the weights before update 0
        assert list(metrics)[:3] == ["rollout/weights_version", "rollout/staleness", "rollout/trainer_weights_version"]
        assert metrics["rollout/staleness"] == 0 and metrics["perf/generate_wait_s"] >= 0
        manager.weights_version = 1  # update 0 synced while rollout 1 generated with the weights before it
        data, metrics, _ = generations.get(1)
        assert data == ["box 1"] and metrics["rollout/staleness"] == 1 and manager.asked == [0, 1]
    finally:
        generations.close()
    plain = Generations(SimpleNamespace(async_rollout=False, num_rollout=2), manager)
    assert plain.get(0)[1] == {"rollout/weights_version": 1}  # no staleness without --async-rollout
