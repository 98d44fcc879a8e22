"""A trainer's rank 0 of the weight sync in a test: the plan of a state dict, and a sender that writes each bucket
as `WeightPusher.push` does (tensors into their slots, `block_terms` over them), with engines on other threads; over
two reused slots or (`resident`, `shm`) the whole sync in the shared file."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from miles.utils.distributed import find_free_port
from miles.utils.weight_checksum import block_terms
from miles.weight_sync.protocol import SyncPlan, plan_buckets, resident_offsets
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
