"""The weight sync's CUDA transports between two processes: `cuda_ipc` (an engine on the trainer's GPU opens rank 0's
persistent device buffer; one GPU) and `nccl` (a broadcast of each bucket to an engine on another GPU; two GPUs). The
engine copies every bucket into its CUDA tensors in place and verifies their checksums, over two syncs."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from miles.utils.distributed import find_free_port
from miles.utils.weight_checksum import block_terms
from miles.weight_sync.protocol import plan_buckets
from miles.weight_sync.receiver import receive_into
from miles.weight_sync.transports import Transport, TransportSpec, shared_buffer

pytestmark = pytest.mark.gpu
TIMEOUT = 120.0
SYNCS = 2


def _weights(device: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    weights = {
        "a.weight": torch.randn(1000, 333, generator=generator).to(torch.bfloat16),
        "a.bias": torch.randn(333, generator=generator),
        "b.weight": torch.randn(512, 1024, generator=generator),  # 2 MiB: a bucket of its own
        "steps": torch.arange(7, dtype=torch.int64),
    }
    return {name: tensor.to(device) for name, tensor in weights.items()}


def _plan():
    return plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in _weights("cpu").items()], bucket_bytes=1 << 20)


def _engine(spec: TransportSpec, device: str, opener, results) -> None:
    """An engine process: receive SYNCS syncs into its own CUDA tensors; report equality and whether they stayed put."""
    torch.cuda.set_device(torch.device(device))
    plan, expected = _plan(), _weights(device)
    targets = {n: torch.zeros_like(t) for n, t in expected.items()}
    pointers = {n: t.data_ptr() for n, t in targets.items()}
    transport = Transport(spec, 1, torch.device(device), opener)
    try:
        for version in range(SYNCS):
            receive_into(transport, plan, targets, version)
        same = all(torch.equal(targets[n], expected[n]) for n in expected)
        results.put(("ok", same and pointers == {n: t.data_ptr() for n, t in targets.items()}))
    except Exception as exc:  # noqa: BLE001 - reported to the test process
        results.put(("error", repr(exc)))


def _run(kind: str, sender_device: str, engine_device: str) -> None:
    torch.cuda.set_device(torch.device(sender_device))
    plan, weights = _plan(), _weights(sender_device)
    shared, opener = shared_buffer(kind, plan.buffer_bytes, torch.device(sender_device))
    spec = TransportSpec(kind, "127.0.0.1", find_free_port(), 2, plan.buffer_bytes, TIMEOUT)
    context = mp.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=_engine, args=(spec, engine_device, opener, results))
    child.start()
    sender = Transport(spec, 0, torch.device(sender_device), shared)
    for _ in range(SYNCS):
        for bucket in plan.buckets:
            data = sender.slot(bucket)
            for slot in bucket.tensors:
                slot.view(data).copy_(weights[slot.name])
            sender.send(bucket, torch.stack([block_terms(weights[t.name]) for t in bucket.tensors]))
        sender.finish()
    status, value = results.get(timeout=TIMEOUT)
    child.join(TIMEOUT)
    assert status == "ok", value
    assert value is True


def test_cuda_ipc_engine_on_the_trainers_gpu_loads_every_bucket_in_place():
    _run("cuda_ipc", "cuda:0", "cuda:0")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL broadcast between two GPUs needs two")
def test_nccl_broadcast_to_an_engine_on_another_gpu_loads_every_bucket_in_place():
    _run("nccl", "cuda:0", "cuda:1")
