"""Gathering an FSDP2 model's sharded parameters into full tensors: `full_state_dict` (rank 0 on CPU, or every rank
on device), the bucketed gather behind it (one all-gather per flat bucket of dim-0 shards, the same plan on every
rank), and `gathered_tensors`, the stream of full tensors the weight sync pushes."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from miles.utils.distributed import collective_device
from miles.utils.weight_checksum import TensorChecksum, build_checksums, checksum_terms, tensor_checksums


def full_state_dict(
    model: nn.Module,
    *,
    cpu_offload: bool = True,
    keep: Callable[[str], bool] | None = None,
    as_dtype: Callable[[str], torch.dtype | None] | None = None,
    checksums: dict[str, TensorChecksum] | None = None,
) -> dict[str, torch.Tensor]:
    """Gather the sharded parameters into full tensors (collective: every rank must call it).

    With `cpu_offload=True` only rank 0 receives the dict (on CPU; other ranks get `{}`), which is what
    `--save-hf` and weight export need; it is gathered in flat buckets (`bucketed_full_state_dict`). With
    `cpu_offload=False` every rank receives full tensors on the parameters' device.

    `keep(name)` picks the entries to gather (e.g. only a LoRA adapter's); the others cost no collective. Every rank
    must pass the same filter: ranks that keep different names issue different collectives. `as_dtype(name)`: the
    dtype a floating entry is cast to on its device before it is gathered (None: as stored; with the rank-0 gather
    only), e.g. the engines' forward dtype, so that half the bytes leave the device. `checksums`: a dict that the
    ranks receiving the tensors fill with each one's `TensorChecksum` (the weight sync's; on the device where the
    bucketed gather has it, before it moves to the CPU).
    """
    if cpu_offload and dist.is_initialized():
        return bucketed_full_state_dict(model, keep=keep, as_dtype=as_dtype, checksums=checksums)
    if keep is not None and not cpu_offload:
        # per tensor, as `get_model_state_dict` gathers (it has no filter and would gather every tensor)
        state = model.state_dict()
        state = {name: _full_tensor(value) for name, value in state.items() if keep(name)}
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
        # a module's state dict holds tensors (torch types it with the optimizer states' nested values too)
        state = cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))
        state = state if keep is None else {name: value for name, value in state.items() if keep(name)}
    if checksums is not None:
        checksums.update(tensor_checksums(state))
    return state


# Bytes each rank sends per all-gather (a bucket closes once it reaches them; also about the extra memory a gather
# takes), by collective device: small on gloo, where merging small tensors saves per-call cost but large copied
# buckets lose; large on NCCL, one big collective per bucket. Measurements: docs/user-guide/performance.md
# ("Weight sync at dp >= 2").
GATHER_BUCKET_BYTES = {"cpu": 4 << 20, "cuda": 128 << 20}


@dataclass(frozen=True)
class ShardLayout:
    """Where a tensor's dim-0 shards live, read from the mesh's global metadata: the mesh's shape, its global ranks
    (row-major), its dim names and the mesh dim that shards. Equal on every rank for a mesh over the whole world
    (FSDP2's default, `build_mesh`'s); not Python object identity, which differs per `fully_shard` call and rank."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    dim_names: tuple[str, ...] | None
    shard_dim: int

    @property
    def group_size(self) -> int:
        return self.shape[self.shard_dim]


@dataclass(frozen=True)
class GatherEntry:
    """What the gather plan reads of one state-dict tensor: global metadata only, the same on every rank."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: ShardLayout | None  # None: not a dim-0 shard (a buffer, another placement), gathered on its own


@dataclass(frozen=True)
class GatherBucket:
    """One collective of the plan: tensors gathered together, and the bytes each rank of the shard group sends (0
    for a tensor gathered on its own, `layout` None)."""

    names: tuple[str, ...]
    nbytes: int
    layout: ShardLayout | None


def _dim0_shard_dim(value: torch.Tensor) -> int | None:
    """The mesh dim that shards `value` when it is a DTensor sharded along tensor dim 0 on exactly one mesh dim and
    replicated on the others (FSDP2's layout, hybrid sharding included); else None."""
    if not isinstance(value, DTensor):
        return None
    shards = [i for i, p in enumerate(value.placements) if p.is_shard()]
    if len(shards) != 1 or not value.placements[shards[0]].is_shard(0):
        return None
    if not all(p.is_replicate() for i, p in enumerate(value.placements) if i != shards[0]):
        return None
    return shards[0]


def gather_entries(
    state: Mapping[str, torch.Tensor],
    keep: Callable[[str], bool] | None = None,
    as_dtype: Callable[[str], torch.dtype | None] | None = None,
) -> list[GatherEntry]:
    """The plan's inputs for a (sharded) state dict, in its order, only the names `keep` accepts; each floating
    entry's dtype is the one it is sent in (`as_dtype(name)`, when given and not None)."""
    layouts: dict[tuple[int, int], ShardLayout] = {}  # by mesh object: `DeviceMesh.mesh` is rebuilt on every read
    entries = []
    for name, value in state.items():
        if keep is not None and not keep(name):
            continue
        dim, layout = _dim0_shard_dim(value), None
        if dim is not None and isinstance(value, DTensor):  # a DTensor when it has a shard dim
            mesh = value.device_mesh
            layout = layouts.get((id(mesh), dim))
            if layout is None:
                names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names is not None else None
                layout = ShardLayout(tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()), names, dim)
                layouts[(id(mesh), dim)] = layout
        dtype = as_dtype(name) if as_dtype is not None and value.is_floating_point() else None
        entries.append(GatherEntry(name, tuple(value.shape), dtype or value.dtype, layout))
    return entries


def padded_shard_bytes(shape: tuple[int, ...], dtype: torch.dtype, group_size: int) -> int:
    """Bytes one rank sends for a dim-0 sharded tensor: FSDP2 splits dim 0 as `torch.chunk` does (ceil(rows / N)
    rows, the last ranks' shards shorter or empty), and every rank pads its shard to that largest one."""
    rows, row = shape[0], math.prod(shape[1:])
    return -(-rows // group_size) * row * dtype.itemsize


def gather_plan(entries: Sequence[GatherEntry], bucket_bytes: int) -> list[GatherBucket]:
    """Cut the entries, in order, into the collectives of `bucketed_full_state_dict`.

    A bucket holds consecutive dim-0 shards of one dtype and layout and closes once its padded bytes reach
    `bucket_bytes` (so it goes over by at most one tensor); any other tensor is a step on its own. Pure over global
    metadata: every rank of a shard group computes the same plan and sends the same bytes per bucket. Sizing a bucket
    by a rank's own (unpadded) shard would close it at different tensors on different ranks wherever dim 0 does not
    divide the group (Wan's (1, 6, D) table, LoRA A with rank < dp): mismatched all-gathers, a gloo abort or an
    NCCL hang.
    """
    plan: list[GatherBucket] = []
    names: list[str] = []
    key: tuple[torch.dtype, ShardLayout] | None = None  # what a bucket's tensors share (set while names are)
    size = 0
    for entry in entries:
        layout = entry.layout
        this = None if layout is None else (entry.dtype, layout)
        if names and key is not None and (this != key or size >= bucket_bytes):
            plan.append(GatherBucket(tuple(names), size, key[1]))
            names, size = [], 0
        if layout is None:
            plan.append(GatherBucket((entry.name,), 0, None))
            continue
        key = (entry.dtype, layout)
        names.append(entry.name)
        size += padded_shard_bytes(entry.shape, entry.dtype, layout.group_size)
    if names and key is not None:
        plan.append(GatherBucket(tuple(names), size, key[1]))
    return plan


def bucketed_full_state_dict(
    model: nn.Module,
    *,
    bucket_bytes: int | None = None,
    keep: Callable[[str], bool] | None = None,
    as_dtype: Callable[[str], torch.dtype | None] | None = None,
    checksums: dict[str, TensorChecksum] | None = None,
) -> dict[str, torch.Tensor]:
    """`full_state_dict(model)` on rank 0 (CPU tensors, the state dict's order; `{}` elsewhere), bit-identical, with
    one all-gather per bucket of consecutive parameters instead of one per tensor (collective).

    The tensors of `gathered_tensors` (same arguments), each joined on the CPU. `checksums`: filled on rank 0 with
    each returned tensor's checksum, computed on the collective device over the gathered pieces.
    """
    out: dict[str, torch.Tensor] = {}
    terms: dict[str, torch.Tensor] = {}
    want = checksums is not None
    for name, shape, pieces, term in gathered_tensors(
        model, bucket_bytes=bucket_bytes, keep=keep, as_dtype=as_dtype, checksums=want
    ):
        pieces = [piece.cpu() for piece in pieces]
        out[name] = (pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces)).view(shape)
        if term is not None:
            terms[name] = term
    if checksums is not None and out:
        checksums.update(build_checksums([(n, t.dtype, tuple(t.shape), terms[n]) for n, t in out.items()]))
    return out


def gathered_tensors(
    model: nn.Module,
    *,
    bucket_bytes: int | None = None,
    keep: Callable[[str], bool] | None = None,
    as_dtype: Callable[[str], torch.dtype | None] | None = None,
    checksums: bool = False,
) -> Iterator[tuple[str, torch.Size, list[torch.Tensor], torch.Tensor | None]]:
    """Gather the full tensors bucket by bucket (collective: every rank runs it to the end) and yield, on rank 0 only,
    each as (name, shape, pieces, checksum terms) in the state dict's order: its flat pieces on the collective device
    (joined in order they are the tensor; they may alias the parameters), until the next step of the iteration.

    The buckets are `gather_plan`'s, from global metadata, so every rank issues the same all-gathers. Each rank lays
    its dim-0 shards of a bucket end to end in one flat tensor, each padded to the largest shard of its tensor; rank 0
    cuts the gathered flats into pieces. Tensors of another layout, and buffers, go one by one. `bucket_bytes`: per
    rank, default `GATHER_BUCKET_BYTES` of the collective device. `keep(name)`: only those entries (the same filter
    on every rank); the others cost no collective. `as_dtype(name)`: the dtype a floating entry is sent in (cast on
    the device, before the gather; None: as stored). `checksums`: yield each tensor's checksum terms
    (`weight_checksum.checksum_terms` over the pieces, on the device), else None.
    """
    if bucket_bytes is None:
        bucket_bytes = GATHER_BUCKET_BYTES.get(collective_device().type, GATHER_BUCKET_BYTES["cuda"])
    rank0 = dist.get_rank() == 0
    state = model.state_dict()
    entries = gather_entries(state, keep, as_dtype)
    dtypes = {entry.name: entry.dtype for entry in entries}
    for bucket in gather_plan(entries, bucket_bytes):
        if bucket.layout is None:
            name = bucket.names[0]
            full = _full_tensor(state[name].to(dtypes[name])).detach()
            if rank0:
                flat = full.reshape(-1)
                yield name, full.shape, [flat], checksum_terms([flat]) if checksums else None
            continue
        pairs = [(name, state[name]) for name in bucket.names]
        for name, shape, pieces in _gather_bucket(pairs, bucket.layout.shard_dim, rank0, dtypes[bucket.names[0]]):
            yield name, shape, pieces, checksum_terms(pieces) if checksums else None


def _full_tensor(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _gather_bucket(
    bucket: list[tuple[str, DTensor]], shard_dim: int, rank0: bool, dtype: torch.dtype
) -> list[tuple[str, torch.Size, list[torch.Tensor]]]:
    """One all-gather of the bucket's dim-0 shards over the group of mesh dim `shard_dim`; on rank 0 each tensor's
    (name, shape, flat pieces on the collective device in rank order), else []."""
    group = bucket[0][1].device_mesh.get_group(shard_dim)
    world, me = dist.get_world_size(group), dist.get_group_rank(group, dist.get_rank())
    device = collective_device()
    layout, locals_ = [], []
    for name, value in bucket:
        rows, row = value.shape[0], math.prod(value.shape[1:])
        chunk = -(-rows // world)  # torch.chunk's split: ceil, the last ranks shorter or empty
        local = value.to_local()
        mine = max(0, min(chunk, rows - me * chunk))
        if local.shape[0] != mine:
            raise RuntimeError(
                f"{name}: rank {me} of {world} holds {local.shape[0]} rows of {rows}, not the {mine} of an even dim-0 "
                "split; cannot gather it in a bucket"
            )
        layout.append((name, value.shape, rows, row, chunk))
        locals_.append(local.detach().reshape(-1))
    # one copy of each shard into the flat send buffer (the padding zeroed, never read back)
    send = torch.empty(sum(chunk * row for *_, row, chunk in layout), dtype=dtype, device=device)
    offset = 0
    for flat, (*_, row, chunk) in zip(locals_, layout):
        send[offset : offset + flat.numel()].copy_(flat)
        send[offset + flat.numel() : offset + chunk * row].zero_()
        offset += chunk * row
    received = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(received, send, group=group)
    if not rank0:
        return []
    out, offset = [], 0
    for name, shape, rows, row, chunk in layout:
        pieces = [received[r][offset : offset + max(0, min(chunk, rows - r * chunk)) * row] for r in range(world)]
        out.append((name, shape, pieces))
        offset += chunk * row
    return out
