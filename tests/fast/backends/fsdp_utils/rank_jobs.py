"""Spawned gloo rank runs that need nothing from the test session, run as background jobs (tests/background.py):
`python rank_jobs.py JOB OUT_DIR` runs JOB's worker function on its ranks (`fsdp_workers.run_ranks`), each rank
saving its report to OUT_DIR/rank{r}.pt; the test reads them with `reports`."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import torch

JOBS = {  # job -> (worker module in this folder, its function, world size, timeout s)
    "gather-ws6-shard3": ("gather_plan_workers", "gather_hybrid", 6, 240.0),
    "hybrid-ws4": ("sharding_workers", "hybrid_and_plain", 4, 240.0),
    "sp-ws2": ("sequence_parallel_workers", "sp_equality", 2, 300.0),
    "compile-ws2": ("sharding_workers", "compiled_gradients", 2, 900.0),
}
SCRIPT = "tests/fast/backends/fsdp_utils/rank_jobs.py"
GATHER_JOB = "gather-ws6-shard3"  # the gather and the direct weight push on 2 replicas x 3 shards (conftest.py)


def reports(folder: Path, job: str) -> list[dict]:
    """What each rank of `job` reported, in rank order."""
    world_size = JOBS[job][2]
    return [torch.load(os.path.join(folder, f"rank{rank}.pt"), weights_only=False) for rank in range(world_size)]


if __name__ == "__main__":
    from tests.fast.backends.fsdp_utils.fsdp_workers import run_ranks

    module, function, world_size, timeout = JOBS[sys.argv[1]]
    worker = getattr(importlib.import_module(f"tests.fast.backends.fsdp_utils.{module}"), function)
    run_ranks(worker, world_size, sys.argv[2], timeout=timeout)
