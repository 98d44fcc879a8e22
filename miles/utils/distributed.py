"""Process-group helpers: init (nccl on CUDA, gloo on CPU), teardown, free ports, where small collectives run,
deterministic mode."""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def uses_gpu(args) -> bool:
    """Whether the run's trainer ranks and engines use GPUs (--device, `auto`: when CUDA is available). Here, not
    in `miles.ray.train_group`, so that the driver sizes its Ray cluster without importing the trainer."""
    return args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())


def engine_cpus(args) -> float:
    """CPUs a rollout engine asks Ray for: one on GPU (its host-side work), --rollout-cpus-per-engine on CPU."""
    return 1.0 if uses_gpu(args) else args.rollout_cpus_per_engine


def init_process_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    device: str | torch.device,
    *,
    timeout: timedelta | None = None,
) -> None:
    """Join the default process group: nccl (plus gloo for CPU tensors) when `device` is CUDA, after selecting
    this rank's GPU; else gloo.

    A CUDA device without an index (`"cuda"`) picks GPU `rank % device_count()`: under Ray each actor usually
    sees only its own GPU, so that is GPU 0.
    """
    if dist.is_initialized():
        raise RuntimeError(
            f"init_process_group(rank={rank}, world_size={world_size}): a default process group already exists "
            f"(rank {dist.get_rank()} of {dist.get_world_size()}); call destroy_process_group() first"
        )
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        # nccl for CUDA tensors, gloo for any CPU tensor a collective is handed (nccl alone rejects them)
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        **kwargs,
    )
    logger.info("process group up: rank %d/%d, backend %s, %s:%d", rank, world_size, backend, master_addr, master_port)


def destroy_process_group() -> None:
    """Tear down the default process group; a no-op when there is none (safe to call twice)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def find_free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it; another process may still race for it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def resolve_device(name: str) -> torch.device:
    """The device a trainer rank runs on for `--device` (auto: CUDA when there is one; cuda: the current one)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def collective_device() -> torch.device:
    """Where small collectives (metrics, checks) run: this rank's GPU under nccl, else the CPU (gloo)."""
    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def use_deterministic_algorithms() -> None:
    """--deterministic-mode: deterministic kernels only (an op without one raises), cuBLAS with a fixed workspace,
    no cuDNN autotuning, NCCL's ring algorithm (a fixed reduction order). Call before the process group exists."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_ALGO", "Ring")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    logger.info("deterministic mode: deterministic algorithms, fixed cuBLAS workspace, NCCL ring reductions")
