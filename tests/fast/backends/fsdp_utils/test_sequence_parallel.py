"""--sp-size 2 on tiny Wan (dp 1, FSDP2 over both ranks, with and without activation checkpointing; two experts; LoRA)
computes what the plain unsharded transformer computes: velocities, a Flow-GRPO log-prob, a flow-matching loss and
every gradient, to fp32 rounding. One spawned world-size-2 run (a background job) that every test here reads."""

from __future__ import annotations

import pytest
import torch

from tests.background import job_folder
from tests.fast.backends.fsdp_utils import rank_jobs

SP_JOB = "sp-ws2"  # `sp_equality` on 2 ranks (sequence_parallel_workers.py): tiny Wan, then tiny LTX-2
ON_SP = pytest.mark.background(rank_jobs.SCRIPT, SP_JOB)
SP_RUNS = {  # run -> its reference
    "sp": "plain",
    "sp_checkpointed": "plain",
    "experts_sp": "experts_plain",
    "lora_sp": "lora_plain",
}


@pytest.fixture(scope="module")
def sp_reports() -> list[dict]:
    assert rank_jobs.JOBS[SP_JOB][1:3] == ("sp_equality", 2)
    return rank_jobs.reports(job_folder(rank_jobs.SCRIPT, SP_JOB), SP_JOB)


@ON_SP
def test_blocks_run_on_half_the_tokens_at_sp_size_2(sp_reports):
    assert [r["sp_rank"] for r in sp_reports] == [0, 1]
    for report in sp_reports:
        seen = set(report["tokens_in_last_block"])
        assert seen == {report["tokens"] // 2}, (seen, report["tokens"])


@ON_SP
@pytest.mark.parametrize("quantity", ["velocity", "guided", "log_prob", "fm_loss"])
def test_outputs_at_sp_size_2_equal_the_unsharded_transformer(sp_reports, quantity):
    for report in sp_reports:
        for run, reference in SP_RUNS.items():
            torch.testing.assert_close(report[run][quantity], report[reference][quantity], rtol=1e-6, atol=1e-6)


@ON_SP
def test_every_gradient_at_sp_size_2_equals_the_unsharded_one(sp_reports):
    for report in sp_reports:
        for run, reference in SP_RUNS.items():
            plain = report[reference]["grads"]
            assert sum(bool(g.abs().sum() > 0) for g in plain.values()) > len(plain) // 2
            assert report[run]["grads"].keys() == plain.keys()
            for name, grad in plain.items():
                torch.testing.assert_close(report[run]["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)
