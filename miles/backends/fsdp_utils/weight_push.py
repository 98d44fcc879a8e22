"""The trainer's end of the weight sync: the bucket plan of the engines' weights (from global metadata, the same on
every rank) and the push, where rank 0 writes each gathered tensor's pieces straight into the transport's bucket slot
(no full CPU copy of the model), checksums it there (`weight_checksum.block_terms`) and hands the bucket over while
the next one is gathered."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from miles.backends.fsdp_utils.gather import GatherEntry, gather_entries, gathered_tensors
from miles.utils.distributed import collective_device
from miles.utils.weight_checksum import block_terms, block_terms_range
from miles.weight_sync.protocol import BucketMeta, SyncPlan, plan_buckets, resident_offsets, split_by_bytes
from miles.weight_sync.transports import SLOTS, Transport, TransportSpec, shared_buffer, shm_has_room

logger = logging.getLogger(__name__)

# Bytes each rank sends per all-gather of a push, by collective device: larger than the gathers' default on CPU
# (`gather.GATHER_BUCKET_BYTES`), since a push streams every bucket out at once and fewer gloo calls win at size
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
    """One trainer rank's part of every weight sync of a run: the plan on every rank; the transport on rank 0. With
    `direct` (shm, every trainer rank on rank 0's node) every rank maps the bucket file and writes its own shards into
    it: no all-gather at all. `offsets` (resident shm): the file holds the whole sync, each bucket at its own place
    (`protocol.resident_offsets`), which the engines' parameters are views of."""

    def __init__(self, plan: SyncPlan, rank: int, device: torch.device) -> None:
        self.plan, self.rank, self.device = plan, rank, device
        self.transport: Transport | None = None
        self.shared: torch.Tensor | None = None
        self.direct = False
        self.offsets: tuple[int, ...] | None = None

    def buffer_device(self, kind: str) -> torch.device:
        """Where rank 0's slots live: the GPU for `cuda_ipc` / `nccl`, host memory for `shm` / `gloo`."""
        return self.device if kind in ("cuda_ipc", "nccl") else torch.device("cpu")

    def prepare(self, kind: str, direct: bool = False, resident: bool = False) -> str | tuple | None:
        """Rank 0: create the persistent buffer of a shared transport; what the engines open it with. `direct`
        (collective, `shm` only): every rank maps the file before this returns on any of them. `resident` (`shm`
        only): the file holds the whole sync where /dev/shm has the room (`self.offsets`), else two slots."""
        opener = None
        if self.rank == 0:
            offsets = resident_offsets(self.plan) if resident and kind == "shm" else None
            if offsets is not None and not shm_has_room(offsets[-1]):
                logger.warning(
                    "weight sync: /dev/shm lacks %d MB free for the engines' shared weights; two %d MB bucket slots "
                    "instead, which each engine copies out of",
                    offsets[-1] >> 20,
                    self.plan.buffer_bytes >> 20,
                )
                offsets = None
            self.offsets = offsets
            total = None if offsets is None else offsets[-1]
            self.shared, opener = shared_buffer(kind, self.plan.buffer_bytes, self.buffer_device(kind), total)
        self.direct = direct and kind == "shm"
        if self.direct:
            shared: list[Any] = [opener, self.offsets]  # what rank 0 broadcasts, unpickled
            dist.broadcast_object_list(shared, src=0)  # the file's name and layout
            if self.rank != 0:
                self.offsets = shared[1]
                size = self.plan.buffer_bytes * SLOTS if self.offsets is None else self.offsets[-1]
                self.shared = torch.from_file(shared[0], shared=True, size=size, dtype=torch.uint8)
            dist.barrier()  # mapped everywhere: rank 0 may unlink it once the engines have too
        return opener

    def _region(self, bucket: BucketMeta) -> torch.Tensor:
        """A rank other than 0 (direct): the place of `bucket` in its mapping of the file, as `Transport.view`."""
        shared = self.shared
        if shared is None:
            raise RuntimeError(f"weight sync: rank {self.rank} has not mapped the bucket file (`prepare`, direct)")
        if self.offsets is not None:
            return shared[self.offsets[bucket.index] : self.offsets[bucket.index + 1]]
        start = (bucket.index % SLOTS) * self.plan.buffer_bytes
        return shared[start : start + self.plan.buffer_bytes]

    def _transport(self) -> Transport:
        """Rank 0's end of the sync group (`open`)."""
        if self.transport is None:
            raise RuntimeError("push before the weight sync was opened (`open` on rank 0)")
        return self.transport

    def open(self, spec: TransportSpec) -> None:
        """Rank 0: join the sync group (with the engines, which join at the same time)."""
        self.transport = Transport(spec, 0, self.buffer_device(spec.kind), self.shared)
        if not self.direct:
            self.shared = None  # the transport holds it now

    @torch.no_grad()
    def push_direct(self, model: nn.Module, keep=None, as_dtype=None) -> float:
        """Every rank writes its own dim-0 shard rows of each tensor into the bucket where the full tensor's rows lie
        (rank 0 the tensors of other layouts), then rank 0 checksums and sends the bucket (collective)."""
        started = time.perf_counter()
        state = model.state_dict()
        entries = {entry.name: entry for entry in gather_entries(state, keep, as_dtype)}
        owners = checksum_owners(self.plan, dist.get_world_size())
        for bucket in self.plan.buckets:
            # rank 0: once the engines are done with the slot's last bucket (resident: are in the sync)
            data = self._transport().slot(bucket) if self.rank == 0 else self._region(bucket)
            dist.barrier()  # ... which the other ranks learn here
            for slot in bucket.tensors:
                region = data[slot.offset : slot.offset + slot.nbytes]
                _write_own_rows(state[slot.name], entries[slot.name], region, self.rank == 0)
            dist.barrier()  # every rank's rows are in
            # the checksums split over the ranks by tensor, summed to rank 0 (int64 sums wrap alike everywhere)
            terms = torch.zeros(len(bucket.tensors), 2, dtype=torch.int64)
            for i, t in enumerate(bucket.tensors):
                if owners[bucket.index][i] == self.rank:
                    terms[i] = block_terms(data[t.offset : t.offset + t.nbytes])
            dist.reduce(terms, dst=0)
            if self.rank == 0:
                self._transport().send(bucket, terms)
        if self.rank == 0:
            self._transport().finish()
        return time.perf_counter() - started if self.rank == 0 else 0.0

    @torch.no_grad()
    def push_resident(self, model: nn.Module, keep=None, as_dtype=None) -> float:
        """`push_direct` into the resident layout: once every engine has entered the sync, every rank writes its own
        rows of the whole sync into the engines' shared parameters, checksumming them as it writes (no second read);
        the terms summed to rank 0, which hands them over bucket by bucket. Three collectives a sync instead of three a bucket: no place is written twice in a
        sync, so the trainer never waits for the engines' reading."""
        started = time.perf_counter()
        state = model.state_dict()
        entries = {entry.name: entry for entry in gather_entries(state, keep, as_dtype)}
        # rank 0's first slot waits for every engine to be in the sync (not sampling); the others learn it here
        places = [self._transport().slot(b) if self.rank == 0 else self._region(b) for b in self.plan.buckets]
        dist.barrier()
        # each rank checksums what it writes, chunk by chunk while in cache; the terms of a tensor whose parts do
        # not lie on 64-bit words are its owner's, over the whole once every part is in
        terms = [torch.zeros(len(bucket.tensors), 2, dtype=torch.int64) for bucket in self.plan.buckets]
        whole: list[tuple[int, int]] = []  # (bucket, tensor) checksummed whole
        for bucket, data, mine in zip(self.plan.buckets, places, terms):
            for i, slot in enumerate(bucket.tensors):
                region = data[slot.offset : slot.offset + slot.nbytes]
                share = _write_own_rows(state[slot.name], entries[slot.name], region, self.rank == 0, checksum=True)
                if share is None:
                    whole.append((bucket.index, i))
                else:
                    mine[i] = share
        if whole:
            dist.barrier()  # every rank's rows are in
            owners = checksum_owners(self.plan, dist.get_world_size())
            for b, i in whole:
                t = self.plan.buckets[b].tensors[i]
                if owners[b][i] == self.rank:
                    terms[b][i] = block_terms(places[b][t.offset : t.offset + t.nbytes])
        flat = torch.cat(terms)
        dist.reduce(flat, dst=0)
        if self.rank != 0:
            return 0.0
        transport = self._transport()
        for bucket, bucket_terms in zip(self.plan.buckets, flat.split([len(b.tensors) for b in self.plan.buckets])):
            transport.send(bucket, bucket_terms)
        transport.finish()
        return time.perf_counter() - started

    @torch.no_grad()
    def push(self, model: nn.Module, keep=None, as_dtype=None) -> float:
        """Gather the weights (collective, every rank) and, on rank 0, send every bucket; seconds rank 0 spent
        until the engines took the last bucket (0 elsewhere). `push_direct` where the ranks map the buckets."""
        if self.direct:
            resident = self.offsets is not None
            return (self.push_resident if resident else self.push_direct)(model, keep, as_dtype)
        started = time.perf_counter()
        gather_bytes = PUSH_GATHER_BYTES.get(collective_device().type, PUSH_GATHER_BYTES["cuda"])
        tensors = gathered_tensors(model, bucket_bytes=gather_bytes, keep=keep, as_dtype=as_dtype)
        if self.rank != 0:
            for _ in tensors:  # the other ranks only take part in the gathers
                pass
            return 0.0
        transport = self._transport()
        slots = ((bucket, slot) for bucket in self.plan.buckets for slot in bucket.tensors)
        terms: list[torch.Tensor] = []
        for name, shape, pieces, _ in tensors:
            bucket, slot = next(slots, (None, None))
            if bucket is None or slot is None or slot.name != name or tuple(shape) != slot.shape:
                raise RuntimeError(
                    f"weight sync: gathered {name} {tuple(shape)} where the plan has "
                    f"{None if slot is None else (slot.name, slot.shape)}: the model changed since the plan was made"
                )
            if slot is bucket.tensors[0]:
                data = transport.slot(bucket)
            region, offset = data[slot.offset : slot.offset + slot.nbytes], 0
            for piece in pieces:
                flat = piece.contiguous().view(-1).view(torch.uint8)
                region[offset : offset + flat.numel()].copy_(flat)
                offset += flat.numel()
            terms.append(block_terms(region))  # over the bytes as they leave: contiguous, whatever the gather's split
            if slot is bucket.tensors[-1]:
                transport.send(bucket, torch.stack(terms))
                terms = []
        if next(slots, None) is not None:
            raise RuntimeError("weight sync: the gather yielded fewer tensors than the plan holds")
        transport.finish()
        return time.perf_counter() - started

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None


def checksum_owners(plan: SyncPlan, world_size: int) -> list[list[int]]:
    """Per bucket, the rank that checksums each tensor: the one with the fewest bytes so far (the same on every
    rank: the plan is)."""
    return split_by_bytes(plan, world_size)


def _write_own_rows(
    value: torch.Tensor, entry: GatherEntry, region: torch.Tensor, rank0: bool, checksum: bool = False
) -> torch.Tensor | None:
    """This rank's part of one tensor, cast to the dtype it is sent in, into `region` (the full tensor's bytes): its
    dim-0 shard rows where they lie in the full tensor (replica 0 of a hybrid mesh only; FSDP2 splits rows as
    `torch.chunk`), or on rank 0 the whole of a tensor of another layout (gathered first where that is collective).
    `checksum`: this rank's share of the tensor's `block_terms` (zeros where it writes nothing), taken over each
    `WRITE_CHUNK` just written while it is in cache; None where the ranks' parts do not lie on 64-bit words (then
    someone checksums the whole tensor once every part is in: `shares_checksums`)."""
    zero = torch.zeros(2, dtype=torch.int64) if checksum and shares_checksums(entry) else None
    if entry.layout is None:
        value = value.to(entry.dtype)
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if rank0:
            return _copy_summed(full.detach().contiguous().view(-1).view(torch.uint8), region, 0, zero)
        return zero
    if not isinstance(value, DTensor):
        raise TypeError(f"{entry.name}: sharded in the plan ({entry.layout}) but not a DTensor on this rank")
    mesh, dim = value.device_mesh, entry.layout.shard_dim
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise RuntimeError(f"{entry.name}: this rank is not in the device mesh of its shards")
    if any(c != 0 for i, c in enumerate(coordinate) if i != dim):
        return zero  # another replica of this shard group writes the same rows
    rows, row = entry.shape[0], math.prod(entry.shape[1:])
    chunk = -(-rows // mesh.size(dim))
    first = coordinate[dim] * chunk
    mine = max(0, min(chunk, rows - first))
    local = value.to_local()
    if local.shape[0] != mine:
        raise RuntimeError(
            f"{entry.name}: this rank holds {local.shape[0]} rows of {rows}, not {mine} of an even split"
        )
    if not mine:
        return zero
    size = entry.dtype.itemsize
    flat = local.detach().to(entry.dtype).contiguous().view(-1).view(torch.uint8)
    return _copy_summed(flat, region, first * row * size, zero)


WRITE_CHUNK = 4 << 20  # bytes copied, then checksummed while in cache (a multiple of 512: whole checksum blocks)


def shares_checksums(entry: GatherEntry) -> bool:
    """Whether every rank's part of the tensor starts on a 64-bit word (its rows times the bytes a rank's chunk of
    rows holds), so that each rank can take its share of `block_terms` (`block_terms_range`). The same on every
    rank: global metadata only."""
    if entry.layout is None:
        return True
    rows_per_rank = -(-entry.shape[0] // entry.layout.group_size)
    return rows_per_rank * math.prod(entry.shape[1:]) * entry.dtype.itemsize % 8 == 0


def _copy_summed(source: torch.Tensor, region: torch.Tensor, start: int, terms: torch.Tensor | None):
    """Copy the bytes `source` to `region[start:]`; with `terms`, add their `block_terms_range` chunk by chunk."""
    if terms is None:
        region[start : start + source.numel()].copy_(source)
        return None
    total = region.numel()
    for offset in range(0, source.numel(), WRITE_CHUNK):
        piece = region[start + offset : start + min(offset + WRITE_CHUNK, source.numel())]
        piece.copy_(source[offset : offset + WRITE_CHUNK])
        terms += block_terms_range(piece, start + offset, total)
    return terms
