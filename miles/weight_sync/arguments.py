"""The weight sync's flags (read by `miles.ray.weight_sync`, which picks the transport and the bucket size)."""

from __future__ import annotations

import argparse

TRANSPORT_CHOICES = ("auto", "shm", "gloo", "cuda_ipc", "nccl")


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
