"""The driver's side of the weight sync (`miles.weight_sync`): at the first sync it picks the transport by placement
(or --weight-sync-transport), has trainer rank 0 make the bucket plan and the buffers, and starts the sync group of
rank 0 and the engines; every sync then runs the trainer's push and the engines' receive at once. No weight passes
through the driver or Ray's object store: only the plan and the group's address do."""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

import ray

from miles.ray.engine_group import RolloutEngineGroup
from miles.ray.placement_group import actor_nodes
from miles.utils import failures
from miles.utils.distributed import uses_gpu
from miles.utils.failures import ACTOR_GONE, dead_peer
from miles.weight_sync.arguments import transport_device_problem
from miles.weight_sync.protocol import bucket_bytes_for
from miles.weight_sync.transports import TransportSpec, choose_transport

logger = logging.getLogger(__name__)

TRAINER, ENGINE = "trainer", "engine"  # the two kinds of sync member, with a trainer rank or an engine index


def bucket_bytes(args: argparse.Namespace) -> int:
    """--weight-sync-bucket-mb in bytes; its default by device."""
    return bucket_bytes_for(args.weight_sync_bucket_mb, "cuda" if uses_gpu(args) else "cpu")


def check_placement(kind: str, rank0: dict, engines: list[dict]) -> None:
    """Refuse a shared transport (`--weight-sync-transport shm` / `cuda_ipc`) that some engine cannot map."""
    key = {"shm": ("node_id",), "cuda_ipc": ("node_id", "gpus")}.get(kind)
    apart = [i for i, e in enumerate(engines) if key and any(e[k] != rank0[k] for k in key)]
    if apart:
        where = "node" if kind == "shm" else "GPU"
        raise ValueError(
            f"--weight-sync-transport {kind} needs every engine on the {where} of the actor's rank 0, but engines "
            f"{apart} run elsewhere (placement.json): use --weight-sync-transport auto"
        )


class WeightSyncLink:
    """The sync group of one actor group's rank 0 and one engine group, made at the first `push`."""

    def __init__(self, args: argparse.Namespace, engines: RolloutEngineGroup) -> None:
        self.args, self.engines = args, engines
        self.actor_group: Any = None
        self.kind: str | None = None

    def connect(self, actor_group: Any) -> None:
        """Pick the transport, make the plan and buffers on the trainer, and have rank 0 and the engines join."""
        args, engines = self.args, self.engines
        ranks, where = actor_group.nodes(), actor_nodes(engines.engines)
        kind, gpu = args.weight_sync_transport, uses_gpu(args)
        if kind == "auto":
            kind = choose_transport(ranks[0], where, "cuda" if gpu else "cpu")
        problem = transport_device_problem(kind, gpu)
        if problem:  # --device auto found no GPU
            raise ValueError(problem)
        check_placement(kind, ranks[0], where)
        # on one host every rank writes its own shards into the shared buckets: no all-gather
        direct = kind == "shm" and all(r["node_id"] == ranks[0]["node_id"] for r in ranks)
        # on one host the shared file holds the whole sync and the engines' parameters are views of it
        prepared = actor_group.call("prepare_weight_sync", kind, bucket_bytes(args), direct, kind == "shm")
        plan, opener, offsets = prepared[0]
        address, port = ray.get(actor_group.actors[0].get_master_address.remote(), timeout=engines.timeouts.sync_s)
        spec = TransportSpec(
            kind,
            address,
            port,
            1 + engines.num_engines,
            plan.buffer_bytes,
            engines.timeouts.sync_s,
            shm_path=opener if kind == "shm" else None,
            offsets=offsets,
        )
        joined = actor_group.actors[0].open_weight_sync.remote(spec)
        engines.open_weight_sync(spec, plan, opener if kind == "cuda_ipc" else None)
        ray.get(joined, timeout=engines.timeouts.sync_s)
        self.actor_group, self.kind = actor_group, kind
        logger.info(
            "weight sync over %s%s%s: %d buckets, %.1f MB, %d engine(s)",
            kind,
            " (every trainer rank writes its shards)" if direct else "",
            ", resident (the engines' parameters)" if offsets is not None else "",
            len(plan.buckets),
            plan.total_bytes / 1e6,
            engines.num_engines,
        )

    def push(self, actor_group: Any, version: int, rollout_id: int | None = None) -> float:
        """One sync: the trainer ranks gather and rank 0 sends while the engines receive; seconds until every engine
        holds (and has verified) the weights. The first member to fail is the one named (the others would wait on it
        until the group's timeout), unless another member died: a member whose collective broke because a peer's
        process died (gloo's "Connection closed by peer") fails about when Ray reports the death, and the dead one,
        trainer rank or engine, is the cause to name."""
        if self.actor_group is not actor_group:
            self.connect(actor_group)
        started = time.perf_counter()
        waiting = {ref: (TRAINER, rank) for rank, ref in enumerate(actor_group.submit_push())}
        waiting.update({ref: (ENGINE, i) for i, ref in self.engines.submit_receive(version).items()})
        while waiting:
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=self.engines.timeouts.sync_s)
            ref = ready[0] if ready else next(iter(waiting))  # none in time: the next get names who timed out
            member = waiting.pop(ref)
            try:
                self._collect(actor_group, member, ref, version, rollout_id)
            except Exception as exc:
                # every member may be left waiting in the broken sync group: none is handed on to a pool
                actor_group.failed = self.engines.failed = True
                if isinstance(exc.__cause__, ACTOR_GONE):
                    raise  # a death, named
                dead = dead_peer(list(waiting), {r: r for r in waiting}, failures.PEER_DEATH_WINDOW_S)
                if dead is None:
                    raise
                self._name_death(actor_group, waiting[dead[0]], dead[0], exc, member, version, rollout_id)
        return time.perf_counter() - started

    def _collect(self, actor_group: Any, member: tuple[str, int], ref: Any, version: int, rollout_id: int | None):
        """One member's answer; its failure named by its group (the trainer rank, the engine index)."""
        kind, index = member
        if kind == TRAINER:
            actor_group.collect([ref], f"weight sync (version {version})", rollout_id, ranks=[index])
        else:
            self.engines.collect_receive({index: ref}, version, rollout_id)

    def _name_death(
        self, actor_group: Any, dead: tuple[str, int], ref: Any, after: Exception, failed: tuple[str, int], *context
    ) -> None:
        """Raise the death of member `dead` (its ref failed with `RayActorError`) as its group names it, noting the
        error of `failed` that followed it."""

        def who(member: tuple[str, int]) -> str:
            kind, index = member
            return f"{actor_group.role} rank {index}" if kind == TRAINER else f"rollout engine {index}"

        try:
            self._collect(actor_group, dead, ref, *context)
        except Exception as death:
            death.add_note(f"{who(failed)} failed after it: {(str(after).strip().splitlines() or [''])[-1]}")
            raise
        raise RuntimeError(f"weight sync: {who(dead)} was reported dead but answered")  # dead_peer saw it fail
