"""The weight sync's transports, chosen by placement (`choose_transport`): one sync group of the trainer's rank 0
(group rank 0) and the engines (ranks 1..E) carries the per-bucket signals and checksum terms; the bytes go

- `shm`: through a shared-memory file on one CPU host, mapped by every member;
- `cuda_ipc`: through one persistent device buffer of rank 0 opened by engines on the same GPU;
- `gloo` / `nccl`: as a broadcast of each bucket over the group (CPU hosts apart / GPUs apart).

Each keeps `SLOTS` bucket buffers, created once per run and reused by every sync: the trainer gathers the next bucket
into one slot while the engines copy the last one out of the other. `shm` on one host is resident instead where
/dev/shm has the room (`TransportSpec.offsets`): the file holds the whole sync, each bucket at a place of its own, and
the engines' parameters are views of it (`receiver.bind_resident`): the trainer ranks write the weights straight
into every engine's parameters, with no copy on the engines' side, once every engine has entered the sync (`begin`).
Nothing here pickles a tensor.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from miles.weight_sync.protocol import BucketMeta

logger = logging.getLogger(__name__)

TRANSPORTS = ("shm", "gloo", "cuda_ipc", "nccl")
SLOTS = 2  # bucket buffers per transport: one filled while the other is read


@dataclass(frozen=True)
class TransportSpec:
    """What every member of a sync group needs to join it (a plain record the driver sends to each)."""

    kind: str  # one of TRANSPORTS
    master_addr: str  # rank 0's address: the sync group's store
    master_port: int
    world_size: int  # 1 + the number of engines
    buffer_bytes: int  # one slot: the plan's largest bucket
    timeout_s: float
    shm_path: str | None = None  # `shm`: the file rank 0 creates and the engines map
    # `shm` resident: where each bucket starts in the file, its bytes last (`protocol.resident_offsets`); None: slots
    offsets: tuple[int, ...] | None = None

    @property
    def resident(self) -> bool:
        return self.offsets is not None

    @property
    def shared_bytes(self) -> int:
        """The bytes of the buffer rank 0 shares (`shm`, `cuda_ipc`): the whole sync if resident, else the slots."""
        return self.offsets[-1] if self.offsets is not None else self.buffer_bytes * SLOTS


def choose_transport(trainer: dict, engines: list[dict], device: str) -> str:
    """The transport for a placement (`miles.ray.placement_group.actor_nodes` records of trainer rank 0 and the
    engines): on CPU `shm` when every engine runs on rank 0's node, else `gloo`; on CUDA `cuda_ipc` when every
    engine runs on rank 0's GPU, `nccl` when none does, `gloo` (over host memory) when some do."""
    same_node = [e["node_id"] == trainer["node_id"] for e in engines]
    if device != "cuda":
        return "shm" if all(same_node) else "gloo"
    same_gpu = [n and bool(trainer["gpus"]) and e["gpus"] == trainer["gpus"] for n, e in zip(same_node, engines)]
    if all(same_gpu):
        return "cuda_ipc"
    if not any(same_gpu):
        return "nccl"
    logger.warning(
        "weight sync: %d of %d engines share the GPU of trainer rank 0 and the others do not; NCCL cannot hold one GPU "
        "twice, so the buckets go over gloo through host memory",
        sum(same_gpu),
        len(engines),
    )
    return "gloo"


def shm_path(size: int) -> str:
    """A fresh file name in /dev/shm, or in the temporary folder where /dev/shm has not `size` bytes free (a
    container's default 64 MB: a write past a full tmpfs kills the process with SIGBUS)."""
    folder = "/dev/shm"
    if not os.path.isdir(folder) or shutil.disk_usage(folder).free < size:
        folder = tempfile.gettempdir()
        logger.warning(
            "weight sync: /dev/shm lacks %d MB free; the shared buckets are a file in %s", size >> 20, folder
        )
    return os.path.join(folder, f"miles-weight-sync-{uuid.uuid4().hex}")


def shm_has_room(size: int) -> bool:
    """Whether /dev/shm has `size` bytes free and a quarter more (the resident layout's test: it holds the whole
    sync, in memory; a file in the temporary folder would put the engines' parameters on disk)."""
    return os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free >= size + size // 4


def shared_buffer(
    kind: str, buffer_bytes: int, device: torch.device, total: int | None = None
) -> tuple[torch.Tensor | None, str | tuple | None]:
    """Rank 0, before the group: the persistent buffer of a shared transport and what the engines open it with (the
    `shm` file's path, or the `cuda_ipc` handle: a handle, not the bytes); (None, None) for a broadcast transport.
    `total`: the buffer's bytes where they are not the two slots (the resident layout)."""
    size = buffer_bytes * SLOTS if total is None else total
    if kind == "shm":
        path = shm_path(size)
        return torch.from_file(path, shared=True, size=size, dtype=torch.uint8), path
    if kind == "cuda_ipc":
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
        return buffer, reduce_tensor(buffer)
    return None, None


def _group(spec: TransportSpec, rank: int, backend: str) -> dist.ProcessGroup:
    """The sync group, apart from any default process group (trainer rank 0 already has one)."""
    timeout = timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, rank == 0, timeout=timeout)
    # a c10d backend runs the collectives of ProcessGroup's interface (torch's stubs declare them on ProcessGroup only)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        return dist.ProcessGroupNCCL(store, rank, spec.world_size, options)  # type: ignore[return-value]
    return dist.ProcessGroupGloo(store, rank, spec.world_size, timeout)  # type: ignore[return-value]


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> dist.Work:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


class Transport:
    """One member's end of a sync group. Rank 0 (`send`): `slot(bucket)` is the buffer to write the bucket into (free
    once the engines are done with its last use), `send(bucket, terms)` hands it over. Engines: `begin()` first,
    then `receive(bucket)` is the bucket's bytes and checksum terms, readable until `release(bucket)`. `finish()` ends
    a sync on every member."""

    def __init__(
        self, spec: TransportSpec, rank: int, device: torch.device, shared: torch.Tensor | tuple | None = None
    ) -> None:
        """Join the sync group (collective over its members). `shared`: for `shm` / `cuda_ipc`, rank 0's buffer from
        `shared_buffer`, and an engine's `cuda_ipc` handle from it (an `shm` engine maps `spec.shm_path`)."""
        if spec.kind not in TRANSPORTS:
            raise ValueError(f"--weight-sync-transport {spec.kind!r} is unknown; use one of {TRANSPORTS}")
        if spec.resident and spec.kind != "shm":
            raise ValueError(f"weight sync ({spec.kind}): only `shm` holds the whole sync resident")
        self.spec, self.rank, self.device, self.kind = spec, rank, device, spec.kind
        self.shared = self.kind in ("shm", "cuda_ipc")  # the slots are one buffer every member maps
        self.resident = spec.resident
        # where the signals and terms travel: the group's own device
        self.signal_device = device if self.kind == "nccl" else torch.device("cpu")
        needed = spec.shared_bytes if self.shared else spec.buffer_bytes * (SLOTS if rank == 0 else 1)
        self.buffer: torch.Tensor | None = self._member_buffer(shared, needed)  # None once closed
        group = _group(spec, rank, "nccl" if self.kind == "nccl" else "gloo")
        self.group: dist.ProcessGroup | None = group  # None once closed
        group.allreduce([torch.zeros(1, device=self.signal_device)]).wait()  # every member holds its buffer
        if rank == 0 and self.kind == "shm" and spec.shm_path is not None:
            os.unlink(spec.shm_path)  # the mappings stay; from here on nothing is left behind if a process dies
        self.pending: dict[int, list[dist.Work]] = {}  # slot -> the works that must end before it is written again

    def _member_buffer(self, shared: torch.Tensor | tuple | None, needed: int) -> torch.Tensor:
        """This member's buffer: rank 0's (the shared one it made, or the slots), an `shm` engine's mapping of the
        file, a `cuda_ipc` engine's view of rank 0's handle, a broadcast receiver's one slot."""
        spec, buffer = self.spec, None
        if self.rank == 0 and self.shared:
            buffer = shared
        elif self.rank == 0 or not self.shared:
            buffer = torch.empty(needed, dtype=torch.uint8, device=self.device)
        elif self.kind == "shm" and spec.shm_path is not None:
            buffer = torch.from_file(spec.shm_path, shared=True, size=needed, dtype=torch.uint8)
        elif self.kind == "cuda_ipc" and isinstance(shared, tuple):
            rebuild, args = shared
            buffer = rebuild(*args)
        if not isinstance(buffer, torch.Tensor) or buffer.numel() < needed:
            raise ValueError(f"weight sync ({self.kind}): rank {self.rank} has no buffer of {needed} bytes")
        return buffer

    def _open(self) -> tuple[torch.Tensor, dist.ProcessGroup]:
        """(the buffer, the sync group), which `close` lets go of."""
        if self.buffer is None or self.group is None:
            raise RuntimeError(f"weight sync ({self.kind}): rank {self.rank}'s transport is closed")
        return self.buffer, self.group

    def view(self, bucket: BucketMeta) -> torch.Tensor:
        """The bytes of `bucket`'s place: its own (resident), or its slot."""
        buffer, offsets = self._open()[0], self.spec.offsets
        if offsets is not None:  # resident
            return buffer[offsets[bucket.index] : offsets[bucket.index + 1]]
        start = (bucket.index % SLOTS) * self.spec.buffer_bytes if (self.shared or self.rank == 0) else 0
        return buffer[start : start + self.spec.buffer_bytes]

    def _signal(self) -> dist.Work:
        return self._open()[1].allreduce([torch.zeros(1, device=self.signal_device)])

    def begin(self) -> None:
        """An engine, before its first `receive` of a sync: resident, it tells rank 0 that it is in the sync (not
        sampling with the parameters the trainer is about to write); a no-op otherwise."""
        if self.resident:
            self._signal().wait()

    def slot(self, bucket: BucketMeta) -> torch.Tensor:
        """Rank 0: where to write `bucket`, once every member is done with its previous use (resident: once every
        engine has entered the sync, at its first bucket)."""
        if self.resident and bucket.index == 0:
            self._signal().wait()
        for work in self.pending.pop(bucket.index % SLOTS, []):
            work.wait()
        return self.view(bucket)

    def send(self, bucket: BucketMeta, terms: torch.Tensor) -> None:
        """Rank 0: the bucket written into its slot goes to every engine; returns without waiting for them."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the slot's bytes are written before anyone reads
        works = [_broadcast(self._open()[1], terms.to(self.signal_device))]
        if self.resident:  # no place is written twice in a sync: nothing to wait for but the terms' delivery
            pass
        elif self.shared:  # the engines answer once they copied the slot out: then it may be written again
            works.append(self._signal())
        else:
            works.append(_broadcast(self._open()[1], self.view(bucket)[: bucket.nbytes]))
        self.pending.setdefault(bucket.index % SLOTS, []).extend(works)

    def receive(self, bucket: BucketMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """An engine: (the bucket's bytes, its (tensors, 2) checksum terms on the CPU)."""
        terms = torch.empty(len(bucket.tensors), 2, dtype=torch.int64, device=self.signal_device)
        _broadcast(self._open()[1], terms).wait()
        view = self.view(bucket)
        if not self.shared:
            _broadcast(self._open()[1], view[: bucket.nbytes]).wait()
        return view, terms.cpu()

    def release(self, bucket: BucketMeta) -> None:
        """An engine is done reading `bucket` (its copies into the parameters have run)."""
        if self.shared and not self.resident:
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            self._signal().wait()

    def finish(self) -> None:
        """Rank 0: wait until every engine has taken every bucket (a no-op for the engines)."""
        for works in self.pending.values():
            for work in works:
                work.wait()
        self.pending.clear()

    def close(self) -> None:
        """Leave the group (rank 0 once the engines took the last sync). A group that a member's death broke (the
        sync that met it failed, naming the member) is left without waiting for it."""
        if self.rank == 0:
            try:
                self.finish()
            except RuntimeError as exc:  # gloo / NCCL: "Connection closed by peer", an aborted communicator
                logger.warning("weight sync (%s): closed with a broken sync group: %s", self.kind, exc)
                self.pending.clear()
        self.buffer = self.group = None
