"""--sp-size 2 on tiny LTX-2 and tiny HunyuanVideo 1.5 (dp 1, FSDP2 over both ranks, with and without activation
checkpointing; LoRA) computes what the plain unsharded transformer computes: velocities (LTX-2: of both streams), the
CFG velocity, a Flow-GRPO log-prob, a flow-matching loss and every gradient, to fp32 rounding. LTX-2 splits the video
and the audio tokens, every self- and audio-video cross-attention on whole sequences of half the heads; HunyuanVideo
1.5 splits the video tokens, its joint attention on every video token and the whole text of half the heads. Read
from the spawned world-size-2 job that the Wan sequence-parallel tests share (`sp_equality`)."""

from __future__ import annotations

import pytest
import torch

from tests.background import job_folder
from tests.fast.backends.fsdp_utils import rank_jobs
from tests.fast.backends.fsdp_utils.test_sequence_parallel import SP_JOB

ON_SP = pytest.mark.background(rank_jobs.SCRIPT, SP_JOB)
SP_RUNS = {"sp": "plain", "sp_checkpointed": "plain", "lora_sp": "lora_plain"}  # run -> its reference
# LTX-2.3's block options: interleaved rotary, per-head gates, cross-attention modulation, perturbed processors;
# 4 video heads, so a rank attends with 2 in one call where the plain model batches 4: outputs agree to rounding
# (2.1e-6 on CFG velocities of ~1.3, measured) rather than bit for bit
LTX2_VARIANT = {"variant_sp": "variant_plain"}
OUTPUT_TOLERANCE = {"variant_sp": {"rtol": 1e-5, "atol": 1e-5}}
QUANTITIES = {
    "ltx2": ["velocity_video", "velocity_audio", "guided_video", "guided_audio", "log_prob", "fm_loss"],
    "hunyuan_video15": ["velocity", "guided", "log_prob", "fm_loss"],
}
CASES = [(family, quantity) for family, names in QUANTITIES.items() for quantity in names]


def runs_of(family: str) -> dict[str, str]:
    return {**SP_RUNS, **LTX2_VARIANT} if family == "ltx2" else SP_RUNS


@pytest.fixture(scope="module")
def sp_reports() -> dict[str, list[dict]]:
    reports = rank_jobs.reports(job_folder(rank_jobs.SCRIPT, SP_JOB), SP_JOB)
    return {family: [report[family] for report in reports] for family in QUANTITIES}


@ON_SP
def test_ltx2_blocks_run_on_half_of_each_streams_tokens(sp_reports):
    for report in sp_reports["ltx2"]:
        assert (report["video_tokens"], report["audio_tokens"]) == (64, 126)  # 16 latent frames of 2x2; 126
        assert set(report["tokens_in_last_block"]) == {(32, 63)}


@ON_SP
def test_hunyuan_video15_blocks_run_on_half_the_video_tokens(sp_reports):
    for report in sp_reports["hunyuan_video15"]:
        assert report["tokens"] == 128 and set(report["tokens_in_last_block"]) == {64}  # 2 latent frames of 8x8


@ON_SP
@pytest.mark.parametrize(("family", "quantity"), CASES)
def test_outputs_at_sp_size_2_equal_the_unsharded_transformer(sp_reports, family, quantity):
    for report in sp_reports[family]:
        for run, reference in runs_of(family).items():
            mine, theirs = report[run][quantity], report[reference][quantity]
            assert torch.isfinite(theirs).all() and theirs.abs().sum() > 0
            tolerance = OUTPUT_TOLERANCE.get(run, {"rtol": 1e-6, "atol": 1e-6})
            torch.testing.assert_close(mine, theirs, **tolerance, msg=f"{run} {quantity}")


@ON_SP
@pytest.mark.parametrize("family", sorted(QUANTITIES))
def test_every_gradient_at_sp_size_2_equals_the_unsharded_one(sp_reports, family):
    for report in sp_reports[family]:
        for run, reference in runs_of(family).items():
            plain = report[reference]["grads"]
            assert sum(bool(g.abs().sum() > 0) for g in plain.values()) > len(plain) // 2
            assert report[run]["grads"].keys() == plain.keys()
            for name, grad in plain.items():
                torch.testing.assert_close(report[run]["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)
