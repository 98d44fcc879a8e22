"""Shared, expensive fixtures, family-agnostic: one Ray cluster per test session, `load_script` for the repository's
scripts and benchmarks (files, not package modules), the background jobs of `tests/background.py` (started once
collection has selected their tests, stopped at the session's end); and the registration of the tiny pipeline
folders' session fixtures, which live with the models' tests (tests/fast/models/tiny_folders.py; the family contract
suite's cases are tests/fast/models/family_cases.py)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import pytest

# the tiny folders are used across the tree (trainer, rollout, planner, whole runs): fixtures visible everywhere
pytest_plugins = ["tests.fast.models.tiny_folders"]

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_JOBS = None  # tests.background.Jobs of this session, once a selected test asks for one


def pytest_collection_finish(session):
    """Start the background jobs the selected tests ask for (`@pytest.mark.background(SCRIPT, JOB)`)."""
    global _JOBS
    wanted = []
    for item in session.items:
        for mark in item.iter_markers("background"):
            key = (os.path.join(ROOT, mark.args[0]), mark.args[1])
            if key not in wanted:
                wanted.append(key)
    if wanted and not session.config.option.collectonly:
        import tests.background

        _JOBS = tests.background.CURRENT = tests.background.Jobs()
        _JOBS.start(wanted)


_POOL = None  # the session's ActorPool (ray_cluster), for its counts in the summary
_TIER_STARTS: dict[str, float] = {}  # tier folder -> when its first test started (time.monotonic)


def pytest_runtest_logstart(nodeid, location):
    tier = nodeid.split("/")[1] if nodeid.startswith("tests/") and nodeid.count("/") > 1 else "other"
    _TIER_STARTS.setdefault(tier, time.monotonic())


def pytest_terminal_summary(terminalreporter):
    if len(_TIER_STARTS) > 1:  # how long each tier ran in this session, in the order they ran
        starts = sorted(_TIER_STARTS.items(), key=lambda item: item[1])
        ends = [start for _, start in starts[1:]] + [time.monotonic()]
        terminalreporter.write_line(
            "tiers: " + ", ".join(f"tests/{t} {e - s:.0f} s" for (t, s), e in zip(starts, ends))
        )
    if _POOL is not None:
        terminalreporter.write_line(f"actor pool: {_POOL.stats}")
    if _JOBS is not None:
        for line in _JOBS.summary():
            terminalreporter.write_line(f"background job {line}")


def pytest_sessionfinish(session):
    if _JOBS is not None:
        _JOBS.stop()


def pytest_unconfigure(config):
    if _JOBS is not None:
        shutil.rmtree(_JOBS.root, ignore_errors=True)


@pytest.fixture
def background_job(request):
    """The folder of this test's background job once it has finished (`tests/background.py`); waits for it."""
    from tests.background import job_folder

    mark = request.node.get_closest_marker("background")
    if mark is None:
        pytest.fail("background_job needs @pytest.mark.background(SCRIPT, JOB) on the test")
    return job_folder(mark.args[0], mark.args[1], timeout=mark.kwargs.get("timeout", 1500))


@pytest.fixture(scope="session")
def load_script() -> Callable[[str], Any]:
    """`load_script("benchmarks/bench_loop.py")`: that file imported as a module named after it (registered in
    sys.modules: dataclasses look their module up)."""
    import importlib.util
    import sys

    def load(relative_path: str) -> Any:
        name = os.path.splitext(os.path.basename(relative_path))[0]
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relative_path))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """One local Ray cluster for the whole session (actors ask for fractional CPUs). Whole runs reuse each other's
    trainer-rank and engine processes (`miles.ray.actor_pool`): a new actor process costs ~5 s of CPU in imports."""
    import ray

    from miles.ray.actor_pool import reusing_actors

    temp_dir = tmp_path_factory.mktemp("ray")
    ray.init(
        num_cpus=6,  # logical: room for a run and the idle actors of two or three earlier shapes
        include_dashboard=False,
        _temp_dir=str(temp_dir),
        log_to_driver=False,
        configure_logging=False,
    )
    global _POOL
    with reusing_actors() as pool:
        _POOL = pool
        yield ray
    ray.shutdown()
