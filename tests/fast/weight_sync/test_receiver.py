"""The engine's end of the weight sync: a plan that does not bind the engine's tensors is refused before any sync,
a tensor changed in transit is named once every bucket was taken (the trainer is never left waiting), and a stale
version is drained without loading anything."""

from __future__ import annotations

import pytest
import torch

from miles.utils.weight_checksum import WeightSyncError
from miles.weight_sync.receiver import check_plan, drain
from miles.weight_sync.transports import Transport
from tests.fast.weight_sync.sync_helpers import mixed_weights, plan_of, run_sync, sync_into


def test_a_bit_flipped_in_transit_is_named_after_every_bucket_is_taken():
    weights = mixed_weights()
    targets = [{n: torch.zeros_like(t) for n, t in weights.items()}]
    errors = sync_into("shm", weights, targets, corrupt="b.weight", syncs=2)
    assert len(errors[0]) == 2  # both syncs ran to the end (the trainer was not left waiting) and both failed
    assert "1 of 1 tensors of bucket 1 differ" in str(errors[0][0]) and "first 'b.weight'" in str(errors[0][0])
    assert torch.equal(targets[0]["c.weight"], weights["c.weight"])  # the buckets after it were still taken


def test_a_plan_that_does_not_bind_the_engine_is_refused_before_any_sync():
    weights = mixed_weights()
    plan = plan_of(weights)
    check_plan(plan, dict(weights), complete=True)
    with pytest.raises(WeightSyncError, match="no tensor for.*'steps'"):
        check_plan(plan, {n: t for n, t in weights.items() if n != "steps"}, complete=True)
    with pytest.raises(WeightSyncError, match="a.weight: the trainer sends shape \\(33, 7\\), the engine holds"):
        check_plan(plan, {**weights, "a.weight": torch.zeros(7, 33)}, complete=True)
    with pytest.raises(WeightSyncError, match="leaves 1 engine tensors unchanged"):
        check_plan(plan, {**weights, "extra": torch.zeros(1)}, complete=True)
    check_plan(plan, {**weights, "extra": torch.zeros(1)}, complete=False)  # LoRA: the base weights stay


def test_a_stale_version_is_drained_every_bucket_taken_and_nothing_loaded():
    weights = mixed_weights()
    plan = plan_of(weights)
    target = {n: torch.zeros_like(t) for n, t in weights.items()}

    def engine(spec, rank):
        drain(Transport(spec, rank, torch.device("cpu")), plan)

    run_sync("shm", weights, [engine], plan=plan)  # returns once the engine took every bucket (else it waits)
    assert len(plan.buckets) == 3 and all(t.abs().sum() == 0 for t in target.values())
