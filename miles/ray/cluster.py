"""The run's Ray cluster: the logical CPUs a local one needs, whether the trainer ranks and engines fit its GPUs,
and starting or joining it (`--ray-address`)."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import ray
import ray._private.services as ray_services
import ray._private.utils as ray_utils

from miles.algorithms import algorithm_of
from miles.arguments.fsdp import resolve_cluster_device, trainer_world_size
from miles.ray.reward_workers import REWARD_WORKER_CPUS
from miles.utils.console import ray_init_kwargs
from miles.utils.distributed import engine_cpus, uses_gpu
from miles.utils.stop_signals import keeping_signal_handlers


def actor_shares(args: argparse.Namespace, per_rank: float, per_engine: float) -> tuple[float, float]:
    """(trainer ranks' total, rollout engines' total) of one resource, given each actor's share of it."""
    algorithm = algorithm_of(args)
    trainers = trainer_world_size(args) * per_rank * len(algorithm.role_names)
    engines = args.rollout_num_engines * per_engine if algorithm.uses_engines else 0.0
    return trainers, engines


def local_ray_cpus(args: argparse.Namespace) -> int:
    """Logical CPUs for a Ray cluster this driver starts: the machine's, or enough for every actor's share.

    Shares are scheduling labels, not pinned cores: a dmd2 run (actor and critic groups, an engine) asks for more
    than a 2-core laptop has, and Ray would wait forever for CPUs that never come.
    """
    return max(os.cpu_count() or 1, math.ceil(actor_cpus(args)))


def actor_cpus(args: argparse.Namespace) -> float:
    """The CPUs every actor of the run asks Ray for: trainer ranks (none on GPU), engines, reward workers."""
    trainers, engines = actor_shares(args, 0.0 if uses_gpu(args) else args.cpus_per_rank, engine_cpus(args))
    workers = REWARD_WORKER_CPUS * args.rm_num_workers if algorithm_of(args).uses_engines else 0.0
    return trainers + engines + workers


def check_gpus_fit(args: argparse.Namespace, cluster_gpus: float) -> None:
    """Fail at once, naming the flags, when the trainer ranks and engines ask for more GPUs than the cluster has
    (otherwise a placement group waits for GPUs that never come)."""
    if not uses_gpu(args):
        return
    if args.colocate:
        if args.dp_size > cluster_gpus:
            raise ValueError(
                f"--colocate puts rank i of every group and its engines on GPU i: --dp-size {args.dp_size} needs "
                f"{args.dp_size} GPUs but the Ray cluster has {cluster_gpus:g}: lower --dp-size"
            )
        return
    world = trainer_world_size(args)
    if world > 1 and args.gpus_per_rank < 1:
        raise ValueError(
            f"--gpus-per-rank {args.gpus_per_rank:g} with {world} ranks per group (--dp-size x --sp-size): Ray packs "
            "fractional shares onto as few GPUs as it can, so ranks of one group would share a GPU, which NCCL "
            "refuses; to share GPUs between trainer ranks and rollout engines use --colocate (whole GPUs, one rank of "
            "each group per GPU)"
        )
    trainers, engines = actor_shares(args, args.gpus_per_rank, args.rollout_gpus_per_engine)
    if trainers + engines <= cluster_gpus + 1e-9:
        return
    if world > cluster_gpus:
        hint = (
            f"lower --dp-size x --sp-size to at most {int(cluster_gpus)} (ranks of one group need distinct GPUs under "
            "nccl)"
        )
    else:
        hint = "share them with --colocate (rank i of every group and engines i, i + dp-size, ... on GPU i)"
    raise ValueError(
        f"the run needs {trainers + engines:g} GPUs ({len(algorithm_of(args).role_names)} group(s) x --dp-size "
        f"{args.dp_size} x --sp-size {args.sp_size} x --gpus-per-rank {args.gpus_per_rank:g}, plus {engines:g} for "
        f"the rollout engines) but the Ray cluster has {cluster_gpus:g}: {hint}"
    )


def check_cluster(args: argparse.Namespace) -> None:
    """Once Ray is up: with --ray-address the `auto` device and forward dtype from the cluster's GPUs (not this
    node's), then whether the run fits them."""
    cluster_gpus = ray.cluster_resources().get("GPU", 0.0)
    if args.ray_address is not None:
        resolve_cluster_device(args, cluster_gpus)
    check_gpus_fit(args, cluster_gpus)


def ray_init_settings(args: argparse.Namespace) -> dict | None:
    """`ray.init` keywords of this run's cluster, or None when Ray is up already (tests, tools). Without
    --ray-address: a local cluster sized for every actor's share, always one of this run's own, never one that
    another run on the machine started."""
    if ray.is_initialized():
        return None
    if args.ray_address:
        return {"address": args.ray_address, **ray_init_kwargs(local=False)}
    return {"address": "local", "num_cpus": local_ray_cpus(args), **ray_init_kwargs(local=True)}


class OwnSessionPopen(ray_services.ConsolePopen):
    """Ray's process launcher, each process in a session (and process group) of its own (`setsid`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, start_new_session=True, **kwargs)


@contextmanager
def ray_processes_in_own_sessions() -> Iterator[None]:
    """While a local cluster starts: its processes (GCS, raylet, agents; the raylet's workers, the actors, follow
    the raylet) start outside the driver's process group, so a scheduler's SIGTERM or a Ctrl-C to the whole group
    reaches the driver alone and the actors live on while it saves; the driver still ends them (`ray.shutdown`), and
    Ray's kernel fate-sharing (PR_SET_PDEATHSIG) ends them if the driver is killed."""
    launcher = ray_services.ConsolePopen
    ray_services.ConsolePopen = OwnSessionPopen
    try:
        yield
    finally:
        ray_services.ConsolePopen = launcher


def start_ray(settings: dict | None) -> bool:
    """Start or join the cluster of `ray_init_settings`; True when this driver started it. Call it from the main
    thread: Ray's processes end with the thread that started them."""
    if settings is None:
        return False
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
