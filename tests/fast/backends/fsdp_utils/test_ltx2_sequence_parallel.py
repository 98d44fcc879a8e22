"""--sp-size 2 on tiny LTX-2 (dp 1, FSDP2 over both ranks, with and without activation checkpointing; LoRA): the video
and the audio tokens split, every self- and audio-video cross-attention on whole sequences of half the heads, and it
computes what the plain unsharded transformer computes: both streams' velocities, the CFG velocity, a Flow-GRPO
log-prob, a flow-matching loss and every gradient, to fp32 rounding. Read from the spawned world-size-2 job that the
Wan sequence-parallel tests share (`sp_equality`)."""

from __future__ import annotations

import pytest
import torch

from tests.background import job_folder
from tests.fast.backends.fsdp_utils import rank_jobs
from tests.fast.backends.fsdp_utils.test_sequence_parallel import SP_JOB

ON_SP = pytest.mark.background(rank_jobs.SCRIPT, SP_JOB)
SP_RUNS = {"sp": "plain", "sp_checkpointed": "plain", "lora_sp": "lora_plain"}  # run -> its reference
QUANTITIES = ["velocity_video", "velocity_audio", "guided_video", "guided_audio", "log_prob", "fm_loss"]


@pytest.fixture(scope="module")
def ltx2_reports() -> list[dict]:
    return [r["ltx2"] for r in rank_jobs.reports(job_folder(rank_jobs.SCRIPT, SP_JOB), SP_JOB)]


@ON_SP
def test_blocks_run_on_half_of_each_streams_tokens(ltx2_reports):
    for report in ltx2_reports:
        assert (report["video_tokens"], report["audio_tokens"]) == (64, 126)  # 16 latent frames of 2x2; 126
        assert set(report["tokens_in_last_block"]) == {(32, 63)}


@ON_SP
@pytest.mark.parametrize("quantity", QUANTITIES)
def test_outputs_at_sp_size_2_equal_the_unsharded_transformer(ltx2_reports, quantity):
    for report in ltx2_reports:
        for run, reference in SP_RUNS.items():
            mine, theirs = report[run][quantity], report[reference][quantity]
            assert torch.isfinite(theirs).all() and theirs.abs().sum() > 0
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6, msg=f"{run} {quantity}")


@ON_SP
def test_every_gradient_at_sp_size_2_equals_the_unsharded_one(ltx2_reports):
    for report in ltx2_reports:
        for run, reference in SP_RUNS.items():
            plain = report[reference]["grads"]
            assert sum(bool(g.abs().sum() > 0) for g in plain.values()) > len(plain) // 2
            assert report[run]["grads"].keys() == plain.keys()
            for name, grad in plain.items():
                torch.testing.assert_close(report[run]["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)
