"""What a simulated rank is seen to hold (miles/plan/tracker.py): every storage an op makes counted once until it
dies, each phase's peak and what stays after it, storages resized in place, tensors made before it was entered."""

from __future__ import annotations

import torch

from miles.plan.tracker import Collective, PlanTracker


def test_live_bytes_count_each_storage_once_until_it_dies_and_phases_keep_their_peaks():
    with PlanTracker() as tracker:
        kept = torch.empty(1000)  # 4000 bytes
        view = kept[:10]  # the same storage: not counted again
        assert tracker.live_bytes == 4000 and view.numel() == 10
        with tracker.in_phase("train"):
            scratch = torch.empty(500, dtype=torch.float64)  # 4000 more
            assert tracker.live_bytes == 8000
            del scratch
            assert tracker.live_bytes == 4000
        assert tracker.peaks == {"start-up": 4000, "train": 8000} and tracker.after == {"train": 4000}
        assert tracker.phase == "start-up"


def test_a_storage_resized_in_place_is_followed_and_restored():
    """FSDP2 frees its gathered parameters by resizing their storages to 0 (and sleep / wake alike)."""
    with PlanTracker() as tracker:
        weight = torch.empty(256)
        storage = weight.untyped_storage()
        storage.resize_(0)
        assert tracker.live_bytes == 0
        storage.resize_(1024)
        assert tracker.live_bytes == 1024 and tracker.peaks["start-up"] == 1024
    storage.resize_(0)  # outside the tracker: resize_ is torch's own again
    assert tracker.live_bytes == 1024


def test_tensors_made_before_entering_are_adopted_once():
    before = [torch.empty(100), torch.empty(50)]
    with PlanTracker() as tracker:
        tracker.adopt(before)
        tracker.adopt(before[:1])
        assert tracker.live_bytes == 600
        tracker.adopt([torch.empty(10, device="meta")])  # meta tensors hold nothing
        assert tracker.live_bytes == 600


def test_a_collective_describes_itself_as_every_rank_must_issue_it():
    collective = Collective("allreduce_", 2, "float32", 12, "train")
    assert collective.describe() == "allreduce_ over 2 ranks, 12 x float32 (train)"
