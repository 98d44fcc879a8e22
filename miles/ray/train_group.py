"""RayTrainGroup: the ranks of one role as Ray actors (--dp-size data-parallel groups of --sp-size sequence-parallel
ranks), every call broadcast to all ranks."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from miles.utils import import_gc

# ruff: noqa: E402 - the imports below come after the collector's pause
# a Ray worker imports this module to start a trainer rank: its imports run without the collector until
# TrainRankActor.__init__ resumes it (docs/user-guide/performance.md, "Imports without the garbage collector")
import_gc.pause_in_ray_worker()

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.arguments.fsdp import trainer_world_size
from miles.backends.fsdp_utils.actor import FSDPTrainRayActor
from miles.ray.actor_pool import ActorPool, ReusableActor
from miles.ray.placement_group import Colocation, actor_location, create_placement_group
from miles.utils.box import Box
from miles.utils.distributed import uses_gpu
from miles.utils.failures import gather
from miles.utils.stop_signals import defer_first_sigterm

logger = logging.getLogger(__name__)


class TrainRankActor(FSDPTrainRayActor, ReusableActor):
    """The trunk actor as Ray starts it: the collector back on, first thing, once this module's imports are done.
    An `ActorPool` may hand its process to the next run (`release`, then `reuse`)."""

    def __init__(self, world_size: int, rank: int, role: str) -> None:
        import_gc.resume()
        defer_first_sigterm()  # a scheduler's signal to the whole job: live on while the driver saves
        self._remember_process_baseline()
        super().__init__(world_size, rank, role)

    def _release_resources(self) -> None:
        self.shutdown()


def rank_options(
    args: argparse.Namespace, rank: int, placement_group: Any, colocation: Colocation | None = None
) -> dict[str, Any]:
    """Ray options of trainer rank `rank`: bundle `rank` of its placement group, with --gpus-per-rank GPUs (or, with
    `colocation`, the bundle's GPU share) on CUDA and --cpus-per-rank CPUs otherwise."""
    gpu = uses_gpu(args)
    gpus = (args.gpus_per_rank if colocation is None else colocation.gpu_share) if gpu else 0
    strategy = PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=rank)
    return {"num_cpus": 0 if gpu else args.cpus_per_rank, "num_gpus": gpus, "scheduling_strategy": strategy}


class RayTrainGroup:
    """dp x sp ranks of one role in one placement group; rank i of this group pairs with rank i of the next. Ranks
    [k·sp, (k + 1)·sp) form sequence-parallel group k and all train data-parallel shard k."""

    def __init__(
        self,
        args: argparse.Namespace,
        role: str,
        *,
        timeout: float | None = None,
        colocation: Colocation | None = None,
        pool: ActorPool | None = None,
    ) -> None:
        """Rank i runs in bundle i of its own placement group, or with `colocation` (--colocate) of the shared one,
        with its share of that bundle's GPU. With `pool`, ranks (and their placement group) of an earlier run of
        the same shape are reused and go back to it at `shutdown` (not with `colocation`: that group is the run's)."""
        self.args, self.role, self.timeout = args, role, timeout
        self.world_size = trainer_world_size(args)
        self.dp_size, self.sp_size = args.dp_size, args.sp_size
        self.last_rollout_id: int | None = None  # named by failures of calls that are not told the rollout
        self.failed = False
        gpu = uses_gpu(args)
        self.owns_placement_group = colocation is None
        self.pool = pool if colocation is None else None
        self.pool_key = ("trainer", self.world_size, gpu, args.cpus_per_rank, args.gpus_per_rank)
        reused = self._take_from_pool(role)
        if reused is not None:
            self.placement_group, self.actors = reused
            return
        if colocation is None:
            if self.pool is not None:  # idle pooled actors hold resources: end the oldest until these ranks fit
                per_rank = {"GPU": args.gpus_per_rank, "CPU": 0.01} if gpu else {"CPU": args.cpus_per_rank}
                self.pool.make_room({k: v * self.world_size for k, v in per_rank.items()})
            self.placement_group = create_placement_group(
                self.world_size, use_gpu=gpu, cpus_per_bundle=args.cpus_per_rank, gpus_per_bundle=args.gpus_per_rank
            )
        else:
            self.placement_group = colocation.placement_group
        remote_cls = ray.remote(TrainRankActor)
        self.actors = [
            remote_cls.options(**rank_options(args, rank, self.placement_group, colocation)).remote(
                self.world_size, rank, role
            )
            for rank in range(self.world_size)
        ]

    def _held_resources(self) -> dict[str, float]:
        """What this group's placement group reserves (its bundles' sum)."""
        held: dict[str, float] = {}
        for bundle in self.placement_group.bundle_specs:
            for name, amount in bundle.items():
                held[name] = held.get(name, 0.0) + amount
        return held

    def _take_from_pool(self, role: str) -> tuple[Any, list] | None:
        """Idle ranks of this shape from the pool, rebuilt as this group's (None: none there, or one did not answer,
        and then they are ended)."""
        reused = self.pool.take(self.pool_key) if self.pool is not None else None
        if reused is None:
            return None
        placement_group, actors = reused
        try:
            ray.get([a.reuse.remote(self.world_size, rank, role) for rank, a in enumerate(actors)], timeout=60)
        except Exception as exc:  # a rank died while idle: start afresh
            logger.warning("pooled %s ranks could not be reused (%s); starting new ones", role, exc)
            _end_ranks(placement_group, actors)
            return None
        return placement_group, actors

    def _get(self, refs: list, phase: str, rollout_id: int | None = None, ranks: list[int] | None = None) -> list:
        """Every rank's answer; a failure names this role, the rank, the phase and the rollout (`failures.gather`;
        `ranks`: each ref's rank, where the refs are not every rank in order)."""
        try:
            return gather(
                refs, role=f"{self.role} rank", phase=phase, rollout_id=rollout_id, timeout=self.timeout, ranks=ranks
            )
        except BaseException:
            self.failed = True
            raise

    def init(self) -> int:
        """Rendezvous at rank 0's address, build every rank; returns the rollout id to start from."""
        self.start_init()
        return self.finish_init()

    def start_init(self) -> None:
        """Rendezvous at rank 0's address and start building every rank without waiting (`finish_init` waits), so
        that other groups and the engines load meanwhile."""
        master_addr, master_port = self._get([self.actors[0].get_master_address.remote()], "init")[0]
        self._init_refs = [a.init.remote(self.args, master_addr, master_port) for a in self.actors]

    def finish_init(self) -> int:
        """Wait for every rank's build (`start_init`); returns the rollout id to start from."""
        starts = self._get(self._init_refs, "init (load)")
        if len(set(starts)) != 1:
            raise RuntimeError(f"{self.role} ranks resumed at different rollouts: {starts}")
        return starts[0]

    def train(self, rollout_id: int, data: list[Box], peer: list[Box] | None = None) -> list[Box]:
        """One `train` call on every rank, rank r on data-parallel shard r // sp-size; returns the ranks' boxed
        outputs (the driver never opens them)."""
        if len(data) != self.dp_size:
            raise ValueError(f"{self.role}: {len(data)} data shards for {self.dp_size} data-parallel groups")
        if peer is not None and len(peer) != self.world_size:
            raise ValueError(f"{self.role}: {len(peer)} peer outputs for {self.world_size} ranks")
        refs = [
            actor.train.remote(rollout_id, data[rank // self.sp_size], None if peer is None else peer[rank])
            for rank, actor in enumerate(self.actors)
        ]
        self.last_rollout_id = rollout_id
        return self._get(refs, "train", rollout_id)

    def node_infos(self) -> list[tuple[str, int]]:
        """(Ray node id, cores) of each rank."""
        return self._get([a.node_info.remote() for a in self.actors], "node_info")

    def set_train_threads(self, counts: list[int | None]) -> None:
        """Each rank's torch thread count while it trains (None: its base count)."""
        self._get([a.set_train_threads.remote(c) for a, c in zip(self.actors, counts)], "set_train_threads")

    def sleep(self) -> list[dict[str, float]]:
        """Every rank moves its weights, optimizer state and shadows to host memory (`--colocate-sleep`)."""
        return self._get([a.sleep.remote() for a in self.actors], "sleep", self.last_rollout_id)

    def wake(self) -> list[dict[str, float]]:
        """Every rank brings back what `sleep` moved."""
        return self._get([a.wake.remote() for a in self.actors], "wake", self.last_rollout_id)

    def pop_metrics(self) -> list[dict[str, Any]]:
        return self._get([self.actors[0].pop_metrics.remote()], "metrics", self.last_rollout_id)[0]

    def save(self, rollout_id: int, extra: dict | None = None) -> None:
        self._get([a.save.remote(rollout_id, extra) for a in self.actors], "save", rollout_id)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The weights for rollout engines, fetched into the caller (tools and tests)."""
        return ray.get(self.export_weights_ref()[0], timeout=self.timeout)

    def export_weights_ref(self) -> tuple[ray.ObjectRef, ray.ObjectRef]:
        """Rank 0's exported weights and their checksums as two object refs (every rank takes part in the gather);
        engines resolve them.

        The driver never fetches the payload: rank 0's refs go to the engines as they are.
        """
        pairs = [a.export_weights.options(num_returns=2).remote() for a in self.actors]
        refs = [ref for pair in pairs for ref in pair]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.timeout, fetch_local=False)
        if len(ready) != len(refs):
            raise TimeoutError(f"{self.role}: export_weights did not finish within {self.timeout}s")
        # every rank's outcome in rank order (gather names a rank by its index): rank 0's checksums (small) stand for
        # its payload, which the driver never fetches
        self._get([pairs[0][1], *(pair[0] for pair in pairs[1:])], "weight sync", self.last_rollout_id)
        weights, checksums = pairs[0]
        return weights, checksums

    def submit_push(self) -> list[ray.ObjectRef]:
        """Every rank starts the weight sync's gather, rank 0 sending to the engines (`miles.ray.weight_sync`)."""
        return [a.push_weights.remote() for a in self.actors]

    def collect(self, refs: list, phase: str, rollout_id: int | None = None, ranks: list[int] | None = None) -> list:
        """Ranks' answers to a submitted call (`ranks`: each ref's rank, default its position); a failure names this
        role, the rank, the phase and the rollout."""
        return self._get(refs, phase, rollout_id, ranks)

    def save_hf(self, out_dir: str) -> str:
        return self._get([a.save_hf.remote(out_dir) for a in self.actors], "save_hf", self.last_rollout_id)[0]

    def nodes(self) -> list[dict[str, Any]]:
        """Where each rank runs (`placement_group.actor_location`: node id, IP, GPU ids, pid), in rank order; a rank
        lost meanwhile fails naming this role and the rank, as a failure in any other phase does."""
        return self._get([a.__ray_call__.remote(actor_location) for a in self.actors], "start-up (placement)")

    def call(self, method: str, *args: Any, **kwargs: Any) -> list:
        """Broadcast any actor method to all ranks (tests and tools)."""
        return self._get([getattr(a, method).remote(*args, **kwargs) for a in self.actors], method)

    def shutdown(self, timeout: float = 60.0) -> None:
        """Tear the ranks down gracefully within `timeout`, then kill them whatever happened (or, with a pool, give
        them back to it once they have released what the run held). After a failure, kill at once: the surviving
        ranks may be blocked in a collective with the dead one and would never answer."""
        pooled = False
        try:
            if not self.failed:
                if self.pool is not None:
                    ray.get([a.release.remote() for a in self.actors], timeout=timeout)
                    placement_group, actors = self.placement_group, self.actors
                    self.pool.put(
                        self.pool_key,
                        (placement_group, actors),
                        lambda: _end_ranks(placement_group, actors),
                        resources=self._held_resources(),
                    )
                    pooled = True
                else:
                    ray.get([a.shutdown.remote() for a in self.actors], timeout=timeout)
        finally:
            if not pooled:
                _end_ranks(self.placement_group if self.owns_placement_group else None, self.actors)


def _end_ranks(placement_group: Any, actors: list) -> None:
    """Kill `actors`, then remove `placement_group` (None: a shared one, --colocate, that the driver removes)."""
    for actor in actors:
        ray.kill(actor)
    if placement_group is not None:
        ray.util.remove_placement_group(placement_group)
