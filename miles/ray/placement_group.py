"""Placement groups for trainer ranks (one GPU bundle per rank on CUDA, a fractional CPU bundle on CPU), and where
the actors of a run landed (`placement.json`)."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group

logger = logging.getLogger(__name__)


def create_placement_group(
    num_bundles: int, *, use_gpu: bool, cpus_per_bundle: float, gpus_per_bundle: float = 1.0, timeout: float = 120
) -> PlacementGroup:
    """Reserve `num_bundles` bundles packed on as few nodes as possible; fail instead of waiting forever."""
    bundle = {"GPU": gpus_per_bundle, "CPU": max(cpus_per_bundle, 0.01)} if use_gpu else {"CPU": cpus_per_bundle}
    pg = placement_group([dict(bundle) for _ in range(num_bundles)], strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout)
    if not ready:
        available = ray.available_resources()
        ray.util.remove_placement_group(pg)
        raise RuntimeError(
            f"could not reserve {num_bundles} x {bundle} within {timeout:.0f}s (cluster has {available}); "
            + ("lower --dp-size or --gpus-per-rank" if use_gpu else "lower --dp-size or --cpus-per-rank")
        )
    return pg


@dataclass(frozen=True)
class Colocation:
    """`--colocate`: one placement group of --dp-size bundles, each one whole GPU (or, on CPU, the CPUs of its
    actors); bundle i holds rank i of every trained group and the engines j with j % dp-size == i, each with an equal
    share of the bundle's GPU. Ray packs fractional bundles onto as few GPUs as it can, so fractional
    `--gpus-per-rank` shares would put two ranks of one group on one GPU, which NCCL refuses; whole-GPU bundles
    cannot."""

    placement_group: PlacementGroup
    gpu_share: float  # of each actor in a bundle (0 on CPU)

    def bundle_of_engine(self, index: int) -> int:
        return index % self.placement_group.bundle_count

    def remove(self) -> None:
        ray.util.remove_placement_group(self.placement_group)


def colocated_actors_per_bundle(num_roles: int, num_engines: int, dp_size: int) -> int:
    """Trainer ranks (one per trained role) plus the most engines any bundle holds."""
    return num_roles + math.ceil(num_engines / dp_size)


def create_colocation(
    dp_size: int,
    num_roles: int,
    num_engines: int,
    *,
    use_gpu: bool,
    cpus_per_rank: float,
    cpus_per_engine: float,
    timeout: float = 120,
) -> Colocation:
    """The shared placement group of `--colocate` (see `Colocation`)."""
    engines_per_bundle = math.ceil(num_engines / dp_size)
    per_bundle = colocated_actors_per_bundle(num_roles, num_engines, dp_size)
    if use_gpu:  # trainer ranks ask for no CPU on GPU (as without --colocate), engines for `cpus_per_engine`
        cpus = engines_per_bundle * cpus_per_engine
        share = math.floor(10_000 / per_bundle) / 10_000  # Ray's resolution for fractional resources
    else:
        cpus, share = num_roles * cpus_per_rank + engines_per_bundle * cpus_per_engine, 0.0
    pg = create_placement_group(dp_size, use_gpu=use_gpu, cpus_per_bundle=cpus, gpus_per_bundle=1.0, timeout=timeout)
    logger.info(
        "colocated: %d bundle(s) of %s, each holding %d trainer rank(s) and up to %d engine(s)%s",
        dp_size,
        "one GPU" if use_gpu else f"{cpus:g} CPUs",
        num_roles,
        engines_per_bundle,
        f", {share:g} of the GPU each" if use_gpu else "",
    )
    return Colocation(pg, share)


def actor_location(_actor_instance: Any) -> dict[str, Any]:
    """Run inside an actor (`__ray_call__`): its Ray node id, that node's IP, the GPU ids Ray gave it and its process
    id (which process on the node is which rank)."""
    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "ip": ray.util.get_node_ip_address(),
        "gpus": [str(gpu) for gpu in ray.get_gpu_ids()],
        "pid": os.getpid(),
    }


def actor_nodes(actors: list[Any], timeout: float = 60.0) -> list[dict[str, Any]]:
    """Where each actor handle runs (node id, IP, GPU ids), in order; works for any actor class."""
    return ray.get([actor.__ray_call__.remote(actor_location) for actor in actors], timeout=timeout)


def write_placement(output_dir: str, placement: dict[str, list[dict[str, Any]]]) -> str:
    """`output_dir/placement.json`: for each role (`actor`, `critic`, `engines`, `reward_workers`), where each actor ran
    (`actor_nodes`); one line per role in the log. Returns the file's path."""
    path = os.path.join(output_dir, "placement.json")
    with open(path, "w") as f:
        json.dump(placement, f, indent=2)
    nodes = sorted({entry["node_id"] for entries in placement.values() for entry in entries})
    for role, entries in placement.items():
        where = ", ".join(f"{i}: {e['ip']} (node {nodes.index(e['node_id'])})" for i, e in enumerate(entries))
        logger.info("%s on %d node(s): %s", role, len({e["node_id"] for e in entries}), where)
    return path


def shard_groups_across_nodes(entries: list[dict[str, Any]], shard_size: int) -> list[tuple[int, list[str]]]:
    """The hybrid-sharding shard groups (ranks [i·N, (i+1)·N) of one trainer group, `entries` in rank order as
    `actor_nodes` lists them) whose ranks sit on more than one node: (i, their nodes in rank order)."""
    split = []
    for index, start in enumerate(range(0, len(entries), shard_size)):
        nodes = list(dict.fromkeys(entry["node_id"] for entry in entries[start : start + shard_size]))
        if len(nodes) > 1:
            split.append((index, nodes))
    return split


def check_shard_groups(shard_size: int | None, placement: dict[str, list[dict[str, Any]]], strict: bool) -> None:
    """Warn (raise with `strict`, --fsdp-strict-shard-groups) when a --fsdp-shard-size group of a trainer role spans
    nodes: its every parameter all-gather and gradient reduce-scatter would cross the network."""
    if shard_size is None:
        return
    split = [
        f"{role} ranks {i * shard_size}-{(i + 1) * shard_size - 1} on nodes {', '.join(nodes)}"
        for role, entries in placement.items()
        if role not in ("engines", "reward_workers")
        for i, nodes in shard_groups_across_nodes(entries, shard_size)
    ]
    if not split:
        return
    message = (
        f"--fsdp-shard-size {shard_size}: shard groups span nodes ({'; '.join(split)}), so every FSDP2 all-gather and "
        "reduce-scatter of those groups crosses the network; pick N = the trainer ranks of one node"
    )
    if strict:
        raise ValueError(f"{message} (refused: --fsdp-strict-shard-groups)")
    logger.warning("%s (--fsdp-strict-shard-groups refuses to start)", message)
