"""The trainer's end of the weight sync: the bucket plan of the engines' weights (from global metadata, the same on
every rank) and the push, where rank 0 writes each gathered tensor's pieces straight into the transport's bucket slot
(no full CPU copy of the model), checksums it there (`weight_checksum.block_terms`) and hands the bucket over while
the next one is gathered."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from miles.backends.fsdp_utils.fsdp import gather_entries, gathered_tensors
from miles.utils.distributed import collective_device
from miles.utils.weight_checksum import block_terms
from miles.weight_sync.protocol import SyncPlan, plan_buckets
from miles.weight_sync.transports import Transport, TransportSpec, shared_buffer

logger = logging.getLogger(__name__)

# Bytes each rank sends per all-gather of a push, by collective device: larger than the gathers' default on CPU
# (`fsdp.GATHER_BUCKET_BYTES`), since a push streams every bucket out at once and fewer gloo calls win at size
# (docs/user-guide/performance.md, "The weight sync").
PUSH_GATHER_BYTES = {"cpu": 32 << 20, "cuda": 128 << 20}


def sync_plan(
    model: nn.Module,
    bucket_bytes: int,
    keep: Callable[[str], bool] | None = None,
    as_dtype: Callable[[str], torch.dtype | None] | None = None,
) -> SyncPlan:
    """The buckets of what `push` sends: the entries `keep` accepts, in the dtypes they are sent in."""
    entries = gather_entries(model.state_dict(), keep, as_dtype)
    return plan_buckets([(e.name, e.shape, e.dtype) for e in entries], bucket_bytes)


class WeightPusher:
    """One trainer rank's part of every weight sync of a run: the plan on every rank; the transport on rank 0."""

    def __init__(self, plan: SyncPlan, rank: int, device: torch.device) -> None:
        self.plan, self.rank, self.device = plan, rank, device
        self.transport: Transport | None = None
        self.shared: torch.Tensor | None = None

    def buffer_device(self, kind: str) -> torch.device:
        """Where rank 0's slots live: the GPU for `cuda_ipc` / `nccl`, host memory for `shm` / `gloo`."""
        return self.device if kind in ("cuda_ipc", "nccl") else torch.device("cpu")

    def prepare(self, kind: str) -> str | tuple | None:
        """Rank 0: create the persistent buffer of a shared transport; what the engines open it with."""
        self.shared, opener = shared_buffer(kind, self.plan.buffer_bytes, self.buffer_device(kind))
        return opener

    def open(self, spec: TransportSpec) -> None:
        """Rank 0: join the sync group (with the engines, which join at the same time)."""
        self.transport = Transport(spec, 0, self.buffer_device(spec.kind), self.shared)
        self.shared = None  # the transport holds it now

    @torch.no_grad()
    def push(self, model: nn.Module, keep=None, as_dtype=None) -> float:
        """Gather the weights (collective, every rank) and, on rank 0, send every bucket; seconds rank 0 spent
        until the engines took the last bucket (0 elsewhere)."""
        started = time.perf_counter()
        gather_bytes = PUSH_GATHER_BYTES.get(collective_device().type, PUSH_GATHER_BYTES["cuda"])
        tensors = gathered_tensors(model, bucket_bytes=gather_bytes, keep=keep, as_dtype=as_dtype)
        if self.rank != 0:
            for _ in tensors:  # the other ranks only take part in the gathers
                pass
            return 0.0
        if self.transport is None:
            raise RuntimeError("push before the weight sync was opened (`open` on rank 0)")
        slots = ((bucket, slot) for bucket in self.plan.buckets for slot in bucket.tensors)
        terms: list[torch.Tensor] = []
        for name, shape, pieces, _ in tensors:
            bucket, slot = next(slots, (None, None))
            if slot is None or slot.name != name or tuple(shape) != slot.shape:
                raise RuntimeError(
                    f"weight sync: gathered {name} {tuple(shape)} where the plan has "
                    f"{None if slot is None else (slot.name, slot.shape)}: the model changed since the plan was made"
                )
            if slot is bucket.tensors[0]:
                data = self.transport.slot(bucket)
            region, offset = data[slot.offset : slot.offset + slot.nbytes], 0
            for piece in pieces:
                flat = piece.contiguous().view(-1).view(torch.uint8)
                region[offset : offset + flat.numel()].copy_(flat)
                offset += flat.numel()
            terms.append(block_terms(region))  # over the bytes as they leave: contiguous, whatever the gather's split
            if slot is bucket.tensors[-1]:
                self.transport.send(bucket, torch.stack(terms))
                terms = []
        if next(slots, None) is not None:
            raise RuntimeError("weight sync: the gather yielded fewer tensors than the plan holds")
        self.transport.finish()
        return time.perf_counter() - started

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
