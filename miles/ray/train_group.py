"""RayTrainGroup: the data-parallel ranks of one role as Ray actors, every call broadcast to all ranks."""

from __future__ import annotations

import argparse
import logging
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.backends.fsdp_utils.actor import FSDPTrainRayActor
from miles.ray.placement_group import create_placement_group
from miles.utils.box import Box

logger = logging.getLogger(__name__)


def uses_gpu(args: argparse.Namespace) -> bool:
    return args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())


class RayTrainGroup:
    """N ranks of one role in one placement group; rank i of this group pairs with rank i of the next."""

    def __init__(self, args: argparse.Namespace, role: str, *, timeout: float | None = None) -> None:
        self.args, self.role, self.timeout = args, role, timeout
        self.world_size = args.dp_size
        gpu = uses_gpu(args)
        self.placement_group = create_placement_group(
            self.world_size, use_gpu=gpu, cpus_per_bundle=args.cpus_per_rank, gpus_per_bundle=args.gpus_per_rank
        )
        remote_cls = ray.remote(FSDPTrainRayActor)
        self.actors = [
            remote_cls.options(
                num_cpus=0 if gpu else args.cpus_per_rank,
                num_gpus=args.gpus_per_rank if gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank
                ),
            ).remote(self.world_size, rank, role)
            for rank in range(self.world_size)
        ]

    def _get(self, refs: list) -> list:
        return ray.get(refs, timeout=self.timeout)

    def init(self) -> int:
        """Rendezvous at rank 0's address, build every rank; returns the rollout id to start from."""
        master_addr, master_port = self._get([self.actors[0].get_master_address.remote()])[0]
        starts = self._get([a.init.remote(self.args, master_addr, master_port) for a in self.actors])
        if len(set(starts)) != 1:
            raise RuntimeError(f"{self.role} ranks resumed at different rollouts: {starts}")
        return starts[0]

    def train(self, rollout_id: int, data: list[Box], peer: list[Box] | None = None) -> list[Box]:
        """One `train` call on every rank; returns the ranks' boxed outputs (the driver never opens them)."""
        if len(data) != self.world_size:
            raise ValueError(f"{self.role}: {len(data)} data shards for {self.world_size} ranks")
        if peer is not None and len(peer) != self.world_size:
            raise ValueError(f"{self.role}: {len(peer)} peer outputs for {self.world_size} ranks")
        refs = [
            actor.train.remote(rollout_id, data[rank], None if peer is None else peer[rank])
            for rank, actor in enumerate(self.actors)
        ]
        return self._get(refs)

    def pop_metrics(self) -> list[dict[str, Any]]:
        return self._get([self.actors[0].pop_metrics.remote()])[0]

    def save(self, rollout_id: int, extra: dict | None = None) -> None:
        self._get([a.save.remote(rollout_id, extra) for a in self.actors])

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The weights for rollout engines, fetched into the caller (tools and tests)."""
        return ray.get(self.export_weights_ref(), timeout=self.timeout)

    def export_weights_ref(self) -> ray.ObjectRef:
        """Rank 0's exported weights as an object ref (every rank takes part in the gather); engines resolve it."""
        refs = [a.export_weights.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.timeout)
        if len(ready) != len(refs):
            raise TimeoutError(f"{self.role}: export_weights did not finish within {self.timeout}s")
        self._get(refs[1:])  # surface errors of the other ranks
        return refs[0]

    def save_hf(self, out_dir: str) -> str:
        return self._get([a.save_hf.remote(out_dir) for a in self.actors])[0]

    def call(self, method: str, *args: Any, **kwargs: Any) -> list:
        """Broadcast any actor method to all ranks (tests and tools)."""
        return self._get([getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    def shutdown(self) -> None:
        try:
            self._get([a.shutdown.remote() for a in self.actors])
        finally:
            for actor in self.actors:
                ray.kill(actor)
            ray.util.remove_placement_group(self.placement_group)
