"""Verified weight syncs and the first-window guard through the driver, in one run: the engines are handed other
weights than the trainer's at the first sync (with checksums that match them: no transit fault) and one corrupted
tensor at the fourth; the first window warns under --allow-rollout-mismatch, the fourth sync fails naming the tensor,
the engine and the rollout. The driver cannot touch the bytes of the sync group (`miles.ray.weight_sync`), so those
two syncs go through the engines' `update_weights` with a dict (the same verification and naming); the second and
third run over the sync group, and the run goes on through them (a transit fault over the group itself:
tests/fast/weight_sync/test_receiver.py)."""

from __future__ import annotations

import os

import pytest
import ray
import torch

import train_diffusion
from miles.backends.fsdp_utils.first_window_guard import LOG_PROB_BOUNDS
from miles.ray.weight_sync import WeightSyncLink
from miles.utils.tracking import read_metrics
from miles.utils.weight_checksum import WeightSyncError, tensor_checksums
from tests.e2e.test_policy_loss import policy_args

pytestmark = pytest.mark.e2e
TIMEOUT = 120
CORRUPTED = "transformer_blocks.0.attn.to_q.weight"


@pytest.fixture(scope="module")
def faulty_syncs(ray_cluster, tiny_pipeline_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("weight_sync")
    real_push, calls = WeightSyncLink.push, []

    def push(self, actor_group, version, rollout_id=None):
        calls.append(version)
        if len(calls) not in (1, 4):
            return real_push(self, actor_group, version, rollout_id)
        weights_ref, checksums_ref = actor_group.export_weights_ref()
        checksums, weights = ray.get(checksums_ref, timeout=TIMEOUT), ray.get(weights_ref, timeout=TIMEOUT)
        calls[-1] = checksums
        if len(calls) == 1:  # the sync before rollout 0: other weights, consistently checksummed
            weights = {**weights, "proj_out.weight": weights["proj_out.weight"] * 1.5}
            checksums = tensor_checksums(weights)
        else:  # the sync after rollout 2: one bit of one tensor flipped on the way
            weights = {**weights, CORRUPTED: weights[CORRUPTED].clone()}
            weights[CORRUPTED].view(-1).view(torch.int16)[7] ^= 1
        self.engines.update_weights(weights, version, rollout_id, checksums=checksums)
        return 0.0

    args = policy_args(
        tiny_pipeline_dir,
        out,
        *("--dp-size", "2", "--num-rollout", "4", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"),
        *("--num-steps-per-rollout", "1", "--micro-batch-size", "4", "--image-grid-interval", "0"),
        "--allow-rollout-mismatch",
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(WeightSyncLink, "push", push)
        with pytest.raises(WeightSyncError) as info:
            train_diffusion.run(args)
    return {"error": info.value, "out": out, "calls": calls}


def test_a_tensor_corrupted_in_transit_fails_the_run_naming_it_the_engine_and_the_rollout(faulty_syncs):
    message = str(faulty_syncs["error"])
    assert message.startswith("rollout engine 0 of 1, weight sync (version 4) of rollout 2: weights version 4: 1 of ")
    assert f"first '{CORRUPTED}'" in message
    # the trainer's checksums (rank 0 of 2, over the gathered pieces) cover exactly what the engines receive; the
    # syncs between went over the sync group (versions 2 and 3)
    assert len(faulty_syncs["calls"]) == 4 and CORRUPTED in faulty_syncs["calls"][0]
    assert faulty_syncs["calls"][1:3] == [2, 3]


def test_a_first_window_outside_the_bound_warns_under_allow_rollout_mismatch(faulty_syncs):
    records = [m for m in read_metrics(os.path.join(faulty_syncs["out"], "metrics.jsonl")) if m.get("role")]
    first, second = records[0], records[1]
    assert first["rollout_id"] == 0 and first["train/rollout_mismatch"] == 1.0
    assert first["train/log_prob_abs_diff"] > LOG_PROB_BOUNDS["fp32"]
    assert second["rollout_id"] == 1 and "train/rollout_mismatch" not in second  # once per run
