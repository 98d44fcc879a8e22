"""Rank bodies for the gather-plan tests: a block model whose tables' rows do not divide a shard group of 3, gathered
in buckets that close around them, under plain FSDP2 (world size 3) and hybrid sharding (6 ranks, shards of 3)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from miles.backends.fsdp_utils.fsdp import apply_fsdp2, build_mesh
from miles.backends.fsdp_utils.gather import bucketed_full_state_dict, full_state_dict, gather_entries, gather_plan
from miles.backends.fsdp_utils.weight_push import WeightPusher, sync_plan
from miles.weight_sync.transports import SLOTS

DIM = 8
SHARD = 3
# Per rank, a block pads to 408 bytes (192 + 32 + 64 + 8 + 64 + 48, see OddRowsBlock): these close buckets inside
# blocks, next to the odd tables and across block ends.
BUCKET_SIZES = (1, 100, 200, 224, 250, 300, 408, 500, 1 << 30)
LORA_BUCKET = 100


def is_lora(name: str) -> bool:
    return "lora_" in name


class OddRowsBlock(nn.Module):
    """Rows of 1 (Wan's (1, 6, D) scale_shift_table), 2 (LTX-2's (2, D) tables), 5 (a projection), 4 and 8 (a LoRA
    pair of rank 4) over a shard group of 3: shards of 1/0/0, 1/1/0, 2/2/1, 2/2/0 and 3/3/2 rows."""

    def __init__(self) -> None:
        super().__init__()
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, DIM))
        self.table = nn.Parameter(torch.randn(2, DIM))
        self.proj = nn.Linear(DIM, 5)
        self.lora_A = nn.Linear(DIM, 4, bias=False)
        self.lora_B = nn.Linear(4, DIM, bias=False)


class OddRowsModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(OddRowsBlock() for _ in range(3))
        self.head = nn.Linear(DIM, 3)
        self.register_buffer("scale", torch.arange(3.0))


def gather_hybrid(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    return gather_report(rank, world_size, shard_size=SHARD)


def gather_report(rank: int, world_size: int, shard_size: int | None) -> dict[str, Any]:
    """The odd-rows model under FSDP2, gathered tensor by tensor (`full_tensor`) and in buckets of every size in
    `BUCKET_SIZES` and with the LoRA filter; what each rank planned, held and sent."""
    torch.manual_seed(0)
    model = OddRowsModel()
    mesh = build_mesh(world_size, shard_size, "cpu")
    apply_fsdp2(model, list(model.blocks), param_dtype=torch.float32, reduce_dtype=torch.float32, mesh=mesh)
    state = model.state_dict()
    per_tensor = {n: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for n, v in state.items()}
    report: dict[str, Any] = {
        "per_tensor": per_tensor,
        "local_rows": {n: v.to_local().shape[0] for n, v in state.items() if isinstance(v, DTensor)},
        "plans": {s: [(b.names, b.nbytes) for b in gather_plan(gather_entries(state), s)] for s in BUCKET_SIZES},
        "old_plans": {s: old_code_plan(state, s) for s in BUCKET_SIZES},
        "bucketed": {},
        "sent": {},
    }
    for size in BUCKET_SIZES:
        with counted_collectives() as sent:
            report["bucketed"][size] = bucketed_full_state_dict(model, bucket_bytes=size)
        report["sent"][size] = sent
    with counted_collectives() as sent:
        report["lora"] = bucketed_full_state_dict(model, bucket_bytes=LORA_BUCKET, keep=is_lora)
    report["lora_sent"] = sent
    report["lora_plan"] = [b.names for b in gather_plan(gather_entries(state, is_lora), LORA_BUCKET)]
    report["lora_full_state_dict"] = full_state_dict(model, keep=is_lora)
    every_rank = full_state_dict(model, cpu_offload=False, keep=is_lora)
    report["lora_every_rank"] = {k: v.detach().clone() for k, v in every_rank.items()}
    with counted_collectives() as sent:  # the engines' dtype, LoRA as trained (the weight export's `as_dtype`)
        report["bf16"] = bucketed_full_state_dict(model, bucket_bytes=LORA_BUCKET, as_dtype=bf16_except_lora)
    report["bf16_sent"] = sent
    report["direct"] = direct_push(model, rank)
    return report


class RecordingTransport:
    """Rank 0's end of the sync group in a test without engines: the bucket slots of the shared file, and what each
    `send` handed over (each tensor's bytes and checksum terms)."""

    def __init__(self, shared: torch.Tensor, buffer_bytes: int, offsets: tuple[int, ...] | None = None) -> None:
        self.shared, self.buffer_bytes, self.offsets, self.sent = shared, buffer_bytes, offsets, {}

    def slot(self, bucket) -> torch.Tensor:
        if self.offsets is not None:  # resident: each bucket at its own place
            return self.shared[self.offsets[bucket.index] : self.offsets[bucket.index + 1]]
        start = (bucket.index % SLOTS) * self.buffer_bytes
        return self.shared[start : start + self.buffer_bytes]

    def send(self, bucket, terms: torch.Tensor) -> None:
        data = self.slot(bucket)
        for tensor, term in zip(bucket.tensors, terms):
            self.sent[tensor.name] = (tensor.view(data).clone(), term.clone())

    def finish(self) -> None:
        pass


def direct_push(model: nn.Module, rank: int) -> list[dict] | None:
    """Two `WeightPusher.push_direct` syncs in the engines' dtype into 256-byte buckets of a shared file (two slots),
    then two `push_resident` ones (the whole sync in the file): every rank writes its own rows (replica 0 only); rank
    0's record of what each sync sent (None elsewhere)."""
    syncs = []
    for resident in (False, True):
        pusher = WeightPusher(sync_plan(model, 256, None, bf16_except_lora), rank, torch.device("cpu"))
        path = pusher.prepare("shm", direct=True, resident=resident)
        assert (pusher.offsets is not None) == resident
        if rank == 0:
            os.unlink(path)
            pusher.transport = RecordingTransport(pusher.shared, pusher.plan.buffer_bytes, pusher.offsets)
        for _ in range(2):
            pusher.push(model, None, bf16_except_lora)
            if rank == 0:
                syncs.append(dict(pusher.transport.sent))
    return syncs if rank == 0 else None


def bf16_except_lora(name: str) -> torch.dtype | None:
    return None if is_lora(name) else torch.bfloat16


def old_code_plan(state: dict[str, torch.Tensor], bucket_bytes: int) -> list[tuple[str, ...]]:
    """The buckets the loop of `bucketed_full_state_dict` cut before the plan: closed once this rank's own (unpadded)
    shard bytes reached the limit, and at a change of dtype or of mesh object."""
    plan, bucket, key, size = [], [], None, 0
    for name, value in state.items():
        if not isinstance(value, DTensor):
            plan += [tuple(bucket), (name,)] if bucket else [(name,)]
            bucket, size = [], 0
            continue
        this = (value.dtype, id(value.device_mesh))
        if this != key or size >= bucket_bytes:
            plan += [tuple(bucket)] if bucket else []
            bucket, size, key = [], 0, this
        bucket.append(name)
        size += value.to_local().numel() * value.element_size()
    return plan + [tuple(bucket)] if bucket else plan


class counted_collectives:
    """Records, in a list, the bytes this rank sends in each `dist.all_gather` and a `-1` for each
    `DTensor.full_tensor` (a per-tensor gather) while active."""

    def __enter__(self) -> list[int]:
        self.sent: list[int] = []
        self.all_gather, self.full_tensor = dist.all_gather, DTensor.full_tensor

        def all_gather(outputs, tensor, *args, **kwargs):
            self.sent.append(tensor.numel() * tensor.element_size())
            return self.all_gather(outputs, tensor, *args, **kwargs)

        def full_tensor(value, *args, **kwargs):
            self.sent.append(-1)
            return self.full_tensor(value, *args, **kwargs)

        dist.all_gather, DTensor.full_tensor = all_gather, full_tensor
        return self.sent

    def __exit__(self, *exc: object) -> None:
        dist.all_gather, DTensor.full_tensor = self.all_gather, self.full_tensor
