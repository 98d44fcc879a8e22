"""Placement groups for trainer ranks: one GPU bundle per rank on CUDA, a fractional CPU bundle on CPU."""

from __future__ import annotations

import logging

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
