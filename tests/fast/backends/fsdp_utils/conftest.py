"""What the trainer-side tests of several files use: the reports of the background job of gloo ranks that gather
and push uneven shards (test_gather.py, test_weight_push.py), and a gloo process group of one rank (a trainer rank
always runs in one)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from miles.utils.distributed import destroy_process_group, find_free_port, init_process_group
from tests.background import job_folder
from tests.fast.backends.fsdp_utils import rank_jobs


@pytest.fixture(scope="module")
def world_of_one():
    """A gloo process group of this one rank for the module's tests (a file may define its own)."""
    init_process_group(0, 1, "127.0.0.1", find_free_port(), "cpu", timeout=timedelta(seconds=60))
    yield
    destroy_process_group()


@pytest.fixture(scope="module")
def gloo_reports() -> dict[str, list[dict]]:
    """What each rank of a 6-rank run in 2 replicas of 3 shards reported (`gather_report`): its shard groups hold the
    uneven rows a plain 3-rank run would, so one run covers both (a separate 3-rank run cost ~25 s more). Before the
    plan, this run aborted in gloo ("Received data size doesn't match expected size", 612 vs 112 bytes). The run is
    the background job `gather-ws6-shard3` of rank_jobs.py (`gather_hybrid` on 2 x SHARD ranks); a test that reads
    it carries `@pytest.mark.background(rank_jobs.SCRIPT, rank_jobs.GATHER_JOB)`."""
    from tests.fast.backends.fsdp_utils.gather_plan_workers import SHARD

    assert rank_jobs.JOBS[rank_jobs.GATHER_JOB][1:3] == ("gather_hybrid", 2 * SHARD)
    job = rank_jobs.GATHER_JOB
    return {"ws6-shard3": rank_jobs.reports(job_folder(rank_jobs.SCRIPT, job), job)}
