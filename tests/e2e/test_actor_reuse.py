"""Runs inside one `reusing_actors` block (the suite's session does this) share trainer-rank and engine processes:
the next run of the same shape takes the same processes, with the process settings a run changed put back."""

from __future__ import annotations

import os

import pytest
import ray

import train_diffusion
from miles.arguments.parser import parse_args
from miles.ray.actor_pool import current_pool

pytestmark = pytest.mark.e2e


def run_args(out, *extra: str):
    return parse_args(
        [
            *("--dp-size", "2", "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"),
            *("--diffusion-num-steps", "2", "--micro-batch-size", "2", "--eval-interval", "0"),
            *("--image-grid-interval", "0", "--no-progress", "--log-level", "WARNING", "--output-dir", str(out)),
            *extra,
        ]
    )


def probe(actor) -> dict:
    def settings(self) -> dict:
        import torch

        return {
            "pid": os.getpid(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        }

    return ray.get(actor.__ray_call__.remote(settings), timeout=60)


def test_a_second_run_takes_the_first_runs_processes_with_their_settings_put_back(ray_cluster, tmp_path):
    seen = []

    def record(groups) -> None:
        seen.append([probe(actor) for actor in groups["actor"].actors])

    train_diffusion.run(run_args(tmp_path / "first", "--deterministic-mode"), before_shutdown=record)
    train_diffusion.run(run_args(tmp_path / "second"), before_shutdown=record)
    first, second = seen
    assert [r["pid"] for r in second] == [r["pid"] for r in first]
    assert all(r["deterministic"] and r["cublas"] is not None for r in first)  # the flag took effect
    assert not any(r["deterministic"] or r["cublas"] is not None for r in second), second
    assert len(current_pool()) >= 2  # at least this run's rank group and engine, back for the next run
