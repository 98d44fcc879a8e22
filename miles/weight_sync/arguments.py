"""The weight sync's flags (read by `miles.ray.weight_sync`, which picks the transport and the bucket size)."""

from __future__ import annotations

import argparse

from miles.utils.distributed import uses_gpu

TRANSPORT_CHOICES = ("auto", "shm", "gloo", "cuda_ipc", "nccl")
CUDA_TRANSPORTS = ("cuda_ipc", "nccl")  # their buffers are CUDA memory: a CPU run has none


def transport_device_problem(kind: str, gpu: bool) -> str | None:
    """Why --weight-sync-transport `kind` cannot carry a run on GPUs (`gpu`) or CPUs; None when it can."""
    if kind in CUDA_TRANSPORTS and not gpu:
        return (
            f"--weight-sync-transport {kind} moves CUDA buffers, but this run's trainer and engines are on the CPU: "
            "give auto, shm (one host) or gloo"
        )
    return None


def weight_sync_rules(args: argparse.Namespace) -> list[str]:
    """The parse-time rule: a CUDA transport on CPUs (--device cpu, or auto here without CUDA; auto on a cluster
    given by --ray-address is the cluster's: the sync's connect checks the device it found)."""
    if args.device == "cuda" or (args.device == "auto" and args.ray_address):
        return []
    problem = transport_device_problem(args.weight_sync_transport, uses_gpu(args))
    return [problem] if problem else []


def add_weight_sync_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("weight sync (trainer rank 0 to the rollout engines)")
    group.add_argument(
        "--weight-sync-transport",
        choices=TRANSPORT_CHOICES,
        default="auto",
        help="How the buckets travel. auto: by placement (one CPU host: shm; CPU hosts apart: gloo; engines on "
        "trainer rank 0's GPU: cuda_ipc; on other GPUs: nccl). docs/user-guide/performance.md, 'The weight sync'.",
    )
    group.add_argument(
        "--weight-sync-bucket-mb",
        type=int,
        default=None,
        help="Bytes per bucket in MiB (default 64 on CPU, 512 on CUDA); two bucket buffers live for the whole run.",
    )
