"""Shared, expensive fixtures: the tiny pipeline folder and one Ray cluster per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_pipeline_dir(tmp_path_factory):
    """A tiny SD3-architecture pipeline folder, built offline once per session."""
    from miles.models.tiny import save_tiny_sd3_pipeline

    path = tmp_path_factory.mktemp("tiny_sd3") / "pipeline"
    save_tiny_sd3_pipeline(str(path), seed=0)
    return str(path)


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """One local Ray cluster for the whole session (actors ask for fractional CPUs)."""
    import ray

    temp_dir = tmp_path_factory.mktemp("ray")
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        _temp_dir=str(temp_dir),
        log_to_driver=False,
        configure_logging=False,
    )
    yield ray
    ray.shutdown()
