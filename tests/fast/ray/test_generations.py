"""--async-rollout's staleness bound: the trainer's weights version against the batch's, at most one update apart."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from miles.ray.generations import staleness_metrics


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
