"""A trainer's rank 0 of the weight sync in a test: the plan of a state dict, and a sender that writes each bucket
as `WeightPusher.push` does (tensors into their slots, `block_terms` over them), with engines on other threads; over
two reused slots or (`resident`, `shm`) the whole sync in the shared file; a state dict of mixed shapes and dtypes,
and engines that receive it into their own tensors."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import torch

from miles.utils.distributed import find_free_port
from miles.utils.weight_checksum import WeightSyncError, block_terms
from miles.weight_sync.protocol import SyncPlan, plan_buckets, resident_offsets
from miles.weight_sync.receiver import bind_resident, receive_into
from miles.weight_sync.transports import Transport, TransportSpec, shared_buffer

TIMEOUT = 60.0


def plan_of(weights: dict[str, torch.Tensor], bucket_bytes: int = 2048) -> SyncPlan:
    return plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in weights.items()], bucket_bytes)


def run_sync(
    kind: str,
    weights: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]],
    engines: list[Callable[[TransportSpec, int], None]],
    *,
    syncs: int = 1,
    corrupt: str | None = None,
    plan: SyncPlan | None = None,
    resident: bool = False,
) -> TransportSpec:
    """Rank 0 sends `weights` `syncs` times over `kind` (a list: one dict per sync) while `engines[i](spec, rank)` run
    on threads (each joins the group as `rank` and takes the syncs). `corrupt`: a tensor whose bytes get one bit
    flipped after its checksum was taken (in transit)."""
    series = weights if isinstance(weights, list) else [weights] * syncs
    plan = plan or plan_of(series[0])
    offsets = resident_offsets(plan) if resident else None
    shared, opener = shared_buffer(kind, plan.buffer_bytes, torch.device("cpu"), offsets and offsets[-1])
    spec = TransportSpec(
        kind, "127.0.0.1", find_free_port(), 1 + len(engines), plan.buffer_bytes, TIMEOUT, opener, offsets
    )
    threads = [threading.Thread(target=engine, args=(spec, i + 1)) for i, engine in enumerate(engines)]
    for thread in threads:
        thread.start()
    sender = Transport(spec, 0, torch.device("cpu"), shared)
    for weights in series:
        for bucket in plan.buckets:
            data = sender.slot(bucket)
            for slot in bucket.tensors:
                slot.view(data).copy_(weights[slot.name])
                if slot.name == corrupt:  # the checksums below are the tensor's as the trainer holds it
                    slot.view(data).view(-1).view(torch.uint8)[3] ^= 4
            sender.send(bucket, torch.stack([block_terms(weights[t.name]) for t in bucket.tensors]))
        sender.finish()
    for thread in threads:
        thread.join(TIMEOUT)
    assert not any(thread.is_alive() for thread in threads)
    sender.close()
    return spec


def mixed_weights() -> dict[str, torch.Tensor]:
    """Tensors of every kind a sync carries: float32, bf16 and fp16, 0-d, int64, and one of 16 KiB."""
    generator = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(33, 7, generator=generator),
        "a.bias": torch.randn(7, generator=generator).to(torch.bfloat16),
        "scale": torch.tensor(1.5),  # 0-d
        "steps": torch.arange(5, dtype=torch.int64),
        "b.weight": torch.randn(64, 64, generator=generator),  # 16 KiB: a bucket of its own below
        "c.weight": torch.randn(3, 5, generator=generator).to(torch.float16),
    }


def sync_into(
    kind: str,
    weights: dict | list[dict],
    targets: list[dict],
    corrupt: str | None = None,
    syncs: int = 2,
    resident: bool = False,
    bound: list | None = None,
) -> list:
    """Rank 0 sends `weights` (or one dict per sync) `syncs` times over `kind`; engine i receives into `targets[i]`
    (`receive_into`). `resident`: the engines' tensors bound to the shared file (`bind_resident`), each engine's bound
    views put in `bound[i]`. Returns each engine's errors."""
    plan = plan_of(weights[0] if isinstance(weights, list) else weights)
    errors: list[list] = [[] for _ in targets]

    def engine(index: int):
        def take(spec: TransportSpec, rank: int) -> None:
            transport = Transport(spec, rank, torch.device("cpu"))
            views = bind_resident(transport, plan, targets[index])
            if bound is not None:
                bound[index] = views
            for version in range(syncs):
                try:
                    receive_into(transport, plan, targets[index], version, views)
                except WeightSyncError as exc:
                    errors[index].append(exc)

        return take

    engines = [engine(i) for i in range(len(targets))]
    spec = run_sync(kind, weights, engines, syncs=syncs, corrupt=corrupt, plan=plan, resident=resident)
    if kind == "shm":
        assert not os.path.exists(spec.shm_path)  # unlinked once every member mapped it
    return errors
