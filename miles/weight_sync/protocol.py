"""The bucket protocol of the weight sync: the exported tensors, in the trainer's gather order, laid end to end in
flat byte buckets of at most `bucket_bytes`; one metadata record per bucket (each tensor's name, shape, dtype and byte
offset) fixed once per run, and per sync one (tensors, 2) int64 tensor of checksum terms per bucket (each tensor's
`miles.utils.weight_checksum.block_terms`), which the engine verifies over what it copied into its parameters.

The buckets lie either in two reused slots, or (`resident_offsets`, `shm` on one host) each at a place of its own in
one buffer the size of the whole sync: the engines' parameters themselves, mapped by every engine of the host."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

ALIGN = 64  # every tensor starts on a 64-byte boundary of its bucket: any dtype's view of it is aligned
DEFAULT_BUCKET_BYTES = {"cpu": 64 << 20, "cuda": 512 << 20}  # --weight-sync-bucket-mb's default, by device


@dataclass(frozen=True)
class TensorSlot:
    """One tensor's place in a bucket: its state-dict name, shape and dtype as sent, and its first byte."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix (a plain string crosses any boundary)
    offset: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize

    def view(self, bucket: torch.Tensor) -> torch.Tensor:
        """This tensor inside a flat uint8 bucket (no copy)."""
        return bucket[self.offset : self.offset + self.nbytes].view(self.torch_dtype).view(self.shape)


@dataclass(frozen=True)
class BucketMeta:
    """One bucket: its index in the sync, its used bytes and its tensors in order."""

    index: int
    nbytes: int
    tensors: tuple[TensorSlot, ...]


@dataclass(frozen=True)
class SyncPlan:
    """Every bucket of one sync and the bytes of the buffer that holds any of them (the largest bucket)."""

    buckets: tuple[BucketMeta, ...]
    buffer_bytes: int

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def names(self) -> list[str]:
        return [t.name for b in self.buckets for t in b.tensors]


def bucket_bytes_for(bucket_mb: int | None, device_type: str) -> int:
    """--weight-sync-bucket-mb in bytes; its default by device type."""
    return (
        bucket_mb << 20 if bucket_mb is not None else DEFAULT_BUCKET_BYTES["cuda" if device_type == "cuda" else "cpu"]
    )


def plan_buckets(entries: Sequence[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int) -> SyncPlan:
    """Cut (name, shape, dtype) entries, in order, into buckets of at most `bucket_bytes` (each tensor aligned to
    `ALIGN`). A tensor larger than `bucket_bytes` gets a bucket of its own, and the buffer grows to hold it; a model
    smaller than one bucket needs a buffer of its own size only."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"--weight-sync-bucket-mb: a bucket of {bucket_bytes} bytes is too small")
    buckets: list[BucketMeta] = []
    slots: list[TensorSlot] = []
    used = 0
    for name, shape, dtype in entries:
        slot = TensorSlot(name, tuple(int(s) for s in shape), str(dtype).removeprefix("torch."), 0)
        start = -(-used // ALIGN) * ALIGN
        if slots and start + slot.nbytes > bucket_bytes:
            buckets.append(BucketMeta(len(buckets), used, tuple(slots)))
            slots, start = [], 0
        slots.append(TensorSlot(slot.name, slot.shape, slot.dtype, start))
        used = start + slot.nbytes
    if slots:
        buckets.append(BucketMeta(len(buckets), used, tuple(slots)))
    return SyncPlan(tuple(buckets), -(-max([ALIGN, *(b.nbytes for b in buckets)]) // ALIGN) * ALIGN)


def resident_offsets(plan: SyncPlan) -> tuple[int, ...]:
    """Where each bucket starts when every bucket has a place of its own (the resident layout: the whole sync in one
    buffer, each bucket `ALIGN`ed), and the buffer's bytes as the last entry."""
    offsets = [0]
    for bucket in plan.buckets:
        offsets.append(offsets[-1] + -(-max(bucket.nbytes, 1) // ALIGN) * ALIGN)
    return tuple(offsets)


def split_by_bytes(plan: SyncPlan, members: int) -> list[list[int]]:
    """Per bucket, the member (0..members-1) that takes each tensor (a checksum to take or verify): the one with the
    fewest bytes so far in that bucket, largest tensors first. Pure over the plan: every member computes the same."""
    owners = []
    for bucket in plan.buckets:
        load = [0] * members
        mine = []
        for tensor in sorted(range(len(bucket.tensors)), key=lambda i: -bucket.tensors[i].nbytes):
            member = min(range(members), key=load.__getitem__)
            load[member] += bucket.tensors[tensor].nbytes
            mine.append((tensor, member))
        owners.append([member for _, member in sorted(mine)])
    return owners
