"""The run's Ray cluster: the logical CPUs a local one needs, whether the trainer ranks and engines fit its GPUs,
and starting or joining it (`--ray-address`)."""

from __future__ import annotations

import argparse
import math
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import ray
import ray._private.services as ray_services
import ray._private.utils as ray_utils

from miles.algorithms import get_algorithm
from miles.arguments.fsdp import resolve_cluster_device
from miles.arguments.records import FlagRecord
from miles.ray.reward_workers import REWARD_WORKER_CPUS
from miles.utils.console import ray_init_kwargs
from miles.utils.distributed import engine_cpus, uses_gpu
from miles.utils.stop_signals import keeping_signal_handlers


@dataclass(frozen=True)
class ClusterFlags(FlagRecord):
    """The flags that size the run's actors on the cluster: which algorithm (its roles, whether it runs engines), the
    device, and each actor kind's count and share."""

    loss_type: str
    device: str  # after `--device auto` resolved (`check_cluster` builds its record once it is)
    ray_address: str | None
    dp_size: int
    sp_size: int
    cpus_per_rank: float
    gpus_per_rank: float
    rollout_num_engines: int
    rollout_cpus_per_engine: float
    rollout_gpus_per_engine: float
    rm_num_workers: int
    colocate: bool

    @property
    def world_size(self) -> int:
        """Ranks of one trained role: --dp-size data-parallel groups of --sp-size sequence-parallel ranks each."""
        return self.dp_size * self.sp_size


def actor_shares(flags: ClusterFlags, per_rank: float, per_engine: float) -> tuple[float, float]:
    """(trainer ranks' total, rollout engines' total) of one resource, given each actor's share of it."""
    algorithm = get_algorithm(flags.loss_type)
    trainers = flags.world_size * per_rank * len(algorithm.role_names)
    engines = flags.rollout_num_engines * per_engine if algorithm.uses_engines else 0.0
    return trainers, engines


def local_ray_cpus(flags: ClusterFlags) -> int:
    """Logical CPUs for a Ray cluster this driver starts: the machine's, or enough for every actor's share.

    Shares are scheduling labels, not pinned cores: a dmd2 run (actor and critic groups, an engine) asks for more
    than a 2-core laptop has, and Ray would wait forever for CPUs that never come.
    """
    return max(os.cpu_count() or 1, math.ceil(actor_cpus(flags)))


def actor_cpus(flags: ClusterFlags) -> float:
    """The CPUs every actor of the run asks Ray for: trainer ranks (none on GPU), engines, reward workers."""
    trainers, engines = actor_shares(flags, 0.0 if uses_gpu(flags) else flags.cpus_per_rank, engine_cpus(flags))
    workers = REWARD_WORKER_CPUS * flags.rm_num_workers if get_algorithm(flags.loss_type).uses_engines else 0.0
    return trainers + engines + workers


def actor_gpus(flags: ClusterFlags) -> float:
    """The GPUs the trainer ranks and engines ask Ray for (none off GPU)."""
    return sum(actor_shares(flags, flags.gpus_per_rank, flags.rollout_gpus_per_engine)) if uses_gpu(flags) else 0.0


def check_gpus_fit(flags: ClusterFlags, cluster_gpus: float) -> None:
    """Fail at once, naming the flags, when the trainer ranks and engines ask for more GPUs than the cluster has
    (otherwise a placement group waits for GPUs that never come)."""
    if not uses_gpu(flags):
        return
    if flags.colocate:
        if flags.dp_size > cluster_gpus:
            raise ValueError(
                f"--colocate puts rank i of every group and its engines on GPU i: --dp-size {flags.dp_size} needs "
                f"{flags.dp_size} GPUs but the Ray cluster has {cluster_gpus:g}: lower --dp-size"
            )
        return
    world = flags.world_size
    if world > 1 and flags.gpus_per_rank < 1:
        raise ValueError(
            f"--gpus-per-rank {flags.gpus_per_rank:g} with {world} ranks per group (--dp-size x --sp-size): Ray packs "
            "fractional shares onto as few GPUs as it can, so ranks of one group would share a GPU, which NCCL "
            "refuses; to share GPUs between trainer ranks and rollout engines use --colocate (whole GPUs, one rank of "
            "each group per GPU)"
        )
    trainers, engines = actor_shares(flags, flags.gpus_per_rank, flags.rollout_gpus_per_engine)
    if trainers + engines <= cluster_gpus + 1e-9:
        return
    if world > cluster_gpus:
        hint = (
            f"lower --dp-size x --sp-size to at most {int(cluster_gpus)} (ranks of one group need distinct GPUs under "
            "nccl)"
        )
    else:
        hint = "share them with --colocate (rank i of every group and engines i, i + dp-size, ... on GPU i)"
    groups = len(get_algorithm(flags.loss_type).role_names)
    raise ValueError(
        f"the run needs {trainers + engines:g} GPUs ({groups} group(s) x --dp-size "
        f"{flags.dp_size} x --sp-size {flags.sp_size} x --gpus-per-rank {flags.gpus_per_rank:g}, plus {engines:g} for "
        f"the rollout engines) but the Ray cluster has {cluster_gpus:g}: {hint}"
    )


def check_cluster(args: argparse.Namespace) -> None:
    """Once Ray is up: with --ray-address the `auto` device and forward dtype from the cluster's GPUs (not this
    node's), then whether the run fits them."""
    cluster_gpus = ray.cluster_resources().get("GPU", 0.0)
    if args.ray_address is not None:
        resolve_cluster_device(args, cluster_gpus)
    check_gpus_fit(ClusterFlags.from_args(args), cluster_gpus)


def ray_init_settings(args: argparse.Namespace) -> dict[str, Any] | None:
    """`ray.init` keywords of this run's cluster, or None when Ray is up already (tests, tools). Without
    --ray-address: a local cluster sized for every actor's share, always one of this run's own, never one that
    another run on the machine started."""
    if ray.is_initialized():
        return None
    flags = ClusterFlags.from_args(args)
    if flags.ray_address:
        return {"address": flags.ray_address, **ray_init_kwargs(local=False)}
    return {"address": "local", "num_cpus": local_ray_cpus(flags), **ray_init_kwargs(local=True)}


class OwnSessionPopen(ray_services.ConsolePopen):
    """Ray's process launcher, each process in a session (and process group) of its own (`setsid`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, start_new_session=True, **kwargs)


@contextmanager
def ray_processes_in_own_sessions() -> Iterator[None]:
    """While a local cluster starts: its processes (GCS, raylet, agents; the raylet's workers, the actors, follow
    the raylet) start outside the driver's process group, so a scheduler's SIGTERM or a Ctrl-C to the whole group
    reaches the driver alone and the actors live on while it saves; the driver still ends them (`ray.shutdown`), and
    Ray's kernel fate-sharing (PR_SET_PDEATHSIG) ends them if the driver is killed."""
    launcher = ray_services.ConsolePopen
    ray_services.ConsolePopen = OwnSessionPopen  # type: ignore[misc]  # the module's launcher is Ray's only hook
    try:
        yield
    finally:
        ray_services.ConsolePopen = launcher  # type: ignore[misc]  # as above


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """A --ray-address HOST:PORT (or ray://HOST:PORT) must answer a TCP connect: joining an address where nothing
    listens, Ray retries for minutes and then some, printing only its own warnings."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if address in ("auto", "local") or not sep or not port.isdigit():
        return  # Ray's own lookup ("auto") and its own error for an address it cannot parse
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(
            f"--ray-address {address}: nothing answers at {host}:{port} ({exc.strerror or exc}); start the cluster "
            "there first (`ray start --head` on that node), or fix the address"
        ) from None


def start_ray(settings: dict[str, Any] | None) -> bool:
    """Start or join the cluster of `ray_init_settings`; True when this driver started it. Call it from the main
    thread: Ray's processes end with the thread that started them."""
    if settings is None:
        return False
    check_reachable(settings["address"])
    # without kernel fate-sharing (macOS) Ray's reaper ends its processes through the driver's process group
    own = settings.get("address") == "local" and ray_utils.detect_fate_sharing_support()
    sessions = ray_processes_in_own_sessions() if own else nullcontext()
    with keeping_signal_handlers(), sessions:  # the driver's stop signals (miles.utils.stop_signals), not Ray's
        ray.init(include_dashboard=False, log_to_driver=True, **settings)
    return True


def stop_ray() -> None:
    """`ray.shutdown`, keeping the driver's signal handlers: Ray's core worker puts the C-level SIGTERM / SIGINT
    actions back to the default on shutdown (the Python handler stays registered but is no longer called), and a
    scheduler's second SIGTERM would then kill a driver that is still saving or closing."""
    with keeping_signal_handlers():
        ray.shutdown()
