"""Per-phase torch thread counts on CPU (ARCHITECTURE §4, colocated phases).

Engines and trainer ranks that share a CPU node never compute at the same time: the engines generate while the
ranks wait for the batch, the ranks train while the engines wait for weights. A thread count fixed per actor (its
fractional Ray share, rounded) leaves most of the node's cores idle in every phase; instead each actor runs its own
phase on the node's cores divided among the actors of that phase on that node, and goes back to its base count after.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch


def node_cores() -> int:
    """The cores this process may run on (its CPU affinity), which is what a thread pool can use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def node_info() -> tuple[str, int]:
    """(Ray node id, cores) of the calling actor process."""
    import ray

    return ray.get_runtime_context().get_node_id(), node_cores()


def gpu_rank_threads() -> int:
    """CPU threads for a trainer rank on a GPU node: the node's cores split among its GPUs (one rank or engine per
    GPU). Ray starts an actor that asks for no CPUs with OMP_NUM_THREADS=1, which would leave the host-side work of a
    GPU rank (a CPU-offloaded optimizer step, weight export, checkpoint writes) on one core. Outside Ray (the trainer
    called directly, as `scripts/gpu_check.sh --no-setup` does) the GPUs are the ones this process sees."""
    ray = sys.modules.get("ray")  # the trainer runs without Ray too: only a process Ray started asks Ray
    if ray is None or not ray.is_initialized():
        return max(1, node_cores() // max(1, torch.cuda.device_count()))
    node = ray.get_runtime_context().get_node_id()
    gpus = next((n["Resources"].get("GPU", 0) for n in ray.nodes() if n["NodeID"] == node), 0)
    return max(1, node_cores() // max(1, int(gpus)))


@contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """Run the block with `count` intra-op torch threads, then restore the previous count (None: leave it)."""
    previous = torch.get_num_threads()
    if count is None or count == previous:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def phase_thread_counts(
    engines: Sequence[tuple[str, int]], ranks: Sequence[Sequence[tuple[str, int]]]
) -> tuple[list[int | None], list[list[int | None]]]:
    """Thread counts for each engine's generate and each trainer rank's train call, from every actor's (node, cores).

    Only actors on a node that holds both an engine and a trainer rank change phase (elsewhere the Ray share
    stands): the engines of a node split its cores, and so do the ranks of one group on a node (a group's ranks
    train together; groups train one after another). None: the actor keeps its base count.
    """
    engine_nodes = Counter(node for node, _ in engines)
    rank_nodes = {node for group in ranks for node, _ in group}
    shared = set(engine_nodes) & rank_nodes
    engine_counts = [max(1, cores // engine_nodes[node]) if node in shared else None for node, cores in engines]
    rank_counts = []
    for group in ranks:
        per_node = Counter(node for node, _ in group)
        rank_counts.append([max(1, cores // per_node[node]) if node in shared else None for node, cores in group])
    return engine_counts, rank_counts
