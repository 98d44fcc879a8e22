"""Throughput of a 64-image batch scored by a reward server on loopback vs the same reward in process, and of the
server merging the client's concurrent requests into one batch vs scoring each alone (`--server-max-batch-size 1`).

    python benchmarks/bench_reward_server.py [--repeats 5]

Rewards: `shapes` on the builtin 32 px shapes images, and `jpeg_compressibility` on 512 px noise images (a
realistic image size). Prints the median seconds per batch and images per second of each way.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from miles.arguments.parser import build_parser  # noqa: E402
from miles.data.shapes import shapes_items  # noqa: E402
from miles.ray.reward_workers import RewardWorkerPool  # noqa: E402
from miles.rollout.rm_hub import compute_rewards, reward_spec_from_args  # noqa: E402
from miles.utils.types import Sample  # noqa: E402
from tests.fast.rollout.rm_hub.reward_processes import reward_server  # noqa: E402

BATCH = 64


def batches(name: str) -> list[Sample]:
    if name == "shapes":
        items = shapes_items(BATCH, seed=0)
        return [
            Sample(index=i, prompt=it["prompt"], metadata=it["metadata"], image=it["image"])
            for i, it in enumerate(items)
        ]
    rng = np.random.default_rng(0)
    # smooth-ish 512 px images: noise at 64 px upsampled, what a decoded sample's PNG size is closer to
    small = rng.integers(0, 256, (BATCH, 64, 64, 3), dtype=np.uint8)
    return [
        Sample(index=i, prompt="p", image=np.kron(img, np.ones((8, 8, 1), dtype=np.uint8)))
        for i, img in enumerate(small)
    ]


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: imports, connections
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def served(name: str, samples: list[Sample], repeats: int, *server_flags: str) -> float:
    """Median seconds of one batch sent to a reward server (4 concurrent requests of --rm-batch-size 16)."""
    with reward_server("--rm-type", name, *server_flags) as (_, url):
        args = build_parser().parse_args(["--rm-url", url])
        pool = RewardWorkerPool(args, reward_spec_from_args(args), num_workers=0)
        return timed(lambda: pool.score(samples), repeats)


def bench(name: str, repeats: int) -> tuple[float, float, float]:
    """(in-process, over loopback merged, over loopback unmerged) median seconds of one 64-image batch of `name`."""
    samples = batches(name)
    local_args = build_parser().parse_args(["--rm-type", name])
    local = timed(lambda: asyncio.run(compute_rewards(local_args, samples, [(name, 1.0)])), repeats)
    merged = served(name, samples, repeats)
    unmerged = served(name, samples, repeats, "--server-max-batch-size", "1")
    return local, merged, unmerged


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    repeats = parser.parse_args().repeats
    print(
        "| reward | images | in process | over loopback, merged | ratio | unmerged (max batch 1) | merged / unmerged |"
        "\n|---|---|---|---|---|---|---|"
    )
    for name, size in (("shapes", "32 px"), ("jpeg_compressibility", "512 px")):
        local, remote, unmerged = bench(name, repeats)
        print(
            f"| `{name}` | 64 x {size} | {local * 1000:.0f} ms ({BATCH / local:.0f} img/s) | "
            f"{remote * 1000:.0f} ms ({BATCH / remote:.0f} img/s) | {remote / local:.1f}x | "
            f"{unmerged * 1000:.0f} ms | {remote / unmerged:.2f}x |"
        )


if __name__ == "__main__":
    main()
