"""The weight sync's bucket protocol: the plan lays the tensors end to end, aligned, in buckets of at most the flag's
bytes; a slot is a view of its bucket's bytes; --weight-sync-bucket-mb in bytes and its default by device."""

from __future__ import annotations

import pytest
import torch

from miles.weight_sync.protocol import ALIGN, DEFAULT_BUCKET_BYTES, TensorSlot, bucket_bytes_for, plan_buckets
from tests.fast.weight_sync.sync_helpers import mixed_weights


def test_plan_lays_tensors_aligned_in_order_and_gives_an_oversized_one_its_own_bucket():
    weights = mixed_weights()
    plan = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in weights.items()], bucket_bytes=4096)
    layout = [[(t.name, t.offset) for t in b.tensors] for b in plan.buckets]
    # 33*7*4 = 924 bytes, then 14 -> 960 (aligned), 4 -> 1024, 40 -> 1088; 16 KiB alone; 30 bytes
    assert layout == [
        [("a.weight", 0), ("a.bias", 960), ("scale", 1024), ("steps", 1088)],
        [("b.weight", 0)],
        [("c.weight", 0)],
    ]
    assert [b.nbytes for b in plan.buckets] == [1128, 16384, 30]
    assert plan.buffer_bytes == 16384 and plan.total_bytes == 1128 + 16384 + 30
    assert all(t.offset % ALIGN == 0 for b in plan.buckets for t in b.tensors)
    assert plan.names == list(weights)


def test_a_small_model_needs_a_buffer_of_its_own_size_and_a_bucket_below_one_alignment_is_refused():
    plan = plan_buckets([("w", (3,), torch.float32)], bucket_bytes=1 << 20)
    assert plan.buffer_bytes == ALIGN and plan.total_bytes == 12
    assert plan_buckets([], bucket_bytes=1 << 20).buckets == ()
    with pytest.raises(ValueError, match="--weight-sync-bucket-mb: a bucket of 32 bytes is too small"):
        plan_buckets([("w", (3,), torch.float32)], bucket_bytes=32)


def test_a_slot_is_a_view_of_its_bytes_in_the_bucket():
    slot = TensorSlot("w", (2, 3), "bfloat16", 64)
    assert slot.torch_dtype is torch.bfloat16 and slot.nbytes == 12
    bucket = torch.zeros(128, dtype=torch.uint8)
    view = slot.view(bucket)
    view.copy_(torch.full((2, 3), 1.5, dtype=torch.bfloat16))
    assert view.data_ptr() == bucket.data_ptr() + 64  # no copy
    assert bucket[:64].sum() == 0 and bucket[76:].sum() == 0 and bucket[64:76].sum() > 0


def test_the_bucket_flag_is_in_mib_with_a_default_by_device():
    assert bucket_bytes_for(3, "cpu") == bucket_bytes_for(3, "cuda") == 3 << 20
    assert bucket_bytes_for(None, "cpu") == DEFAULT_BUCKET_BYTES["cpu"] == 64 << 20
    assert bucket_bytes_for(None, "cuda") == 512 << 20
