"""Placement groups for trainer ranks (one GPU bundle per rank on CUDA, a fractional CPU bundle on CPU), and where
the actors of a run landed (`placement.json`)."""

from __future__ import annotations

import json
import logging
import os
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


def _where(_actor_instance: Any) -> dict[str, str]:
    """Run inside an actor (`__ray_call__`): its Ray node id and that node's IP."""
    return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address()}


def actor_nodes(actors: list[Any], timeout: float = 60.0) -> list[dict[str, str]]:
    """The node (id and IP) of each actor handle, in order; works for any actor class."""
    return ray.get([actor.__ray_call__.remote(_where) for actor in actors], timeout=timeout)


def write_placement(output_dir: str, placement: dict[str, list[dict[str, str]]]) -> str:
    """`output_dir/placement.json`: for each role (`actor`, `critic`, `engines`), where each rank or engine ran;
    one line per role in the log. Returns the file's path."""
    path = os.path.join(output_dir, "placement.json")
    with open(path, "w") as f:
        json.dump(placement, f, indent=2)
    nodes = sorted({entry["node_id"] for entries in placement.values() for entry in entries})
    for role, entries in placement.items():
        where = ", ".join(f"{i}: {e['ip']} (node {nodes.index(e['node_id'])})" for i, e in enumerate(entries))
        logger.info("%s on %d node(s): %s", role, len({e["node_id"] for e in entries}), where)
    return path
